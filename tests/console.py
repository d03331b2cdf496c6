"""The `mtrain` console script, and the scripts of scripts/, as tests run them: in a subprocess,
on this checkout; a script also in this process, the same way but for the start of Python."""

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def mtrain(*args, input=None, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "mtrain", *args],
        input=input,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def script(name: str, *args, cwd=REPO) -> subprocess.CompletedProcess:
    """scripts/NAME run with `args`."""
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@functools.cache
def script_module(name: str) -> ModuleType:
    """scripts/NAME as a module."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses find their module
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """scripts/NAME run with `args` in this process, as its `__main__` runs it: its exit status
    and what it wrote, as `script` gives them."""
    from mtrain.commands.common import script_main

    monkeypatch.setattr(sys, "argv", [str(REPO / "scripts" / name), *args])
    with pytest.raises(SystemExit) as exited:
        script_main(script_module(name).main)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(sys.argv, exited.value.code, out, err)
