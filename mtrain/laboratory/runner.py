"""Running a lab: every run checked and its corpus prepared before anything trains, the
recipe chosen once for all, each run trained (or resumed, or left as it is), then measured and
reported; a run that diverges is recorded and the lab goes on."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from mtrain.core import runtime
from mtrain.core.config import Config
from mtrain.core.errors import MtrainError, OptionError
from mtrain.core.files import LOCK_FILE
from mtrain.data.prepare import prepare, prepared_dir
from mtrain.data.tokenizer import Tokenizer
from mtrain.laboratory.plan import RUN_NAME, Lab, LabRun
from mtrain.laboratory.record import LAB_FILE, recorded
from mtrain.laboratory.report import report
from mtrain.laboratory.results import LabRow
from mtrain.run.directory import (
    CONFIG_FILE,
    LAST,
    finished_record,
)
from mtrain.training.budget_recipe import Choice
from mtrain.training.speed import timed_updates_per_second
from mtrain.training.start import check_start, train_run
from mtrain.training.update_step import NonFiniteLoss

log = logging.getLogger("mtrain")


def checked(lab: Lab, lab_dir: Path) -> dict[str, tuple[Config, Tokenizer | None]]:
    """Every run of the lab checked as its training will check it, before anything is prepared
    or trained: a bad key, a missing corpus, a parent it cannot be built on."""
    configs = {}
    for run in lab.runs():
        try:
            configs[run.name] = check_start(lab.config, list(run.overrides), lab_dir / run.name)
        except MtrainError as e:
            e.args = (f"lab run {run.name}: {e}",)  # one line, whichever error it is
            raise e from None
    return configs


def check_lab_dir(lab_dir: Path) -> None:
    """Refuse a lab directory that is a run's, or a folder of other files (an empty one, or one
    that holds a lab's runs and no lab.json, is fine)."""
    if lab_dir.is_symlink() and not lab_dir.exists():
        raise OptionError(f"--out {lab_dir}: a symbolic link to {lab_dir.readlink()}, not there")
    if lab_dir.exists() and not lab_dir.is_dir():
        raise OptionError(f"--out {lab_dir}: exists and is not a directory")
    if not lab_dir.is_dir() or (lab_dir / LAB_FILE).is_file():
        return
    if (lab_dir / CONFIG_FILE).is_file() or (lab_dir / LOCK_FILE).is_file():
        raise OptionError(f"--out {lab_dir}: a run's directory, not a lab's; use another --out")
    entries = list(lab_dir.iterdir())
    older = any(RUN_NAME.fullmatch(e.name) and (e / CONFIG_FILE).is_file() for e in entries)
    if entries and not older:
        raise OptionError(f"--out {lab_dir}: holds other files and no lab; use a new or empty one")


def run_lab(
    lab: Lab, lab_dir: Path, device: str = "auto", train: Callable[..., object] = train_run
) -> list[LabRow]:
    """Train every run of `lab` into LAB_DIR/<variant>-seed<k> in turn, as `mtrain train` does
    (`train`: another function of its arguments, for tests), then write the report; return its
    table. Runs a stopped lab had finished are left as they are, the one it was training
    resumes; one that diverged is not trained again."""
    check_lab_dir(lab_dir)
    record, lab = recorded(lab, lab_dir)  # every seed and variant the lab holds, its recipe
    configs = checked(lab, lab_dir)
    diverged = {n: r["diverged"] for n, r in record.runs.items() if "diverged" in r}
    runs = lab.runs()
    to_train = [r for r in runs if r.name not in diverged and not finished(lab_dir / r.name)]
    prepare_corpora([configs[r.name] for r in to_train])
    speed = lab_speed(configs[runs[0].name][0], device) if to_train else None
    if not lab.recipe and speed is not None:
        lab = dataclasses.replace(lab, recipe=recipe(lab, configs[runs[0].name][0], speed))
        record.recipe = list(lab.recipe)
        checked(lab, lab_dir)  # a run begun without this recipe may refuse it
    runs = lab.runs()  # with the recipe
    record.write(lab_dir)
    log.info("%s", estimate(lab, len(runs), len(to_train), speed))
    for number, run in enumerate(runs, 1):
        if run.name in diverged:
            log.info(
                "run %d of %d: %s %s before: not trained again",
                number,
                len(runs),
                run.name,
                diverged[run.name],
            )
            continue
        try:
            train_one(run, number, len(runs), lab, lab_dir, device, train)
        except NonFiniteLoss as e:
            diverged[run.name] = f"diverged at step {e.step}: loss not finite"
            log.warning("run %d of %d: %s %s", number, len(runs), run.name, diverged[run.name])
            record.runs[run.name] = {"diverged": diverged[run.name]}
            record.write(lab_dir)
    names = {r.name for r in runs}
    data = configs[runs[0].name][0].data  # the baseline's corpora as checked at this start
    return report(lab, lab_dir, device, {n: d for n, d in diverged.items() if n in names}, data)


