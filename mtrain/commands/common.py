"""What the commands share: options, logging, errors, finding a run, and the engine that
translates with it (for translate, eval, serve and plot)."""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from mtrain.core import config, runtime
from mtrain.core.config import MAX_ALPHA, Config, DecodeConfig
from mtrain.data import corpus
from mtrain.decoding.translator import TextTranslator, Translator
from mtrain.export import engine as ct2_engine
from mtrain.run.directory import BEST, latest_run, load_run

RUNS_ROOT = Path("runs")


log = logging.getLogger("mtrain")


class Quantize(str, enum.Enum):
    """Computing in int8 as it translates (CPU only), whatever the weights are stored as."""

    none = "none"
    int8 = "int8"


class Engine(str, enum.Enum):
    """What searches: mtrain on PyTorch, or CTranslate2 on a directory `mtrain export` wrote."""

    mtrain = "mtrain"
    ctranslate2 = "ctranslate2"


RunOption = Annotated[
    Path | None,
    typer.Option(
        "--run",
        help="Run directory to use. Default: the most recently trained run under ./runs/.",
        file_okay=False,
    ),
]


BeamOption = Annotated[
    int | None, typer.Option("--beam", min=1, help="Beam size; 1 is greedy. Default: the run's.")
]


AlphaOption = Annotated[
    float | None,
    typer.Option(
        min=0.0, max=MAX_ALPHA, help="Length penalty exponent for beam search. Default: the run's."
    ),
]


QuantizeOption = Annotated[
    Quantize,
    typer.Option(help="int8: dynamic int8 quantization of the linear layers (CPU only)."),
]


EngineOption = Annotated[
    Engine,
    typer.Option(
        help="mtrain: the run's checkpoint, on PyTorch. ctranslate2: a directory written by "
        "`mtrain export`, given as --run; needs `pip install ctranslate2`.",
    ),
]


JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


DeviceOption = Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")]


CheckpointOption = Annotated[
    str,
    typer.Option(
        "--checkpoint",
        help="Checkpoint in the run directory: best.pt, last.pt, averaged.pt or step-N.pt.",
    ),
]


def error(message: str) -> int:
    """Print one error line; return the exit status for it."""
    typer.echo(f"mtrain: error: {message}", err=True)
    return 2


def fail(message: str) -> None:
    """Stop the command with one error line and exit status 2."""
    raise typer.Exit(error(message))


def setup_logging(quiet: bool = False) -> None:
    """Log to stderr: progress and information, or warnings and errors only when `quiet`."""
    level = logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)


def matplotlib_dirs() -> list[Path]:
    """Where matplotlib keeps its configuration and its font cache unless MPLCONFIGDIR is set."""
    home = Path.home()
    if sys.platform.startswith(("linux", "freebsd")):
        config = os.environ.get("XDG_CONFIG_HOME") or home / ".config"
        cache = os.environ.get("XDG_CACHE_HOME") or home / ".cache"
        return [Path(config, "matplotlib"), Path(cache, "matplotlib")]
    return [home / ".matplotlib"]


