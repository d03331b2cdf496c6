"""`mtrain plot ...`: training curves, the positional encoding, the masks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mtrain.commands.common import (
    Decoding,
    Engine,
    RunOption,
    fail,
    load_engine,
    log,
    quiet_matplotlib_dirs,
    resolve_run,
    setup_logging,
)
from mtrain.core.config import Config
from mtrain.run.directory import CheckpointError, run_config

app = typer.Typer(
    no_args_is_help=True,
    help="Draw PNG figures: training curves, the positional encoding, the attention masks.",
)


def figure_output(path: Path) -> Path:
    """Check --output's format as the options are read: before the figure is drawn."""
    quiet_matplotlib_dirs()  # the check imports matplotlib: every plot command passes here
    from mtrain.figures.common import check_output

    return check_output(path)


OutputOption = Annotated[
    Path,
    typer.Option(
        "--output", "-o", help="PNG file to write (or .svg, .pdf, ...).", callback=figure_output
    ),
]


@app.command()
def curves(
    runs: Annotated[list[Path], typer.Argument(help="Run directories, one curve each.")],
    output: OutputOption = Path("curves.png"),
) -> None:
    """Training loss, dev loss, dev BLEU and learning rate against steps and against minutes.

    Reads each run's metrics.jsonl and train.jsonl; prints the PNG's path.
    """
    from mtrain.figures.common import save
    from mtrain.figures.curves import draw_curves

    setup_logging()
    typer.echo(str(save(draw_curves(runs), output)))


def optional_run(run: Path | None) -> Path | None:
    """`run`, else the latest run under ./runs/, else None (no run trained yet)."""
    if run is not None:
        return run
    try:
        return resolve_run(None)
    except CheckpointError:
        return None


@app.command()
def positional(
    run: Annotated[
        Path | None,
        typer.Argument(help="Run whose d_model and lengths to use. Default: the latest run."),
    ] = None,
    output: OutputOption = Path("positional.png"),
) -> None:
    """The sinusoidal positional encoding, from the model's PositionalEncoding module.

    Without a run (and none under ./runs/), default.yaml's d_model and lengths are used.
    """
    from mtrain.figures.common import save
    from mtrain.figures.positional import draw_positional

    setup_logging()
    run = optional_run(run)
    cfg = run_config(run) if run else Config()
    positions = draw_positional(cfg.model.d_model, cfg.data.max_positions())
    typer.echo(str(save(positions, output)))


@app.command()
def masks(
    texts: Annotated[list[str], typer.Argument(help="Source sentences: one batch.")],
    tgt: Annotated[
        list[str] | None,
        typer.Option(
            help="Target sentence for each source (repeat). Default: the run's own greedy "
            "translations."
        ),
    ] = None,
    run: RunOption = None,
    output: OutputOption = Path("masks.png"),
) -> None:
    """The padding mask of a batch and the decoder's look-ahead mask, as training builds them.

    Pieces come from the run's tokenizers; with no run at all, each character is a piece.
    """
    from mtrain.data.text import normalize
    from mtrain.data.tokenizer import fit
    from mtrain.figures.common import save
    from mtrain.figures.masks import draw_masks, mask_inputs

    setup_logging()
    if tgt and len(tgt) != len(texts):
        fail(f"{len(texts)} sentences but {len(tgt)} --tgt")
    run = optional_run(run)
    if run is None:
        log.info("no run: one piece per character (source) and per word (--tgt)")
        src_pieces = [list(t) for t in texts]
        tgt_pieces = [t.split() for t in tgt] if tgt else None
        src_ids = [list(range(4, 4 + len(p))) for p in src_pieces]  # any non-padding ids
        tgt_ids = [list(range(4, 4 + len(p))) for p in tgt_pieces] if tgt else None
        max_src_len = Config().data.max_src_len
    else:
        _, cfg, translator = load_engine(Engine.mtrain, Decoding(run, "cpu", beam=1))
        sources = [normalize(t, cfg.data.src_lang) for t in texts]
        if not tgt:
            tgt = translator.translate(sources)
            log.info("targets (greedy translations): %s", " | ".join(tgt))
        tok = translator.tokenizer
        src_ids = tok.encode_src(sources)
        tgt_ids = tok.encode_tgt([normalize(t, cfg.data.tgt_lang) for t in tgt])
        tgt_ids = [fit(ids, cfg.data.max_tgt_len) for ids in tgt_ids]  # as encode_pairs
        src_pieces = [[tok.src.id_to_piece(i) for i in ids] for ids in src_ids]
        tgt_pieces = [[tok.tgt.id_to_piece(i) for i in ids] for ids in tgt_ids]
        max_src_len = cfg.data.max_src_len
    inputs = mask_inputs(src_ids, src_pieces, tgt_ids, tgt_pieces, max_src_len)
    typer.echo(str(save(draw_masks(inputs), output)))
