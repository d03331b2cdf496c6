"""Progress off a terminal: plain lines, never carriage-return frames (core/progress.py), and
the lines training logs on stderr where the caller configured no logging."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mtrain.core import progress

from .console import REPO, mtrain


def test_a_bar_off_a_terminal_writes_a_line_at_its_start_and_end(capsys) -> None:
    with progress.bar(total=3, desc="sample", unit="B", leave=False) as bar:
        for _ in range(3):
            bar.update(1)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("sample:   0%") and lines[1].startswith("sample: 100%")


def test_a_disabled_bar_writes_nothing(capsys) -> None:
    with progress.bar(total=3, desc="sample", disable=True) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""


LOGS = """
import logging, sys
from tqdm.contrib.logging import logging_redirect_tqdm
from mtrain.core.progress import lines_to_stderr
{setup}
with lines_to_stderr(), logging_redirect_tqdm():  # as training enters it
    logging.getLogger("mtrain.training.run_log").info("finished at step 3")
logging.getLogger("mtrain.training.run_log").info("after")
"""


CONFIGURED = "logging.basicConfig(level=logging.INFO, format='%(message)s')"


@pytest.mark.parametrize(
    "setup, expected",
    [
        ("", "finished at step 3\n"),  # nothing configured: to stderr, while it is open
        (CONFIGURED, "finished at step 3\nafter\n"),  # as the caller configured, once
        ("logging.basicConfig(level=logging.WARNING)", ""),  # the caller's choice holds
    ],
)
def test_training_lines_reach_stderr_unless_the_caller_configured_logging(setup, expected):
    code = LOGS.format(setup=setup)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stderr == expected  # each line once


def test_translate_writes_plain_lines_into_a_log_file(run_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.zh"
    source.write_text("我是谁\n今天是星期二\n", encoding="utf-8")
    args = ["translate", "--run", str(run_dir), "--device", "cpu", "--input", str(source)]
    result = mtrain(*args, "-o", str(tmp_path / "out.en"))
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    assert any(line.startswith("translate: 2 lines") for line in result.stderr.splitlines())
