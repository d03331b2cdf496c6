"""When training validates and stops: the step and time budgets, early stopping, Ctrl-C and
SIGTERM; under torchrun, rank 0 decides and tells the others after every update."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mtrain.core.config import ConfigError, TrainConfig
from mtrain.core.distributed import Group
from mtrain.training.optim import Schedule

if TYPE_CHECKING:
    from mtrain.training.validation import Scoreboard

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Action(enum.Enum):
    """What every process does after an update."""

    GO = "go"  # on to the next update
    VALIDATE = "validate"  # validate and checkpoint, then go on
    FINAL = "final"  # validate and checkpoint for the last time
    STOP = "stop"  # save last.pt and stop: the last validation was of this very step
    INTERRUPT = "interrupt"  # save last.pt and stop (Ctrl-C or SIGTERM)


def patience(cfg: TrainConfig) -> int:
    """The validations without a better dev BLEU that end a run; 0: never. A linear schedule
    ends at its planned last update, where its rate reaches 0: stopping it earlier would skip
    the annealing, and best.pt keeps the best validated model anyway."""
    return 0 if cfg.lr_schedule == "linear" else cfg.patience


def limits(cfg: TrainConfig) -> dict[str, float]:
    """A run's limits, as a finished run records them (0, which turns one off: infinite)."""
    return {
        "max_steps": cfg.max_steps,
        "max_minutes": cfg.max_minutes or math.inf,
        "patience": patience(cfg) or math.inf,
    }


