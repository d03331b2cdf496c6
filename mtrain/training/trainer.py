"""Training a model: the `Trainer`, which puts one run's parts together and runs its loop.

Each part is an object of its own, built from what it needs: `TrainingData` (prepared corpus,
tokenizer, dev set, updates: the one place that reads data), `UpdateStep` (accumulation, DDP,
mixed precision, out of memory, non-finite losses), `Validator` and `Scoreboard` (dev scores,
best dev BLEU, patience), `Schedule` (the learning rate), `Coordinator` (when to validate and
stop), `TrainingState` and `Checkpoints` (what checkpoints hold, and their files) and `RunLog`
(progress bar, train.jsonl, metrics.jsonl, examples.jsonl, TensorBoard). docs/architecture.md
follows one update through them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from mtrain.core import runtime
from mtrain.core.config import Config
from mtrain.core.distributed import Group
from mtrain.run.directory import build_model, write_config
from mtrain.training.budget_recipe import Choice
from mtrain.training.coordinator import Action, Coordinator, Finished, patience
from mtrain.training.data import TrainingData, Update
from mtrain.training.moving_average import MovingAverage
from mtrain.training.optim import build_optimizer
from mtrain.training.run_log import RunLog, run_log, trim_logs
from mtrain.training.state import Checkpoints, Held, Progress, TrainingState, resume_from_rank_0
from mtrain.training.update_step import NonFiniteLoss, OutOfMemory, UpdateStep
from mtrain.training.validation import Scoreboard, Validation, Validator

# The Trainer, and the ways its run can end other than by finishing.
__all__ = ["Interrupted", "NonFiniteLoss", "OutOfMemory", "RunFileError", "Trainer"]
__all__ += ["Update", "Validation"]  # what tests and scripts hand a Trainer's parts
log = logging.getLogger(__name__)
# Updates between two returns of the heap's free pages to the kernel: a bf16 default run on the
# CPU peaked at 3,088 MB without them and at 2,204 MB with them, with 1% fewer updates in its
# 29 minutes (another seed, so within noise; docs/benchmarks.md).
RELEASE_MEMORY_EVERY = 50


class RunFileError(OSError):
    """A file could not be read or written while training; the message says what was kept."""


class Interrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


class Trainer:
    """Trains one run into its directory; knows the model only through forward/encode/decode."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        device: torch.device,
        resume: bool = False,
        group: Group | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        make_step: type[UpdateStep] = UpdateStep,
        make_validator: Callable[..., Validator] = Validator,
    ):
        """Under torchrun every process builds one; rank 0 alone writes the run directory and
        sends the others its tokenizer and checkpoint. Tests replace `clock` (s) and the makers."""
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.group = group = group or Group()
        self.checkpoints = Checkpoints(run_dir, cfg.train)
        # Every rank says which last.pt it holds: one newer than rank 0's is not ignored.
        mine = self.checkpoints.held(expected=resume) if resume or not group.is_main else None
        none = Held(None, socket.gethostname(), str(self.checkpoints.last))
        resume = resume_from_rank_0(group.gather(mine or none, startup=True))
        self.clock, self.start = clock, clock()
        runtime.set_seed(cfg.train.seed)
        runtime.configure(device)
        self.data = data = TrainingData(cfg, run_dir, group, resume)
        self.tokenizer, self.corpus, self.stream = data.tokenizer, data.corpus, data.stream  # tests
        self.amp_dtype = runtime.mixed_precision(device, cfg.train.precision)
        self.model = build_model(cfg, data.tokenizer).to(device)
        n_params = sum(p.numel() for p in self.model.parameters())
        dtype = str(self.amp_dtype or torch.float32).removeprefix("torch.")
        log.info("model has %.1fM parameters, training on %s in %s", n_params / 1e6, device, dtype)
        optimizer, self.schedule = build_optimizer(self.model, cfg.train)
        # fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not.
        scaler = torch.amp.GradScaler(enabled=self.amp_dtype == torch.float16)
        self.scores = Scoreboard(patience(cfg.train))
        fingerprint = data.tokenizer.fingerprint()
        average = MovingAverage(self.model, cfg.train.ema_decay) if cfg.train.ema_decay else None
        self.state = TrainingState(
            self.model,
            optimizer,
            self.schedule,
            scaler,
            data,
            self.scores,
            fingerprint,
            dtype,
            average,
            dropout=cfg.model.dropout,
        )
        progress = self.resume() if resume else Progress()
        if not resume and group.rank:  # the same initial weights everywhere, other dropout masks
            torch.manual_seed(cfg.train.seed + group.rank)
        if self.state.choice:  # resumed after the plan chose: train on as it chose
            self.model.set_dropout(self.state.choice.dropout)
        self.minutes_before, self.finished = progress.minutes, progress.finished
        self.validated = progress.validated  # whether the step resumed from was validated
        group.end_startup()
        # The network the updates run through: under torchrun, DDP all-reduces its gradients.
        self.net = DistributedDataParallel(self.model) if group.active else self.model
        self.update_step = make_step.of(
            self.state, self.net, group, device, self.amp_dtype, cfg.train, progress
        )
        self.validator = make_validator(self.model, data, cfg, device, self.amp_dtype, self.minutes)

    def resume(self) -> Progress:
        """Continue from last.pt, which rank 0 reads and sends: no rank needs another's disk."""
        main = self.group.is_main
        state = self.group.broadcast(self.checkpoints.load_last() if main else None, startup=True)
        progress = self.state.load_state_dict(state, self.checkpoints.last, self.group)
        self.checkpoints.saved_step = progress.step
        if progress.finished:
            progress.finished.check_trainable(self.cfg.train, str(self.run_dir), progress.step)
        log.info("resuming %s at step %d", self.run_dir, progress.step)
        return progress

    @property
    def step(self) -> int:  # the optimizer updates done
        return self.update_step.step

    @property
    def skipped(self) -> int:  # the updates skipped: out of memory, a non-finite loss
        return self.update_step.skipped

    def minutes(self) -> float:
        """Minutes of training, those before a resume included."""
        return self.minutes_before + (self.clock() - self.start) / 60

    def state_dict(self, rng: list[dict], validated: bool = False) -> dict:
        """A checkpoint of the run now; `validated`: this step's dev scores were just taken."""
        progress = Progress(self.step, self.skipped, self.minutes(), validated=validated)
        return self.state.state_dict(progress, rng)

    def run(self) -> float:
        """Train until max_steps or the time budget; return the best dev BLEU.

        SIGINT or SIGTERM saves `last.pt` at the next step boundary and raises Interrupted.
        Under torchrun, rank 0 decides when to validate and stop, and tells the others.
        """
        tcfg, main, finished = self.cfg.train, self.group.is_main, self.finished
        trim_logs(self.run_dir, self.step, main)
        if finished and not finished.raised(tcfg):  # nothing to do
            if main:
                why, hint = finished.reason, finished.hint(tcfg)
                log.info("%s finished at step %d (%s); %s", self.run_dir, self.step, why, hint)
            return self.scores.best_bleu
        coordinator = Coordinator(tcfg, self.group, self.step, self.minutes(), self.schedule)
        try:
            with (
                coordinator.stop_signals(),
                run_log(self.run_dir, tcfg, main, coordinator, self.step, self.minutes()) as logs,
            ):
                self.train_updates(coordinator, logs)
                if tcfg.average_last and main:
                    self.validate_average(logs)
                ended = coordinator.ended(self.step, self.minutes(), self.scores)
                if main and ended:  # a later start with the same limits leaves the run as it is
                    finished = Finished.of(tcfg, *ended, lr=self.schedule.lr)
                    self.checkpoints.mark_finished(finished, self.scores.best_bleu)
                    logs.finished(self.step, finished, tcfg.lr)
        except OSError as e:  # a full disk, a file system gone read-only
            kept = self.checkpoints.kept()
            raise RunFileError(f"{e.filename or self.run_dir}: {e.strerror}; {kept}") from None
        return self.scores.best_bleu

    def train_updates(self, coordinator: Coordinator, logs: RunLog) -> None:
        """Train update after update, validating and stopping as the coordinator says."""
        main = self.group.is_main
        if self.step >= coordinator.last_step and not self.validated:
            # Resumed at the end from a checkpoint of a Ctrl-C or a failed validation: validate it.
            rng = self.group.gather(runtime.rng_state())
            if main:
                self.validate_and_save(coordinator, logs, rng)
            return
        self.follow_plan(coordinator)
        # Closed however the loop ends, so that the thread that builds batches stops with it.
        with contextlib.closing(self.data.updates(self.group, self.cfg.train.accumulate)) as ups:
            self.train_on(ups, coordinator, logs)

    def train_on(self, updates: Iterator[Update], coordinator: Coordinator, logs: RunLog) -> None:
        """Train on `updates` until the coordinator says to stop."""
        main = self.group.is_main
        for update in updates:
            if self.step >= coordinator.last_step:
                break
            lr = self.schedule.lr  # this update's (the next's after)
            try:
                loss = self.update_step(update)
            except (NonFiniteLoss, OutOfMemory) as e:
                raise type(e)(f"{e}; {self.checkpoints.kept()}") from None
            if self.step % RELEASE_MEMORY_EVERY == 0:
                runtime.release_freed_memory()
            coordinator.plan(self.step, self.minutes())
            self.follow_plan(coordinator)
            if loss is not None:
                logs.update(update, loss, self.step, self.minutes(), lr)
            action = coordinator.next_action(self.step, self.minutes(), loss is not None)
            if action is Action.GO:
                continue
            rng = self.group.gather(runtime.rng_state())  # every rank's, for the checkpoint
            if action in (Action.INTERRUPT, Action.STOP):
                if main:
                    self.checkpoints.save_last(self.state_dict(rng, action is Action.STOP))
                if action is Action.INTERRUPT:
                    raise Interrupted(self.step)
                break
            if main:
                self.validate_and_save(coordinator, logs, rng)
            if coordinator.patience_out(self.scores) or action is Action.FINAL:
                break

    @property
    def choice(self) -> Choice | None:
        """What the run chose from its plan (budget_recipe.py); None: not planned yet."""
        return self.state.choice

    def follow_plan(self, coordinator: Coordinator) -> None:
        """Once the run's end is first planned, take what the plan chooses (the dropout), say
        so and record it in the run's config.yaml; every rank plans alike, so chooses alike."""
        planned = coordinator.planned_end
        if self.state.choice or planned is None or not self.cfg.train.short_run_updates:
            return
        self.state.choice = choice = Choice.of(self.cfg, planned)
        self.model.set_dropout(choice.dropout)
        if self.group.is_main:
            log.info("%s", choice.describe(self.cfg))
            write_config(self.run_dir, self.cfg, choice.to_dict())

    def validate_and_save(self, coordinator: Coordinator, logs: RunLog, rng: list[dict]) -> None:
        """Validate (rank 0), keep the best dev BLEU, write the checkpoints and log the scores."""
        began = self.minutes()
        try:
            with self.averaged_weights():
                val = self.validator(self.step)
        except BaseException:  # out of memory, a second Ctrl-C: keep the updates since last.pt
            self.checkpoints.save_last(self.state_dict(rng))
            raise
        improved = self.scores.record(val.dev_bleu)
        self.checkpoints.save_validated(self.state_dict(rng, validated=True), improved)
        logs.validation("validation", val, improved, skipped=self.skipped)
        coordinator.validated(self.step, self.minutes() - began)
        runtime.release_freed_memory()  # what decoding and saving freed: the heap stays flat
        logs.restart_window()

    def averaged_weights(self) -> contextlib.AbstractContextManager:
        """Within this block the model holds the weights a checkpoint offers: the moving
        average's, where the run keeps one."""
        average = self.state.average
        return average.applied() if average else contextlib.nullcontext()

    def validate_average(self, logs: RunLog) -> None:
        """Average the last `train.average_last` step checkpoints into averaged.pt and validate
        it; it becomes best.pt if its dev BLEU is the best. Leaves the averaged model loaded."""
        averaged = self.checkpoints.average()
        if averaged is None:
            return
        self.model.load_state_dict(averaged["model"])
        val = self.validator(self.step)
        improved = self.scores.record_average(val.dev_bleu)
        if improved:
            self.checkpoints.make_average_best()
        logs.validation("average", val, improved, steps=averaged["steps"])
