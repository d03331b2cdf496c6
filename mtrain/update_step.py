"""The update step: one optimizer update from the summed gradients of an update's batches (one
all-reduce under DDP, mixed precision, clipping), and what becomes of an update that runs out
of memory or whose loss is not finite."""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from mtrain import runtime
from mtrain.data import Batch
from mtrain.training_data import Update

if TYPE_CHECKING:
    from mtrain.train import Trainer

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


class OutOfMemory(RuntimeError):
    """A process of several ran out of memory: it cannot skip an update the others train on."""


def train_step(trainer: Trainer, update: Update) -> float | None:
    """One optimizer update from the summed gradients of the update's batches.

    Returns the mean loss per target token, or None when the update was skipped (out of
    memory in a single process, or a non-finite loss with `train.skip_nonfinite`).
    """
    state, group = trainer.state, trainer.group
    state.model.train()
    batches = [batch.to(trainer.device) for batch in update.batches]
    state.optimizer.zero_grad(set_to_none=True)
    try:
        total = backward(trainer, batches, update.n_target)
    except torch.cuda.OutOfMemoryError:
        return out_of_memory(trainer, update)
    # Every rank sees the same total, so every rank takes the same decision below.
    mean_loss = group.sum(total).item() / group.world_size
    if not math.isfinite(mean_loss):
        return non_finite(trainer, update, mean_loss)
    state.scaler.unscale_(state.optimizer)
    clip_norm = trainer.cfg.train.clip_norm
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), clip_norm, foreach=True)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.scheduler.step()
    state.step += 1
    return mean_loss


def backward(trainer: Trainer, batches: list[Batch], n_target: int) -> torch.Tensor:
    """Sum the gradients of the batches' losses, every target token of the update (`n_target`
    on all processes) weighing the same; return this process's share of the mean loss."""
    group, device, scaler = trainer.group, trainer.device, trainer.state.scaler
    total = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        # DDP all-reduces the gradients in the backward of the last batch only.
        last = i == len(batches) - 1
        with nullcontext() if last or not group.active else trainer.net.no_sync():
            with runtime.autocast(device, trainer.amp_dtype):
                logits = trainer.net(batch.src, batch.tgt_in)  # (B, T, V)
            loss = trainer.token_loss(logits, batch.tgt_out) / n_target
            if group.active:  # DDP averages the ranks' gradients: undo the mean
                loss = loss * group.world_size
            scaler.scale(loss).backward()
        total += loss.detach()
    return total


def out_of_memory(trainer: Trainer, update: Update) -> None:
    """Skip the update in a single process; among several, stop with one line."""
    if trainer.group.active:  # the other ranks are already waiting for this one
        raise OutOfMemory(
            f"rank {trainer.group.rank}: out of memory at step {trainer.step + 1} (sentences × "
            f"(source, target) lengths: {shapes(update)}); lower train.batch_tokens (and raise "
            f"train.accumulate to keep the update's size); {trainer.checkpoints.kept()}"
        )
    trainer.state.optimizer.zero_grad(set_to_none=True)  # drop partial gradients
    if trainer.device.type == "cuda":
        torch.cuda.empty_cache()
    skip(trainer, update, "out of memory")


def non_finite(trainer: Trainer, update: Update, mean_loss: float) -> None:
    """Skip the update with `train.skip_nonfinite`; else stop with one line."""
    trainer.state.optimizer.zero_grad(set_to_none=True)
    if not trainer.cfg.train.skip_nonfinite:
        raise NonFiniteLoss(
            f"step {trainer.step + 1}: the loss is {mean_loss}; training stopped; "
            f"{trainer.checkpoints.kept()}"
        )
    skip(trainer, update, f"loss is {mean_loss}")


def skip(trainer: Trainer, update: Update, reason: str) -> None:
    trainer.state.skipped += 1
    log.warning(
        "step %d: skipped the update (sentences × (source, target) lengths: %s): %s; "
        "%d skipped so far",
        trainer.step + 1,
        shapes(update),
        reason,
        trainer.state.skipped,
    )


def shapes(update: Update) -> str:
    """The sizes of an update's batches: sentences × (source, target) lengths."""
    return ", ".join(
        f"{b.src.size(0)}×({b.src.size(1)}, {b.tgt_in.size(1)})" for b in update.batches
    )
