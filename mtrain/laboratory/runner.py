"""Running a lab: each run trained (or resumed, or left as it is), then measured and reported."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from mtrain.core import config
from mtrain.core.config import ConfigError
from mtrain.laboratory.plan import Lab, LabRun
from mtrain.laboratory.report import report
from mtrain.laboratory.results import LabRow
from mtrain.run.directory import LAST, finished_record

log = logging.getLogger("mtrain")

# Trains one run as `mtrain train --config CONFIG --set ... --out RUN_DIR` does: resumes a run
# directory that holds a checkpoint, and has nothing to do in a finished one.
TrainRun = Callable[[Path, list[str], Path], object]


def check_runs(lab: Lab) -> None:
    """Refuse a lab with a bad config or variant before anything is trained."""
    for run in lab.runs():
        try:
            config.load(lab.config, list(run.overrides), require_data=True)
        except ConfigError as e:
            raise ConfigError(f"lab run {run.name}: {e}") from None


def run_lab(lab: Lab, lab_dir: Path, train: TrainRun, device: str = "auto") -> list[LabRow]:
    """Train every run of `lab` into LAB_DIR/<variant>-seed<k> in turn, then write the report;
    return its table. Runs a stopped lab had finished are left as they are, the one it was
    training resumes."""
    check_runs(lab)
    runs = lab.runs()
    for number, run in enumerate(runs, 1):
        train_one(run, number, len(runs), lab, lab_dir, train)
    return report(lab, lab_dir, device, {})


def train_one(
    run: LabRun, number: int, total: int, lab: Lab, lab_dir: Path, train: TrainRun
) -> None:
    run_dir = lab_dir / run.name
    state = (
        "finished"
        if finished_record(run_dir / LAST)
        else ("resuming" if (run_dir / LAST).is_file() else "training")
    )
    what = " ".join(run.changes) or "the baseline"
    log.info("lab %d/%d: %s (%s; %s): %s", number, total, run.name, what, lab.budget, state)
    start = time.monotonic()
    train(lab.config, list(run.overrides), run_dir)
    log.info(
        "lab %d/%d: %s done in %.1f min", number, total, run.name, (time.monotonic() - start) / 60
    )
