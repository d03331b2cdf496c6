"""A run's training state, what its checkpoints hold, and its checkpoint files.

`TrainingState` is everything a resumed run needs to continue exactly where another stopped;
`Checkpoints` writes it: last.pt at every validation, best.pt, the last `train.keep_last`
step-N.pt and, at the end, their average. A checkpoint records its `FORMAT`; `upgrade` is the
one place that reads older ones. `resume_from_rank_0` decides, from what every rank holds,
whether a run resumes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtrain.core import runtime
from mtrain.core.config import VERSION, TrainConfig
from mtrain.core.distributed import Group
from mtrain.run.directory import (
    AVERAGED,
    BEST,
    LAST,
    CheckpointError,
    average_checkpoints,
    check_tokenizer,
    load_checkpoint,
    peek_checkpoint,
    save_checkpoint,
    save_copy,
    step_checkpoints,
    step_name,
)
from mtrain.training.budget_recipe import Choice
from mtrain.training.coordinator import Finished
from mtrain.training.data import TrainingData
from mtrain.training.moving_average import MovingAverage
from mtrain.training.optim import Schedule
from mtrain.training.validation import Scoreboard

log = logging.getLogger(__name__)


# The layout of the checkpoints this version writes; `upgrade` brings older ones to it.
FORMAT = 2


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A training checkpoint of any earlier format in this version's layout (FORMAT)."""
    written_in = state.get("format", 1)
    if written_in > FORMAT:
        raise ValueError(f"its format {written_in} is newer than this mtrain's, {FORMAT}")
    if written_in == FORMAT:
        return state
    state = dict(state)
    if "rng" not in state and "torch_rng_state" in state:  # before training under torchrun
        state["rng"] = [
            {
                "python": state.pop("python_rng_state"),
                "torch": state.pop("torch_rng_state"),
                "cuda": state.pop("cuda_rng_states"),
            }
        ]
    state.setdefault("dtype", None)  # unknown: no warning of another one
    state.setdefault("stale", 0)  # before train.patience (ff2b51d), which such a run has off
    state.setdefault("validated", True)
    state.setdefault("finished", None)
    finished = state["finished"]
    if finished is not None and "limit" not in finished:  # before runs named their limit
        reason = finished["reason"]
        if reason.startswith("train.max_steps"):
            limit = "max_steps"
        elif reason.startswith("dev BLEU"):
            limit = "patience"
        else:
            limit = "max_minutes"
        state["finished"] = {"patience": math.inf, **finished, "limit": limit}
    state["format"] = FORMAT
    return state


@dataclass
class Progress:
    """How far a run got: what a resumed run continues from, besides its parts' own states."""

    step: int = 0  # optimizer updates done
    skipped: int = 0  # updates skipped for running out of memory or a non-finite loss
    minutes: float = 0.0  # training time spent
    finished: Finished | None = None  # why the run ended; None while it goes on
    validated: bool = True  # whether dev scores were taken at this step

    def done(self, cfg: TrainConfig) -> bool:
        """Whether a start has nothing to do: finished, the limit that ended it not raised."""
        return self.finished is not None and not self.finished.raised(cfg)


class RunClock:
    """Minutes of training, those before a resume included."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        """`clock` counts seconds (tests replace it); the run's time starts now."""
        self.clock, self.start = clock, clock()
        self.before = 0.0  # minutes spent before a resume

    def minutes(self) -> float:
        return self.before + (self.clock() - self.start) / 60


