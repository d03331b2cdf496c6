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
    DeviceOption,
    Quantize,
    QuantizeOption,
    RunOption,
    fail,
    load_translator,
    log,
    resolve_run,
    setup_logging,
)
from mtrain.data import group_references, read_lines, read_parallel
from mtrain.evaluate import score
from mtrain.files import DirectoryLock, write_atomic
from mtrain.run_dir import (
    AVERAGED,
    BEST,
    CONFIG_FILE,
    average_checkpoints,
    save_checkpoint,
    step_checkpoints,
)


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
    beam: BeamOption = None,
    alpha: AlphaOption = None,
    quantize: QuantizeOption = Quantize.none,
    which: CheckpointOption = BEST,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    device: DeviceOption = "auto",
) -> None:
    """Translate a test set and print BLEU and chrF with their sacrebleu signatures."""
    setup_logging()
    if (src is None) != (ref is None):
        fail("--src and --ref go together")
    run_dir, cfg, translator = load_translator(run, device, beam, alpha, quantize, which)
    if src is None:
        test = Path(cfg.data.test)
        sources, references = group_references(
            read_parallel(test, cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.swap_columns)
        )
        hyp_path, source_name = run_dir / f"{test.stem}.hyp.{cfg.data.tgt_lang}", test
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
        hyp_path, source_name = run_dir / f"{src.name}.hyp.{cfg.data.tgt_lang}", src
    if not sources:
        fail(f"{source_name}: no sentences to evaluate")
    hyps = [t[0].text for t in translator.stream(sources)]
    scores = score(hyps, references, cfg.data.tgt_lang)
    try:
        write_atomic(hyp_path, "".join(h + "\n" for h in hyps))
        log.info("hypotheses written to %s", hyp_path)
    except OSError as e:  # a read-only run directory: the scores still count
        log.warning("mtrain: warning: cannot write %s (%s); scores below", hyp_path, e.strerror)
        hyp_path = None
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
    if not (run_dir / CONFIG_FILE).is_file():
        fail(f"{run_dir}: not a run directory (no {CONFIG_FILE})")
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
