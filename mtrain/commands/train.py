"""`mtrain train`: one process, or one of several under torchrun."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from mtrain.commands.common import DeviceOption, log, setup_logging
from mtrain.training.start import Stopped, train_run


def train(
    config_path: Annotated[
        Path, typer.Option("--config", "-c", help="YAML config file, e.g. configs/default.yaml.")
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override one config key, e.g. --set train.lr=3e-4 (repeatable)."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Run directory. Default: runs/<config name>-<date-time>. If it holds a "
            "checkpoint, training resumes from it: re-running the same command continues an "
            "interrupted run exactly (train.max_steps and train.max_minutes may be raised)."
        ),
    ] = None,
    device: DeviceOption = "auto",
    peer_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Under torchrun: minutes a process waits for the others, once training has "
            "started, before it gives up with an error (rank 0's validations must fit in it; "
            "start-up, where rank 0 prepares the corpus, may take up to a day).",
        ),
    ] = 5.0,
    init_from: Annotated[
        Path | None,
        typer.Option(
            "--init-from",
            help="Start from another run's weights, tokenizers, model and tokenizer sections: "
            "RUN (its best.pt) or RUN/CHECKPOINT; the same as --set train.init_from=RUN. The "
            "optimizer, schedule, batch order, dropout and data are this run's own.",
        ),
    ] = None,
) -> None:
    """Train a model; writes config, tokenizers, checkpoints and metrics into a run directory.

    Ctrl-C (or SIGTERM) saves a checkpoint after the current step and exits with status 130;
    a second Ctrl-C exits at once. Under `torchrun --nproc_per_node N -m mtrain train ...`,
    N processes train one model with DistributedDataParallel; rank 0 writes the run.
    """
    setup_logging(quiet=not is_main_process())
    overrides = [
        *(overrides or []),
        *([f"train.init_from={json.dumps(str(init_from))}"] if init_from else []),
    ]
    run_dir, best = stopped_in_one_line(config_path, overrides, out, device, peer_timeout)
    if run_dir is not None:
        log.info("best dev BLEU %.2f", best)
        typer.echo(str(run_dir))


def is_main_process() -> bool:
    """Whether this process writes the run: alone, or rank 0 under torchrun."""
    from mtrain.core import distributed

    return distributed.from_env().is_main


def stopped_in_one_line(
    config_path: Path, overrides: list[str], out: Path | None, device: str, peer_timeout: float
) -> tuple[Path | None, float]:
    """`train_run`, where Ctrl-C ends the command with one line and exit status 130."""
    from mtrain.training.trainer import Interrupted  # imported here: keeps `translate` light

    try:
        return train_run(config_path, overrides, out, device, peer_timeout)
    except Interrupted as e:
        if is_main_process():
            typer.echo(
                f"mtrain: {e}; checkpoint saved in {e.run_dir}; run the same command to resume",
                err=True,
            )
        raise typer.Exit(130) from None
    except Stopped as e:
        typer.echo(f"mtrain: {e}", err=True)
        raise typer.Exit(130) from None
