"""Assembling a run: `build_trainer` reads the config and builds the trainer's parts, each from
its own section, and hands them to a `Trainer` that only runs the loop.

The order matters: rank 0 decides whether the run resumes before anything is read; the
tokenizer and the prepared corpus come before the model (its vocabulary sizes); the model
before its optimiser, schedule and moving average; the checkpoint is loaded into all of them
before the network is wrapped for DDP and the update step takes the updates done so far.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from mtrain.core import runtime
from mtrain.core.config import Config, TrainConfig
from mtrain.core.distributed import Group
from mtrain.run.directory import build_model, write_config
from mtrain.run.lineage import Parent, share
from mtrain.training.budget_recipe import BudgetRecipe, Choice
from mtrain.training.coordinator import Coordinator, patience
from mtrain.training.data import TrainingData
from mtrain.training.moving_average import MovingAverage
from mtrain.training.optim import build_optimizer
from mtrain.training.state import (
    Checkpoints,
    Held,
    Progress,
    RunClock,
    TrainingState,
    resume_from_rank_0,
)
from mtrain.training.trainer import Trainer
from mtrain.training.update_step import UpdateStep
from mtrain.training.validation import Scoreboard, Validator

log = logging.getLogger(__name__)


def build_trainer(
    cfg: Config,
    run_dir: Path,
    device: torch.device,
    resume: bool = False,
    group: Group | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    make_step: type[UpdateStep] = UpdateStep,
    make_validator: Callable[..., Validator] = Validator,
    parent: Parent | None = None,
) -> Trainer:
    """The trainer of one run into `run_dir`, resumed from its last.pt if `resume`. Under
    torchrun every process builds one; rank 0 alone writes the run directory and sends the
    others its tokenizer and checkpoint (and the `parent` run a new run starts from, which it
    reads if not given). Tests replace `clock` (s) and the makers."""
    group = group or Group()
    checkpoints = Checkpoints(run_dir, cfg.train)
    resume = agreed_resume(checkpoints, resume, group)
    run_clock = RunClock(clock)
    runtime.set_seed(cfg.train.seed)
    runtime.configure(device)
    parent = share(cfg, parent, resume, group)  # None on a resume: last.pt holds the rest
    data = TrainingData(cfg, run_dir, group, resume, parent)
    amp_dtype = runtime.mixed_precision(device, cfg.train.precision)
    state = training_state(cfg, data, device, amp_dtype, parent)
    progress = resumed(state, checkpoints, group, cfg.train) if resume else Progress()
    run_clock.before = progress.minutes
    if not resume and group.rank:  # the same initial weights everywhere, other dropout masks
        torch.manual_seed(cfg.train.seed + group.rank)

    def record(choice: Choice) -> None:
        write_config(run_dir, cfg, choice.to_dict(), state.parent)

    recipe = BudgetRecipe(cfg, state.model, record if group.is_main else None)
    recipe.keep(state.choice)  # resumed after the plan chose: train on as it chose
    group.end_startup()
    # The network the updates run through: under torchrun, DDP all-reduces its gradients.
    net = DistributedDataParallel(state.model) if group.active else state.model
    update_step = make_step.of(state, net, group, device, amp_dtype, cfg.train, progress)
    validator = make_validator(state.model, data, cfg, device, amp_dtype, run_clock.minutes)
    coordinator = Coordinator(cfg.train, group, progress.step, run_clock.minutes(), state.schedule)
    return Trainer(
        run_dir=run_dir,
        cfg=cfg.train,
        group=group,
        data=data,
        state=state,
        checkpoints=checkpoints,
        update_step=update_step,
        validator=validator,
        coordinator=coordinator,
        recipe=recipe,
        clock=run_clock,
        progress=progress,
    )


def agreed_resume(checkpoints: Checkpoints, resume: bool, group: Group) -> bool:
    """Whether the run resumes: every rank says which last.pt it holds, so that one newer
    than rank 0's is refused rather than ignored."""
    mine = checkpoints.held(expected=resume) if resume or not group.is_main else None
    none = Held(None, socket.gethostname(), str(checkpoints.last))
    return resume_from_rank_0(group.gather(mine or none, startup=True))


def training_state(
    cfg: Config,
    data: TrainingData,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    parent: Parent | None = None,
) -> TrainingState:
    """A new run's model (with `parent`'s weights, if given) and the parts that train it:
    optimiser, schedule, loss scaler, scoreboard and, under `train.ema_decay`, the weights'
    moving average."""
    model = build_model(cfg, data.tokenizer).to(device)
    if parent is not None:  # before the moving average copies the weights
        model.load_state_dict(parent.weights)
    n_params = sum(p.numel() for p in model.parameters())
    dtype = str(amp_dtype or torch.float32).removeprefix("torch.")
    log.info("model has %.1fM parameters, training on %s in %s", n_params / 1e6, device, dtype)
    tcfg = cfg.train
    optimizer, schedule = build_optimizer(model, tcfg)
    # fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not.
    scaler = torch.amp.GradScaler(enabled=amp_dtype == torch.float16)
    scores = Scoreboard(patience(tcfg))
    average = MovingAverage(model, tcfg.ema_decay) if tcfg.ema_decay else None
    fingerprint = data.tokenizer.fingerprint()
    record = parent and parent.record
    return TrainingState(
        model,
        optimizer,
        schedule,
        scaler,
        data,
        scores,
        fingerprint,
        dtype,
        average,
        parent=record,
        dropout=cfg.model.dropout,
    )


def resumed(
    state: TrainingState, checkpoints: Checkpoints, group: Group, cfg: TrainConfig
) -> Progress:
    """Load last.pt into `state` and return how far the run got; rank 0 reads it and sends it,
    so that no rank needs another's disk."""
    checkpoint = checkpoints.load_last() if group.is_main else None
    checkpoint = group.broadcast(checkpoint, startup=True)
    progress = state.load_state_dict(checkpoint, checkpoints.last, group)
    checkpoints.saved_step = progress.step
    run_dir = checkpoints.run_dir
    if progress.finished:
        progress.finished.check_trainable(cfg, str(run_dir), progress.step)
    log.info("resuming %s at step %d", run_dir, progress.step)
    return progress
