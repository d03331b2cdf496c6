"""The loop of a run: updates, with validations and checkpoints between them, until a budget,
early stopping or a signal ends it; then the average of the last checkpoints."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mtrain import runtime
from mtrain.coordinator import FINAL, GO, INTERRUPT, STOP, Coordinator, annealed, limits, raised
from mtrain.training_log import RunLog, run_log

if TYPE_CHECKING:
    from mtrain.train import Trainer

log = logging.getLogger(__name__)


class RunFileError(OSError):
    """A file could not be read or written while training; the message says what was kept."""


class Interrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


def run(trainer: Trainer) -> float:
    """Train until max_steps or the time budget; return the best dev BLEU.

    SIGINT or SIGTERM saves `last.pt` at the next step boundary and raises Interrupted.
    Under torchrun, rank 0 decides when to validate and stop, and tells the others.
    """
    tcfg, main = trainer.cfg.train, trainer.group.is_main
    schedule = trainer.state.scheduler.lr_lambdas[0]
    coordinator = Coordinator(tcfg, trainer.group, trainer.step, trainer.minutes(), schedule)
    if finished_before(trainer):
        return trainer.state.best_bleu
    # Under a time budget the step count is unknown: show no misleading ETA.
    total = None if tcfg.max_minutes else tcfg.max_steps
    try:
        with (
            coordinator.stop_signals(),
            run_log(trainer.run_dir, main, trainer.step, total) as logs,
        ):
            train_updates(trainer, coordinator, logs)
            if tcfg.average_last and main:
                validate_average(trainer, logs)
            ended = coordinator.ended(trainer.step, trainer.minutes(), trainer.state.stale)
            if main and ended:  # a later start with the same limits leaves the run as it is
                limit, reason = ended
                finished = {"reason": reason, "limit": limit, **limits(tcfg)}
                trainer.checkpoints.mark_finished(finished, trainer.state.best_bleu)
    except OSError as e:  # a full disk, a file system gone read-only
        kept = trainer.checkpoints.kept()
        raise RunFileError(f"{e.filename or trainer.run_dir}: {e.strerror}; {kept}") from None
    return trainer.state.best_bleu


def finished_before(trainer: Trainer) -> bool:
    """Whether the run resumed had finished and its limits were not raised: nothing to do."""
    finished = trainer.state.finished
    if finished and raised(trainer.cfg.train, finished):
        trainer.state.finished = None  # it trains on
    elif finished:
        if trainer.group.is_main:
            limit = finished.get("limit")
            if annealed(trainer.cfg.train, finished):
                hint = "its learning rate is annealed: train a new run to train longer"
            else:
                limits_named = f"train.{limit}" if limit else "train.max_steps or train.max_minutes"
                hint = f"raise {limits_named} to train on"
            log.info(
                "%s finished at step %d (%s); %s",
                trainer.run_dir,
                trainer.step,
                finished["reason"],
                hint,
            )
        return True
    return False


def train_updates(trainer: Trainer, coordinator: Coordinator, logs: RunLog) -> None:
    """Train update after update, validating and stopping as the coordinator says."""
    if trainer.step >= coordinator.last_step and not trainer.state.validated:
        # Resumed at the end from a checkpoint of a Ctrl-C or a failed validation: validate it.
        rng = trainer.group.gather(runtime.rng_state())
        if trainer.group.is_main:
            validate_and_save(trainer, coordinator, logs, rng)
        return
    for update in trainer.updates():
        if trainer.step >= coordinator.last_step:
            break
        lr = trainer.state.optimizer.param_groups[0]["lr"]  # this update's (the next's after)
        loss = trainer.train_step(update)
        coordinator.plan(trainer.step, trainer.minutes())
        if loss is not None:
            logs.update(update, loss, trainer.step, trainer.minutes(), lr)
        action = coordinator.next_action(trainer.step, trainer.minutes(), loss is not None)
        if action == GO:
            continue
        rng = trainer.group.gather(runtime.rng_state())  # every rank's, for the checkpoint
        if action in (INTERRUPT, STOP):
            if trainer.group.is_main:
                trainer.checkpoints.save_last(trainer.state_dict(rng, action == STOP))
            if action == INTERRUPT:
                raise Interrupted(trainer.step)
            break
        if trainer.group.is_main:
            validate_and_save(trainer, coordinator, logs, rng)
        if coordinator.patience_out(trainer.state.stale) or action == FINAL:
            break


def validate_and_save(
    trainer: Trainer, coordinator: Coordinator, logs: RunLog, rng: list[dict]
) -> None:
    """Validate (rank 0), keep the best dev BLEU, write the checkpoints and log the scores."""
    state, began = trainer.state, trainer.minutes()
    try:
        val = trainer.validate()
    except BaseException:  # out of memory, a second Ctrl-C: keep the updates since last.pt
        trainer.checkpoints.save_last(trainer.state_dict(rng))
        raise
    improved = val.dev_bleu > state.best_bleu
    state.best_bleu = max(state.best_bleu, val.dev_bleu)
    state.stale = 0 if improved else state.stale + 1
    trainer.checkpoints.save_validated(trainer.state_dict(rng, validated=True), improved)
    logs.validation("validation", val, improved, skipped=state.skipped)
    coordinator.validated(trainer.step, trainer.minutes() - began)
    logs.restart_window()


def validate_average(trainer: Trainer, logs: RunLog) -> None:
    """Average the last `train.average_last` step checkpoints into averaged.pt and validate it;
    it becomes best.pt if its dev BLEU is the best. Leaves the averaged model loaded."""
    averaged = trainer.checkpoints.average()
    if averaged is None:
        return
    trainer.model.load_state_dict(averaged["model"])
    val = trainer.validate()
    improved = val.dev_bleu > trainer.state.best_bleu
    if improved:
        trainer.state.best_bleu = val.dev_bleu
        trainer.checkpoints.make_average_best()
    logs.validation("average", val, improved, steps=averaged["steps"])
