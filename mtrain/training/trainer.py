"""Training a model: the `Trainer`, which runs one run's loop with the parts it is handed.

`build.py` reads the config and builds the parts, each from its own section: `TrainingData`
(prepared corpus, tokenizer, dev set, updates: the one place that reads data), `UpdateStep`
(accumulation, DDP, mixed precision, out of memory, non-finite losses), `Validator` and
`Scoreboard` (dev scores, best dev BLEU, patience), `Coordinator` (when to validate and stop),
`TrainingState` and `Checkpoints` (what checkpoints hold, and their files), `BudgetRecipe` (what
the run chooses from its plan) and `RunClock`; the loop opens the `RunLog` (progress bar,
train.jsonl, metrics.jsonl, examples.jsonl, TensorBoard). docs/architecture.md follows one
update through them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mtrain.core import runtime
from mtrain.core.config import TrainConfig
from mtrain.core.distributed import Group
from mtrain.core.errors import MtrainError
from mtrain.model.transformer import Transformer
from mtrain.training.budget_recipe import BudgetRecipe, Choice
from mtrain.training.coordinator import Action, Coordinator, Finished
from mtrain.training.data import TrainingData, Update
from mtrain.training.run_log import RunLog, run_log, trim_logs
from mtrain.training.state import Checkpoints, Progress, RunClock, TrainingState
from mtrain.training.update_step import NonFiniteLoss, OutOfMemory, UpdateStep
from mtrain.training.validation import Validation, Validator

# The Trainer, and the ways its run can end other than by finishing.
__all__ = ["Interrupted", "NonFiniteLoss", "OutOfMemory", "RunFileError", "Trainer"]
__all__ += ["Update", "Validation"]  # what tests and scripts hand a Trainer's parts
log = logging.getLogger(__name__)
# Updates between two returns of the heap's free pages to the kernel: a bf16 default run on the
# CPU peaked at 3,088 MB without them and at 2,204 MB with them, with 1% fewer updates in its
# 29 minutes (another seed, so within noise; docs/benchmarks.md).
RELEASE_MEMORY_EVERY = 50


class RunFileError(MtrainError, OSError):
    """A file could not be read or written while training; the message says what was kept."""


class Interrupted(MtrainError):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint into `run_dir`."""

    def __init__(self, step: int, run_dir: Path | None = None):
        super().__init__(f"interrupted at step {step}")
        self.step = step
        self.run_dir = run_dir


