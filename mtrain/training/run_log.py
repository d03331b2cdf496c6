"""What training shows and keeps as it goes: the progress bar, train.jsonl, metrics.jsonl,
examples.jsonl and, with `train.tensorboard`, TensorBoard's event files."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from mtrain.core import jsonl, progress
from mtrain.core.config import TrainConfig
from mtrain.core.progress import tqdm
from mtrain.run.directory import EXAMPLES, METRICS, TENSORBOARD, TRAIN_LOG
from mtrain.training.coordinator import Coordinator, Finished
from mtrain.training.data import Update
from mtrain.training.tensorboard_log import TensorBoardLog
from mtrain.training.validation import Validation

log = logging.getLogger(__name__)
LOG_EVERY = 10  # steps per progress-bar update and per train.jsonl record
# Where stderr is not a terminal (`mtrain train 2> train.log`), a plain line replaces the bar's
# redrawn frames: every PLAIN_EVERY updates, or sooner once PLAIN_SECONDS have passed (at a
# LOG_EVERY step). A 29-minute default run writes about 50 such lines.
PLAIN_EVERY, PLAIN_SECONDS = 100, 60.0
# Under a time budget the bar shows the budget's minutes left (in its postfix), not tqdm's
# estimate from its recent speed, which validations slow down.
BUDGET_BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


# Losses, on the device or not, as floats, read back together: one wait for the device.
ReadBack = Callable[..., list[float]]


def floats(*values: torch.Tensor | float) -> list[float]:
    """`values` as floats (a `ReadBack` for a log that checks nothing)."""
    return [float(v) for v in values]


class TrainLog:
    """The training loss and learning rate, a record every LOG_EVERY updates in train.jsonl;
    the loss is the mean per target token of the updates since the last record.

    The losses are summed where they are, on the device, and read back once a record."""

    def __init__(self, file):
        self.file = file  # None: log nothing (a rank other than 0)
        self.loss_sum: torch.Tensor | float = 0.0
        self.tokens = 0

    def add(self, loss: torch.Tensor | float, n_target: int) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.double()  # as a float's sum was: the logged losses do not move
        self.loss_sum, self.tokens = self.loss_sum + loss * n_target, self.tokens + n_target

    def write(self, step: int, minutes: float, lr: float, loss_sum: float) -> float:
        """Record the mean loss since the last record (`loss_sum`: `self.loss_sum` as read
        back), and return it."""
        loss = loss_sum / self.tokens  # label-smoothed, as the updates minimised it
        if self.file is not None:
            record = {"event": "train", "step": step, "minutes": minutes, "loss": loss, "lr": lr}
            self.file.write(jsonl.dumps(record))
            self.file.flush()
        self.loss_sum, self.tokens = 0.0, 0
        return loss


LOGS = (METRICS, TRAIN_LOG, EXAMPLES)  # the run's logs, each a record per line with its step


def trim_logs(run_dir: Path, step: int, main: bool) -> None:
    """On rank 0 (`main`), cut the run's logs back to `step`, where a resumed run goes on (a
    torn last line too); a finished run's logs as well, whether or not it trains on."""
    if main:
        for name in LOGS:
            jsonl.trim(run_dir / name, step)


@contextlib.contextmanager
def run_log(
    run_dir: Path,
    cfg: TrainConfig,
    main: bool,
    coordinator: Coordinator,
    step: int,
    minutes: float,
    read: ReadBack,
) -> Iterator[RunLog]:
    """The run's log, open while it trains from `step`, `minutes` into the run, to where the
    coordinator says it is headed, reading its losses back with `read`; on a rank other than
    0, a log that shows and writes nothing. The bar is drawn on a terminal only: elsewhere its
    fields come as plain lines."""
    plain = main and not progress.draws_bars()
    with contextlib.ExitStack() as files:
        bar = tqdm(
            total=coordinator.end_step(step, minutes),
            initial=step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not main or plain,
            bar_format=BUDGET_BAR if cfg.max_minutes else None,
        )
        files.enter_context(bar)

        def open_log(name: str):
            path = run_dir / name
            return files.enter_context(path.open("a", encoding="utf-8")) if main else None

        logs = RunLog(bar, open_log(METRICS), TrainLog(open_log(TRAIN_LOG)), coordinator, read)
        logs.plain = plain
        logs.examples = open_log(EXAMPLES)
        if main and cfg.tensorboard:
            logs.tensorboard = TensorBoardLog(run_dir / TENSORBOARD, step)
            files.callback(logs.tensorboard.close)
        files.enter_context(logging_redirect_tqdm())
        yield logs


