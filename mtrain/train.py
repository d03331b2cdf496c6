"""The training loop: updates, validation, checkpoints, metrics log, stopping and resuming."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from mtrain import checkpoint, runtime
from mtrain.config import Config
from mtrain.data import (
    Batch,
    BatchStream,
    DataError,
    encode_pairs,
    epoch_batches,
    group_references,
    read_parallel,
)
from mtrain.evaluate import score
from mtrain.model import Transformer
from mtrain.optim import build_optimizer, loss_fn
from mtrain.tokenizer import Tokenizer
from mtrain.translate import Translator

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOG_EVERY = 10  # steps per progress-bar update and per train.jsonl record


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


class Interrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


@dataclass
class Validation:
    step: int
    minutes: float
    dev_loss: float
    dev_bleu: float
    dev_chrf: float


class Trainer:
    """Trains one run into its directory; knows the model only through forward/encode/decode."""

    def __init__(self, cfg: Config, run_dir: Path, device: torch.device, resume: bool = False):
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
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
        if resume:
            self.tokenizer = Tokenizer.load(run_dir)
        else:
            self.tokenizer = Tokenizer.train(
                [s for s, _ in train_pairs],
                [t for _, t in train_pairs],
                cfg.tokenizer,
                dcfg.src_lang,
                dcfg.tgt_lang,
                run_dir,
                tcfg.seed,
            )
        self.tokenizer_hash = self.tokenizer.fingerprint()
        self.train_examples = encode_pairs(
            self.tokenizer, train_pairs, dcfg.max_src_len, dcfg.max_tgt_len
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
        if resume:
            self.restore(checkpoint.load(run_dir / checkpoint.LAST))
            log.info("resuming %s at step %d", run_dir, self.step)

    def minutes(self) -> float:
        return self.minutes_before + (time.monotonic() - self.start) / 60

    def updates(self):
        """Yield the batches of each optimizer update, `train.accumulate` at a time."""
        batches = iter(self.stream)
        while True:
            yield [next(batches) for _ in range(self.cfg.train.accumulate)]

    def train_step(self, batches: list[Batch]) -> float | None:
        """One optimizer update from the summed gradients of `batches`.

        Returns the mean loss per target token, or None when the update was skipped (out of
        memory, or a non-finite loss with `train.skip_nonfinite`).
        """
        self.model.train()
        # Counted on the host: on a GPU, counting would wait for the non-blocking copies.
        n_target = sum(batch.n_target_tokens for batch in batches)
        batches = [batch.to(self.device) for batch in batches]
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        try:
            for batch in batches:
                with runtime.autocast(self.device, self.amp_dtype):
                    logits = self.model(batch.src, batch.tgt_in)  # (B, T, V)
                loss = loss_fn(logits, batch.tgt_out, self.cfg.train.label_smoothing, "sum")
                loss = loss / n_target  # every token weighs the same across the batches
                if not torch.isfinite(loss):
                    if not self.cfg.train.skip_nonfinite:
                        raise NonFiniteLoss(
                            f"step {self.step + 1}: the loss is {loss.item()}; training stopped, "
                            "the last checkpoint written before it is kept"
                        )
                    return self._skip(batch, f"loss is {loss.item()}")
                self.scaler.scale(loss).backward()
                total += loss.item()
        except torch.cuda.OutOfMemoryError:
            self.optimizer.zero_grad(set_to_none=True)  # drop partial gradients
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return self._skip(batch, "out of memory")
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.train.clip_norm, foreach=True
        )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.step += 1
        return total

    def _skip(self, batch: Batch, reason: str) -> None:
        self.skipped += 1
        log.warning(
            "step %d: skipped a batch of %d sentences (source length %d, target length %d): %s; "
            "%d skipped so far",
            self.step + 1,
            batch.src.size(0),
            batch.src.size(1),
            batch.tgt_in.size(1),
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

    def state(self) -> dict:
        """Everything a resumed run needs to continue exactly where this one is."""
        return {
            "model": self.model.state_dict(),
            "tokenizer": self.tokenizer_hash,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            **self.stream.state_dict(),
            "python_rng_state": random.getstate(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_states": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "best_bleu": self.best_bleu,
            "stale": self.stale,
            "skipped": self.skipped,
            "minutes": self.minutes(),
        }

    def restore(self, state: dict) -> None:
        checkpoint.check_tokenizer(self.run_dir / checkpoint.LAST, state, self.tokenizer_hash)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
            self.step = state["step"]
            self.stream.load_state_dict(state)
            random.setstate(state["python_rng_state"])
            torch.set_rng_state(state["torch_rng_state"])
            if state["cuda_rng_states"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["cuda_rng_states"])
            self.best_bleu, self.stale = state["best_bleu"], state["stale"]
            self.minutes_before = state["minutes"]
            self.skipped = state["skipped"]
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            reason = " ".join(str(e).split())[:200]
            raise checkpoint.CheckpointError(
                f"{self.run_dir / checkpoint.LAST}: cannot resume from it ({reason})"
            ) from None

    def save(self, name: str) -> None:
        checkpoint.save(self.run_dir / name, self.state())

    def checkpoint_and_log(self, val: Validation, metrics_file) -> None:
        improved = val.dev_bleu > self.best_bleu
        self.best_bleu = max(self.best_bleu, val.dev_bleu)
        self.stale = 0 if improved else self.stale + 1
        last = self.run_dir / checkpoint.LAST
        self.save(checkpoint.LAST)
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
        log.warning(
            "%s: saving a checkpoint after this step (again to stop at once)",
            signal.Signals(signum).name,
        )

    def run(self) -> float:
        """Train until max_steps or the time budget; return the best dev BLEU.

        SIGINT or SIGTERM saves `last.pt` at the next step boundary and raises Interrupted.
        """
        tcfg = self.cfg.train
        budget = tcfg.max_minutes or math.inf
        reserve = 0.0  # minutes the last validation took: keep room for a final one
        window_tokens, window_start = 0, time.monotonic()
        loss_sum, loss_tokens = 0.0, 0  # training loss since the last train.jsonl record
        # Under a time budget the step count is unknown: show no misleading ETA.
        total = None if tcfg.max_minutes else tcfg.max_steps
        bar = tqdm(total=total, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        metrics_path = self.run_dir / checkpoint.METRICS
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            with (
                metrics_path.open("a", encoding="utf-8") as metrics,
                (self.run_dir / checkpoint.TRAIN_LOG).open("a", encoding="utf-8") as train_log,
                logging_redirect_tqdm(),
            ):
                for batches in self.updates():
                    if self.step >= tcfg.max_steps:
                        break
                    loss = self.train_step(batches)
                    if loss is None:
                        continue
                    window_tokens += sum(batch.n_tokens for batch in batches)
                    n_target = sum(batch.n_target_tokens for batch in batches)
                    loss_sum, loss_tokens = loss_sum + loss * n_target, loss_tokens + n_target
                    bar.update(1)
                    if self.step % LOG_EVERY == 0:
                        now = time.monotonic()
                        lr = self.scheduler.get_last_lr()[0]
                        tok_s = window_tokens / (now - window_start)
                        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
                        record = {
                            "event": "train",
                            "step": self.step,
                            "minutes": self.minutes(),
                            "loss": loss_sum / loss_tokens,  # per target token, label-smoothed
                            "lr": lr,
                        }
                        train_log.write(json.dumps(record) + "\n")
                        train_log.flush()
                        window_tokens, window_start = 0, now
                        loss_sum, loss_tokens = 0.0, 0
                    if self.stop_requested:
                        self.save(checkpoint.LAST)
                        raise Interrupted(self.step)
                    stop = self.step >= tcfg.max_steps or self.minutes() + reserve >= budget
                    if stop or self.step % tcfg.eval_every == 0:
                        began = self.minutes()
                        self.checkpoint_and_log(self.validate(), metrics)
                        # Keep room for a final validation, and one of the averaged model.
                        reserve = (self.minutes() - began) * (2 if tcfg.average_last else 1)
                        window_tokens, window_start = 0, time.monotonic()
                    if tcfg.patience and self.stale >= tcfg.patience:
                        log.info("no better dev BLEU in %d validations: stopping", self.stale)
                        break
                    if stop:
                        break
                if tcfg.average_last:
                    self.average(metrics)
        finally:
            bar.close()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return self.best_bleu