@dataclass
class Trainer:
    """Trains one run into its directory with the parts `build_trainer` made; knows the model
    only through the update step and the validator. Under torchrun every process runs one."""

    run_dir: Path
    cfg: TrainConfig  # the run's limits, accumulation and logs
    group: Group
    data: TrainingData
    state: TrainingState  # what a checkpoint holds: the model, its optimiser, ...
    checkpoints: Checkpoints
    update_step: UpdateStep
    validator: Validator
    coordinator: Coordinator
    recipe: BudgetRecipe
    clock: RunClock
    progress: Progress  # where the run starts: a resumed run's checkpoint, or step 0

    @property
    def model(self) -> Transformer:
        return self.state.model

    @property
    def step(self) -> int:  # the optimizer updates done
        return self.update_step.step

    @property
    def skipped(self) -> int:  # the updates skipped: out of memory, a non-finite loss
        return self.update_step.skipped

    @property
    def choice(self) -> Choice | None:  # what the run chose from its plan; None: not yet
        return self.state.choice

    def state_dict(self, rng: list[dict], validated: bool = False) -> dict:
        """A checkpoint of the run now; `validated`: this step's dev scores were just taken."""
        progress = Progress(self.step, self.skipped, self.clock.minutes(), validated=validated)
        return self.state.state_dict(progress, rng)

    def run(self) -> float:
        """Train until max_steps or the time budget; return the best dev BLEU. SIGINT or SIGTERM,
        in any update or validation, saves `last.pt` (once that step is done) and raises
        Interrupted. Under torchrun, rank 0 decides when to validate and stop, and tells all."""
        cfg, main, scores = self.cfg, self.group.is_main, self.state.scores
        finished = self.progress.finished
        trim_logs(self.run_dir, self.step, main)
        if self.progress.done(cfg):
            if main:
                why, hint = finished.reason, finished.hint(cfg)
                log.info("%s finished at step %d (%s); %s", self.run_dir, self.step, why, hint)
            return scores.best_bleu
        coordinator, minutes = self.coordinator, self.clock.minutes
        read = self.update_step.check_finite  # the log reads its losses with the NaN check
        try:
            with (
                coordinator.stop_signals(),
                run_log(self.run_dir, cfg, main, coordinator, self.step, minutes(), read) as logs,
            ):
                self.train_updates(logs)
                if cfg.average_last and main:
                    self.validate_average(logs)
                ended = coordinator.ended(self.step, minutes(), scores)
                if main and ended:  # a later start with the same limits leaves the run as it is
                    finished = Finished.of(cfg, *ended, lr=self.state.schedule.lr)
                    self.checkpoints.mark_finished(finished, scores.best_bleu)
                    logs.finished(self.step, finished, cfg.lr)
        except OSError as e:  # a full disk, a file system gone read-only
            kept = self.checkpoints.kept()
            raise RunFileError(f"{e.filename or self.run_dir}: {e.strerror}; {kept}") from None
        # Asked to stop during the last update or validation, now saved: stop what called it.
        if self.group.broadcast(coordinator.stop_requested):
            raise Interrupted(self.step)
        return scores.best_bleu

    def train_updates(self, logs: RunLog) -> None:
        """Train update after update, validating and stopping as the coordinator says."""
        if self.step >= self.coordinator.last_step and not self.progress.validated:
            # Resumed at the end from a checkpoint of a Ctrl-C or a failed validation: validate it.
            rng = self.group.gather(runtime.rng_state())
            if self.group.is_main:
                self.validate_and_save(logs, rng)
            return
        self.follow_plan()
        # Closed however the loop ends, so that the thread that builds batches stops with it.
        batches = contextlib.closing(self.data.updates(self.group, self.cfg.accumulate))
        with batches as updates, kept_on_failure(self.checkpoints):  # a NaN loss: what is kept
            self.train_on(updates, logs)

    def train_on(self, updates: Iterator[Update], logs: RunLog) -> None:
        """Train on `updates` until the coordinator says to stop."""
        main, coordinator, minutes = self.group.is_main, self.coordinator, self.clock.minutes
        for update in updates:
            if self.step >= coordinator.last_step:
                break
            lr = self.state.schedule.lr  # this update's (the next's after)
            loss = self.update_step(update)
            if self.step % RELEASE_MEMORY_EVERY == 0:
                runtime.release_freed_memory()
            coordinator.plan(self.step, minutes())
            self.follow_plan()
            if loss is not None:  # at a log step, the log reads the losses with check_finite
                logs.update(update, loss, self.step, minutes(), lr)
            action = coordinator.next_action(self.step, minutes(), loss is not None)
            if action is Action.GO:
                continue
            self.update_step.check_finite()  # no checkpoint after a NaN loss
            rng = self.group.gather(runtime.rng_state())  # every rank's, for the checkpoint
            if action in (Action.INTERRUPT, Action.STOP):
                if main:
                    self.checkpoints.save_last(self.state_dict(rng, action is Action.STOP))
                if action is Action.INTERRUPT:
                    raise Interrupted(self.step, self.run_dir)
                break
            if main:
                self.validate_and_save(logs, rng)
            if coordinator.patience_out(self.state.scores) or action is Action.FINAL:
                break

    def follow_plan(self) -> None:
        """Once the run's end is first planned, take what the recipe chooses from it."""
        if not self.state.choice:
            self.state.choice = self.recipe.choose(self.coordinator.planned_end)

    def validate_and_save(self, logs: RunLog, rng: list[dict]) -> None:
        """Validate (rank 0), keep the best dev BLEU, write the checkpoints and log the scores."""
        began = self.clock.minutes()
        try:
            with self.state.offered_weights():
                val = self.validator(self.step)
        except BaseException:  # out of memory, a second Ctrl-C: keep the updates since last.pt
            self.checkpoints.save_last(self.state_dict(rng))
            raise
        improved = self.state.scores.record(val.dev_bleu)
        self.checkpoints.save_validated(self.state_dict(rng, validated=True), improved)
        logs.validation("validation", val, improved, skipped=self.skipped)
        self.coordinator.validated(self.step, self.clock.minutes() - began)
        runtime.release_freed_memory()  # what decoding and saving freed: the heap stays flat
        logs.restart_window()

    def validate_average(self, logs: RunLog) -> None:
        """Average the last `train.average_last` step checkpoints into averaged.pt and validate
        it; it becomes best.pt if its dev BLEU is the best. Leaves the averaged model loaded."""
        averaged = self.checkpoints.average()
        if averaged is None:
            return
        self.model.load_state_dict(averaged["model"])
        val = self.validator(self.step)
        improved = self.state.scores.record_average(val.dev_bleu)
        if improved:
            self.checkpoints.make_average_best()
        logs.validation("average", val, improved, steps=averaged["steps"])


@contextlib.contextmanager
def kept_on_failure(checkpoints: Checkpoints) -> Iterator[None]:
    """Within this block, a non-finite loss or running out of memory (which only the update step
    and its `check_finite` raise) says which checkpoint is left."""
    try:
        yield
    except (NonFiniteLoss, OutOfMemory) as e:
        e.args = (f"{e}; {checkpoints.kept()}",)  # its other fields (the step) kept
        raise e from None
