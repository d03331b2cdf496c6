"""The training loop: updates, validation, checkpoints, metrics log, stopping and resuming."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from mtrain import checkpoint, jsonl, runtime
from mtrain.config import Config
from mtrain.data import (
    Batch,
    BatchStream,
    DataError,
    encode_pairs,
    epoch_batches,
    file_fingerprint,
    group_references,
    read_parallel,
)
from mtrain.distributed import DistributedError, Group
from mtrain.evaluate import score
from mtrain.model import Transformer
from mtrain.optim import build_optimizer, loss_fn
from mtrain.tokenizer import Tokenizer
from mtrain.translate import Translator

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DATA_KEYS = ("train", "dev")  # the corpora a run reads: a resumed run must find them unchanged
LOG_EVERY = 10  # steps per progress-bar update and per train.jsonl record


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


class RunWriteError(OSError):
    """A file of the run could not be written; the message says what was kept."""


class Interrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


@dataclass
class Update:
    """What one process trains on in one optimizer update."""

    batches: list[Batch]  # this process's share: `train.accumulate` batches
    n_target: int  # target tokens of the whole update, on every process
    n_tokens: int  # source and target tokens of the whole update, for the tokens/s shown

    @classmethod
    def of(cls, batches: list[Batch]) -> Update:
        """An update of one process alone."""
        n_target = sum(batch.n_target_tokens for batch in batches)
        return cls(batches, n_target, sum(batch.n_tokens for batch in batches))


@dataclass
class Validation:
    step: int
    minutes: float
    dev_loss: float
    dev_bleu: float
    dev_chrf: float


class TrainLog:
    """The training loss and learning rate, a record every LOG_EVERY updates in train.jsonl;
    the loss is the mean per target token of the updates since the last record."""

    def __init__(self, file):
        self.file = file  # None: log nothing (a rank other than 0)
        self.loss_sum, self.tokens = 0.0, 0

    def add(self, loss: float, n_target: int) -> None:
        self.loss_sum, self.tokens = self.loss_sum + loss * n_target, self.tokens + n_target

    def write(self, step: int, minutes: float, lr: float) -> None:
        if self.file is not None:
            loss = self.loss_sum / self.tokens  # label-smoothed, as the updates minimised it
            record = {"event": "train", "step": step, "minutes": minutes, "loss": loss, "lr": lr}
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        self.loss_sum, self.tokens = 0.0, 0


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
        resume = group.broadcast(resume)
        self.start = time.monotonic()
        tcfg, dcfg = cfg.train, cfg.data
        runtime.set_seed(tcfg.seed)
        runtime.configure(device)

        train_pairs = read_parallel(
            Path(dcfg.train), dcfg.src_lang, dcfg.tgt_lang, dcfg.swap_columns
        )
        dev_pairs = read_parallel(Path(dcfg.dev), dcfg.src_lang, dcfg.tgt_lang, dcfg.swap_columns)
        for path, pairs in ((dcfg.train, train_pairs), (dcfg.dev, dev_pairs)):
            if not any(s and t for s, t in pairs):
                raise DataError(f"{path}: no sentence pairs with both sides non-empty")
        log.info("read %d training and %d dev pairs", len(train_pairs), len(dev_pairs))
        # A resumed run must read the same data, or it would not continue the same run.
        self.data_hash = {key: file_fingerprint(Path(getattr(dcfg, key))) for key in DATA_KEYS}
        if group.is_main and resume:
            self.tokenizer = Tokenizer.load(run_dir)
        elif group.is_main:
            self.tokenizer = Tokenizer.train(
                [s for s, _ in train_pairs],
                [t for _, t in train_pairs],
                cfg.tokenizer,
                dcfg.src_lang,
                dcfg.tgt_lang,
                run_dir,
                tcfg.seed,
            )
        protos = group.broadcast(self.tokenizer.protos() if group.is_main else None)
        if not group.is_main:
            self.tokenizer = Tokenizer.from_protos(*protos)
        self.tokenizer_hash = self.tokenizer.fingerprint()
        self.train_examples = encode_pairs(
            self.tokenizer, train_pairs, dcfg.max_src_len, dcfg.max_tgt_len, drop_long=True
        )
        too_long = sum(1 for s, t in train_pairs if s and t) - len(self.train_examples)
        if not self.train_examples:
            raise DataError(f"{dcfg.train}: every pair is longer than data.max_src_len/max_tgt_len")
        if too_long:
            log.info(
                "dropped %d training pairs longer than data.max_src_len/max_tgt_len tokens",
                too_long,
            )
        self.dev_examples = encode_pairs(
            self.tokenizer, dev_pairs, dcfg.max_src_len, dcfg.max_tgt_len
        )
        self.dev_sources, self.dev_refs = group_references(dev_pairs)

        self.model: Transformer = checkpoint.build_model(cfg, self.tokenizer).to(device)
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("model has %.1fM parameters, training on %s", n_params / 1e6, device)
        self.optimizer, self.scheduler = build_optimizer(self.model, tcfg)
        self.amp_dtype = runtime.mixed_precision(device, tcfg.precision)
        # fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not.
        self.scaler = torch.amp.GradScaler(enabled=self.amp_dtype == torch.float16)
        self.stream = BatchStream(self.train_examples, tcfg.batch_tokens, tcfg.seed)
        self.step = 0
        self.best_bleu = -1.0
        self.stale = 0  # validations since dev BLEU last improved
        self.skipped = 0  # batches skipped for running out of memory or a non-finite loss
        self.minutes_before = 0.0  # training time spent before a resume
        self.stop_requested = False
        self.saved_step: int | None = None  # the step last.pt holds
        if resume:
            self.restore(group.broadcast(checkpoint.load(run_dir / checkpoint.LAST)))
            self.saved_step = self.step
            log.info("resuming %s at step %d", run_dir, self.step)
        elif group.rank:  # the same initial weights everywhere, other dropout masks
            torch.manual_seed(tcfg.seed + group.rank)
        if group.is_main:
            for name in (checkpoint.METRICS, checkpoint.TRAIN_LOG):
                jsonl.trim(run_dir / name, self.step)
        # The network the updates run through: under torchrun, DDP all-reduces its gradients.
        self.net = DistributedDataParallel(self.model) if group.active else self.model

    def minutes(self) -> float:
        return self.minutes_before + (time.monotonic() - self.start) / 60

    def updates(self):
        """Yield this process's share of each optimizer update.

        An update is the next `world_size × accumulate` batches of the batch stream, which is
        the same on every process; process r trains on the r-th `accumulate` of them. So an
        update holds the same sentences whatever the number of processes, and updates run
        across epoch ends as they do in one process: no process ever runs short of batches.
        """
        accumulate, group = self.cfg.train.accumulate, self.group
        mine = slice(group.rank * accumulate, (group.rank + 1) * accumulate)
        stream = iter(self.stream)
        while True:
            indices = [next(stream) for _ in range(group.world_size * accumulate)]
            # Counted on the host from the lengths: no wait for a GPU, no exchange between ranks.
            examples = [self.train_examples[i] for batch in indices for i in batch]
            n_target = sum(len(ex.tgt) + 1 for ex in examples)
            n_source = sum(len(ex.src) for ex in examples)
            yield Update(
                [self.stream.collate(b) for b in indices[mine]], n_target, n_source + n_target
            )

    def train_step(self, update: Update) -> float | None:
        """One optimizer update from the summed gradients of the update's batches.

        Returns the mean loss per target token, or None when the update was skipped (out of
        memory, or a non-finite loss with `train.skip_nonfinite`).
        """
        self.model.train()
        batches = [batch.to(self.device) for batch in update.batches]
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        try:
            for i, batch in enumerate(batches):
                # DDP all-reduces the gradients in the backward of the last batch only.
                last = i == len(batches) - 1
                with nullcontext() if last or not self.group.active else self.net.no_sync():
                    with runtime.autocast(self.device, self.amp_dtype):
                        logits = self.net(batch.src, batch.tgt_in)  # (B, T, V)
                    loss = loss_fn(logits, batch.tgt_out, self.cfg.train.label_smoothing, "sum")
                    loss = loss / update.n_target  # every token of the update weighs the same
                    if self.group.active:  # DDP averages the ranks' gradients: undo the mean
                        loss = loss * self.group.world_size
                    self.scaler.scale(loss).backward()
                total += loss.detach()
        except torch.cuda.OutOfMemoryError:
            if self.group.active:  # the other ranks are already waiting for this one
                raise DistributedError(f"rank {self.group.rank}: out of memory") from None
            self.optimizer.zero_grad(set_to_none=True)  # drop partial gradients
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return self._skip(update, "out of memory")
        # Every rank sees the same total, so every rank takes the same decision below.
        mean_loss = self.group.sum(total).item() / self.group.world_size
        if not math.isfinite(mean_loss):
            self.optimizer.zero_grad(set_to_none=True)
            if not self.cfg.train.skip_nonfinite:
                raise NonFiniteLoss(
                    f"step {self.step + 1}: the loss is {mean_loss}; training stopped; "
                    f"{self.kept()}"
                )
            return self._skip(update, f"loss is {mean_loss}")
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.train.clip_norm, foreach=True
        )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.step += 1
        return mean_loss

    def _skip(self, update: Update, reason: str) -> None:
        self.skipped += 1
        shapes = ", ".join(
            f"{b.src.size(0)}×({b.src.size(1)}, {b.tgt_in.size(1)})" for b in update.batches
        )
        log.warning(
            "step %d: skipped the update (sentences × (source, target) lengths: %s): %s; "
            "%d skipped so far",
            self.step + 1,
            shapes,
            reason,
            self.skipped,
        )

    @torch.no_grad()
    def validate(self) -> Validation:
        """Teacher-forced dev loss and greedy dev BLEU against all references."""
        self.model.eval()
        total, tokens = 0.0, 0
        batches = epoch_batches(self.dev_examples, self.cfg.train.batch_tokens, random.Random(0))
        for batch in batches:
            batch = batch.to(self.device)
            with runtime.autocast(self.device, self.amp_dtype):
                logits = self.model(batch.src, batch.tgt_in)
            total += loss_fn(logits, batch.tgt_out, 0.0, "sum").item()
            tokens += batch.n_target_tokens
        greedy = dataclasses.replace(self.cfg.decode, beam_size=1)
        translator = Translator(self.model, self.tokenizer, self.cfg, self.device, greedy)
        hyps = translator.translate(self.dev_sources)
        scores = score(hyps, self.dev_refs, self.cfg.data.tgt_lang)
        return Validation(self.step, self.minutes(), total / tokens, scores.bleu, scores.chrf)

    def state(self, rng: list[dict]) -> dict:
        """Everything a resumed run needs to continue exactly where this one is; `rng` holds
        every rank's random generators."""
        return {
            "model": self.model.state_dict(),
            "tokenizer": self.tokenizer_hash,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "data": self.data_hash,
            **self.stream.state_dict(),
            "rng": rng,
            "best_bleu": self.best_bleu,
            "stale": self.stale,
            "skipped": self.skipped,
            "minutes": self.minutes(),
        }

    def restore(self, state: dict) -> None:
        last = self.run_dir / checkpoint.LAST
        checkpoint.check_tokenizer(last, state, self.tokenizer_hash)
        for key, digest in state.get("data", {}).items():
            if self.data_hash.get(key) != digest:
                raise checkpoint.CheckpointError(
                    f"data.{key}: {getattr(self.cfg.data, key)} changed since {last} was written; "
                    "resuming would not continue the same run (restore the file, or train into "
                    "another --out)"
                )
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
            self.step = state["step"]
            self.stream.load_state_dict(state)
            rng = state.get("rng") or [  # written before mtrain trained under torchrun
                {
                    "python": state["python_rng_state"],
                    "torch": state["torch_rng_state"],
                    "cuda": state["cuda_rng_states"],
                }
            ]
            if len(rng) != self.group.world_size:
                raise checkpoint.CheckpointError(
                    f"{last}: written by {len(rng)} training process(es), not "
                    f"{self.group.world_size}; resume with as many (or train into another --out)"
                )
            runtime.set_rng_state(rng[self.group.rank])
            self.best_bleu, self.stale = state["best_bleu"], state["stale"]
            self.minutes_before = state["minutes"]
            self.skipped = state["skipped"]
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            reason = " ".join(str(e).split())[:200]
            raise checkpoint.CheckpointError(
                f"{self.run_dir / checkpoint.LAST}: cannot resume from it ({reason})"
            ) from None

    def kept(self) -> str:
        """What a failure leaves behind, for its message."""
        if self.saved_step is None:
            return f"no checkpoint was written in {self.run_dir} yet"
        return f"{self.run_dir / checkpoint.LAST} (step {self.saved_step}) is intact"

    def save(self, name: str, rng: list[dict]) -> None:
        checkpoint.save(self.run_dir / name, self.state(rng))
        if name == checkpoint.LAST:
            self.saved_step = self.step

    def checkpoint_and_log(self, val: Validation, metrics_file, rng: list[dict]) -> None:
        improved = val.dev_bleu > self.best_bleu
        self.best_bleu = max(self.best_bleu, val.dev_bleu)
        self.stale = 0 if improved else self.stale + 1
        last = self.run_dir / checkpoint.LAST
        self.save(checkpoint.LAST, rng)
        if improved:
            checkpoint.save_copy(last, self.run_dir / checkpoint.BEST)
        if self.cfg.train.keep_last:
            checkpoint.save_copy(last, self.run_dir / checkpoint.step_name(self.step))
            for old in checkpoint.step_checkpoints(self.run_dir)[: -self.cfg.train.keep_last]:
                old.unlink()
        self.log(metrics_file, "validation", val, improved, skipped=self.skipped)

    def average(self, metrics_file) -> None:
        """Average the last `train.average_last` step checkpoints into averaged.pt and validate
        it; it becomes best.pt if its dev BLEU is the best. Leaves the averaged model loaded."""
        paths = checkpoint.step_checkpoints(self.run_dir)[-self.cfg.train.average_last :]
        if len(paths) < 2:
            return
        state = checkpoint.average(paths)
        averaged = self.run_dir / checkpoint.AVERAGED
        checkpoint.save(averaged, state)
        self.model.load_state_dict(state["model"])
        val = self.validate()
        improved = val.dev_bleu > self.best_bleu
        if improved:
            self.best_bleu = val.dev_bleu
            checkpoint.save_copy(averaged, self.run_dir / checkpoint.BEST)
            # A resumed run compares with this score, or it could replace best.pt by a worse one.
            last = self.run_dir / checkpoint.LAST
            checkpoint.save(last, {**checkpoint.load(last), "best_bleu": val.dev_bleu})
        self.log(metrics_file, "average", val, improved, steps=state["steps"])

    def log(self, metrics_file, event: str, val: Validation, improved: bool, **extra) -> None:
        record = {"event": event, **vars(val), "best": improved, **extra}
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        what = f"average of steps {extra['steps']}" if event == "average" else f"step {val.step}"
        log.info(
            "%s  %.1f min  dev loss %.3f  dev BLEU %.2f  chrF %.2f%s",
            what,
            val.minutes,
            val.dev_loss,
            val.dev_bleu,
            val.dev_chrf,
            "  (best)" if improved else "",
        )

    def _on_signal(self, signum, frame) -> None:
        if self.stop_requested:  # second Ctrl-C: stop at once; checkpoints are written atomically
            raise KeyboardInterrupt
        self.stop_requested = True
        if self.group.is_main:
            log.warning(
                "%s: saving a checkpoint after this step (again to stop at once)",
                signal.Signals(signum).name,
            )

    def next_action(self, stop: bool) -> str:
        """What every rank does after this update, as rank 0 decides: "go" on, "validate"
        (and checkpoint), validate for the last time ("final"), or save and "interrupt"."""
        if self.stop_requested:
            action = "interrupt"
        elif stop:
            action = "final"
        else:
            action = "validate" if self.step % self.cfg.train.eval_every == 0 else "go"
        return self.group.broadcast(action)

    def run(self) -> float:
        """Train until max_steps or the time budget; return the best dev BLEU.

        SIGINT or SIGTERM saves `last.pt` at the next step boundary and raises Interrupted.
        Under torchrun, rank 0 decides when to validate and stop, and tells the others.
        """
        tcfg, main = self.cfg.train, self.group.is_main
        budget = tcfg.max_minutes or math.inf
        reserve = 0.0  # minutes the last validation took: keep room for a final one
        window_tokens, window_start = 0, time.monotonic()
        # Under a time budget the step count is unknown: show no misleading ETA.
        total = None if tcfg.max_minutes else tcfg.max_steps
        bar = tqdm(
            total=total,
            initial=self.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not main,
        )
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            with contextlib.ExitStack() as files:
                # Rank 0 alone logs: the others write to no file.
                def log_file(name: str):
                    path = self.run_dir / name
                    return files.enter_context(path.open("a", encoding="utf-8")) if main else None

                metrics, train_log = (
                    log_file(checkpoint.METRICS),
                    TrainLog(log_file(checkpoint.TRAIN_LOG)),
                )
                files.enter_context(logging_redirect_tqdm())
                for update in self.updates():
                    if self.step >= tcfg.max_steps:
                        break
                    loss = self.train_step(update)
                    if loss is None:
                        continue
                    window_tokens += update.n_tokens  # of all processes
                    train_log.add(loss, update.n_target)
                    bar.update(1)
                    if self.step % LOG_EVERY == 0:
                        now = time.monotonic()
                        lr = self.scheduler.get_last_lr()[0]
                        tok_s = window_tokens / (now - window_start)
                        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
                        train_log.write(self.step, self.minutes(), lr)
                        window_tokens, window_start = 0, now
                    stop = self.step >= tcfg.max_steps or self.minutes() + reserve >= budget
                    action = self.next_action(stop)
                    if action == "go":
                        continue
                    rng = self.group.gather(runtime.rng_state())  # for the checkpoint
                    if action == "interrupt":
                        if main:
                            self.save(checkpoint.LAST, rng)
                        raise Interrupted(self.step)
                    if main:
                        began = self.minutes()
                        self.checkpoint_and_log(self.validate(), metrics, rng)
                        # Keep room for a final validation, and one of the averaged model.
                        reserve = (self.minutes() - began) * (2 if tcfg.average_last else 1)
                        window_tokens, window_start = 0, time.monotonic()
                    patience_out = self.group.broadcast(
                        bool(tcfg.patience) and self.stale >= tcfg.patience
                    )
                    if patience_out:
                        log.info("no better dev BLEU in %d validations: stopping", self.stale)
                    if patience_out or action == "final":
                        break
                if tcfg.average_last and main:
                    self.average(metrics)
        except OSError as e:  # a full disk, a file system gone read-only
            where = e.filename or f"into {self.run_dir}"
            raise RunWriteError(f"cannot write {where} ({e.strerror}); {self.kept()}") from None
        finally:
            bar.close()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return self.best_bleu