def writable(directory: Path) -> bool:
    """Whether `directory` is, or can be made, a directory this process can write in."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return directory.is_dir() and os.access(directory, os.W_OK)


def quiet_matplotlib_dirs() -> None:
    """Before matplotlib is imported: where its own directory is not writable (a read-only
    HOME), give it one under the temporary directory, so that it does not warn at length at
    every start. One per user, kept, so that its font cache is built once."""
    if os.environ.get("MPLCONFIGDIR") or "matplotlib" in sys.modules:
        return
    try:
        if all(writable(d) for d in matplotlib_dirs()):
            return
    except RuntimeError:  # no home directory at all
        pass
    os.environ["MPLCONFIGDIR"] = str(private_temporary_dir("mtrain-matplotlib"))


def private_temporary_dir(name: str) -> Path:
    """`name`-UID in the temporary directory, this user's alone; or, where another user or a
    link holds that name, a new directory removed at exit."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is not None:
        path = Path(tempfile.gettempdir(), f"{name}-{uid}")
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
        with contextlib.suppress(OSError):
            st = path.lstat()
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
                return path
    directory = tempfile.mkdtemp(prefix=f"{name}-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return Path(directory)


def resolve_run(run: Path | None) -> Path:
    """The run asked for, or the latest under ./runs/."""
    if run is not None:
        return run
    run = latest_run(RUNS_ROOT)
    log.info("using run %s", run)
    return run


@dataclass
class Decoding:
    """The model to translate with, where it runs, and how it searches: what an engine reads."""

    run: Path | None  # a run directory (mtrain), an exported one (ctranslate2); None: the latest
    device: str = "auto"
    quantize: Quantize = Quantize.none
    checkpoint: str = BEST
    beam: int | None = None  # None: the run's
    alpha: float | None = None  # None: the run's
    nbest: int = 1


def load_engine(engine: Engine, d: Decoding) -> tuple[Path, Config, TextTranslator]:
    """The directory, config and Translator of `engine` reading `d`'s model: the one place
    that chooses an engine, for every command that translates."""
    if engine is Engine.ctranslate2:
        if d.checkpoint != BEST:
            fail("--checkpoint needs --engine mtrain")
        return _ctranslate2_translator(d)
    return _torch_translator(d)


def _torch_translator(d: Decoding) -> tuple[Path, Config, Translator]:
    """A run's checkpoint in a Translator that mtrain drives on PyTorch."""
    torch_device = runtime.pick_device(d.device)
    runtime.configure(torch_device)
    run_dir = resolve_run(d.run)
    cfg, tokenizer, model = load_run(run_dir, torch_device, d.checkpoint)
    if d.quantize is Quantize.int8:
        if torch_device.type != "cpu":
            fail("--quantize int8 runs on the CPU only; add --device cpu")
        model = runtime.quantize_int8(model)
    decode = decode_options(cfg, d.beam, d.alpha, d.nbest)
    return run_dir, cfg, Translator(model, tokenizer, cfg, torch_device, decode, d.nbest)


def _ctranslate2_translator(d: Decoding) -> tuple[Path, Config, TextTranslator]:
    """A directory written by `mtrain export` in a Translator that CTranslate2 drives."""
    if d.run is None:
        fail("--engine ctranslate2 needs --run DIR, a directory written by mtrain export")
    cfg, tokenizer, engine = ct2_engine.load(d.run, d.device, d.quantize is Quantize.int8)
    decode = decode_options(cfg, d.beam, d.alpha, d.nbest)
    return d.run, cfg, ct2_engine.CT2Translator(engine, tokenizer, cfg, decode, d.nbest)


def decode_options(cfg: Config, beam: int | None, alpha: float | None, nbest: int) -> DecodeConfig:
    """The run's decoding options with those asked for on the command line."""
    asked = {"beam_size": beam, "alpha": alpha}
    raw = cfg.to_dict()
    raw["decode"].update({k: v for k, v in asked.items() if v is not None})
    decode = config.from_dict(raw, "options").decode  # the run's own checks, e.g. a finite alpha
    if nbest > decode.beam_size:
        fail(f"--nbest {nbest} needs --beam {nbest} or more")
    return decode


def resolve_data(cfg: Config, config_path: Path) -> None:
    """Check that the config's corpora exist, and make every data path absolute: the run
    works from any directory."""
    for key in ("train", "dev", "test"):
        try:
            corpus.check_files(getattr(cfg.data, key), f"data.{key}")
        except corpus.DataError as e:
            fail(f"{config_path}: {e}")
        setattr(cfg.data, key, corpus.resolve(getattr(cfg.data, key)))
    cfg.data.prepared_dir = str(Path(cfg.data.prepared_dir).resolve())
