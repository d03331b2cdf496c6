"""The training speed of a config on this machine: its real update step, timed for a few
updates without a run (scripts/bench_train.py times more, and tells more)."""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from mtrain.core import runtime
from mtrain.core.config import Config
from mtrain.core.distributed import Group
from mtrain.run.directory import build_model
from mtrain.training.data import TrainingData
from mtrain.training.optim import build_optimizer
from mtrain.training.update_step import LossSettings, UpdateStep, compiled_shapes


def update_step(cfg: Config, data: TrainingData, device: torch.device, group: Group) -> UpdateStep:
    """The update step a run of `cfg` would train with, at step 0."""
    amp_dtype = runtime.mixed_precision(device, cfg.train.precision)
    model = build_model(cfg, data.tokenizer).to(device)
    if group.rank:  # the same initial weights everywhere, other dropout masks
        torch.manual_seed(cfg.train.seed + group.rank)
    group.end_startup()
    optimizer, schedule = build_optimizer(model, cfg.train)
    return UpdateStep(
        net=DistributedDataParallel(model) if group.active else model,
        model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler(enabled=amp_dtype == torch.float16),
        schedule=schedule,
        group=group,
        device=device,
        amp_dtype=amp_dtype,
        loss=LossSettings.of(cfg.train),
        compiled_shapes=compiled_shapes(cfg.train, device, data.stream.grid.shapes),
    )


def timed_updates_per_second(
    cfg: Config, device: torch.device, timed: int = 5, warmup: int = 2
) -> float:
    """Updates a second a run of `cfg` trains here (its corpus prepared), timed over `timed`
    updates after `warmup` untimed ones; the validations a run makes are not counted. Eager,
    even where the run compiles (a compile takes longer than the timing): it errs slow."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))
    runtime.set_seed(cfg.train.seed)
    runtime.configure(device)
    group = Group()
    with tempfile.TemporaryDirectory() as tmp:  # where a run would keep its tokenizer
        data = TrainingData(cfg, Path(tmp), group, resume=False)
    step = update_step(cfg, data, device, group)
    with contextlib.closing(data.updates(group, cfg.train.accumulate)) as updates:
        for _ in range(warmup):
            step(next(updates))
        start = time.perf_counter()
        for _ in range(timed):
            step(next(updates))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return timed / (time.perf_counter() - start)
