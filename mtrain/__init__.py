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
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtrain.core.errors import MtrainError, OptionError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from mtrain.translation_model import TranslationModel

__version__ = "0.1.0"
__all__ = ["MtrainError", "TranslationModel", "__version__", "curves", "lab", "load", "train"]


def _path(value: Any, name: str) -> Path:
    """An argument that names a file or directory, as a Path; anything else in one line."""
    if not isinstance(value, (str, PathLike)) or not str(value):
        raise OptionError(f"{name}: expected a path (a string or a Path), got {value!r}")
    return Path(value)


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
    from mtrain.translation_model import open_model

    return open_model(_path(path, "path"), engine, device, checkpoint, quantize, beam, alpha)


def _several(value: Any, one: type, name: str) -> tuple:
    """An argument that takes one value of type `one` or several: None (none), one, or an
    iterable of them (each checked where it is used); anything else in one line."""
    if value is None:
        return ()
    if isinstance(value, one):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return tuple(value)
    raise OptionError(f"{name}: expected a {one.__name__} or a list of them, got {value!r:.80}")


def _overrides(overrides: Any) -> list[str | tuple[str, Any]]:
    """A mapping's items (Python values, set as given), or `--set` strings (YAML values)."""
    if isinstance(overrides, Mapping):
        return list(overrides.items())
    if not isinstance(overrides, (str, bytes)) and isinstance(overrides, Iterable):
        given = list(overrides)
        if all(isinstance(item, str) for item in given):
            return given
    raise OptionError(
        'overrides: expected a mapping such as {"train.max_steps": 100} or a list of '
        f'"section.key=value" strings, got {overrides!r:.80}'
    )


def train(
    config: str | Path,
    out: str | Path | None = None,
    overrides: Mapping[str, Any] | Iterable[str] = (),
    device: str = "auto",
) -> Path | None:
    """Train as `mtrain train --config CONFIG --out OUT --set KEY=VALUE ...` does; return the
    run directory (default: runs/<config name>-<date-time>).

    `overrides` are config keys to change: a mapping of Python values, set as given
    ({"train.max_steps": 100, "data.train": "corpus #2.tsv"}), or `--set` strings, whose values
    are YAML (["train.max_steps=100"]). A run directory that holds a checkpoint is resumed.
    Progress shows as a bar on a terminal (a notebook widget under Jupyter, with ipywidgets
    installed) and as plain lines on stderr elsewhere; Ctrl-C, or the notebook's interrupt,
    saves a checkpoint and raises `Interrupted`, an MtrainError (a second one: `Stopped`, at
    once). Under torchrun, every rank trains and rank 0 alone writes the run: the others
    return None.
    """
    from mtrain.core.progress import lines_to_stderr
    from mtrain.training.start import train_run

    config_path, given = _path(config, "config"), _overrides(overrides)
    out_dir = None if out is None else _path(out, "out")
    if not isinstance(device, str):
        raise OptionError(f"device: expected a string such as 'cpu', got {device!r}")
    with lines_to_stderr():
        run_dir, _ = train_run(config_path, given, out_dir, device)
    return run_dir  # None under torchrun, on a rank other than 0


def curves(*runs: str | Path) -> Figure:
    """The training curves of one or more run directories (`mtrain plot curves`): a Figure."""
    from mtrain.figures.curves import draw_curves

    if not runs:
        raise OptionError("curves: name at least one run directory, as mtrain.curves(run)")
    return draw_curves([_path(r, "run") for r in runs])


def lab(
    config: str | Path | None = None,
    variants: str | Iterable[str] | None = (),
    out: str | Path = "labs/lab",
    updates: int | None = None,
    minutes: float | None = None,
    seeds: int | Iterable[int] | None = (),
    overrides: Mapping[str, Any] | Iterable[str] = (),
    probes: str | Iterable[str] | None = None,
    preset: str | None = None,
    device: str = "auto",
) -> list:
    """Train a baseline config and its variants as `mtrain lab` does, and return its table: a
    list of `LabRow`s, one per run (variant, seed, changes, status, parameters, dropout,
    updates/s, best and last step, minutes, dev and test BLEU, the difference from the
    baseline with its 95% interval, p-value and Holm's p-value, run_dir).

    `variants` are named ones ("one-head") or your own ("3+1: model.n_encoder_layers=3
    model.n_decoder_layers=1"); none (or None): the baseline alone, once per seed. A string is one
    variant, one probe. `overrides` change every run, as `mtrain.train`'s do. Each run is
    trained as `mtrain.train` trains; a lab directory that holds runs goes on where it stopped.
    """
    from mtrain.core.progress import lines_to_stderr
    from mtrain.laboratory.plan import make_lab
    from mtrain.laboratory.runner import run_lab

    plan = make_lab(
        None if config is None else _path(config, "config"),
        list(_several(variants, str, "variants")),
        updates,
        minutes,
        _several(seeds, int, "seeds"),
        tuple(_overrides(overrides)),
        None if probes is None else _several(probes, str, "probes"),
        preset,
    )
    with lines_to_stderr():
        return run_lab(plan, _path(out, "out"), device)


def __getattr__(name: str) -> Any:
    if name == "TranslationModel":  # its module loads PyTorch: only when asked for
        from mtrain.translation_model import TranslationModel

        return TranslationModel
    raise AttributeError(f"module 'mtrain' has no attribute {name!r}")
