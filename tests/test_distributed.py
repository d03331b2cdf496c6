"""Training with several processes (DDP over gloo, on the CPU) is training with one, exactly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mtrain import checkpoint, config, distributed
from mtrain.dataset import BatchStream
from mtrain.distributed import Group
from mtrain.train import Trainer

from .synthetic import REPO, overrides

CPU = torch.device("cpu")
# One thread per process everywhere, so that the runs compared add up floats in the same order.
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(corpus, **train_keys) -> config.Config:
    settings = [*overrides(corpus, **train_keys), "model.dropout=0"]
    return config.load(REPO / "configs" / "tiny.yaml", settings)


def train_worker(rank, world_size, port, corpus, run_dir, accumulate, report) -> None:
    """Train 10 updates as rank `rank`; write what it trained on and its all-reduce count."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = Group(rank, world_size, rank)
    distributed.start(group, CPU, timeout_minutes=2)
    cfg = tiny_config(corpus, max_steps=10, eval_every=10, accumulate=accumulate)
    trainer = Trainer(cfg, Path(run_dir), CPU, group=group)
    consumed, allreduces = [], []
    collate = trainer.corpus.collate

    def recording_collate(indices):
        consumed.append([int(i) for i in indices])
        return collate(indices)

    def counting_hook(state, bucket):
        allreduces.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    trainer.corpus.collate = recording_collate
    if group.active:
        trainer.net.register_comm_hook(None, counting_hook)
    trainer.run()
    distributed.stop(group)
    report = Path(report)
    report.with_name(f"{report.name}.{rank}").write_text(
        json.dumps({"consumed": consumed, "allreduces": len(allreduces)})
    )


def train_processes(tmp_path, corpus, name, world_size, accumulate) -> tuple[dict, list[dict]]:
    run = tmp_path / name
    run.mkdir()
    report = tmp_path / f"{name}.json"
    args = (world_size, free_port(), corpus, str(run), accumulate, str(report))
    mp.start_processes(train_worker, args, nprocs=world_size, start_method="spawn")
    reports = [json.loads(Path(f"{report}.{r}").read_text()) for r in range(world_size)]
    return checkpoint.load(run / "last.pt"), reports


def test_two_processes_with_accumulation_equal_one_and_reduce_once_per_update(corpus, tmp_path):
    # 2 processes × 3 batches per update against 1 process × 6: the same sentences per update.
    # 6 batches per update do not divide the epoch, so updates run across epoch ends.
    two, reports = train_processes(tmp_path, corpus, "two", world_size=2, accumulate=3)
    one, _ = train_processes(tmp_path, corpus, "one", world_size=1, accumulate=6)
    assert two["step"] == one["step"] == 10
    for name, tensor in one["model"].items():
        other = two["model"][name]
        if name.endswith("kv_proj.bias"):
            # Keep the values' half only. The keys' bias adds the same amount to every score of
            # a query, which softmax ignores: its gradient is 0 but for rounding, and Adam turns
            # rounding noise (summed in another order here: (g1+g2+g3)+(g4+g5+g6)) into steps.
            tensor, other = tensor[tensor.numel() // 2 :], other[other.numel() // 2 :]
        torch.testing.assert_close(other, tensor, msg=name)

    # Gradients are all-reduced in the last batch's backward only (the model fits one bucket).
    assert [r["allreduces"] for r in reports] == [10, 10]

    # The ranks took turns through one stream of batches: each batch once, none skipped.
    cfg = tiny_config(corpus)
    corpus = Trainer(cfg, tmp_path / "one", CPU, resume=True).corpus
    stream = BatchStream(corpus.src_len, corpus.tgt_len, cfg.train.batch_tokens, cfg.train.seed)
    assert len(stream.epoch_order(0)) % 6, "the test needs an epoch that 6 batches do not divide"
    batches = iter(stream)
    expected = [next(batches).tolist() for _ in range(10 * 6)]
    taken = reports[0]["consumed"] + reports[1]["consumed"]
    assert sorted(map(tuple, taken)) == sorted(map(tuple, expected))


def torchrun(run: Path, corpus, *settings: str, nproc: int = 2) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [
        *launcher,
        f"--nproc_per_node={nproc}",
        "-m",
        "mtrain",
        "train",
        "--config",
        "configs/tiny.yaml",
        "--out",
        str(run),
        *(f"--set={s}" for s in [*overrides(corpus, eval_every=3), *settings]),
    ]


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists():
        assert proc.poll() is None, "training ended before it wrote a checkpoint"
        time.sleep(0.1)


def test_sigterm_to_torchrun_then_resume_equals_an_uninterrupted_run(corpus, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    done = subprocess.run(
        torchrun(whole, corpus, "train.max_steps=30"), cwd=REPO, env=ENV, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]

    proc = subprocess.Popen(
        torchrun(parts, corpus, "train.max_steps=30"),
        cwd=REPO,
        env=ENV,
        stderr=subprocess.DEVNULL,
    )
    wait_for(parts / "last.pt", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    stopped = checkpoint.load(parts / "last.pt")["step"]
    assert stopped < 30

    alone = subprocess.run(
        torchrun(parts, corpus, "train.max_steps=30", nproc=1),
        cwd=REPO,
        env=ENV,
        capture_output=True,
    )
    assert alone.returncode != 0
    assert b"written by 2 training process(es), not 1" in alone.stderr

    resumed = subprocess.run(
        torchrun(parts, corpus, "train.max_steps=30"), cwd=REPO, env=ENV, capture_output=True
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    assert f"resuming {parts} at step {stopped}".encode() in resumed.stderr
    a, b = checkpoint.load(whole / "last.pt"), checkpoint.load(parts / "last.pt")
    assert a["step"] == b["step"] == 30
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def test_a_killed_rank_makes_the_other_exit_with_one_line(corpus, tmp_path):
    run, port = tmp_path / "run", free_port()
    command = [sys.executable, "-m", "mtrain", "train", "--config", "configs/tiny.yaml"]
    settings = [f"--set={s}" for s in overrides(corpus, eval_every=3)]
    procs = []
    for rank in range(2):
        env = {
            **ENV,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        args = [*command, "--out", str(run), *settings, "--peer-timeout", "0.5"]
        procs.append(subprocess.Popen(args, cwd=REPO, env=env, stderr=subprocess.PIPE))
    wait_for(run / "last.pt", procs[0])
    procs[1].kill()
    procs[1].wait()
    _, stderr = procs[0].communicate(timeout=120)  # a bound against a hang, not a speed test
    stderr = stderr.decode()
    assert procs[0].returncode == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("mtrain: error:")]
    assert len(errors) == 1 and "rank 0: lost the other training processes" in errors[0]
    assert "Traceback" not in stderr
    assert checkpoint.load(run / "last.pt")["step"] > 0


def test_a_plain_run_is_a_group_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    group = distributed.from_env()
    assert group == Group() and group.is_main and not group.active
    assert group.broadcast("x") == "x" and group.gather(1) == [1]
