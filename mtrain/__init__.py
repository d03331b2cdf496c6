"""mtrain: train Transformer translation models, from the command line or from Python.

From Python (a notebook, a script), three calls cover what the commands do:

    import mtrain
    run = mtrain.train("configs/tiny.yaml", out="runs/tiny")   # the run directory
    model = mtrain.load(run)                                   # a TranslationModel
    model.translate("我是谁？")                                  # a string

`model.score(source, target)` tells how likely the model finds a given translation, piece by
piece; `model.trace(text)` and `model.attention(text)` show how it found its own, and show as
figures in Jupyter; `mtrain.curves(run)` draws the training curves. Every error is an
`MtrainError` whose message is the line `mtrain` prints. docs/python.md has the details.

Importing mtrain is light: PyTorch and the rest load with the first call that needs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtrain.core.errors import MtrainError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from mtrain.export.models import TranslationModel

__version__ = "0.1.0"
__all__ = ["MtrainError", "TranslationModel", "__version__", "curves", "lab", "load", "train"]


def load(
    path: str | Path,
    checkpoint: str = "best.pt",
    device: str = "auto",
    engine: str = "mtrain",
    quantize: bool = False,
    beam: int | None = None,
    alpha: float | None = None,
) -> TranslationModel:
    """Open a trained model: a run directory (engine "mtrain") or a directory that
    `mtrain export` wrote (engine "ctranslate2", which needs `pip install ctranslate2`).

    `checkpoint` is a file in the run directory (best.pt, last.pt, averaged.pt, step-N.pt);
    `device` "auto" is CUDA when present; `quantize` computes in int8 (CPU only); `beam` and
    `alpha` replace the run's own search options (each call may replace them again).
    """
    from mtrain.export.models import open_model

    return open_model(Path(path), engine, device, checkpoint, quantize, beam, alpha)


def train(
    config: str | Path,
    out: str | Path | None = None,
    overrides: Mapping[str, Any] | Iterable[str] = (),
    device: str = "auto",
) -> Path:
    """Train as `mtrain train --config CONFIG --out OUT --set KEY=VALUE ...` does; return the
    run directory (default: runs/<config name>-<date-time>).

    `overrides` are config keys to change, as {"train.max_steps": 100} or ["train.max_steps=100"].
    A run directory that holds a checkpoint is resumed. Progress shows as a bar (a notebook
    widget under Jupyter, with ipywidgets installed); Ctrl-C, or the notebook's interrupt, saves
    a checkpoint and raises `Interrupted`, an MtrainError.
    """
    from mtrain.commands.train import train_run

    if isinstance(overrides, Mapping):
        overrides = [f"{key}={value}" for key, value in overrides.items()]
    out_dir = None if out is None else Path(out)
    run_dir, _ = train_run(Path(config), list(overrides), out_dir, device, command=False)
    if run_dir is None:  # under torchrun, on a rank other than 0
        raise MtrainError("mtrain.train writes its run from one process; use mtrain train")
    return run_dir


def curves(*runs: str | Path) -> Figure:
    """The training curves of one or more run directories (`mtrain plot curves`): a Figure."""
    from mtrain.figures.curves import draw_curves

    return draw_curves([Path(r) for r in runs])


def lab(
    config: str | Path | None = None,
    variants: Iterable[str] = (),
    out: str | Path = "labs/lab",
    updates: int | None = None,
    minutes: float | None = None,
    seeds: Iterable[int] = (),
    overrides: Iterable[str] = (),
    probes: Iterable[str] | None = None,
    preset: str | None = None,
    device: str = "auto",
) -> list:
    """Train a baseline config and its variants as `mtrain lab` does, and return its table: a
    list of `LabRow`s (variant, seed, updates, minutes, losses, dev BLEU, p-value, run_dir).

    `variants` are named ones ("one-head") or your own ("3+1: model.n_encoder_layers=3
    model.n_decoder_layers=1"). Each run is trained as `mtrain.train` trains; a lab directory
    that holds runs goes on where it stopped.
    """
    from mtrain.commands.train import train_run
    from mtrain.laboratory.plan import make_lab
    from mtrain.laboratory.runner import run_lab

    plan = make_lab(
        None if config is None else Path(config),
        list(variants),
        updates,
        minutes,
        tuple(seeds),
        tuple(overrides),
        tuple(probes or ()),
        preset,
    )

    def train(cfg: Path, changes: list[str], run_dir: Path) -> None:
        train_run(cfg, changes, run_dir, device, command=False)

    return run_lab(plan, Path(out), train, device)


def __getattr__(name: str) -> Any:
    if name == "TranslationModel":  # its module loads PyTorch: only when asked for
        from mtrain.export.models import TranslationModel

        return TranslationModel
    raise AttributeError(f"module 'mtrain' has no attribute {name!r}")
