"""The GPU path checked and measured in one command, every result in one directory.

    python scripts/gpu_check.py [--out gpu-check] [--device cuda]
    python scripts/gpu_check.py --device cpu --quick     # the same steps, tiny config, < 2 min

Steps, each under its own time limit on the device (about 8 minutes in all on one H200; none
with --quick):
1. versions: Python, torch, CUDA, cuDNN, the GPU and its memory;
2. the device's matrix-multiply peak, measured: bf16 and fp32 (and TF32 on CUDA);
3. the `gpu` tests (`pytest -m gpu tests/test_gpu.py`; they skip without CUDA);
4. scripts/bench_train.py on configs/base-gpu.yaml: tokens/s, MFU against the bf16 peak of
   step 2 and against its own, peak GPU memory; then eager and `train.compile` on the same few
   updates, repeated after a warm pass (each shape compiled before the clock starts);
5. a base-gpu training of a few minutes to a dev BLEU, then `mtrain eval` on the test split;
6. scripts/bench_decode.py on the run just trained.

Writes OUT/check.json (the figures, each step's status and seconds) and OUT/check.log (every
command with its output); prints the JSON's path. A step that fails or runs out of time is
recorded as such, and the steps after it still run. With --quick the tests' run
(tests/test_gpu_check.py) is a smoke test of the script itself, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TESTS = "tests/test_gpu.py"
QUICK_SENTENCES = 100  # of the dev and test splits, with --quick


class Check:
    """The check's directory: its log, its figures and each step's outcome."""

    def __init__(self, out: Path, quick: bool = False):
        out.mkdir(parents=True, exist_ok=True)
        self.quick = quick
        self.out, self.log = out, (out / "check.log").open("w", encoding="utf-8")
        self.figures: dict = {"steps": {}}

    def say(self, text: str) -> None:
        self.log.write(text + "\n")
        self.log.flush()
        print(text, file=sys.stderr, flush=True)

    def run(self, name: str, command: list[str], timeout: float, env=None) -> str | None:
        """Run `command` from the repository; its output, or None (recorded) if it failed.
        `timeout` bounds a step on the device, whose time is lent; a quick rehearsal on the CPU
        runs each step to its end, however busy the machine (its tests must not race the clock)."""
        timeout = None if self.quick else timeout
        limit = "no limit" if timeout is None else f"limit {timeout:.0f} s"
        self.say(f"\n## {name}: {' '.join(command)} ({limit})")
        start = time.monotonic()
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        try:
            done = subprocess.run(
                command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
            )
            output, status = done.stdout + done.stderr, "ok" if done.returncode == 0 else "failed"
            if done.returncode:
                status = f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired as e:
            output = "".join(text_of(part) for part in (e.stdout, e.stderr))
            status = "timed out"
        seconds = time.monotonic() - start
        self.log.write(output)
        self.say(f"-> {status} in {seconds:.0f} s")
        self.figures["steps"][name] = {"status": status, "seconds": round(seconds, 1)}
        return output if status == "ok" else None

    def write(self) -> Path:
        path = self.out / "check.json"
        path.write_text(json.dumps(self.figures, indent=2) + "\n", encoding="utf-8")
        return path


def text_of(part: bytes | str | None) -> str:
    """A timed-out command's output so far, as text."""
    return part.decode(errors="replace") if isinstance(part, bytes) else part or ""


def json_line(text: str) -> dict:
    """The last line of `text` that holds a JSON object."""
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def quick_data(out: Path) -> list[str]:
    """`--set` values for a quick check: the first QUICK_SENTENCES of the dev and test
    splits, so that validating and evaluating on the CPU take seconds."""
    values = []
    for split in ("dev", "test"):
        lines = (REPO / "data" / "tatoeba" / f"{split}.tsv").read_text("utf-8").splitlines()
        path = out / f"{split}.tsv"
        path.write_text("".join(line + "\n" for line in lines[:QUICK_SENTENCES]), "utf-8")
        values.append(f"data.{split}={path}")
    return values


