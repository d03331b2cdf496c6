"""Journey (c): a user's script that trains and loads from Python, run as a user runs it: with
stderr in a file (`python train.py 2> log`) and on a terminal (a pseudo-terminal here).

The notebook's journey, executed and compared with its committed outputs, is
tests/test_notebook.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from .console import REPO

SCRIPT = """
import json, sys
import mtrain

run = mtrain.train("configs/tiny.yaml", out=sys.argv[1], overrides=json.loads(sys.argv[2]))
model = mtrain.load(run, device="cpu")
print(model.translate("一二三"))
"""


def overrides(corpus: dict[str, str], tmp_path: Path) -> str:
    """The tiny config on the synthetic corpus, 20 updates, a validation every 10."""
    values = {f"data.{key}": path for key, path in corpus.items()}
    values["data.prepared_dir"] = str(tmp_path / "prepared")
    values |= {
        "tokenizer.vocab_size": 300,
        "tokenizer.character_coverage": 1.0,
        "train.batch_tokens": 256,
        "train.max_minutes": 0,
        "train.max_steps": 20,
        "train.eval_every": 10,
        "train.examples": ["一二三"],
        "train.dev_examples": 0,
    }
    return json.dumps(values)


def script(tmp_path: Path) -> list[str]:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT, encoding="utf-8")
    return [sys.executable, str(path)]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}


def check_journey(log: str, stdout: str) -> None:
    """What the run says on stderr, as the command says it: progress, validations, the end."""
    lines = log.splitlines()
    assert any(line.startswith("step 10/20  ") and "loss " in line for line in lines), log
    validations = [line for line in lines if line.startswith(("step 10  ", "step 20  "))]
    assert len(validations) == 2 and all("dev BLEU" in line for line in validations), log
    assert sum(line.startswith("  一二三 → ") for line in lines) == 2, log  # the example
    assert sum(line.startswith("finished at step 20: ") for line in lines) == 1, log
    assert stdout.count("\n") == 1  # the script's own line, nothing of mtrain's


def test_a_script_with_stderr_in_a_file_logs_plain_lines(corpus, tmp_path) -> None:
    log = tmp_path / "log"
    with log.open("w") as stderr:
        result = subprocess.run(
            [*script(tmp_path), str(tmp_path / "run"), overrides(corpus, tmp_path)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=REPO,
            env=environment(),
        )
    text = log.read_text(encoding="utf-8")
    assert result.returncode == 0, text
    assert "\r" not in text  # no bar frames in a file
    assert "sample: " in text and "prepare: " in text  # the tokenizer's and prepare's bars
    check_journey(text, result.stdout)


def run_in_terminal(args: list[str]) -> tuple[int, str, str]:
    """Run `args` with stderr (and stdin) on a pseudo-terminal; its exit status and stderr."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    process = subprocess.Popen(
        args,
        stdin=follower,
        stdout=subprocess.PIPE,
        stderr=follower,
        cwd=REPO,
        env=environment(),
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower closed: the process has ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    stdout = process.stdout.read()
    process.wait()
    os.close(leader)
    text = b"".join(chunks).decode("utf-8", errors="replace").replace("\r\n", "\n")
    return process.returncode, text, stdout.decode("utf-8")


def test_a_script_on_a_terminal_draws_the_bar_and_logs_its_lines(corpus, tmp_path) -> None:
    if not hasattr(pty, "openpty"):
        pytest.skip("no pseudo-terminals here")
    args = [*script(tmp_path), str(tmp_path / "run"), overrides(corpus, tmp_path)]
    status, text, stdout = run_in_terminal(args)
    assert status == 0, text
    assert "\rtrain: " in text or "train: " in text.split("\r")[0]  # the bar, drawn in place
    frames = [part.split("\n")[0] for part in text.split("\r")]
    assert any(frame.startswith("train: 100%") for frame in frames), text
    # The lines logged between the bar's frames, each once, as in a file but for the
    # plain progress lines, which the bar replaces.
    lines = [line.split("\r")[-1] for line in text.split("\n")]
    assert not any(line.startswith("step 10/20  ") for line in lines), text
    validations = [line for line in lines if line.startswith(("step 10  ", "step 20  "))]
    assert len(validations) == 2, text
    assert sum(line.startswith("finished at step 20: ") for line in lines) == 1, text
    assert stdout.count("\n") == 1
