"""The training objective and optimiser: label-smoothed loss, AdamW, warmup + inverse-sqrt."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mtrain.config import TrainConfig
from mtrain.tokenizer import PAD_ID


def lr_factor(updates_done: int, warmup_steps: int) -> float:
    """The learning-rate factor of update number `updates_done + 1`: a linear warmup to 1 at
    update `warmup_steps`, then inverse-square-root decay.

    LambdaLR calls this with the count of scheduler steps taken so far (0 for the first update).
    """
    update = updates_done + 1
    if update < warmup_steps:
        return update / warmup_steps
    return math.sqrt(max(warmup_steps, 1) / update)


def loss_fn(
    logits: torch.Tensor, tgt_out: torch.Tensor, label_smoothing: float, reduction: str = "mean"
) -> torch.Tensor:
    """Label-smoothed cross-entropy over non-padding target tokens: their mean, or sum."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(),  # (B*T, V)
        tgt_out.flatten(),  # (B*T,)
        ignore_index=PAD_ID,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with the betas of the paper and its learning-rate schedule, stepped per update."""
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=(0.9, 0.98),
        eps=1e-9,
        weight_decay=0.0,
        fused=True,  # one kernel for all parameters, on the CPU as on CUDA
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps)
    )
    return optimizer, schedule
