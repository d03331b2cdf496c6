"""Prepare and train on a corpus of any size: speed and memory, printed as figures.

    python scripts/bench_data.py --pairs 1000000 [--pairs 10000000 ...]

For each N it writes a synthetic corpus of N pairs made by joining two random shipped Tatoeba
pairs (so lengths and characters are real ones, about twice a Tatoeba sentence, and nearly no
pair repeats), prepares it with `mtrain prepare` and trains 50 updates of configs/default.yaml
on it, each in a process of its own. It prints

    prepare: P pairs/s, peak RSS M MB
    train: first update after S s, peak RSS R MB

(the proportional set sizes of a process and its workers, summed, sampled every 0.1 s),
and the same train line for the shipped corpus first.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "default.yaml"


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, in MB: their proportional set
    sizes, so pages that forked workers share with their parent count once."""
    total, pids = 0, [pid]
    while pids:
        p = pids.pop()
        try:
            status = Path(f"/proc/{p}/smaps_rollup").read_text()
            pss = next(line for line in status.splitlines() if line.startswith("Pss:"))
            total += int(pss.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                pids += map(int, (task / "children").read_text().split())
        except (OSError, StopIteration, ValueError):
            continue
    return total / 1024


def run_measured(command: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run a command; return it, its wall time and the peak RSS of its process tree."""
    began = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0.0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    done = subprocess.CompletedProcess(command, proc.returncode, out, err)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{err[-3000:]}")
    return done, time.monotonic() - began, peak[0]


def synthetic_corpus(path: Path, pairs: int, seed: int = 0) -> None:
    """N pairs, each two random shipped training pairs joined."""
    shipped = []
    for line in (REPO / "data/tatoeba/train.tsv").read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        shipped.append((fields[1], fields[3]))
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for first in range(0, pairs, 10_000):
            rows = []
            for _ in range(min(10_000, pairs - first)):
                (zh1, en1), (zh2, en2) = rng.choice(shipped), rng.choice(shipped)
                rows.append(f"{zh1}{zh2}\t{en1} {en2}\n")
            f.writelines(rows)


def mtrain_args(train: Path, prepared: Path) -> list[str]:
    return [
        f"--set=data.train={train}",
        f"--set=data.prepared_dir={prepared}",
    ]


def train_line(train: Path, prepared: Path) -> str:
    command = [sys.executable, __file__, "--train-only", str(train), str(prepared)]
    done, _, peak = run_measured(command)
    return f"{done.stdout.strip()}, peak RSS {peak:,.0f} MB"


def train_only(train: Path, prepared: Path, n_updates: int = 50) -> None:
    """In a fresh process: build the trainer on a prepared corpus and time its first update."""
    began = time.monotonic()
    import torch

    from mtrain.core import config
    from mtrain.training.build import build_trainer
    from mtrain.training.start import resolve_data

    overrides = [s.removeprefix("--set=") for s in mtrain_args(train, prepared)]
    cfg = config.load(CONFIG, [*overrides, "train.max_minutes=0"])
    resolve_data(cfg, CONFIG)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(cfg, Path(run_dir), torch.device("cpu"))
        updates = trainer.data.updates(trainer.group, cfg.train.accumulate)
        trainer.update_step(next(updates))
        first = time.monotonic() - began
        for _ in range(n_updates - 1):
            trainer.update_step(next(updates))
    print(f"train: first update after {first:.1f} s ({len(trainer.data.corpus):,} pairs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, action="append", default=[], help="repeatable")
    parser.add_argument("--train-only", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_only:
        return train_only(*args.train_only)
    print(f"{os.cpu_count()} CPUs; {CONFIG.name}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shipped = REPO / "data/tatoeba/train.tsv"
        mtrain = [sys.executable, "-m", "mtrain", "prepare", "--config", str(CONFIG)]
        run_measured([*mtrain, *mtrain_args(shipped, tmp / "prepared")])
        print(f"shipped corpus: {train_line(shipped, tmp / 'prepared')}", flush=True)
        for n in args.pairs:
            corpus = tmp / f"synthetic-{n}.tsv"
            synthetic_corpus(corpus, n)
            size = corpus.stat().st_size / 1e6
            _, seconds, peak = run_measured([*mtrain, *mtrain_args(corpus, tmp / "prepared")])
            print(f"{n:,} pairs ({size:,.0f} MB):", flush=True)
            print(
                f"  prepare: {n / seconds:,.0f} pairs/s, peak RSS {peak:,.0f} MB ({seconds:.0f} s)"
            )
            print(f"  {train_line(corpus, tmp / 'prepared')}", flush=True)
            corpus.unlink()


if __name__ == "__main__":
    main()
