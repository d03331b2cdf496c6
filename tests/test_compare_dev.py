"""scripts/compare_dev.py: every system is checked before anything translates, and a bad one is
one line, as `mtrain` says its errors."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mtrain.core.config import load
from mtrain.export.converter import MODEL_FILE, MTRAIN_CONFIG
from mtrain.run.directory import write_config

from .console import REPO, run_script, script

PREFIX = "compare_dev.py: error: "


def one_line(result: subprocess.CompletedProcess) -> str:
    """The one error line of a refusal (exit status 2): nothing translated, no traceback."""
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(PREFIX), line
    return line


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    """`tmp_path`, the current directory, holding `untrained`, a run directory with its config
    and no checkpoint yet; `export`, what mtrain export writes (its files' names); `run/best.pt`,
    a checkpoint file."""
    (tmp_path / "untrained").mkdir()
    write_config(tmp_path / "untrained", load(REPO / "configs" / "tiny.yaml"))
    (tmp_path / "export").mkdir()
    for name in (MODEL_FILE, MTRAIN_CONFIG):
        (tmp_path / "export" / name).write_text("")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "best.pt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("system", "said"),
    [
        ("b=untrained:beam=0", "--system b=untrained: options: decode.beam_size: must be positive"),
        ("b=untrained:alpha=nan", "decode.alpha: expected a finite number, got nan"),
        ("b=untrained", "--system b=untrained: untrained/best.pt: no such checkpoint"),
        ("b=untrained:checkpoint=../x.pt", "expected the name of a checkpoint file"),
        ("b=run/best.pt", "a file, not a run directory (a checkpoint is named as RUN:checkpoint"),
        ("b=export", "--system b=export: a CTranslate2 export (written by mtrain export)"),
        ("b=untrained:beam=x", "beam='x' is not a number"),
    ],
)
def test_a_system_that_cannot_translate_is_refused_in_one_line(
    runs, monkeypatch, capsys, system, said
):
    args = ["--system", system, "--system", "a=missing"]  # the first refused is said
    result = run_script("compare_dev.py", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert said in one_line(result)


def test_a_missing_run_is_one_line_from_the_script(tmp_path):
    """What a user sees: the script's own process."""
    result = script(
        "compare_dev.py", "--system", "a=missing", "--system", "b=missing", cwd=tmp_path
    )
    line = one_line(result)
    assert line == PREFIX + "--system a=missing: missing: not a run directory (no config.yaml)"


@pytest.mark.parametrize("samples", ["0", "-5"])
def test_no_resamples_is_refused_before_anything_translates(run_dir, monkeypatch, capsys, samples):
    args = ["--system", f"a={run_dir}", "--system", f"b={run_dir}:beam=2", "--samples", samples]
    line = one_line(run_script("compare_dev.py", *args, monkeypatch=monkeypatch, capsys=capsys))
    assert f"argument --samples: expected 1 or more, got {samples}" in line


def test_too_few_resamples_for_a_p_value_below_005_are_refused(run_dir, monkeypatch, capsys):
    args = ["--system", f"a={run_dir}", "--system", f"b={run_dir}:beam=2", "--samples", "20"]
    result = run_script("compare_dev.py", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert result.returncode == 2 and not result.stdout
    assert "argument --samples: 20 bootstrap resamples: too few" in result.stderr
    assert "translating" not in result.stderr


def test_two_systems_are_compared(run_dir, monkeypatch, capsys):
    args = ["--system", f"a={run_dir}", "--system", f"b={run_dir}:beam=2", "--samples", "40"]
    result = run_script("compare_dev.py", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| system", "| a", "| b"]
    assert rows[1].endswith("| (baseline) |")
