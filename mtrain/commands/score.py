"""`mtrain score`: how likely the model finds given translations, piece by piece."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated

import typer

from mtrain.commands.common import (
    CheckpointOption,
    Decoding,
    DeviceOption,
    Engine,
    JsonOption,
    Quantize,
    QuantizeOption,
    RunOption,
    fail,
    load_model,
    setup_logging,
)
from mtrain.core.config import DataConfig
from mtrain.core.files import check_arguments, check_input_encoding
from mtrain.data.pairs import decode_lines
from mtrain.decoding.score import TOP_K, Score, score_pairs
from mtrain.run.directory import BEST

log = logging.getLogger(__name__)
CHUNK = 2000  # pairs scored at a time: any length of input in bounded memory


def pairs_of(lines: Iterable[str], name: str) -> Iterator[tuple[str, str, str]]:
    """`source<TAB>target` lines as (NAME:LINE, source, target); a line with no tab or more
    than one is refused by its number."""
    for number, line in enumerate(lines, 1):
        fields = line.split("\t")
        if len(fields) != 2:
            found = f", found {len(fields)} tab-separated fields" if len(fields) > 2 else ""
            fail(f"{name}:{number}: expected SOURCE<TAB>TARGET{found}")
        yield f"{name}:{number}", *fields


def given_pairs(texts: list[str]) -> Iterator[tuple[str, str, str]]:
    """SOURCE TARGET arguments as ("pair N", source, target)."""
    for n, (source, target) in enumerate(zip(texts[::2], texts[1::2]), 1):
        yield f"pair {n}", source, target


def warn_truncated(where: str, score: Score, cfg: DataConfig) -> None:
    """Say on stderr that a pair was scored cut, and where it is (its JSON says so too)."""
    for side in score.truncated:
        key = "max_src_len" if side == "source" else "max_tgt_len"
        what = f"the {side} is longer than the model reads (data.{key}: {getattr(cfg, key)} tokens)"
        log.warning("%s: %s; scored cut", where, what)


def format_tsv(score: Score) -> str:
    """TOTAL, MEAN, then each piece with its log-probability, tab-separated."""
    pieces = " ".join(f"{p.piece}:{p.log_prob:.4f}" for p in score.pieces)
    return f"{score.total:.4f}\t{score.mean:.4f}\t{pieces}"


def score(
    texts: Annotated[
        list[str] | None,
        typer.Argument(
            help="SOURCE TARGET pairs, one after the other. Default: the --input file or "
            "stdin, one SOURCE<TAB>TARGET pair per line."
        ),
    ] = None,
    input_path: Annotated[
        Path | None,
        typer.Option(
            "--input",
            "-i",
            help="Score the pairs of this file, SOURCE<TAB>TARGET per line.",
            dir_okay=False,
            exists=True,
        ),
    ] = None,
    run: RunOption = None,
    top_k: Annotated[
        int,
        typer.Option("--top-k", min=1, help="The model's own choices listed per piece (--json)."),
    ] = TOP_K,
    as_json: JsonOption = False,
    quantize: QuantizeOption = Quantize.none,
    which: CheckpointOption = BEST,
    device: DeviceOption = "auto",
) -> None:
    """Score translations by teacher forcing: each target piece's log-probability.

    One line per pair on stdout: its total log-probability (</s> included), the mean per piece,
    then each piece with its log-probability, tab-separated; `cut -f1` gives the totals. With
    --json, one JSON object per pair and line, with each piece's rank among the model's choices
    and the model's own likeliest pieces there. A source or target longer than the model reads
    is scored cut: a warning on stderr names its line, and the JSON's `truncated` its side.
    """
    setup_logging()
    if texts and input_path:
        fail("give pairs as arguments or --input, not both")
    if texts and len(texts) % 2:
        fail(f"{len(texts)} arguments: give SOURCE TARGET pairs")
    check_arguments(texts or [])
    if input_path:
        check_input_encoding(input_path)
    translator = load_model(Engine.mtrain, Decoding(run, device, quantize, which)).translator
    with contextlib.ExitStack() as stack:
        if texts:
            pairs: Iterable[tuple[str, str, str]] = given_pairs(texts)
        elif input_path:
            f = stack.enter_context(input_path.open("rb"))
            pairs = pairs_of(decode_lines(f, str(input_path)), str(input_path))
        else:
            pairs = pairs_of(decode_lines(sys.stdin.buffer, "<stdin>"), "<stdin>")
        it = iter(pairs)
        while chunk := list(itertools.islice(it, CHUNK)):
            wheres, sources, targets = (list(column) for column in zip(*chunk))
            for where, result in zip(wheres, score_pairs(translator, sources, targets, top_k)):
                warn_truncated(where, result, translator.cfg.data)
                line = json.dumps(result.to_dict(), ensure_ascii=False) if as_json else None
                typer.echo(line or format_tsv(result))