class RunLog:
    """The progress bar (loss, learning rate, tokens/s, last dev BLEU, where the run is
    headed), train.jsonl, metrics.jsonl, examples.jsonl and TensorBoard's files."""

    def __init__(
        self,
        bar: tqdm,
        metrics,
        train_log: TrainLog,
        coordinator: Coordinator,
        read: ReadBack = floats,
    ):
        """`read` turns the losses into floats, all in one read of the device."""
        self.bar, self.metrics, self.train_log = bar, metrics, train_log
        self.coordinator, self.read = coordinator, read
        self.examples = None  # examples.jsonl, open on rank 0
        self.tensorboard: TensorBoardLog | None = None
        self.dev_bleu: float | None = None  # of the last validation
        self.postfix: dict[str, str] = {}  # the bar's fields as last shown
        self.plain = False  # plain lines instead of the bar (stderr is not a terminal)
        self.plain_step, self.plain_time = None, time.monotonic()  # of the last plain line
        self.restart_window()

    def restart_window(self) -> None:
        """Count tokens/s afresh from now (after a validation: training time only)."""
        self.window_tokens, self.window_start = 0, time.monotonic()

    def update(
        self, update: Update, loss: torch.Tensor | float, step: int, minutes: float, lr: float
    ) -> None:
        """Show a finished update; every LOG_EVERY steps, record the mean loss since the last
        record and the learning rate, and show them (the only steps that read the losses back
        from the device, once): one update's loss jumps with its batch's shape."""
        self.window_tokens += update.n_tokens  # of all processes
        self.train_log.add(loss, update.n_target)
        # The end moves as the plan or the speed does: never shown behind the step.
        self.bar.total = self.coordinator.end_step(step, minutes)
        self.bar.update(1)
        if step % LOG_EVERY == 0:
            (loss_sum,) = self.read(self.train_log.loss_sum)
            tok_s = self.window_tokens / (time.monotonic() - self.window_start)
            mean_loss = self.train_log.write(step, minutes, lr, loss_sum)
            self.show(mean_loss, lr, tok_s, minutes)
            if self.plain:
                self.show_plain(step, minutes)
            if self.tensorboard:
                self.tensorboard.train(step, mean_loss, lr, tok_s)
            self.restart_window()

    def show(self, loss: float, lr: float, tok_s: float, minutes: float) -> None:
        """Refresh the bar's postfix."""
        postfix = {"loss": f"{loss:.3f}", "lr": f"{lr:.2e}", "tok_s": f"{tok_s:.0f}"}
        if self.dev_bleu is not None:
            postfix["bleu"] = f"{self.dev_bleu:.2f}"
        left = self.coordinator.minutes_left(minutes)
        if left is not None:
            postfix["left"] = tqdm.format_interval(60 * left)
        self.bar.set_postfix(postfix)
        self.postfix = postfix

    def show_plain(self, step: int, minutes: float) -> None:
        """The bar's fields as one line, every PLAIN_EVERY updates or PLAIN_SECONDS."""
        due = self.plain_step is None or step - self.plain_step >= PLAIN_EVERY
        if not due and time.monotonic() - self.plain_time < PLAIN_SECONDS:
            return
        self.plain_step, self.plain_time = step, time.monotonic()
        end = self.coordinator.end_step(step, minutes)
        fields = "  ".join(f"{key} {value}" for key, value in self.postfix.items())
        log.info("step %d/%s  %s", step, "?" if end is None else end, fields)

    def validation(self, event: str, val: Validation, improved: bool, **extra) -> None:
        """Record a validation (event "validation") or that of the averaged model ("average"):
        its scores in metrics.jsonl, then its examples in examples.jsonl, one line each on
        stderr, and in TensorBoard."""
        record = {"event": event, **val.scores(), "best": improved, **extra}
        self.metrics.write(jsonl.dumps(record))
        self.metrics.flush()
        if val.examples and self.examples is not None:
            shown = [example.to_dict() for example in val.examples]
            record = {"event": event, "step": val.step, "minutes": val.minutes, "examples": shown}
            self.examples.write(jsonl.dumps(record, ensure_ascii=False))
            self.examples.flush()
        self.dev_bleu = val.dev_bleu
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
        for example in val.examples:
            ref = f"  (reference: {example.reference})" if example.reference else ""
            log.info("  %s → %s%s", example.source, example.translation, ref)
        if self.tensorboard:
            self.tensorboard.validation(event, val)

    def finished(self, step: int, finished: Finished, peak_lr: float) -> None:
        """Say why the run ended, and where its learning rate was then (last.pt records it)."""
        log.info(
            "finished at step %d: %s; learning rate %.2e (%.0f%% of its peak)",
            step,
            finished.reason,
            finished.lr,
            100 * finished.lr / peak_lr,
        )
