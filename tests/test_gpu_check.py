"""scripts/gpu_check.py runs its every step on the CPU (--device cpu --quick), so that a session
lent a GPU finds it working."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from .synthetic import REPO


def gpu_check():
    """scripts/gpu_check.py as a module."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/gpu_check.py", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_the_quick_check_runs_every_step_and_writes_its_figures(tmp_path):
    out = tmp_path / "check"
    done = check("--device", "cpu", "--quick", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(out / "check.json")  # stdout holds the result only
    figures = json.loads((out / "check.json").read_text("utf-8"))
    log = (out / "check.log").read_text("utf-8")
    statuses = {name: step["status"] for name, step in figures["steps"].items()}
    assert statuses == dict.fromkeys(statuses, "ok"), log[-3000:]
    expected = ["matmul_peak", "gpu_tests", "bench_train", "bench_train_eager"]
    expected += ["bench_train_compiled", "train", "eval", "bench_decode"]
    assert list(statuses) == expected
    assert figures["versions"]["torch"] and figures["matmul_peak"]["fp32_tflops"] > 0
    # Measured where the CPU has a bf16 kernel; null with the reason where torch emulates it.
    bf16 = figures["matmul_peak"]["bf16_tflops"]
    assert bf16 > 0 if gpu_check().cpu_has_bf16() else bf16 is None
    assert bf16 or "no bf16" in figures["matmul_peak"]["bf16_note"]
    assert figures["gpu_tests"]["failed"] == 0
    assert figures["gpu_tests"]["passed"] + figures["gpu_tests"]["skipped"] >= 10
    for bench in ("bench_train", "bench_train_eager", "bench_train_compiled"):
        assert figures[bench]["tokens_per_s"] > 0 and figures[bench]["achieved_tflops"] > 0
        mfu = figures[bench]["mfu_bf16_peak_pct"]
        assert mfu > 0 if bf16 else mfu is None
    assert figures["bench_train_compiled"]["warm_s"] is not None
    assert figures["train"]["step"] == 10 and figures["train"]["dev_bleu"] is not None
    assert figures["eval"]["sentences"] > 0
    assert figures["bench_decode"]["greedy, cache, batch 1"] > 0


def test_the_cpu_peaks_read_more_than_zero_or_null_with_the_reason(monkeypatch):
    """bf16 on a CPU without its kernel (AVX2 only) runs at a few GFLOP/s, which two decimals
    of TFLOP/s read as 0.0: there it is left null and said why; a figure never reads 0."""
    module = gpu_check()
    assert module.significant(0.0012747) == 0.00127 and module.significant(91.04) == 91.0
    monkeypatch.setattr(module, "cpu_has_bf16", lambda: False)
    found = module.peaks(torch.device("cpu"), quick=True)
    assert found["bf16_tflops"] is None and "no bf16" in found["bf16_note"]
    assert found["fp32_tflops"] > 0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--device", "tpu"], "gpu_check.py: --device tpu: expected cuda (or cuda:N) or cpu\n"),
        (["--out", "{file}/check"], "gpu_check.py: --out {file}/check: cannot write there"),
    ],
    ids=["device", "out"],
)
def test_a_wrong_device_or_an_unwritable_out_ends_in_one_line(tmp_path, args, expected):
    file = tmp_path / "a-file"
    file.write_text("", encoding="utf-8")
    done = check("--device", "cpu", *[arg.format(file=file) for arg in args])
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.startswith(expected.format(file=file)), done.stderr
    assert len(done.stderr.splitlines()) == 1
