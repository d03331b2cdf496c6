"""The `mtrain` console script as tests run it: in a subprocess, on this checkout."""

import os
import subprocess
import sys
from pathlib import Path

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