def finished(run_dir: Path) -> bool:
    return finished_record(run_dir / LAST) is not None


def prepare_corpora(configs: list[tuple[Config, Tokenizer | None]]) -> None:
    """Prepare the runs' corpora (train their tokenizers) now, before the first run's clock
    starts: otherwise the first run of each corpus pays the time, which a time budget counts."""
    seen = set()
    for cfg, tokenizer in configs:
        where = prepared_dir(cfg, tokenizer)
        if where not in seen:
            seen.add(where)
            prepare(cfg, tokenizer=tokenizer)


def lab_speed(cfg: Config, device: str) -> float:
    """Updates a second here, timed on a few updates of the baseline: a resumed lab's too, as
    its earlier runs may have shared the machine."""
    return timed_updates_per_second(cfg, runtime.pick_device(device))


def recipe(lab: Lab, cfg: Config, speed: float) -> tuple[str, ...]:
    """What the budget recipe chooses, once for every run of the lab: the baseline config's
    rule at the budget's updates (at equal time, the updates the measured speed reaches)."""
    dropout = cfg.model.dropout
    if cfg.train.short_run_updates:
        if lab.budget.updates is not None:
            planned = lab.budget.updates
        else:
            planned = min(cfg.train.max_steps, math.floor(speed * 60 * lab.budget.minutes))
        dropout = Choice.of(cfg, planned).dropout
    return (f"model.dropout={dropout!r}", "train.short_run_updates=0")


def estimate(lab: Lab, total: int, left: int, rate: float | None) -> str:
    """The lab's plan in one line, and when it ends at the speed measured."""
    budget = lab.budget
    head = f"lab: {total} runs of {budget}"
    if rate is None or not left:
        return f"{head}; all trained"
    per_run = budget.updates / rate if budget.updates is not None else 60 * budget.minutes
    seconds = left * per_run
    ends = datetime.now() + timedelta(seconds=seconds)
    todo = f" ({left} to train)" if left < total else ""
    return (
        f"{head}{todo}; about {seconds / 60:.0f} min at {rate:.1f} updates/s measured here; "
        f"ends about {ends:%H:%M}"
    )


def train_one(
    run: LabRun,
    number: int,
    total: int,
    lab: Lab,
    lab_dir: Path,
    device: str,
    train: Callable[..., object],
) -> None:
    run_dir = lab_dir / run.name
    state = (
        "finished"
        if finished(run_dir)
        else ("resuming" if (run_dir / LAST).is_file() else "training")
    )
    what = " ".join(run.changes) or "the baseline"
    log.info("run %d of %d: %s (%s; %s): %s", number, total, run.name, what, lab.budget, state)
    start = time.monotonic()
    train(lab.config, list(run.overrides), run_dir, device)
    minutes = (time.monotonic() - start) / 60
    log.info("run %d of %d: %s done in %.1f min", number, total, run.name, minutes)