@dataclass
class Finished:
    """Why a run ended, and its limits then: a later start with the same limits has nothing
    to do."""

    reason: str  # in words, for the log
    limit: str  # the key of `limits` that ended it
    max_steps: float
    max_minutes: float
    patience: float
    lr: float = 0.0  # the learning rate the next update would have had

    @classmethod
    def of(cls, cfg: TrainConfig, limit: str, reason: str, lr: float) -> Finished:
        return cls(reason, limit, **limits(cfg), lr=lr)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Finished:
        return cls(**{f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def raised(self, cfg: TrainConfig) -> bool:
        """Whether `cfg` raises the limit that ended the run, so that it can train on."""
        return limits(cfg)[self.limit] > getattr(self, self.limit)

    def annealed(self, cfg: TrainConfig) -> bool:
        """Whether the run ended with its linear schedule at 0, where no raised limit can train
        it on; one that `train.patience` stopped ended partway down."""
        return cfg.lr_schedule == "linear" and self.limit != "patience"

    def check_trainable(self, cfg: TrainConfig, where: str, step: int) -> None:
        """Refuse raised limits where the run's learning rate is annealed: nothing trains on."""
        if self.raised(cfg) and self.annealed(cfg):
            raise ConfigError(
                f"{where}: finished at step {step} ({self.reason}) with its learning rate "
                "annealed (train.lr_schedule: linear): raising train.max_steps or "
                "train.max_minutes cannot train it on; train a new run (another --out)"
            )

    def hint(self, cfg: TrainConfig) -> str:
        """What would train the run on, in words."""
        if self.annealed(cfg):
            return "its learning rate is annealed: train a new run to train longer"
        return f"raise train.{self.limit} to train on"


class Coordinator:
    """The decisions of a run that every process must take alike."""

    def __init__(
        self, cfg: TrainConfig, group: Group, step: int, minutes: float, schedule: Schedule
    ):
        self.cfg, self.group = cfg, group
        self.budget = cfg.max_minutes or math.inf
        # The learning rate's end under a linear schedule: where the run ends too.
        self.schedule = schedule if schedule.anneals else None
        if self.schedule and self.budget == math.inf:
            self.schedule.end_at(step, cfg.max_steps)
        self.measured_from = (step, minutes)  # where the speed is measured from: the last plan
        self.started = (step, minutes)
        self.reserve = 0.0  # minutes the last validation took: keep room for a final one
        self.validated_step: int | None = None  # the step this process last validated
        self.stop_requested = False
        if group.is_main and cfg.patience and not patience(cfg):
            log.info(
                "train.patience is not used under train.lr_schedule: linear: the run ends where "
                "its learning rate reaches 0, and best.pt keeps its best validated model"
            )

    @contextlib.contextmanager
    def stop_signals(self) -> Iterator[None]:
        """Within this block, SIGINT and SIGTERM ask training to stop after the update."""
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        if self.stop_requested:  # second Ctrl-C: stop at once; checkpoints are written atomically
            raise KeyboardInterrupt
        self.stop_requested = True
        if self.group.is_main:
            log.warning(
                "%s: saving a checkpoint after this step (again to stop at once)",
                signal.Signals(signum).name,
            )

    @property
    def planned_end(self) -> int | None:
        """The update a linear schedule is planned to end at; None before a time budget's
        first plan, or without a linear schedule."""
        return self.schedule.total if self.schedule else None

    @property
    def last_step(self) -> int:
        planned = self.schedule.total if self.schedule and self.schedule.total else math.inf
        return min(self.cfg.max_steps, planned)

    def end_step(self, step: int, minutes: float) -> int | None:
        """The step the run is headed for: train.max_steps, or under a time budget the planned
        end of the linear schedule, or else the step the speed so far reaches by the budget's
        end; None until that speed is measured. Patience may still end it sooner."""
        if self.budget == math.inf or (self.schedule and self.schedule.total):
            return self.last_step
        done, took = step - self.started[0], minutes - self.started[1]
        if done < 1 or took <= 0:
            return None
        left = max(0.0, self.budget - minutes - self.reserve)
        return min(self.cfg.max_steps, step + math.floor(done / took * left))

    def minutes_left(self, minutes: float) -> float | None:
        """Minutes left of the time budget; None without one."""
        return None if self.budget == math.inf else max(0.0, self.budget - minutes)

    def plan(self, step: int, minutes: float) -> None:
        """Once warmup is over, and again at every validation step, fix the step count the time
        budget allows, from the speed since the last plan (its validation included), so that
        the linear schedule reaches zero at the budget's end even if the machine's speed drifts."""
        if self.schedule is None or self.budget == math.inf or step < self.cfg.warmup_steps:
            return  # without a time budget the schedule ends at max_steps
        if self.schedule.total is not None and step % self.cfg.eval_every:
            return
        done, took = step - self.measured_from[0], minutes - self.measured_from[1]
        if done < max(1, min(self.cfg.warmup_steps, self.cfg.eval_every) // 2):
            return  # too few updates to time (just resumed, or an update was skipped): no plan
        self.measured_from = (step, minutes)
        rate, left = done / max(took, 1e-9), self.budget - minutes - self.reserve
        planned = step + max(1, math.floor(rate * left))
        planned = self.group.broadcast(min(planned, self.cfg.max_steps))
        if planned == self.schedule.total:
            return
        self.schedule.replan(step, planned)
        if self.group.is_main:
            log.info(
                "%.1f steps/min: the learning rate decays to 0 at step %d, the budget's end",
                rate,
                planned,
            )

    def ended(self, step: int, minutes: float, scores: Scoreboard) -> tuple[str, str] | None:
        """Why a run at `step` after `minutes` is over: the limit that ended it (a key of
        `limits`) and the reason in words; None while it goes on."""
        cfg, total = self.cfg, self.schedule and self.schedule.total
        if step >= cfg.max_steps:
            return "max_steps", f"train.max_steps is {cfg.max_steps}"
        if total is not None and step >= total:  # short of max_steps: where the budget planned
            return "max_minutes", f"the linear learning-rate schedule reached 0 at step {total}"
        if scores.exhausted:
            stale = scores.stale
            return "patience", f"dev BLEU did not improve in {stale} validations (train.patience)"
        if minutes + self.reserve >= self.budget:
            return "max_minutes", f"train.max_minutes ({cfg.max_minutes:g}) is spent"
        return None

    def next_action(self, step: int, minutes: float, updated: bool) -> Action:
        """What every process does after an update, as rank 0 decides; `updated` is false
        after a skipped update, which leaves nothing new to validate but may still end the run."""
        if self.stop_requested:
            action = Action.INTERRUPT
        elif step >= self.last_step or minutes + self.reserve >= self.budget:
            action = Action.STOP if step == self.validated_step else Action.FINAL
        elif updated and step % self.cfg.eval_every == 0:
            action = Action.VALIDATE
        else:
            action = Action.GO
        return self.group.broadcast(action)

    def validated(self, step: int, minutes_taken: float) -> None:
        """Note a validation (rank 0): the next ones, and the average's, need as long."""
        self.validated_step = step
        self.reserve = minutes_taken * (2 if self.cfg.average_last else 1)

    def patience_out(self, scores: Scoreboard) -> bool:
        """Whether dev BLEU has not improved for `train.patience` validations (as rank 0 saw)."""
        out = self.group.broadcast(scores.exhausted)
        if out:
            log.info("no better dev BLEU in %d validations: stopping", scores.stale)
        return out