@dataclass
class TrainingState:
    """The parts of a run whose states a checkpoint holds: the model, its optimiser and
    schedule, the loss scaler, the batch stream and the scoreboard, and the weights' moving
    average where the run keeps one."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    scaler: torch.amp.GradScaler
    data: TrainingData
    scores: Scoreboard
    tokenizer: str  # the tokenizer's fingerprint
    dtype: str  # what the updates compute in: autocast's dtype, or float32
    average: MovingAverage | None = None  # train.ema_decay's
    choice: Choice | None = None  # what the run chose from its plan, once planned
    parent: dict[str, Any] | None = None  # the run it started from (run/lineage.py)
    dropout: float = field(kw_only=True)  # model.dropout, which a run begun before runs chose keeps

    def weights(self) -> dict[str, Any]:
        """The model a checkpoint offers for translation (the moving average, where the run
        keeps one), and the weights the optimizer trains when they differ."""
        if self.average is None:
            return {"model": self.model.state_dict()}
        return {"model": self.average.state_dict(), "trained_model": self.model.state_dict()}

    def offered_weights(self) -> contextlib.AbstractContextManager:
        """Within this block the model holds the weights a checkpoint offers: the moving
        average's, where the run keeps one."""
        return self.average.applied() if self.average else contextlib.nullcontext()

    def state_dict(self, progress: Progress, rng: list[dict]) -> dict[str, Any]:
        """A checkpoint of the run at `progress`; `rng` holds every rank's random generators."""
        return {
            "format": FORMAT,
            "config_version": VERSION,  # the schema of the run's config.yaml
            **self.weights(),
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": progress.step,
            **self.data.state_dict(),
            "rng": rng,
            **self.scores.state_dict(),
            "skipped": progress.skipped,
            "minutes": progress.minutes,
            "validated": progress.validated,
            "finished": progress.finished and progress.finished.to_dict(),
            "chosen": self.choice and self.choice.to_dict(),
            "parent": self.parent,
        }

    def load_state_dict(self, state: dict[str, Any], path: Path, group: Group) -> Progress:
        """Continue from the checkpoint `state`, read from `path`, as rank `group.rank`; return
        how far it had got."""
        self.data.check_unchanged(state, path)
        check_tokenizer(path, state, self.tokenizer)
        try:
            state = upgrade(state)
            self.warn_of_another_dtype(state["dtype"], path)
            if self.average is None:
                self.model.load_state_dict(state["model"])
            else:
                self.model.load_state_dict(state["trained_model"])
                self.average.load_state_dict(state["model"], state["step"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.schedule.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
            self.data.load_state_dict(state)
            rng = state["rng"]
            if len(rng) != group.world_size:
                raise CheckpointError(
                    f"{path}: written by {len(rng)} training process(es), not "
                    f"{group.world_size}; resume with as many (or train into another --out)"
                )
            runtime.set_rng_state(rng[group.rank])
            self.scores.load_state_dict(state)
            if "chosen" not in state:  # begun before runs chose from their plan: it never does
                self.choice = Choice.kept(self.dropout)
            else:
                chosen = state["chosen"]  # None: not planned yet
                self.choice = None if chosen is None else Choice.from_dict(chosen)
            self.parent = state.get("parent")  # absent: its own weights, or written before
            finished = state["finished"]  # written by `Checkpoints.mark_finished`
            return Progress(
                state["step"],
                state["skipped"],
                state["minutes"],
                None if finished is None else Finished.from_dict(finished),
                state["validated"],
            )
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            if isinstance(e, CheckpointError):
                raise
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


@dataclass(frozen=True)
class Held:
    """The checkpoint a rank holds at the run directory's path on its machine."""

    step: int | None  # the step of its last.pt; None: it holds none
    host: str
    path: str  # of its last.pt


def resume_from_rank_0(held: list[Held]) -> bool:
    """Whether the run resumes, from rank 0's last.pt, given what each rank holds (in rank
    order). A run resumes from what rank 0 reads, so a newer last.pt on another rank's machine
    (rank 0 started on a machine without the run's disk) is refused rather than ignored: the
    run would start over, or go back to an older step, without a word."""
    newest = max((h.step for h in held if h.step is not None), default=None)
    if newest is None or held[0].step == newest:
        return newest is not None
    rank = next(r for r, h in enumerate(held) if h.step == newest)
    has = "none" if held[0].step is None else f"one of step {held[0].step}"
    there = held[rank].host
    raise CheckpointError(
        f"{held[rank].path}: rank {rank} (on {there}) holds it at step {newest}, rank 0 (on "
        f"{held[0].host}) {has}; start rank 0 on {there}, or copy the run directory there to "
        "rank 0's machine"
    )


class Checkpoints:
    """The checkpoint files of a run directory, which rank 0 alone writes."""

    def __init__(self, run_dir: Path, cfg: TrainConfig):
        self.run_dir, self.keep_last, self.average_last = run_dir, cfg.keep_last, cfg.average_last
        self.last = run_dir / LAST
        self.saved_step: int | None = None  # the step last.pt holds

    def load_last(self) -> dict[str, Any]:
        return load_checkpoint(self.last)

    def held(self, expected: bool = False) -> Held:
        """What this process holds at last.pt's path (`expected`: refuse none); its step is read
        without its tensors."""
        step = None
        if expected and not self.last.exists():
            raise CheckpointError(f"{self.last}: no such checkpoint")
        if self.last.exists():  # damaged or foreign: refused as a resume from it would be
            step = peek_checkpoint(self.last)["step"]
        return Held(step, socket.gethostname(), str(self.last))

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

    def mark_finished(self, finished: Finished, best_bleu: float) -> None:
        """Record in last.pt that the run ended (`finished`: why, and the limits then: a later
        start with the same limits has nothing to do), and the best dev BLEU, the average's
        included (a resumed run compares with it, or could replace best.pt by a worse model)."""
        state = upgrade(load_checkpoint(self.last))
        finished_state = {"best_bleu": best_bleu, "finished": finished.to_dict()}
        save_checkpoint(self.last, {**state, **finished_state})

    def kept(self) -> str:
        """What a failure leaves behind, for its message."""
        if self.saved_step is None:
            return f"no checkpoint was written in {self.run_dir} yet"
        return f"{self.last} (step {self.saved_step}) is intact"
