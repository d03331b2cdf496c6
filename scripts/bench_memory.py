"""Whole-run memory: train N updates with `mtrain train` and print the peak resident memory,
the batch shapes the updates met, tokens/s and the padding.

    python scripts/bench_memory.py --config configs/default.yaml --steps 1000 [--set key=value]

The run is a real one (validations included) under a temporary --out, in a process of its own:
its peak is that process's largest resident set, as `/usr/bin/time -v` reports it. The corpus
is prepared first, in another process, so the peak is training's. The shapes and the padding
are those of the training batches of the same config and seed, computed from the batch stream
(validation and decoding meet shapes of their own, not counted here); tokens/s counts
training time only, between train.jsonl records with no validation between them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mtrain.core import config
from mtrain.data.batching import BatchStream
from mtrain.data.token_corpus import TokenCorpus
from mtrain.training.run_log import LOG_EVERY

SAMPLE_SECONDS = 0.5  # how often the resident set is read, for its course over the run


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo (Linux) or the platform."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def resident_mb(pid: int) -> float | None:
    """The process's resident set now, in MB (None where /proc cannot tell)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_measured(command: list[str]) -> tuple[int, float, list[tuple[float, float]]]:
    """Run `command`; return its exit status, its peak resident set in MB and the samples
    (seconds, MB) of its resident set over the run."""
    start = time.monotonic()
    child = subprocess.Popen(command, stdout=sys.stderr)
    samples = []
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        if (rss := resident_mb(child.pid)) is not None:
            samples.append((time.monotonic() - start, rss))
        time.sleep(SAMPLE_SECONDS)
    child.returncode = os.waitstatus_to_exitcode(status)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KB on Linux
    return child.returncode, usage.ru_maxrss * scale / 2**20, samples


def batch_figures(
    corpus: TokenCorpus, cfg: config.Config, steps: int
) -> tuple[set[tuple[int, int, int]], float, list[int]]:
    """The distinct (rows, source, decoder) shapes of the training batches of the first
    `steps` updates, their share of padded positions, and each update's tokens."""
    budget, accumulate = cfg.train.batch_tokens, cfg.train.accumulate
    stream = iter(BatchStream(corpus.src_len, corpus.tgt_len, budget, cfg.train.seed))
    shapes, positions, per_update = set(), 0, []
    for _ in range(steps):
        tokens = 0
        for _ in range(accumulate):
            plan = next(stream)
            indices, shape = plan.indices, plan.shape
            shapes.add((shape.rows, shape.src_len, shape.tgt_len))
            positions += shape.rows * (shape.src_len + shape.tgt_len)
            src = corpus.src_len[indices].sum(dtype=np.int64)
            tokens += int(src + corpus.tgt_len[indices].sum(dtype=np.int64)) + len(indices)
        per_update.append(tokens)
    return shapes, 1 - sum(per_update) / max(positions, 1), per_update


def training_speed(run_dir: Path, per_update: list[int]) -> float | None:
    """Tokens/s between train.jsonl records with no validation and no start-up between them."""
    try:
        records = [json.loads(line) for line in (run_dir / "train.jsonl").open()]
        validated = {json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()}
    except (OSError, ValueError, KeyError):
        return None
    tokens = seconds = 0.0
    for before, after in itertools.pairwise(records):
        first, last = before["step"], after["step"]
        if first in validated or last - first != LOG_EVERY or last > len(per_update):
            continue
        tokens += sum(per_update[first:last])
        seconds += 60 * (after["minutes"] - before["minutes"])
    return tokens / seconds if seconds > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument("--set", action="append", default=[], help="key=value (repeatable)")
    parser.add_argument("--steps", type=int, default=1000, help="updates to train")
    args = parser.parse_args()
    settings = [*args.set, "train.max_minutes=0", f"train.max_steps={args.steps}"]
    sets = [x for s in settings for x in ("--set", s)]
    cfg = config.load(args.config, settings)
    mtrain = [sys.executable, "-m", "mtrain"]

    say(f"preparing the corpus of {args.config}")
    prepared = subprocess.run(
        [*mtrain, "prepare", "--config", str(args.config), *sets],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout.strip()
    corpus = TokenCorpus(Path(prepared.splitlines()[-1]))
    shapes, padding, per_update = batch_figures(corpus, cfg, args.steps)

    with tempfile.TemporaryDirectory(prefix="bench_memory-") as out:
        run_dir = Path(out) / "run"
        command = [*mtrain, "train", "--config", str(args.config), "--out", str(run_dir), *sets]
        say(" ".join(command))
        status, peak, samples = run_measured(command)
        if status:
            sys.exit(f"mtrain train failed (exit status {status})")
        speed = training_speed(run_dir, per_update)

    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs)")
    print(f"config: {' '.join([str(args.config), *args.set])}, {args.steps} updates")
    print(f"peak resident memory, whole run: {peak:,.0f} MB")
    if samples:
        course = [rss for _, rss in samples]
        marks = [course[min(len(course) - 1, int(len(course) * q))] for q in (0.25, 0.5, 0.75)]
        print(
            "resident memory at 1/4, 1/2, 3/4 of the run: "
            + ", ".join(f"{mb:,.0f}" for mb in marks)
            + " MB"
        )
    print(f"distinct training batch shapes: {len(shapes)}")
    print(f"tokens/s (training): {speed:,.0f}" if speed else "tokens/s: not measured")
    print(f"padding: {100 * padding:.1f}% of positions")


if __name__ == "__main__":
    main()
