"""A run's training state, what its checkpoints hold, and its checkpoint files.

`TrainingState` is everything a resumed run needs to continue exactly where another stopped;
`Checkpoints` writes it: last.pt at every validation, best.pt, the last `train.keep_last`
step-N.pt and, at the end, their average.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtrain import runtime
from mtrain.config import Config, TrainConfig
from mtrain.distributed import Group
from mtrain.optim import build_optimizer
from mtrain.run_dir import (
    AVERAGED,
    BEST,
    LAST,
    CheckpointError,
    average_checkpoints,
    build_model,
    check_tokenizer,
    load_checkpoint,
    save_checkpoint,
    save_copy,
    step_checkpoints,
    step_name,
)
from mtrain.training_data import TrainingData

log = logging.getLogger(__name__)


@dataclass
class TrainingState:
    """The model, its optimiser and the counters of a run."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    data: TrainingData
    tokenizer: str  # the tokenizer's fingerprint
    dtype: str  # what the updates compute in: autocast's dtype, or float32
    step: int = 0  # optimizer updates done
    best_bleu: float = -1.0
    stale: int = 0  # validations since dev BLEU last improved
    skipped: int = 0  # updates skipped for running out of memory or a non-finite loss
    minutes_before: float = 0.0  # training time spent before a resume
    finished: dict | None = None  # why the run ended, and its limits then; None while it goes on
    validated: bool = True  # whether the checkpoint resumed from was validated at its step

    @classmethod
    def new(
        cls, cfg: Config, data: TrainingData, device: torch.device, amp_dtype: torch.dtype | None
    ) -> TrainingState:
        """A run at step 0: a fresh model for the data's tokenizer, and its optimiser."""
        model = build_model(cfg, data.tokenizer).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        dtype = str(amp_dtype or torch.float32).removeprefix("torch.")
        log.info("model has %.1fM parameters, training on %s in %s", n_params / 1e6, device, dtype)
        optimizer, scheduler = build_optimizer(model, cfg.train)
        # fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not.
        scaler = torch.amp.GradScaler(enabled=amp_dtype == torch.float16)
        return cls(model, optimizer, scheduler, scaler, data, data.tokenizer.fingerprint(), dtype)

    def state_dict(self, rng: list[dict], minutes: float, validated: bool) -> dict[str, Any]:
        """A checkpoint of this state; `rng` holds every rank's random generators, `validated`
        says whether dev scores were taken at this step (not at a Ctrl-C or a failed one)."""
        return {
            "model": self.model.state_dict(),
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            **self.data.state_dict(),
            "rng": rng,
            "best_bleu": self.best_bleu,
            "stale": self.stale,
            "skipped": self.skipped,
            "minutes": minutes,
            "validated": validated,
        }

    def load_state_dict(self, state: dict[str, Any], path: Path, group: Group) -> None:
        """Continue from the checkpoint `state`, read from `path`, as rank `group.rank`."""
        self.data.check_unchanged(state, path)
        check_tokenizer(path, state, self.tokenizer)
        self.warn_of_another_dtype(state.get("dtype"), path)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
            self.step = state["step"]
            self.data.load_state_dict(state)
            rng = state.get("rng") or [  # written before mtrain trained under torchrun
                {
                    "python": state["python_rng_state"],
                    "torch": state["torch_rng_state"],
                    "cuda": state["cuda_rng_states"],
                }
            ]
            if len(rng) != group.world_size:
                raise CheckpointError(
                    f"{path}: written by {len(rng)} training process(es), not "
                    f"{group.world_size}; resume with as many (or train into another --out)"
                )
            runtime.set_rng_state(rng[group.rank])
            self.best_bleu, self.stale = state["best_bleu"], state["stale"]
            self.minutes_before = state["minutes"]
            self.skipped = state["skipped"]
            self.finished = state.get("finished")  # written by `Checkpoints.mark_finished`
            self.validated = state.get("validated", True)
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            reason = " ".join(str(e).split())[:200]
            raise CheckpointError(f"{path}: cannot resume from it ({reason})") from None

    def warn_of_another_dtype(self, written_in: str | None, path: Path) -> None:
        """Say so when the run goes on in another dtype than it was trained in: on a CPU
        without native bf16, `train.precision: auto` trains in fp32 what another began in bf16."""
        if written_in in (None, self.dtype):  # None: written before checkpoints kept it
            return
        log.warning(
            "%s was trained in %s; the run goes on in %s here (train.precision), so it will "
            "not match an uninterrupted run exactly%s",
            path,
            written_in,
            self.dtype,
            "; --set train.precision=fp32 keeps fp32" if written_in == "float32" else "",
        )


class Checkpoints:
    """The checkpoint files of a run directory, which rank 0 alone writes."""

    def __init__(self, run_dir: Path, cfg: TrainConfig):
        self.run_dir, self.keep_last, self.average_last = run_dir, cfg.keep_last, cfg.average_last
        self.last = run_dir / LAST
        self.saved_step: int | None = None  # the step last.pt holds

    def load_last(self) -> dict[str, Any]:
        return load_checkpoint(self.last)

    def save_last(self, state: dict[str, Any]) -> None:
        save_checkpoint(self.last, state)
        self.saved_step = state["step"]

    def save_validated(self, state: dict[str, Any], improved: bool) -> None:
        """Save a validated state as last.pt, as best.pt if it `improved`, and as a step-N.pt
        (but the last `keep_last`)."""
        self.save_last(state)
        if improved:
            save_copy(self.last, self.run_dir / BEST)
        if self.keep_last:
            save_copy(self.last, self.run_dir / step_name(state["step"]))
            for old in step_checkpoints(self.run_dir)[: -self.keep_last]:
                old.unlink()

    def average(self) -> dict[str, Any] | None:
        """Average the last `average_last` step checkpoints into averaged.pt and return it;
        None when there are fewer than two."""
        paths = step_checkpoints(self.run_dir)[-self.average_last :]
        if len(paths) < 2:
            return None
        state = average_checkpoints(paths)
        save_checkpoint(self.run_dir / AVERAGED, state)
        return state

    def make_average_best(self) -> None:
        """Make averaged.pt the best checkpoint (`mark_finished` records its score)."""
        save_copy(self.run_dir / AVERAGED, self.run_dir / BEST)

    def mark_finished(self, finished: dict[str, Any], best_bleu: float) -> None:
        """Record in last.pt that the run ended (`finished`: why, and the limits then: a later
        start with the same limits has nothing to do), and the best dev BLEU, the average's
        included (a resumed run compares with it, or could replace best.pt by a worse model)."""
        state = load_checkpoint(self.last)
        save_checkpoint(self.last, {**state, "best_bleu": best_bleu, "finished": finished})

    def kept(self) -> str:
        """What a failure leaves behind, for its message."""
        if self.saved_step is None:
            return f"no checkpoint was written in {self.run_dir} yet"
        return f"{self.last} (step {self.saved_step}) is intact"
