"""`mtrain export`: a run's model as a CTranslate2 model directory, to serve without mtrain."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mtrain.commands.common import CheckpointOption, setup_logging
from mtrain.export.converter import Quantization, export_run
from mtrain.run.directory import BEST


def export(
    run: Annotated[
        Path, typer.Argument(help="Run directory to export.", file_okay=False, exists=True)
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the model into.")],
    which: CheckpointOption = BEST,
    quantize: Annotated[
        Quantization,
        typer.Option(
            help="int8 or int8_float32: int8 matrices, the rest float32 (the same file for "
            "mtrain's float32 weights); float16: for GPUs (a CPU computes in float32 from the "
            "rounded weights: outputs differ). Default: float32, as trained.",
        ),
    ] = Quantization.none,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replace an earlier export in that directory; one holding files that export "
            "did not write is refused.",
        ),
    ] = False,
) -> None:
    """Write a run's model as a CTranslate2 model directory and print the directory.

    The directory (not the current one or a parent of it) holds the model, the SentencePiece
    models, the run's config and a README with a Python example; `mtrain translate --engine
    ctranslate2 --run DIR` translates with it. Needs CTranslate2: pip install ctranslate2.
    """
    setup_logging()
    typer.echo(str(export_run(run, out, which, quantize, force)))
