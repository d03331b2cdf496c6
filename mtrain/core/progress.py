"""Progress, the one owner of how it shows: tqdm's notebook widget under Jupyter (where
ipywidgets is installed), its bar on a terminal, and plain lines everywhere else (a log file,
a pipe, Jupyter without ipywidgets), never carriage-return frames.

Every bar of mtrain comes from `bar`; the lines training logs (progress, validations, the end
of the run) reach stderr through `lines_to_stderr` where the caller configured no logging.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from tqdm.std import TqdmWarning

with warnings.catch_warnings():
    warnings.simplefilter("ignore", TqdmWarning)  # Jupyter without ipywidgets: plain lines
    from tqdm.auto import tqdm

__all__ = ["PLAIN_SECONDS", "bar", "draws_bars", "is_widget", "lines_to_stderr", "tqdm"]

# Off a terminal a bar writes a line when it starts, when it ends, and at most this often.
PLAIN_SECONDS = 60.0


def is_widget() -> bool:
    """Whether the bar is Jupyter's widget (drawn in place, never as lines on stderr)."""
    from tqdm import notebook

    return issubclass(tqdm, notebook.tqdm)


def draws_bars() -> bool:
    """Whether progress is drawn in place (a terminal, Jupyter's widget), not written as lines."""
    return is_widget() or sys.stderr.isatty()


class PlainLines:
    """A file for tqdm that turns its carriage-return frames into lines on stderr: each frame
    it draws a line, the blank frames that clear a bar and a repeated frame none."""

    def __init__(self) -> None:
        self.last = ""

    def write(self, text: str) -> None:
        for frame in text.replace("\r", "\n").split("\n"):
            frame = frame.rstrip()
            if frame and frame != self.last:
                sys.stderr.write(frame + "\n")
                self.last = frame

    def flush(self) -> None:
        sys.stderr.flush()


def bar(**options: Any) -> tqdm:
    """A progress bar on stderr (tqdm's options): drawn in place on a terminal or in Jupyter,
    else a plain line at its start, at its end and every PLAIN_SECONDS."""
    if options.get("disable") or draws_bars():
        return tqdm(**options)
    options.update(file=PlainLines(), mininterval=PLAIN_SECONDS, leave=True, dynamic_ncols=False)
    from tqdm.std import tqdm as text_bar  # the widget's class draws nothing in a file

    return text_bar(**options)


class StderrHandler(logging.Handler):
    """Writes each record's message to the stderr of the moment (a notebook cell's), between
    the frames of a bar drawn there."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def lines_to_stderr(name: str = "mtrain") -> Iterator[None]:
    """While it is open, logger `name`'s information lines go to stderr, where the caller
    configured no logging that would take them (the command line does; a script or a notebook
    usually does not). A caller's own configuration is left as it is, and decides."""
    logger = logging.getLogger(name)
    if logger.hasHandlers():
        yield
        return
    handler, level, propagate = StderrHandler(logging.INFO), logger.level, logger.propagate
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # Not to the root too: tqdm's logging_redirect_tqdm, which training enters, gives the
    # root a handler of its own, and each line would show twice.
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