def versions(device: torch.device) -> dict:
    """What the figures were measured with."""
    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found |= {
            "gpu": props.name,
            "gpu_memory_gb": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
        }
    return found


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, seconds: float) -> float:
    """The FLOP/s of n×n by n×n products, timed for about `seconds`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            a @ b
        runs += 10
        if device.type == "cuda":
            torch.cuda.synchronize()
    return 2 * n**3 * runs / (time.perf_counter() - start)


def peaks(device: torch.device, quick: bool) -> dict:
    """The measured matrix-multiply peaks, in TFLOP/s (3 significant figures: a CPU's fit in
    hundredths). A CPU without a bf16 kernel has its bf16 figure null, with the reason: torch
    emulates bf16 there, at a speed no run would train at."""
    n, seconds = (1024, 0.3) if quick else (8192, 2.0)
    kinds = {"bf16": (torch.bfloat16, False), "fp32": (torch.float32, False)}
    if device.type == "cuda":
        kinds["tf32"] = (torch.float32, True)
    found, tf32 = {}, torch.backends.cuda.matmul.allow_tf32
    if device.type == "cpu" and not cpu_has_bf16():
        del kinds["bf16"]
        found |= {"bf16_tflops": None, "bf16_note": NO_BF16}
    try:
        for name, (dtype, allow) in kinds.items():
            torch.backends.cuda.matmul.allow_tf32 = allow
            found[f"{name}_tflops"] = significant(matmul_peak(device, dtype, n, seconds) / 1e12)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return found


NO_BF16 = "not measured: this CPU has no bf16 matmul kernel (oneDNN's), torch emulates it"


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512 or AMX on x86, as oneDNN
    finds them; ONEDNN_MAX_CPU_ISA=AVX2 hides them)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def significant(value: float, digits: int = 3) -> float:
    """`value` rounded to `digits` significant figures, so that no small figure reads 0."""
    return float(f"{value:.{digits}g}")


def figure(text: str | None, pattern: str) -> float | None:
    """The number that `pattern`'s group finds in `text` (commas dropped); None if absent."""
    found = text and re.search(pattern, text)
    return float(found[1].replace(",", "")) if found else None


def bench_figures(text: str | None, bf16_peak: float | None) -> dict:
    """bench_train.py's figures: tokens/s, MFU (its own, and against the bf16 peak), memory."""
    achieved = figure(text, r"achieved: ([\d,.]+) GFLOP/s")
    return {
        "tokens_per_s": figure(text, r"tokens/s \(source \+ target, non-padding\): ([\d,.]+)"),
        "updates_per_s": figure(text, r"updates/s: ([\d.]+)"),
        "achieved_tflops": achieved and significant(achieved / 1e3),
        "mfu_own_peak_pct": figure(text, r"MFU: ([\d.]+)%"),
        "mfu_bf16_peak_pct": (
            significant(100 * achieved / 1e3 / bf16_peak) if achieved and bf16_peak else None
        ),
        "peak_gpu_memory_mb": figure(text, r"peak CUDA memory: ([\d,]+) MB"),
        "peak_rss_mb": figure(text, r"peak resident memory: ([\d,]+) MB"),
        "warm_s": figure(text, r"shapes warmed: \d+ updates in ([\d.]+) s"),
    }


