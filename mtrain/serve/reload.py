"""Serve the newest checkpoint of a run that is still training.

A thread looks at the checkpoint's stamp (inode, size, modification time) once a second. When it
changes, the new weights are loaded aside, off the worker thread, and handed to the batcher as a
solo job: the worker swaps them in between two batches, so no request is dropped and each answer
comes from one model. A checkpoint that does not load (torn, written in place, from another
tokenizer) is logged once and skipped: the old model goes on serving until the file changes again.
A file that changed while it was read is read again at the next look.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtrain.core.files import Stamp, lock_holder, stamp
from mtrain.decoding.loaded import wrap
from mtrain.decoding.translator import Translator
from mtrain.run.directory import CheckpointError, load_model, peek_checkpoint

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0  # a stat a second: nothing next to a batch


@dataclass
class Loaded:
    """A checkpoint's model, ready to serve."""

    translator: Translator
    step: int  # the training step the checkpoint was saved at
    stamp: Stamp


def saved_step(path: Path) -> int | None:
    """The step a checkpoint was saved at, its tensors not read; None if it cannot be told."""
    try:
        return peek_checkpoint(path)["step"]
    except CheckpointError:  # absent or damaged: the watcher loads it again (or says why) later
        return None


def wait_for_checkpoint(path: Path, run_dir: Path) -> None:
    """Wait while a process holds the run directory's lock (a run training) and has not written
    the checkpoint `path` yet (its first validation writes best.pt); return at once if it exists
    or nothing holds the run."""
    said = False
    while not path.exists() and (holder := lock_holder(run_dir)) is not None:
        if not said:
            log.info(
                "mtrain: waiting for %s: the run (%s) writes it at its first validation; "
                "the port opens once it is loaded",
                path,
                holder,
            )
            said = True
        time.sleep(POLL_SECONDS)


class ModelWatcher:
    """Looks at one checkpoint of a run and loads it again, aside, when it changes."""

    def __init__(self, path: Path, base: Translator, quantize: bool, seen: Stamp | None):
        self.path, self.base, self.quantize = path, base, quantize
        self.seen = seen  # the stamp of the file served, or last refused
        self.failing = False  # a refusal was logged: the next one is not
        self.pending: Loaded | None = None  # loaded, not yet taken by the worker
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    @classmethod
    def after_load(
        cls, path: Path, base: Translator, quantize: bool, before: Stamp | None
    ) -> tuple[ModelWatcher, int | None]:
        """The watcher of the checkpoint `base` was loaded from, and the step `base` serves.

        `before` is the file's stamp taken before it was loaded: if the file is still that one,
        its step is base's; otherwise (None) the first look loads it again.
        """
        step = saved_step(path)
        if before is None or stamp(path) != before:
            return cls(path, base, quantize, None), None
        return cls(path, base, quantize, before), step

    def poll(self) -> Loaded | None:
        """The checkpoint's model if the file changed since the last look and loads whole."""
        now = stamp(self.path)
        if now is None or now == self.seen:
            return None
        b = self.base
        try:
            model, step = load_model(self.path, b.cfg, b.tokenizer, b.device)
        except CheckpointError as e:
            if stamp(self.path) != now:  # replaced while it was read: look again
                return None
            self.seen = now
            if not self.failing:
                log.warning("mtrain serve: %s; serving the model loaded before", e)
            self.failing = True
            return None
        if stamp(self.path) != now:
            return None
        translator = wrap(model, b.tokenizer, b.cfg, b.device, b.decode, b.nbest, self.quantize)
        self.seen, self.failing = now, False
        log.info("mtrain serve: loaded %s (step %d)", self.path, step)
        return Loaded(translator, step, now)

    def start(self, offer: Callable[[Loaded], bool]) -> None:
        """Look every POLL_SECONDS; hand each new model to `offer` until it takes it (True)."""

        def watch() -> None:
            while not self.stop.wait(POLL_SECONDS):
                try:
                    self.pending = self.pending or self.poll()
                    if self.pending is not None and offer(self.pending):
                        self.pending = None
                except Exception as e:  # the watcher must not die: the server goes on serving
                    log.error("mtrain serve: watching %s: %s: %s", self.path, type(e).__name__, e)

        self.thread = threading.Thread(target=watch, name="mtrain-watcher", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
