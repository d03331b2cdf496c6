"""`mtrain lab`: a baseline and its variants, trained side by side, in one report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mtrain.commands.common import DeviceOption, setup_logging
from mtrain.core.errors import OptionError
from mtrain.laboratory.plan import LAB_VARIANTS, PROBES


def parse_seeds(texts: list[str]) -> tuple[int, ...]:
    """`--seeds 1,2` or `--seeds 1 --seeds 2`."""
    try:
        return tuple(int(s) for text in texts for s in text.replace(",", " ").split())
    except ValueError:
        raise OptionError(f"--seeds {' '.join(texts)}: expected whole numbers, e.g. 1,2") from None


VariantsArgument = Annotated[
    list[str] | None,
    typer.Argument(
        help=f"Variants: a named one ({', '.join(LAB_VARIANTS)}) or one of your own as "
        "'NAME: KEY=VALUE ...'.",
        show_default=False,
    ),
]
ProbeOption = Annotated[
    list[str] | None,
    typer.Option(
        "--probe",
        help=f"A probe sentence (repeatable). Default: {', '.join(PROBES[:5])} and a long one.",
    ),
]
PresetOption = Annotated[
    str | None,
    typer.Option(
        help="A lab ready to run: quick (positions and the causal mask, one seed, about 30 "
        "min on 2 fp32 cores); textbook (every part the textbook explains, seeds 1 and 2, "
        "1 h 39 min on 2 fp32 cores); paper (the paper's other choices, seeds 1 and 2, about 1.3 "
        "hours); full (every variant, seeds 1 and 2, 2,000 updates each: an estimated 7 "
        "hours). Its config is the clone's configs/default.yaml."
    ),
]


def lab(
    variants: VariantsArgument = None,
    config_path: Annotated[
        Path | None, typer.Option("--config", "-c", help="The baseline's YAML config.")
    ] = None,
    out: Annotated[
        Path, typer.Option(help="Lab directory: one run directory per variant and seed.")
    ] = Path("labs/lab"),
    preset: PresetOption = None,
    updates: Annotated[int | None, typer.Option(help="Updates per run.")] = None,
    minutes: Annotated[
        float | None, typer.Option(help="Minutes per run (equal time), instead of --updates.")
    ] = None,
    seeds: Annotated[list[str] | None, typer.Option(help="Seeds, e.g. 1,2. Default: 1.")] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Change a key of every run, baseline too.")
    ] = None,
    probes: ProbeOption = None,
    device: DeviceOption = "auto",
) -> None:
    """Train a baseline and variants of it at equal updates (or equal time), and compare them.

    Every run is checked, and the corpus prepared, before anything trains; every run gets the
    same budget, seed and recipe (dropout chosen once for all), only its variant differs. Each
    run is an ordinary run directory, OUT/<variant>-seed<k>: run the lab again and it goes on
    where it stopped (OUT/lab.json remembers what the lab was asked; another budget, config or
    probe list is refused). A run that diverges is a row of the report. At its start the lab
    says when it should end, from the speed measured here. Writes OUT/report.md and
    OUT/report.html (the table with the paired bootstrap against the baseline, the probes'
    translations, every run's curves, each variant's cross-attention) and prints the table.
    """
    import mtrain
    from mtrain.laboratory.report import COLUMNS, markdown_table, table
    from mtrain.training.start import Stopped
    from mtrain.training.trainer import Interrupted

    setup_logging()
    try:
        rows = mtrain.lab(
            config_path,
            variants or [],
            out,
            updates,
            minutes,
            parse_seeds(seeds or []),
            overrides or [],
            probes,
            preset,
            device,
        )
    except (Interrupted, Stopped) as e:
        typer.echo(f"mtrain: {e}; run the same command to go on", err=True)
        raise typer.Exit(130) from None
    typer.echo(markdown_table(COLUMNS, table(rows)))
