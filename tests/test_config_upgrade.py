"""A run written by an older mtrain resumes as it began: its config.yaml and checkpoints of
every schema since the first run directory (tests/fixtures/old_runs) read with its values."""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from mtrain.cli import app, main
from mtrain.core import config, runtime
from mtrain.core.config import POLICIES
from mtrain.core.config_upgrade import VERSION, removed
from mtrain.core.distributed import Group
from mtrain.model.transformer import Dropout
from mtrain.run.directory import (
    check_state,
    load_checkpoint,
    run_config,
    save_checkpoint,
    write_config,
)
from mtrain.training import state as training_state
from mtrain.training import update_step
from mtrain.training.budget_recipe import Choice
from mtrain.training.build import build_trainer
from mtrain.training.start import check_resumable, resumed, run_training

from .fixtures.old_runs.reconstruct import COMMITS  # in the order mtrain wrote them
from .synthetic import REPO

FIXTURES = REPO / "tests" / "fixtures" / "old_runs"
# What an older run without a key had, the keys since gone and those whose meaning changed, as
# declared beside each key.
ADDED = {key: policy.added.value for key, policy in POLICIES.items() if policy.added}
REMOVED = removed()
REDEFINED = {key for key, policy in POLICIES.items() if policy.redefined}
# Those whose checkpoints hold the tokenizer's fingerprint and the batch stream's position:
# the earlier ones cannot be resumed (a resume refuses them in one line).
RESUMABLE = COMMITS[COMMITS.index("c8b9337") :]
CPU = torch.device("cpu")


def record(commit: str) -> dict:
    return yaml.safe_load((FIXTURES / commit / "config.yaml").read_text("utf-8"))


def header(commit: str) -> dict:
    return json.loads((FIXTURES / commit / "header.json").read_text("utf-8"))


def test_the_fixtures_are_every_schema():
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(COMMITS)
    keys = [{(s, k) for s, values in record(c).items() for k in values} for c in COMMITS]
    assert all(a != b for a, b in itertools.pairwise(keys))  # each one a schema of its own
    today = {(s, k) for s, values in config.Config().to_dict().items() for k in values}
    versioned = {("train", "compile"), ("train", "init_from"), ("model", "variant")}  # 2 and 3
    assert keys[-1] | versioned == today  # the last one without a version: today's less those
    assert set(ADDED) == today - keys[0]
    assert keys[0] - today == REMOVED
    assert set().union(*keys) - keys[-1] >= REDEFINED  # an older meaning, in some older record


@pytest.mark.parametrize("commit", COMMITS)
def test_an_old_record_reads_with_the_values_its_run_used(commit, tmp_path):
    old = record(commit)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old), "utf-8")
    cfg = run_config(tmp_path).to_dict()
    for section, values in old.items():
        for key, value in values.items():
            if (section, key) not in REMOVED:
                assert cfg[section][key] == value, (section, key)
    for (section, key), value in ADDED.items():
        if key not in old[section]:
            assert cfg[section][key] == value, (section, key)
    added = COMMITS.index
    if added(commit) < added("a2a5f5e"):
        assert run_config(tmp_path).tokenizer.tgt_size == old["tokenizer"]["vocab_size"]
        assert cfg["train"]["ema_decay"] == 0
    if added(commit) < added("6028b16"):
        assert cfg["train"]["short_run_updates"] == 0  # off
    if added(commit) < added("dc6eecf"):
        assert cfg["train"]["examples"] == [] and cfg["train"]["dev_examples"] == 0
    # The same file, written by a person today (no version), keeps today's defaults.
    if commit in ("416dbc9", "c8b9337"):
        # decode.batch_size: gone since; keep_last 1 under average_last 5
        with pytest.raises(config.ConfigError, match=r"unknown key|train\.average_last"):
            config.load(tmp_path / "config.yaml")
        return
    today = config.load(tmp_path / "config.yaml").to_dict()
    if added(commit) < added("a2a5f5e"):
        assert today["tokenizer"]["tgt_vocab_size"] == 4000
    if added(commit) < added("6028b16"):
        assert today["train"]["short_run_updates"] == 2800


def test_a_run_records_its_version_and_reads_it_back(tmp_path):
    cfg = config.load(REPO / "configs" / "tiny.yaml")
    write_config(tmp_path, cfg, {"planned_updates": 10, "dropout": 0.1})
    text = (tmp_path / "config.yaml").read_text("utf-8")
    assert text.startswith(f"version: {VERSION}\n")
    assert run_config(tmp_path) == cfg
    assert config.load(tmp_path / "config.yaml") == cfg  # a run's record is a config too
    newer = text.replace(f"version: {VERSION}", f"version: {VERSION + 1}")
    (tmp_path / "config.yaml").write_text(newer, "utf-8")
    with pytest.raises(config.ConfigError, match="written by a newer mtrain"):
        run_config(tmp_path)


