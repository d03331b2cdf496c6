"""A run planned short of train.short_run_updates trains with train.short_run_dropout, chosen
once when its end is first planned, kept by resumes and recorded in its config.yaml."""

from __future__ import annotations

import contextlib

import pytest
import torch
import yaml
from typer.testing import CliRunner

from mtrain.cli import app
from mtrain.core import config
from mtrain.model.transformer import Dropout
from mtrain.run.directory import load_checkpoint, save_checkpoint
from mtrain.training import update_step
from mtrain.training.budget_recipe import Choice
from mtrain.training.build import build_trainer

from .synthetic import small_config

CPU = torch.device("cpu")


class Enough(Exception):
    """Ends a test's run early."""


def rates(model: torch.nn.Module) -> set[float]:
    return {m.p for m in model.modules() if isinstance(m, Dropout)}


def test_the_choice_follows_the_planned_updates():
    cfg = config.Config()
    cfg.model.dropout, cfg.train.short_run_updates, cfg.train.short_run_dropout = 0.2, 2800, 0.1
    assert Choice.of(cfg, 2662).dropout == 0.1
    assert Choice.of(cfg, 2799).dropout == 0.1
    assert Choice.of(cfg, 2800).dropout == 0.2
    assert Choice.of(cfg, 4700).dropout == 0.2
    assert "instead of 0.2 (model.dropout)" in Choice.of(cfg, 2662).describe(cfg)


@pytest.mark.parametrize("max_steps, expected", [(6, 0.05), (150, 0.1)])
def test_a_run_of_max_steps_chooses_at_start_and_records_it(
    corpus, tmp_path, max_steps, expected, caplog
):
    cfg = small_config(
        corpus,
        max_steps=max_steps,
        eval_every=3,
        short_run_updates=100,
        lr_schedule="linear",
        short_run_dropout=0.05,
    )
    assert cfg.model.dropout == 0.1  # configs/tiny.yaml's
    seen = []
    trainer = build_trainer(cfg, tmp_path, CPU)
    real_loss = update_step.loss_fn

    def loss(*args, **kwargs):
        seen.append(rates(trainer.model))
        if len(seen) == 6 and max_steps > 6:
            raise Enough  # six updates tell enough of a long run
        return real_loss(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, caplog.at_level("INFO"):
        patch.setattr(update_step, "loss_fn", loss)
        with pytest.raises(Enough) if max_steps > 6 else contextlib.nullcontext():
            trainer.run()
    assert seen and all(s == {expected} for s in seen)
    assert trainer.choice == Choice(max_steps, expected)
    record = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert record["chosen"] == {"planned_updates": max_steps, "dropout": expected}
    assert f"planned {max_steps} updates" in caplog.text
    # A run's config.yaml is still a config: a new run makes its own choice.
    assert config.load(tmp_path / "config.yaml").model.dropout == 0.1
    if max_steps == 6:
        assert load_checkpoint(tmp_path / "last.pt")["chosen"] == record["chosen"]


def test_under_a_time_budget_the_choice_waits_for_the_first_plan(corpus, tmp_path):
    # Warmup ends at update 4, where the speed plans the end: max_steps (8), short of 100.
    cfg = small_config(
        corpus,
        max_steps=8,
        max_minutes=60,
        warmup_steps=4,
        eval_every=4,
        short_run_updates=100,
        lr_schedule="linear",
        short_run_dropout=0.05,
    )
    seconds = [0.0]

    def clock() -> float:
        seconds[0] += 1.0
        return seconds[0]

    trainer = build_trainer(cfg, tmp_path, CPU, clock=clock)
    seen = []
    real_loss = update_step.loss_fn

    def loss(*args, **kwargs):
        seen.append((trainer.step + 1, rates(trainer.model), trainer.choice))
        return real_loss(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(update_step, "loss_fn", loss)
        trainer.run()
    assert [(update, r) for update, r, _ in seen[:4]] == [(u, {0.1}) for u in range(1, 5)]
    assert all(choice is None for _, _, choice in seen[:4])
    assert [r for _, r, _ in seen[4:]] == [{0.05}] * 4
    assert trainer.choice == Choice(8, 0.05)


def test_a_resumed_run_trains_on_with_its_choice(corpus, tmp_path):
    first = small_config(
        corpus, max_steps=6, eval_every=3, short_run_updates=100, lr_schedule="linear"
    )
    first.train.short_run_dropout = 0.05
    build_trainer(first, tmp_path, CPU).run()
    # Resumed under a config whose plan would choose otherwise, it keeps the run's choice.
    again = small_config(
        corpus, max_steps=6, eval_every=3, short_run_updates=0, lr_schedule="linear"
    )
    resumed = build_trainer(again, tmp_path, CPU, resume=True)
    assert resumed.choice == Choice(6, 0.05)
    assert rates(resumed.model) == {0.05}


def test_a_run_begun_before_runs_chose_keeps_its_dropout(corpus, tmp_path):
    """Its checkpoints hold no choice: resumed under a config whose plan would choose, it does
    not, on this resume or the next, and trains on as it would have uninterrupted."""
    began = small_config(
        corpus, max_steps=6, eval_every=3, short_run_updates=0, lr_schedule="linear"
    )
    first = build_trainer(began, tmp_path, CPU)
    real_loss = update_step.loss_fn

    def stop_at_4(*args, **kwargs):
        if first.step == 3:
            raise Enough  # killed after the checkpoint of step 3
        return real_loss(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Enough):
        patch.setattr(update_step, "loss_fn", stop_at_4)
        first.run()
    state = load_checkpoint(tmp_path / "last.pt")
    del state["chosen"], state["config_version"]  # as mtrain wrote it before runs chose
    save_checkpoint(tmp_path / "last.pt", state)
    planning = small_config(
        corpus,
        max_steps=6,
        eval_every=3,
        short_run_updates=100,
        short_run_dropout=0.05,
        lr_schedule="linear",
    )
    resumed = build_trainer(planning, tmp_path, CPU, resume=True)
    seen = []

    def loss(*args, **kwargs):
        seen.append(rates(resumed.model))
        return real_loss(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(update_step, "loss_fn", loss)
        resumed.run()
    assert seen == [{0.1}] * 3  # model.dropout, configs/tiny.yaml's
    assert resumed.choice == Choice.kept(0.1)
    kept = {"planned_updates": None, "dropout": 0.1}
    assert load_checkpoint(tmp_path / "last.pt")["chosen"] == kept
    assert Choice.from_dict(kept) == resumed.choice  # and the next resume keeps it too


def test_info_shows_the_choice(corpus, tmp_path):
    build_trainer(
        small_config(
            corpus,
            max_steps=4,
            eval_every=2,
            short_run_updates=100,
            lr_schedule="linear",
            short_run_dropout=0.05,
        ),
        tmp_path,
        CPU,
    ).run()
    shown = CliRunner().invoke(app, ["info", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    assert "chosen from its plan of 4 updates: dropout 0.05" in shown.output


@pytest.mark.parametrize(
    "setting, message",
    [
        ("train.short_run_dropout=1", r"train\.short_run_dropout: must be in \[0, 1\)"),
        ("train.short_run_updates=-1", r"train\.short_run_updates: must not be negative"),
    ],
)
def test_bad_budget_recipe_values_are_refused(tmp_path, setting, message):
    path = tmp_path / "c.yaml"
    path.write_text("{}\n")
    with pytest.raises(config.ConfigError, match=message):
        config.load(path, [setting])
