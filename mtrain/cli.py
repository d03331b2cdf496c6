"""The `mtrain` command line: parse arguments, call the library, print results on stdout."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from mtrain import checkpoint, config, runtime
from mtrain.checkpoint import CheckpointError
from mtrain.config import ConfigError
from mtrain.data import DataError, group_references, read_lines, read_parallel
from mtrain.decode import translate as translate_texts
from mtrain.evaluate import score

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train Transformer translation models and translate with them.",
)
RUNS_ROOT = Path("runs")
log = logging.getLogger("mtrain")

RunOption = Annotated[
    Path | None,
    typer.Option(
        "--run",
        help="Run directory to use. Default: the most recently trained run under ./runs/.",
        file_okay=False,
    ),
]


def fail(message: str) -> None:
    typer.echo(f"mtrain: error: {message}", err=True)
    raise typer.Exit(2)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def resolve_run(run: Path | None) -> Path:
    if run is not None:
        return run
    run = checkpoint.latest_run(RUNS_ROOT)
    log.info("using run %s", run)
    return run


@app.command()
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
        typer.Option(help="Run directory to create. Default: runs/<config name>-<date-time>."),
    ] = None,
    device: Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")] = "auto",
) -> None:
    """Train a model; writes config, tokenizers, checkpoints and metrics into a run directory."""
    from mtrain.train import Trainer  # keeps `translate` start-up free of training imports

    setup_logging()
    try:
        cfg = config.load(config_path, overrides or [])
        run_dir = out or RUNS_ROOT / f"{config_path.stem}-{datetime.now():%Y%m%d-%H%M%S}"
        if (run_dir / checkpoint.LAST).exists():
            fail(f"{run_dir}: already holds a run; choose another --out")
        run_dir.mkdir(parents=True, exist_ok=True)
        for key in ("train", "dev", "test"):
            path = Path(getattr(cfg.data, key))
            if not path.is_file():
                fail(f"{config_path}: data.{key}: no such file {path}")
            setattr(cfg.data, key, str(path.resolve()))  # the run works from any directory
        checkpoint.write_config(run_dir, cfg)
        log.info("run directory %s", run_dir)
        best = Trainer(cfg, run_dir, runtime.pick_device(device)).run()
    except (ConfigError, DataError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        typer.echo("mtrain: interrupted; checkpoints written so far are kept", err=True)
        raise typer.Exit(130) from None
    log.info("best dev BLEU %.2f", best)
    typer.echo(str(run_dir))


@app.command()
def translate(
    texts: Annotated[
        list[str] | None,
        typer.Argument(help="Sentences to translate. Default: one per line from stdin."),
    ] = None,
    run: RunOption = None,
    device: Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")] = "auto",
) -> None:
    """Translate sentences with greedy decoding; one output line per input line, in order."""
    setup_logging()
    try:
        cfg, tokenizer, model = checkpoint.load_run(resolve_run(run), runtime.pick_device(device))
    except CheckpointError as e:
        fail(str(e))
    lines = texts if texts else sys.stdin.read().splitlines()
    for hyp in translate_texts(model, tokenizer, cfg, lines, runtime.pick_device(device)):
        typer.echo(hyp)


@app.command(name="eval")
def evaluate(
    run: RunOption = None,
    src: Annotated[
        Path | None,
        typer.Option(
            help="Source sentences, one per line. Default: the run's test split.",
            dir_okay=False,
            exists=True,
        ),
    ] = None,
    ref: Annotated[
        list[Path] | None,
        typer.Option(
            help="Reference translations, one per line, aligned with --src; repeat for several "
            "references per sentence (an empty line means no reference there).",
            dir_okay=False,
            exists=True,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    device: Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")] = "auto",
) -> None:
    """Translate a test set and print BLEU and chrF with their sacrebleu signatures."""
    setup_logging()
    torch_device = runtime.pick_device(device)
    try:
        run_dir = resolve_run(run)
        cfg, tokenizer, model = checkpoint.load_run(run_dir, torch_device)
        if (src is None) != (ref is None):
            fail("--src and --ref go together")
        if src is None:
            test = Path(cfg.data.test)
            sources, references = group_references(
                read_parallel(test, cfg.data.src_lang, cfg.data.tgt_lang)
            )
            hyp_path = run_dir / f"{test.stem}.hyp.{cfg.data.tgt_lang}"
        else:
            sources = read_lines(src)
            streams = [read_lines(path) for path in ref]
            for path, stream in zip(ref, streams):
                if len(stream) != len(sources):
                    fail(f"{path}: {len(stream)} lines, but {src} has {len(sources)}")
            references = [[r for r in refs if r.strip()] for refs in zip(*streams)]
            for number, refs in enumerate(references, 1):
                if not refs:
                    fail(f"{src}:{number}: no reference in any --ref file")
            hyp_path = run_dir / f"{src.name}.hyp.{cfg.data.tgt_lang}"
    except (CheckpointError, DataError) as e:
        fail(str(e))
    hyps = translate_texts(model, tokenizer, cfg, sources, torch_device)
    hyp_path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    scores = score(hyps, references, cfg.data.tgt_lang)
    log.info("hypotheses written to %s", hyp_path)
    if as_json:
        result = {"run": str(run_dir), "sentences": len(hyps), "hypotheses": str(hyp_path)}
        typer.echo(json.dumps({**result, **vars(scores)}))
    else:
        typer.echo(f"BLEU = {scores.bleu:.2f}  {scores.bleu_signature}")
        typer.echo(f"chrF = {scores.chrf:.2f}  {scores.chrf_signature}")