def old_state(state: dict, commit: str) -> dict:
    """A checkpoint as the mtrain of `commit` wrote it: its entries only, today's values."""
    entries = header(commit)
    old = {key: state[key] for key in entries["states"] if key in state}
    old |= {key: copy.deepcopy(state.get(key, value)) for key, value in entries["fields"].items()}
    if "python_rng_state" in entries["states"]:  # before "rng" held every rank's generators
        rng = state["rng"][0]
        old |= {"python_rng_state": rng["python"], "torch_rng_state": rng["torch"]}
        old["cuda_rng_states"] = rng["cuda"]
    if "epoch_rng_state" in entries["states"]:
        old["epoch_rng_state"] = None
    if "chosen" in entries["fields"]:
        old["chosen"] = state["chosen"]
    return old


@pytest.mark.parametrize("commit", COMMITS)
def test_an_old_checkpoint_header_is_read(commit):
    rng = runtime.rng_state()
    state = {"model": {"w": torch.zeros(2)}, "optimizer": {}, "scheduler": {}, "scaler": {}}
    state |= {"rng": [rng], "config_version": 2, "chosen": None}
    old = old_state(state | header(commit)["fields"], commit)
    check_state(Path("last.pt"), old)
    upgraded = training_state.upgrade(old)
    assert upgraded["format"] == training_state.FORMAT and upgraded["step"] == 100
    if commit in RESUMABLE:
        assert torch.equal(upgraded["rng"][0]["torch"], rng["torch"])
    assert ("chosen" in upgraded) == (COMMITS.index(commit) >= COMMITS.index("6028b16"))


def adapted(commit: str, corpus: dict, **train) -> dict:
    """The fixture's record, for the synthetic corpus and a model that trains in seconds; its
    keys those of its schema."""
    old = record(commit)
    for key in ("train", "dev", "test", "prepared_dir"):
        if key in old["data"]:
            old["data"][key] = corpus[key]
    old["tokenizer"] |= {"vocab_size": 300, "character_coverage": 1.0}
    old["model"]["dropout"] = 0.2  # not train.short_run_dropout's 0.1: a change shows
    old["train"] |= {"batch_tokens": 256, "max_minutes": 0, "eval_every": 5, **train}
    for key in ("keep_last", "average_last"):
        if key in old["train"]:
            old["train"][key] = 1 if key == "keep_last" else 0
    return old


def make_old(run: Path, old: dict, commit: str) -> None:
    """Make the run in `run` look written by the mtrain of `commit`: its config.yaml, and the
    entries of its last.pt."""
    (run / "config.yaml").write_text(yaml.safe_dump(old, allow_unicode=True), "utf-8")
    save_checkpoint(run / "last.pt", old_state(load_checkpoint(run / "last.pt"), commit))


def resume_config(tmp_path: Path, run: Path, old: dict, **train) -> config.Config:
    """The config `mtrain train --config OLD --out RUN` resumes with: the old file, which
    names no version, and the run's own values for what it does not name."""
    path = tmp_path / "old.yaml"
    old = copy.deepcopy(old)
    old["train"] |= train
    path.write_text(yaml.safe_dump(old, allow_unicode=True), "utf-8")
    cfg = config.load(path, require_data=True, run=resumed(run))
    check_resumable(run, cfg)
    return cfg


