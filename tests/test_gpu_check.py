"""scripts/gpu_check.py runs its every step on the CPU (--device cpu --quick), so that a session
lent a GPU finds it working."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .synthetic import REPO


@pytest.mark.slow
def test_the_quick_check_runs_every_step_and_writes_its_figures(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(out / "check.json")  # stdout holds the result only
    figures = json.loads((out / "check.json").read_text("utf-8"))
    log = (out / "check.log").read_text("utf-8")
    statuses = {name: step["status"] for name, step in figures["steps"].items()}
    assert statuses == dict.fromkeys(statuses, "ok"), log[-3000:]
    expected = ["matmul_peak", "gpu_tests", "bench_train", "bench_train_eager"]
    expected += ["bench_train_compiled", "train", "eval", "bench_decode"]
    assert list(statuses) == expected
    assert figures["versions"]["torch"] and figures["matmul_peak"]["bf16_tflops"] > 0
    assert figures["gpu_tests"]["failed"] == 0
    assert figures["gpu_tests"]["passed"] + figures["gpu_tests"]["skipped"] >= 10
    for bench in ("bench_train", "bench_train_eager", "bench_train_compiled"):
        assert figures[bench]["tokens_per_s"] > 0 and figures[bench]["mfu_bf16_peak_pct"] > 0
    assert figures["bench_train_compiled"]["warm_s"] is not None
    assert figures["train"]["step"] == 10 and figures["train"]["dev_bleu"] is not None
    assert figures["eval"]["sentences"] > 0
    assert figures["bench_decode"]["greedy, cache, batch 1"] > 0
