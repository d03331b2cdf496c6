"""The update step: one optimizer update from the summed gradients of an update's batches (one
all-reduce under DDP, mixed precision, clipping), and what becomes of an update that runs out
of memory or whose loss is not finite.

An update never waits for the device: its loss stays there (the run log sums it), and a
non-finite loss is noted there too; `check_finite` reads the note, with the run log's losses,
in one transfer at the log steps, and alone before a checkpoint. Only `train.skip_nonfinite`,
which must decide before the optimizer steps, reads each update's loss back."""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mtrain.core import runtime
from mtrain.core.config import TrainConfig
from mtrain.core.distributed import Group
from mtrain.core.errors import MtrainError
from mtrain.data.pairs import Batch
from mtrain.training.compiled import Compiled, compiles_on
from mtrain.training.data import Update
from mtrain.training.moving_average import MovingAverage
from mtrain.training.optim import Schedule, loss_fn

if TYPE_CHECKING:
    from mtrain.training.state import Progress, TrainingState

log = logging.getLogger(__name__)


class NonFiniteLoss(MtrainError, RuntimeError):
    """The loss became NaN or infinite; the message names the step."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step  # the update whose loss was not finite


class OutOfMemory(MtrainError, RuntimeError):
    """A process of several ran out of memory: it cannot skip an update the others train on."""


@dataclass(frozen=True)
class LossSettings:
    """What an update minimises and how far it may go: the train keys the update step reads."""

    label_smoothing: float
    clip_norm: float
    skip_nonfinite: bool  # skip an update whose loss is not finite, rather than stop

    @classmethod
    def of(cls, cfg: TrainConfig) -> LossSettings:
        return cls(cfg.label_smoothing, cfg.clip_norm, cfg.skip_nonfinite)


class UpdateStep:
    """One optimizer update from an `Update`'s batches; counts the updates done and skipped."""

    def __init__(
        self,
        net: torch.nn.Module,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        schedule: Schedule,
        group: Group,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        loss: LossSettings,
        step: int = 0,
        skipped: int = 0,
        average: MovingAverage | None = None,
        compiled_shapes: int = 0,
    ):
        """`net` is `model`, or `model` wrapped in DistributedDataParallel; `step` and
        `skipped` count the updates done and skipped before (a resumed run's); `average`, if
        any, follows the weights after every update; `compiled_shapes`, if not 0, compiles a
        batch's forward and loss for each of the batch grid's that many shapes
        (`train.compile`, in a single process)."""
        self.net, self.model, self.optimizer, self.scaler = net, model, optimizer, scaler
        self.schedule, self.group, self.device, self.amp_dtype = schedule, group, device, amp_dtype
        self.loss, self.average = loss, average
        self.compiled = None
        if compiled_shapes and group.active:
            log.warning("train.compile: not under torchrun yet; the updates run eagerly")
        elif compiled_shapes:
            self.compiled = Compiled(self.batch_loss, compiled_shapes)
        self.step = step  # optimizer updates done
        self.skipped = skipped  # updates skipped for running out of memory or a non-finite loss
        # The first update since the last check whose loss was not finite (0: none), and that
        # loss, kept on the device: see `check_finite`.
        self.non_finite_step = torch.zeros((), dtype=torch.long, device=device)
        self.non_finite_loss = torch.zeros((), device=device)

    @classmethod
    def of(
        cls,
        state: TrainingState,
        net: torch.nn.Module,
        group: Group,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        cfg: TrainConfig,
        progress: Progress,
    ) -> UpdateStep:
        """The update step that trains the parts of `state` through `net` from `progress` on."""
        return cls(
            net=net,
            model=state.model,
            optimizer=state.optimizer,
            scaler=state.scaler,
            schedule=state.schedule,
            group=group,
            device=device,
            amp_dtype=amp_dtype,
            loss=LossSettings.of(cfg),
            step=progress.step,
            skipped=progress.skipped,
            average=state.average,
            compiled_shapes=compiled_shapes(cfg, device, state.data.stream.grid.shapes),
        )

    def __call__(self, update: Update) -> torch.Tensor | None:
        """One optimizer update from the summed gradients of the update's batches.

        Returns the mean loss per target token, a () tensor on the device, or None when the
        update was skipped (out of memory in a single process, or a non-finite loss with
        `train.skip_nonfinite`).
        """
        self.model.train()
        batches = [batch.to(self.device) for batch in update.batches]
        self.optimizer.zero_grad(set_to_none=True)
        try:
            total = self.backward(batches, update.n_target)
        except torch.cuda.OutOfMemoryError:
            return self.out_of_memory(update)
        # Every rank sees the same total, so every rank takes the same decision below.
        mean_loss = self.group.sum(total) / self.group.world_size  # ()
        if self.loss.skip_nonfinite:
            value = mean_loss.item()  # the one read per update: skipping is decided here
            if not math.isfinite(value):
                return self.non_finite(update, value)
        else:
            self.note_non_finite(mean_loss)
        self.scaler.unscale_(self.optimizer)
        clip_norm = self.loss.clip_norm
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip_norm, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.schedule.step()
        if self.average is not None:
            self.average.update()
        self.step += 1
        return mean_loss

    def backward(self, batches: list[Batch], n_target: int) -> torch.Tensor:
        """Sum the gradients of the batches' losses, every target token of the update
        (`n_target` on all processes) weighing the same; return this process's share of the
        mean loss."""
        group = self.group
        batch_loss = self.compiled or self.batch_loss
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            # DDP all-reduces the gradients in the backward of the last batch only.
            last = i == len(batches) - 1
            with nullcontext() if last or not group.active else self.net.no_sync():
                loss = batch_loss(batch.src, batch.tgt_in, batch.tgt_out) / n_target
                if group.active:  # DDP averages the ranks' gradients: undo the mean
                    loss = loss * group.world_size
                self.scaler.scale(loss).backward()
            total += loss.detach()
        return total

    def note_non_finite(self, mean_loss: torch.Tensor) -> None:
        """Note on the device, without waiting for it, whether this update's loss is the first
        non-finite one since the last check."""
        first = ~torch.isfinite(mean_loss) & (self.non_finite_step == 0)  # ()
        self.non_finite_step = torch.where(first, self.step + 1, self.non_finite_step)
        self.non_finite_loss = torch.where(first, mean_loss.float(), self.non_finite_loss)

    def check_finite(self, *logged: torch.Tensor | float) -> list[float]:
        """Stop with one line if an update's loss was not finite (without
        `train.skip_nonfinite`); return `logged` (the run log's losses, on the device) as
        floats, read with the check in one transfer. Each call waits for the device: the loop
        makes one at its log steps (the log reads no NaN) and before a checkpoint, which then
        holds no update after the bad one."""
        values = [self.non_finite_step, self.non_finite_loss, *logged]
        as_double = [torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values]
        step, loss, *read = torch.stack(as_double).tolist()  # (2 + len(logged),) read once
        if step:
            message = f"step {int(step)}: the loss is {loss}; training stopped"
            raise NonFiniteLoss(message, int(step))
        return read

    def batch_loss(
        self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor
    ) -> torch.Tensor:
        """The label-smoothed loss of a batch, summed over its target tokens."""
        with runtime.autocast(self.device, self.amp_dtype):
            logits = self.net(src, tgt_in)  # (B, T, V)
        return loss_fn(logits, tgt_out, self.loss.label_smoothing, "sum")

    def out_of_memory(self, update: Update) -> None:
        """Skip the update in a single process; among several, stop with one line."""
        if self.group.active:  # the other ranks are already waiting for this one
            raise OutOfMemory(
                f"rank {self.group.rank}: out of memory at step {self.step + 1} (sentences × "
                f"(source, target) lengths: {shapes(update)}); lower train.batch_tokens (and "
                "raise train.accumulate to keep the update's size)"
            )
        self.optimizer.zero_grad(set_to_none=True)  # drop partial gradients
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.skip(update, "out of memory")

    def non_finite(self, update: Update, mean_loss: float) -> None:
        """Skip the update (`train.skip_nonfinite`)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skip(update, f"loss is {mean_loss}")

    def skip(self, update: Update, reason: str) -> None:
        self.skipped += 1
        log.warning(
            "step %d: skipped the update (sentences × (source, target) lengths: %s): %s; "
            "%d skipped so far",
            self.step + 1,
            shapes(update),
            reason,
            self.skipped,
        )


def compiled_shapes(cfg: TrainConfig, device: torch.device, grid: list) -> int:
    """The shapes to compile a batch's forward and loss for (`train.compile`); 0: none."""
    return len(grid) if compiles_on(cfg.compile, device) else 0


def shapes(update: Update) -> str:
    """The sizes of an update's batches: sentences × (source, target) lengths."""
    return ", ".join(
        f"{b.src.size(0)}×({b.src.size(1)}, {b.tgt_in.size(1)})" for b in update.batches
    )
