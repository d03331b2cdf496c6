"""Training a model: the `Trainer`, which puts one run's parts together.

Each part is a module of its own: `training_data` (prepared corpus, tokenizer, dev set, batches:
the one place that reads data), `update_step` (accumulation, DDP, mixed precision, out of
memory, non-finite losses), `validation`, `training_state` (what checkpoints hold, resuming,
best/keep-last/average), `training_log` (progress bar, train.jsonl, metrics.jsonl),
`coordinator` (when to validate and stop) and `train_loop` (the loop that runs them)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from mtrain import jsonl, runtime, train_loop, update_step
from mtrain.config import Config, ConfigError
from mtrain.coordinator import annealed, raised
from mtrain.distributed import Group
from mtrain.optim import loss_fn
from mtrain.run_dir import METRICS, TRAIN_LOG
from mtrain.train_loop import Interrupted, RunFileError
from mtrain.training_data import TrainingData, Update
from mtrain.training_state import Checkpoints, TrainingState
from mtrain.update_step import NonFiniteLoss, OutOfMemory
from mtrain.validation import Validation, dev_scores

# The Trainer, and the ways its run can end other than by finishing.
__all__ = ["Interrupted", "NonFiniteLoss", "OutOfMemory", "RunFileError", "Trainer"]
log = logging.getLogger(__name__)


class Trainer:
    """Trains one run into its directory; knows the model only through forward/encode/decode."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        device: torch.device,
        resume: bool = False,
        group: Group | None = None,
    ):
        """Under torchrun every process builds a Trainer; rank 0 alone reads and writes the run
        directory, and sends the others the tokenizer and the checkpoint to resume from."""
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.group = group = group or Group()
        resume = group.broadcast(resume, startup=True)
        self.start = time.monotonic()
        runtime.set_seed(cfg.train.seed)
        runtime.configure(device)
        self.data = data = TrainingData(cfg, run_dir, group, resume)
        # Shortcuts, for scripts and tests:
        self.tokenizer, self.corpus, self.stream = data.tokenizer, data.corpus, data.stream
        self.amp_dtype = runtime.mixed_precision(device, cfg.train.precision)
        self.state = TrainingState.new(cfg, data, device, self.amp_dtype)
        self.model = self.state.model
        self.checkpoints = Checkpoints(run_dir, cfg.train)
        if resume:
            self.resume()
        elif group.rank:  # the same initial weights everywhere, other dropout masks
            torch.manual_seed(cfg.train.seed + group.rank)
        if group.is_main:
            for name in (METRICS, TRAIN_LOG):
                jsonl.trim(run_dir / name, self.step)
        group.end_startup()
        # The network the updates run through: under torchrun, DDP all-reduces its gradients.
        self.net = DistributedDataParallel(self.model) if group.active else self.model

    def resume(self) -> None:
        """Continue from last.pt, which rank 0 reads and sends: no rank needs another's disk."""
        main = self.group.is_main
        state = self.group.broadcast(self.checkpoints.load_last() if main else None, startup=True)
        self.state.load_state_dict(state, self.checkpoints.last, self.group)
        self.checkpoints.saved_step = self.step
        finished = self.state.finished
        if finished and raised(self.cfg.train, finished) and annealed(self.cfg.train, finished):
            raise ConfigError(
                f"{self.run_dir}: finished at step {self.step} ({finished['reason']}) with its "
                "learning rate annealed (train.lr_schedule: linear): raising train.max_steps or "
                "train.max_minutes cannot train it on; train a new run (another --out)"
            )
        log.info("resuming %s at step %d", self.run_dir, self.step)

    @property
    def step(self) -> int:
        """The optimizer updates done."""
        return self.state.step

    @property
    def skipped(self) -> int:
        """The updates skipped for running out of memory or a non-finite loss."""
        return self.state.skipped

    def minutes(self) -> float:
        """Minutes of training, those before a resume included."""
        return self.state.minutes_before + (time.monotonic() - self.start) / 60

    def token_loss(self, logits: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        """What the updates minimise: the label-smoothed loss summed over a batch's tokens."""
        return loss_fn(logits, tgt_out, self.cfg.train.label_smoothing, "sum")

    def updates(self):
        """This process's share of each optimizer update, update after update."""
        return self.data.updates(self.group, self.cfg.train.accumulate)

    def train_step(self, update: Update) -> float | None:
        """One optimizer update; its mean loss per target token, or None if it was skipped."""
        return update_step.train_step(self, update)

    def validate(self) -> Validation:
        """Dev loss, BLEU and chrF of the model as it is now."""
        dev_loss, scores = dev_scores(self.model, self.data, self.cfg, self.device, self.amp_dtype)
        return Validation(self.step, self.minutes(), dev_loss, scores.bleu, scores.chrf)

    def state_dict(self, rng: list[dict], validated: bool = False) -> dict:
        """A checkpoint of the run as it is now; `rng` holds every rank's random generators,
        `validated` whether this step's dev scores were just taken."""
        return self.state.state_dict(rng, self.minutes(), validated)

    def run(self) -> float:
        """Train until max_steps or the time budget; return the best dev BLEU (`train_loop`)."""
        return train_loop.run(self)
