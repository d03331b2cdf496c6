"""Running a lab: each run trained (or resumed, or left as it is), then measured and reported."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from mtrain.core import config
from mtrain.core.config import ConfigError
from mtrain.decoding.loaded import open_run
from mtrain.figures.attention import Attention
from mtrain.laboratory.plan import Lab, LabRun
from mtrain.laboratory.report import Report, draw_figures, write_html, write_markdown
from mtrain.laboratory.results import LabRow, measure
from mtrain.run.directory import BEST, LAST, finished_record

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
    return report(lab, lab_dir, device)


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


def report(lab: Lab, lab_dir: Path, device: str = "auto") -> list[LabRow]:
    """Measure the lab's trained runs and write its report; return the table's rows."""
    rows, found = measure(lab.runs(), lab_dir, lab.probes, device)
    if not rows:
        return rows
    first = rows[0].seed
    attention = {
        r.variant: cross_attention(r, lab.probes[0], device) for r in rows if r.seed == first
    }
    title = f"Lab: {lab.config} and {len(lab.variants)} variants, {lab.budget} each"
    figures = draw_figures(rows, lab_dir, attention)
    result = Report(rows, found, lab.probes, title, figures)
    log.info("report: %s, %s", write_markdown(result, lab_dir), write_html(result, lab_dir))
    return rows


def cross_attention(row: LabRow, probe: str, device: str):
    """The figure of a run's cross-attention for `probe`, titled with its variant."""
    translator = open_run(row.run_dir, device, BEST, beam=1).translator
    attention = Attention.of_translation(translator, probe)
    attention.title = f"{row.variant}: {attention.title}"
    return attention.figure("cross")