def last_validation(run: Path) -> dict:
    """The run's last dev scores and how far it got, from metrics.jsonl."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    scores = [r for r in records if r.get("event") == "validation"]
    if not scores:
        return {}
    last = scores[-1]
    return {
        "step": last.get("step"),
        "minutes": last.get("minutes"),
        "dev_bleu": last.get("dev_bleu"),
        "best_dev_bleu": max(r.get("dev_bleu", 0.0) for r in scores),
    }


def device_of(name: str) -> torch.device:
    """The device `--device` names, cuda or cpu; anything else ends the check with one line."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        sys.exit(f"gpu_check.py: --device {name}: expected cuda (or cuda:N) or cpu")
    return device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="the directory")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="the tiny config, briefly")
    parser.add_argument("--train-minutes", type=float, default=3.0, help="step 5's budget")
    args = parser.parse_args()
    device = device_of(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check.py: no CUDA GPU here; --device cpu --quick checks the script")
    out = args.out.resolve()
    try:
        check = Check(out, args.quick)
    except OSError as e:  # a file in the way, a read-only disk
        sys.exit(f"gpu_check.py: --out {args.out}: cannot write there ({e.strerror})")
    py, dev = sys.executable, ["--device", args.device]
    config = "configs/tiny.yaml" if args.quick else "configs/base-gpu.yaml"
    check.figures |= {"config": config, "quick": args.quick, "versions": versions(device)}
    check.say(json.dumps(check.figures["versions"]))

    start = time.monotonic()
    check.figures["matmul_peak"] = peaks(device, args.quick)
    check.figures["steps"]["matmul_peak"] = {
        "status": "ok",
        "seconds": round(time.monotonic() - start, 1),
    }
    check.say(f"matmul peaks: {check.figures['matmul_peak']}")
    bf16_peak = check.figures["matmul_peak"].get("bf16_tflops")

    tests = check.run(
        "gpu_tests",
        [py, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", TESTS],
        timeout=240,
    )
    if tests is None:  # failures too: count them from the log
        tests = (out / "check.log").read_text("utf-8")
    check.figures["gpu_tests"] = {
        word: int(figure(tests, rf"(\d+) {word}") or 0) for word in ("passed", "failed", "skipped")
    }

    data = quick_data(out) if args.quick else []
    bench = [py, "scripts/bench_train.py", "--config", config, *dev]
    bench += [arg for value in data for arg in ("--set", value)]
    steps = ["--steps", "3", "--warmup", "1"] if args.quick else ["--steps", "40"]
    check.figures["bench_train"] = bench_figures(
        check.run("bench_train", bench + steps, timeout=150 if args.quick else 180), bf16_peak
    )
    # Eager and compiled on the same few updates, warmed: few shapes, each compiled once.
    same = ["--steps", "1", "--repeat", "2", "--warmup", "0"]
    if not args.quick:
        same = ["--steps", "3", "--repeat", "8", "--warmup", "0"]
    backend = ["--compile-backend", "aot_eager"] if args.quick else []  # gcc's C++: minutes
    for name, extra in (
        ("bench_train_eager", []),
        ("bench_train_compiled", ["--set", "train.compile=true", *backend]),
    ):
        text = check.run(name, bench + same + extra, timeout=120 if args.quick else 150)
        check.figures[name] = bench_figures(text, bf16_peak)

    run = out / "run"
    if args.quick:
        limits = [*data, "train.max_steps=10", "train.eval_every=10", "train.max_minutes=0"]
    else:  # a short run's recipe: brief warmup, linear decay to 0 at the budget's end
        limits = [
            f"train.max_minutes={args.train_minutes:g}",
            "train.warmup_steps=300",
            "train.lr_schedule=linear",
            "train.eval_every=300",
            "train.average_last=0",
            "train.keep_last=1",
            "train.patience=0",
        ]
    train = [py, "-m", "mtrain", "train", "--config", config, "--out", str(run), *dev]
    train += [f"--set={value}" for value in limits]
    minutes = 2 if args.quick else args.train_minutes + 2
    check.run("train", train, timeout=60 * minutes)
    check.figures["train"] = last_validation(run)
    evaluated = check.run(
        "eval", [py, "-m", "mtrain", "eval", "--run", str(run), "--json", *dev], timeout=120
    )
    if evaluated:
        scores = json_line(evaluated)
        check.figures["eval"] = {k: scores.get(k) for k in ("bleu", "chrf", "sentences")}

    sentences = ["--sentences", "10" if args.quick else "300"]
    decoded = check.run(
        "bench_decode",
        [py, "scripts/bench_decode.py", "--run", str(run), *sentences, *dev],
        timeout=90 if args.quick else 150,
    )
    check.figures["bench_decode"] = {  # sentences/s by mode, as bench_decode.py names them
        found[1].strip(): float(found[2])
        for found in re.finditer(r"^(\S.*?)\s+[\d.]+ s\s+([\d.]+) sent/s", decoded or "", re.M)
    }
    check.figures["seconds"] = round(sum(s["seconds"] for s in check.figures["steps"].values()))
    path = check.write()
    check.say(f"\n{json.dumps(check.figures, indent=2)}")
    print(path)


if __name__ == "__main__":
    main()
