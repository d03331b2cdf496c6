"""`mtrain eval` and `mtrain average`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from mtrain.commands.common import (
    AlphaOption,
    BeamOption,
    CheckpointOption,
    Decoding,
    DeviceOption,
    Engine,
    JsonOption,
    Quantize,
    QuantizeOption,
    RunOption,
    fail,
    load_engine,
    log,
    resolve_run,
    setup_logging,
)
from mtrain.core.files import DirectoryLock, write_atomic
from mtrain.core.metrics import score
from mtrain.data.corpus import corpora, read_pairs
from mtrain.data.pairs import group_references, read_lines
from mtrain.run.directory import (
    AVERAGED,
    BEST,
    average_checkpoints,
    run_config,
    save_checkpoint,
    step_checkpoints,
)

SrcOption = Annotated[
    Path | None,
    typer.Option(
        help="Source sentences, one per line. Default: the run's test split.",
        dir_okay=False,
        exists=True,
    ),
]


RefOption = Annotated[
    list[Path] | None,
    typer.Option(
        help="Reference translations, one per line, aligned with --src; repeat for several "
        "references per sentence (an empty line means no reference there).",
        dir_okay=False,
        exists=True,
    ),
]


def evaluate(
    run: RunOption = None,
    src: SrcOption = None,
    ref: RefOption = None,
    beam: BeamOption = None,
    alpha: AlphaOption = None,
    quantize: QuantizeOption = Quantize.none,
    which: CheckpointOption = BEST,
    as_json: JsonOption = False,
    device: DeviceOption = "auto",
) -> None:
    """Translate a test set and print BLEU and chrF with their sacrebleu signatures."""
    setup_logging()
    if (src is None) != (ref is None):
        fail("--src and --ref go together")
    decoding = Decoding(run, device, quantize, which, beam, alpha)
    run_dir, cfg, translator = load_engine(Engine.mtrain, decoding)
    if src is None:
        (test,) = corpora(cfg.data.test, cfg.data.swap_columns)  # a TSV file or {src, tgt}
        sources, references = group_references(
            read_pairs(test, cfg.data.src_lang, cfg.data.tgt_lang, scored=True)
        )
        stem, source_name = test.path.stem, test.path
    else:
        sources, references = read_test_files(src, ref)
        stem, source_name = src.name, src
    hyp_path = run_dir / f"{stem}{search_name(decoding)}.hyp.{cfg.data.tgt_lang}"
    if not sources:
        fail(f"{source_name}: no sentences to evaluate")
    hyps = [t[0].text for t in translator.stream(sources)]
    scores = score(hyps, references, cfg.data.tgt_lang)
    hyp_path = write_hypotheses(hyp_path, hyps)
    if as_json:
        result = {
            "run": str(run_dir),
            "checkpoint": which,
            "sentences": len(hyps),
            "hypotheses": hyp_path and str(hyp_path),
        }
        typer.echo(json.dumps({**result, **vars(scores)}))
    else:
        typer.echo(f"BLEU = {scores.bleu:.2f}  {scores.bleu_signature}")
        typer.echo(f"chrF = {scores.chrf:.2f}  {scores.chrf_signature}")


def search_name(d: Decoding) -> str:
    """What the hypotheses' file name says of the options given (".beam1.last" for `--beam 1
    --checkpoint last.pt`), so that another search keeps the file of the run's own."""
    given = [
        "" if d.beam is None else f"beam{d.beam}",
        "" if d.alpha is None else f"alpha{d.alpha:g}",
        "" if d.checkpoint == BEST else Path(d.checkpoint).stem,
        "" if d.quantize is Quantize.none else d.quantize.value,
    ]
    return "".join(f".{part}" for part in given if part)


def read_test_files(src: Path, ref: list[Path]) -> tuple[list[str], list[list[str]]]:
    """Sources, one per line, and each one's references: the non-empty lines of the --ref files."""
    sources = read_lines(src)
    streams = [read_lines(path) for path in ref]
    for path, stream in zip(ref, streams):
        if len(stream) != len(sources):
            fail(f"{path}: {len(stream)} lines, but {src} has {len(sources)}")
    references = [[r for r in refs if r.strip()] for refs in zip(*streams)]
    for number, refs in enumerate(references, 1):
        if not refs:
            fail(f"{src}:{number}: no reference in any --ref file")
    return sources, references


def write_hypotheses(path: Path, hyps: list[str]) -> Path | None:
    """Write the translations, one per line; None where the run directory is read-only."""
    try:
        write_atomic(path, "".join(h + "\n" for h in hyps))
    except OSError as e:  # a read-only run directory: the scores still count
        log.warning("mtrain: warning: cannot write %s (%s); scores below", path, e.strerror)
        return None
    log.info("hypotheses written to %s", path)
    return path


def average(
    run: RunOption = None,
    last: Annotated[
        int, typer.Option(min=2, help="How many of the newest step-N.pt checkpoints to average.")
    ] = 5,
) -> None:
    """Average the weights of a run's last step checkpoints into averaged.pt; print its path.

    Translate or evaluate with it by adding --checkpoint averaged.pt.
    """
    setup_logging()
    run_dir = resolve_run(run)
    run_config(run_dir)  # refused unless it is a run directory
    with DirectoryLock(run_dir):  # training writes averaged.pt too
        paths = step_checkpoints(run_dir)
        if len(paths) < last:
            fail(
                f"{run_dir}: {len(paths)} step checkpoints, fewer than --last {last} "
                "(train.keep_last says how many training keeps)"
            )
        state = average_checkpoints(paths[-last:])
        save_checkpoint(run_dir / AVERAGED, state)
    log.info("averaged the checkpoints of steps %s", ", ".join(map(str, state["steps"])))
    typer.echo(str(run_dir / AVERAGED))
