"""The training objective and optimiser: label-smoothed loss, AdamW, warmup then decay."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mtrain.core.config import TrainConfig
from mtrain.data.tokenizer import PAD_ID


def lr_factor(updates_done: int, warmup_steps: int) -> float:
    """The learning-rate factor of update number `updates_done + 1`: a linear warmup to 1 at
    update `warmup_steps`, then inverse-square-root decay.

    LambdaLR calls this with the count of scheduler steps taken so far (0 for the first update).
    """
    update = updates_done + 1
    if update < warmup_steps:
        return update / warmup_steps
    return math.sqrt(max(warmup_steps, 1) / update)


class LinearSchedule:
    """The learning-rate factor: a linear warmup to 1 at update `warmup`, then a linear decay
    to nearly 0 at update `total`, the run's last (budgeted training's best-known schedule).

    Under a time budget `total` is not known at first: the factor stays at 1 after warmup until
    `replan` fixes it from the measured speed, and each later `replan` (the machine got faster
    or slower) goes on in a straight line from the factor reached to 0 at the new `total`.
    LambdaLR keeps this object's attributes in its state dict, so a resumed run decays exactly
    as the interrupted one would have.
    """

    def __init__(self, warmup: int, total: int | None):
        self.warmup, self.total = warmup, total
        self.decay_from, self.decay_factor = warmup, 1.0  # where the current line starts

    def __call__(self, updates_done: int) -> float:
        update = updates_done + 1
        if update < self.warmup:
            return update / self.warmup
        if self.total is None:
            return 1.0
        left = (self.total - update + 1) / max(1, self.total - self.decay_from + 1)
        return max(0.0, self.decay_factor * left)

    def replan(self, updates_done: int, total: int) -> None:
        """End at update `total` instead, from the factor of the next update onwards."""
        self.decay_factor = self(updates_done)
        self.decay_from, self.total = updates_done + 1, total


class SmoothedCrossEntropy(torch.autograd.Function):
    """Label-smoothed cross-entropy summed over the rows whose target is not padding, with a
    backward of three in-place passes over the (N, V) log-probabilities.

    The same loss as `F.cross_entropy(..., ignore_index=PAD_ID, label_smoothing=eps,
    reduction="sum")`, whose backward builds the gradients of its two terms as (N, V) tensors,
    adds them and runs log-softmax's backward: on the CPU in fp32 about 5% of an update. The
    gradient with respect to the logits is softmax - q, q the smoothed target distribution, and
    the softmax is the exp of the log-probabilities kept for it.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
        # logits (N, V) of any float dtype, target (N,) ids; the loss in fp32 at least
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logp = F.log_softmax(logits, dim=-1, dtype=dtype)  # (N, V)
        real = target != PAD_ID  # (N,)
        target = target.masked_fill(~real, 0)
        loss = -(1 - eps) * logp.gather(1, target[:, None]).squeeze(1)  # (N,)
        if eps:
            loss = loss - eps / logp.size(1) * logp.sum(dim=1)
        ctx.save_for_backward(logp, target, real)
        ctx.eps, ctx.dtype = eps, logits.dtype
        return loss.masked_fill(~real, 0.0).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logp, target, real = ctx.saved_tensors
        eps = ctx.eps
        # d loss / d logits = softmax - q, q = eps / V everywhere plus 1 - eps at the target;
        # written over the log-probabilities, which nothing needs after this.
        grad_logits = logp.exp_()  # (N, V)
        if eps:
            grad_logits.sub_(eps / logp.size(1))
        rows = torch.arange(logp.size(0), device=logp.device)
        grad_logits[rows, target] -= 1 - eps
        grad_logits.mul_(grad * real[:, None])  # padding rows get no gradient
        return grad_logits.to(ctx.dtype), None, None


def loss_fn(
    logits: torch.Tensor, tgt_out: torch.Tensor, label_smoothing: float, reduction: str = "mean"
) -> torch.Tensor:
    """Label-smoothed cross-entropy over non-padding target tokens: their mean, or sum."""
    # (B, T, V) logits, (B, T) target ids
    total = SmoothedCrossEntropy.apply(logits.flatten(0, 1), tgt_out.flatten(), label_smoothing)
    if reduction == "sum":
        return total
    return total / (tgt_out != PAD_ID).sum()


class Schedule:
    """The learning-rate schedule of a run, stepped once per update; a linear one can be
    re-planned to end at another update (the coordinator's `plan`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float]):
        self.optimizer = optimizer
        self.linear = factor if isinstance(factor, LinearSchedule) else None
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        self.factor = factor  # of update number `updates_done + 1`

    @property
    def anneals(self) -> bool:
        """Whether the rate decays to 0 at a planned last update (a linear schedule)."""
        return self.linear is not None

    @property
    def total(self) -> int | None:
        """The planned last update of a linear schedule; None: none planned (yet)."""
        return self.linear.total if self.linear else None

    @property
    def lr(self) -> float:
        """The learning rate of the next update."""
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> None:
        self.scheduler.step()

    def replan(self, updates_done: int, total: int) -> None:
        """Decay in a straight line from the next update's rate to 0 at update `total`."""
        self.linear.replan(updates_done, total)

    def end_at(self, updates_done: int, end: int) -> None:
        """Without a time budget the linear decay ends at `end` (max_steps); a run resumed with
        another `max_steps`, or without the budget it had, decays from the rate reached to 0
        there instead."""
        total = self.linear.total
        if total is None and updates_done < self.linear.warmup:
            self.linear.total = end  # still warming up: the decay has not begun
        elif total is None or (total != end and updates_done < min(total, end)):
            self.replan(updates_done, end)

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> tuple[torch.optim.AdamW, Schedule]:
    """AdamW with the betas of the paper and its learning-rate schedule, stepped per update."""
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=(0.9, 0.98),
        eps=1e-9,
        weight_decay=0.0,
        fused=True,  # one kernel for all parameters, on the CPU as on CUDA
    )
    if cfg.lr_schedule == "linear":
        # Without a time budget the run ends at max_steps; with one, `plan` fixes the end.
        factor = LinearSchedule(cfg.warmup_steps, None if cfg.max_minutes else cfg.max_steps)
    else:
        factor = functools.partial(lr_factor, warmup_steps=cfg.warmup_steps)
    return optimizer, Schedule(optimizer, factor)
