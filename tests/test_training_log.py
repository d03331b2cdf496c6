"""The progress bar: headed for the step the run is planned to end at, with the time left."""

from __future__ import annotations

import io
import json
import logging

import torch
from tqdm import tqdm

from mtrain.core.config import TrainConfig
from mtrain.core.distributed import Group
from mtrain.data.pairs import Batch
from mtrain.training.coordinator import Coordinator
from mtrain.training.data import Update
from mtrain.training.optim import build_optimizer
from mtrain.training.run_log import LOG_EVERY, RunLog, TrainLog
from mtrain.training.validation import Validation


def coordinator_of(cfg: TrainConfig) -> Coordinator:
    _, schedule = build_optimizer(torch.nn.Linear(2, 2), cfg)
    return Coordinator(cfg, Group(), step=0, minutes=0.0, schedule=schedule)


def test_without_a_budget_the_run_is_headed_for_max_steps():
    coordinator = coordinator_of(TrainConfig(max_steps=300, max_minutes=0))
    assert coordinator.end_step(0, 0.0) == 300
    assert coordinator.minutes_left(5.0) is None


def test_under_a_budget_the_end_is_the_plan_and_follows_it_when_it_changes():
    cfg = TrainConfig(warmup_steps=4, max_steps=1000, max_minutes=10, eval_every=2)
    coordinator = coordinator_of(cfg)
    assert coordinator.end_step(0, 0.0) is None  # no speed measured yet
    coordinator.plan(step=4, minutes=2.0)  # 2 steps a minute, 8 minutes left
    assert coordinator.end_step(4, 2.0) == 20 == coordinator.schedule.total
    coordinator.plan(step=8, minutes=6.0)  # slower: 1 step a minute, 4 minutes left
    assert coordinator.end_step(8, 6.0) == 12
    assert coordinator.minutes_left(6.0) == 4.0


def test_under_a_budget_without_a_plan_the_end_is_where_the_speed_gets_by_the_budget():
    cfg = TrainConfig(lr_schedule="inverse_sqrt", max_steps=1000, max_minutes=10)
    coordinator = coordinator_of(cfg)
    assert coordinator.end_step(30, 3.0) == 30 + 70  # 10 steps a minute, 7 minutes left
    assert coordinator.end_step(990, 3.0) == 1000  # never past max_steps


def update_of(tokens: int) -> Update:
    src = torch.ones(1, tokens // 2, dtype=torch.long)
    batch = Batch(src, src, src)
    return Update([batch], n_target=tokens // 2, n_tokens=tokens)


def test_the_bar_shows_the_end_the_time_left_and_the_last_dev_bleu():
    cfg = TrainConfig(warmup_steps=4, max_steps=1000, max_minutes=10, eval_every=2)
    coordinator = coordinator_of(cfg)
    coordinator.plan(step=4, minutes=2.0)
    bar = tqdm(total=None, file=io.StringIO())
    logs = RunLog(bar, io.StringIO(), TrainLog(None), coordinator)
    logs.validation("validation", Validation(4, 2.0, 3.0, 12.345, 30.0), improved=True)
    for step in range(1, LOG_EVERY + 1):
        logs.update(update_of(100), 2.5, step, 2.0 + step / 100, 1e-3)
    assert bar.total == 20
    assert bar.postfix.startswith("loss=2.500, lr=1.00e-03, tok_s=")
    assert bar.postfix.endswith(", bleu=12.35, left=07:54")


def test_the_progress_line_shows_the_mean_loss_train_jsonl_records(caplog):
    """One update's loss jumps with its batch's shape: the bar and the plain line show the
    mean since the last record, train.jsonl's number, not the last update's."""
    coordinator = coordinator_of(TrainConfig(max_steps=1000, max_minutes=0))
    bar, train_jsonl = tqdm(total=None, file=io.StringIO()), io.StringIO()
    logs = RunLog(bar, io.StringIO(), TrainLog(train_jsonl), coordinator)
    logs.plain = True  # a plain line at the first record
    with caplog.at_level(logging.INFO, logger="mtrain.training.run_log"):
        for step in range(1, LOG_EVERY + 1):
            # Losses 2, 3, 1, 2, ... of batches that grow: the last one's is 2, the mean 1.945.
            logs.update(update_of(20 * step), float(step % 3 + 1), step, step / 100, 1e-3)
    record = json.loads(train_jsonl.getvalue())
    assert f"{record['loss']:.3f}" == "1.945"
    assert bar.postfix.startswith("loss=1.945, ")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert line.startswith(f"step {LOG_EVERY}/1000  loss 1.945  lr 1.00e-03  tok_s ")


def test_the_bar_is_never_behind_its_step_when_the_speed_drops():
    cfg = TrainConfig(lr_schedule="inverse_sqrt", max_steps=1000, max_minutes=10)
    coordinator = coordinator_of(cfg)
    bar = tqdm(total=None, file=io.StringIO())
    logs = RunLog(bar, io.StringIO(), TrainLog(None), coordinator)
    for step in range(1, 3 * LOG_EVERY):
        minutes = step if step < 5 else 5 + (step - 5) * 2  # half as fast after step 5
        logs.update(update_of(100), 2.5, step, minutes, 1e-3)
        assert bar.n == step and bar.total >= step
