"""What the commands share: options, logging, errors (the scripts' too), finding a run, and the
engine that translates with it (for translate, eval, serve and plot)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import enum
import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from mtrain.core.config import MAX_ALPHA, MAX_BEAM, Config
from mtrain.core.errors import MtrainError, OptionError
from mtrain.decoding.translator import TextTranslator
from mtrain.export.engine import Opened, open_engine
from mtrain.run.directory import BEST, latest_run
from mtrain.training.start import RUNS_ROOT

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
    int | None,
    typer.Option("--beam", min=1, max=MAX_BEAM, help="Beam size; 1 is greedy. Default: the run's."),
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


def error(message: str, prog: str = "mtrain") -> int:
    """Print one error line; return the exit status for it."""
    typer.echo(f"{prog}: error: {message}", err=True)
    return 2


def fail(message: str) -> None:
    """Stop the command with one error line and exit status 2."""
    raise typer.Exit(error(message))


def file_error(e: OSError) -> str:
    """A file that cannot be read or written, in one line."""
    return f"{e.filename}: {e.strerror}" if e.filename else str(e)


class ScriptParser(argparse.ArgumentParser):
    """The scripts' parser: a bad option is an OptionError, which `script_main` says in one
    line, as `mtrain` says its own."""

    def error(self, message: str) -> NoReturn:
        raise OptionError(f"{message} (see {self.prog} --help)")


def script_main(main: Callable[[], int | None]) -> NoReturn:
    """Run a script's `main` and exit with its status, as `mtrain` runs a command: an error of
    the user's making is one line `SCRIPT: error: ...` and status 2, Ctrl-C status 130."""
    prog = Path(sys.argv[0]).name
    try:
        status = main()
    except MtrainError as e:  # a ScriptParser's options among them
        status = error(str(e), prog)
    except KeyboardInterrupt:
        typer.echo(f"{prog}: interrupted", err=True)
        status = 130
    except OSError as e:
        status = error(file_error(e), prog)
    sys.exit(status or 0)


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


def load_model(engine: Engine, d: Decoding) -> Opened:
    """`d`'s model on `engine`, for every command that translates (the latest run where `d`
    names none), opened as serve and `mtrain.load` open it (`export.engine.open_engine`)."""
    if engine is Engine.ctranslate2 and d.run is None:
        fail("--engine ctranslate2 needs --run DIR, a directory written by mtrain export")
    if engine is Engine.mtrain:
        from mtrain.core import runtime

        runtime.pick_device(d.device)  # a wrong --device is said before a run is looked for
    run = d.run if engine is Engine.ctranslate2 else resolve_run(d.run)
    int8 = d.quantize is Quantize.int8
    return open_engine(run, engine.value, d.device, d.checkpoint, int8, d.beam, d.alpha, d.nbest)


def load_engine(engine: Engine, d: Decoding) -> tuple[Path, Config, TextTranslator]:
    """The directory, config and translator of `d`'s model on `engine`."""
    model = load_model(engine, d)
    return model.path, model.translator.cfg, model.translator