@pytest.mark.parametrize("commit", RESUMABLE)
def test_an_old_run_resumes_with_its_tokenizer_corpus_and_dropout(commit, corpus, tmp_path):
    old = adapted(commit, corpus, max_steps=5)
    (tmp_path / "record.yaml").write_text(yaml.safe_dump(old), "utf-8")
    cfg = config.load_recorded(tmp_path / "record.yaml")  # what the run used
    run = tmp_path / "run"
    run.mkdir()
    build_trainer(cfg, run, CPU).run()
    written = load_checkpoint(run / "last.pt")
    make_old(run, old, commit)
    shown = CliRunner().invoke(app, ["info", str(run), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["config"] == cfg.to_dict()  # what the run really uses

    resumed_cfg = resume_config(tmp_path, run, old, max_steps=10)
    assert resumed_cfg.to_dict() == cfg.to_dict() | {
        "train": cfg.to_dict()["train"] | {"max_steps": 10}
    }
    trainer = build_trainer(resumed_cfg, run, CPU, resume=True)
    assert trainer.step == 5
    assert trainer.data.tokenizer.fingerprint() == written["tokenizer"]
    assert trainer.data.fingerprints == written["data"]
    rates = {m.p for m in trainer.model.modules() if isinstance(m, Dropout)}
    assert rates == {0.2}
    if "chosen" not in header(commit)["fields"]:
        assert trainer.choice == Choice.kept(0.2)


@pytest.mark.parametrize("commit", ["dc6eecf", "6c38272"])
def test_an_old_interrupted_run_ends_as_it_would_have(commit, corpus, tmp_path):
    """Killed at step 13 (last.pt: step 10), resumed by today's mtrain to step 30:
    the weights of the run made uninterrupted from its upgraded config. 6c38272 has no
    train.short_run_updates, whose default would choose dropout 0.1 on resume."""
    old = adapted(commit, corpus, max_steps=30, eval_every=10, lr_schedule="linear")
    (tmp_path / "record.yaml").write_text(yaml.safe_dump(old), "utf-8")
    cfg = config.load_recorded(tmp_path / "record.yaml")
    whole = tmp_path / "whole"
    whole.mkdir()
    build_trainer(cfg, whole, CPU).run()

    parts = tmp_path / "parts"
    parts.mkdir()
    first = build_trainer(cfg, parts, CPU)
    real_loss = update_step.loss_fn

    def killed_at_13(*args, **kwargs):
        if first.step == 13:
            raise KeyboardInterrupt  # killed: last.pt holds step 10, the last validation's
        return real_loss(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(update_step, "loss_fn", killed_at_13)
        first.run()
    make_old(parts, old, commit)
    run_training(resume_config(tmp_path, parts, old), parts, CPU, Group())

    a, b = load_checkpoint(whole / "last.pt"), load_checkpoint(parts / "last.pt")
    assert a["step"] == b["step"] == 30
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert b["chosen"] == {"planned_updates": None, "dropout": 0.2}
    recorded = yaml.safe_load((parts / "config.yaml").read_text("utf-8"))
    assert recorded["version"] == VERSION and recorded["tokenizer"]["tgt_vocab_size"] == 0


def old_run(tmp_path: Path, commit: str, state: dict) -> Path:
    """A run directory holding the config.yaml the mtrain of `commit` wrote for its
    configs/tiny.yaml, and a last.pt holding `state`."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((FIXTURES / commit / "config.yaml").read_text("utf-8"))
    save_checkpoint(run / "last.pt", state)
    return run


def test_an_old_run_resumes_with_todays_shipped_config(tmp_path):
    """The record the last mtrain before versions (116cbc2) wrote for configs/tiny.yaml, and
    the same command typed again with today's shipped config: train.compile (absent then, auto
    now) changes how updates are computed, not what is trained."""
    run = old_run(tmp_path, "116cbc2", {"model": {}, "step": 3})  # no corpus hashes: by path
    path = REPO / "configs" / "tiny.yaml"
    cfg = config.load(path, require_data=True, run=resumed(run))
    check_resumable(run, cfg)
    assert cfg.train.compile == "auto" and cfg.train.init_from == ""
    with pytest.raises(config.ConfigError, match=r"trained with train\.lr=[\d.]+, not 0\.5"):
        check_resumable(run, config.load(path, ["train.lr=0.5"], run=resumed(run)))


def test_a_record_that_lost_its_version_line_is_read_with_its_checkpoints(tmp_path):
    cfg = config.load(REPO / "configs" / "tiny.yaml", ["train.compile=true"])
    write_config(tmp_path, cfg)
    text = (tmp_path / "config.yaml").read_text("utf-8")
    (tmp_path / "config.yaml").write_text(text.replace(f"version: {VERSION}\n", ""), "utf-8")
    with pytest.raises(
        config.ConfigError, match=r"names no version but holds [^:]*train\.init_from"
    ):
        run_config(tmp_path)  # no checkpoint says which: said plainly, not read as version 1
    save_checkpoint(tmp_path / "last.pt", {"model": {}, "step": 3, "config_version": VERSION})
    assert run_config(tmp_path) == cfg  # train.compile: true, not version 1's compile


@pytest.mark.parametrize(("device", "precision"), [("cuda", "auto"), ("cpu", "fp32")])
def test_an_old_run_keeps_the_precision_it_trained_in(device, precision, tmp_path, monkeypatch):
    """Before ff2b51d mtrain autocast on CUDA (bf16, or fp16 with a loss scaler) and computed
    in fp32 on the CPU; the device is the one its checkpoint's tensors were saved from."""
    with monkeypatch.context() as patch:  # a checkpoint saved from the GPU, on any machine
        patch.setattr(torch.serialization, "location_tag", lambda storage: f"{device}:0")
        run = old_run(tmp_path, "c8b9337", {"model": {"w": torch.zeros(2)}, "step": 3})
    assert run_config(run).train.precision == precision
    assert record("c8b9337")["train"].get("precision") is None


def test_a_start_that_does_nothing_rewrites_no_file_and_an_upgrade_is_said(
    corpus, tmp_path, caplog
):
    """An old run that finished, started again with its limits: its config.yaml stays as the
    older mtrain wrote it (which can still read it). Resumed with a raised limit, it is
    upgraded, and stderr and `info` say from which version; info's steps are last.pt's."""
    old = adapted("116cbc2", corpus, max_steps=5)
    (tmp_path / "record.yaml").write_text(yaml.safe_dump(old), "utf-8")
    run = tmp_path / "run"
    run.mkdir()
    build_trainer(config.load_recorded(tmp_path / "record.yaml"), run, CPU).run()
    make_old(run, old, "116cbc2")
    written = (run / "config.yaml").read_bytes()

    run_training(resume_config(tmp_path, run, old), run, CPU, Group())
    assert (run / "config.yaml").read_bytes() == written  # finished: nothing to do

    with caplog.at_level("WARNING"):
        run_training(resume_config(tmp_path, run, old, max_steps=6), run, CPU, Group())
    said = [r.getMessage() for r in caplog.records if "upgraded" in r.getMessage()]
    assert len(said) == 1 and f"from config version 1 to {VERSION}" in said[0], said
    recorded = yaml.safe_load((run / "config.yaml").read_text("utf-8"))
    assert recorded["version"] == VERSION and recorded["upgraded_from"] == 1

    for log in ("train.jsonl", "metrics.jsonl"):
        (run / log).unlink()
    shown = CliRunner().invoke(app, ["info", str(run)])
    assert shown.exit_code == 0, shown.output
    assert "config upgraded from version 1 by a resume" in shown.output
    assert "training: 6 steps" in shown.output  # last.pt's step, not the logs'
    info = json.loads(CliRunner().invoke(app, ["info", str(run), "--json"]).output)
    assert info["schema"]["upgraded_from"] == 1 and info["training"]["steps"] == 6


RELEASES = REPO / "tests" / "fixtures" / "old_releases"


@pytest.mark.parametrize("variant", ["no-positions", "peek"])
def test_a_record_holding_a_key_its_version_lacks_is_refused(
    variant, tmp_path, capsys, monkeypatch
):
    """A version-2 config.yaml naming model.variant (version 3) is not read at face value: the
    run the old release trained with positions resumes neither as another variant nor with a
    false refusal ("trained with peek"), and its record is not rewritten as version 3."""
    made = json.loads((RELEASES / "0770be8" / "made.json").read_text("utf-8"))
    place = tmp_path / "0770be8"
    shutil.copytree(RELEASES / "0770be8", place, ignore=shutil.ignore_patterns("finished"))
    path = place / "run" / "config.yaml"
    text = path.read_text("utf-8").replace(made["root"], str(place))
    text = text.replace("model:\n", f"model:\n  variant: {variant}\n")
    path.write_text("version: 2\n" + text, "utf-8")
    with pytest.raises(SystemExit) as exit_:
        monkeypatch.chdir(place)  # the command that began the run, typed again
        main(["train", "--config", str(REPO / "configs/tiny.yaml"), *made["command"][4:]])
    err = capsys.readouterr().err
    assert exit_.value.code != 0 and err.count("\n") == 1, err
    assert "run/config.yaml: model.variant came in config version 3" in err, err
    assert "record is of version 2" in err, err
    assert path.read_text("utf-8") == "version: 2\n" + text  # not rewritten


def test_a_config_file_naming_an_older_version_holds_only_its_keys(tmp_path):
    """A config file that names version 2 is a record of version 2: model.variant (3) refused."""
    cfg = config.load(REPO / "configs" / "tiny.yaml")
    record = {**cfg.to_dict(), "version": 2}
    del record["model"]["variant"]
    (tmp_path / "v2.yaml").write_text(yaml.safe_dump(record), "utf-8")
    assert config.load(tmp_path / "v2.yaml") == cfg  # without it, read and upgraded
    record["model"]["variant"] = "no-positions"
    (tmp_path / "v2.yaml").write_text(yaml.safe_dump(record), "utf-8")
    with pytest.raises(config.ConfigError, match=r"v2\.yaml: model\.variant came in config "):
        config.load(tmp_path / "v2.yaml")
    record["version"] = 1  # and a key of version 2 in a record of version 1
    record["model"].pop("variant")
    record["train"]["init_from"] = "runs/parent"
    (tmp_path / "v2.yaml").write_text(yaml.safe_dump(record), "utf-8")
    with pytest.raises(config.ConfigError, match=r"train\.init_from came in config version 2"):
        config.load(tmp_path / "v2.yaml")
