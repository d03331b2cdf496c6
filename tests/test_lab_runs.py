"""How a lab trains its runs: refused plans, every run checked and the corpus prepared before
anything trains, one recipe for all, lab.json, a diverging run recorded and passed over, a stop
signal that stops the lab, the budget honoured, a lab interrupted mid-run and resumed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import mtrain
from mtrain.core import config
from mtrain.core.errors import MtrainError, OptionError
from mtrain.laboratory import plan, runner
from mtrain.laboratory.plan import (
    FULL,
    LAB_VARIANTS,
    PAPER,
    PROBES,
    QUICK,
    TEXTBOOK,
    Budget,
    Lab,
    make_lab,
    parse_variant,
)
from mtrain.laboratory.record import LAB_FILE, LabRecord, jsonable
from mtrain.run.directory import LAST, finished_record, load_checkpoint, peek_checkpoint
from mtrain.training.build import build_trainer
from mtrain.training.trainer import Interrupted

from .console import mtrain as mtrain_command
from .synthetic import REPO, resampled, small_config
from .test_train import CPU, scripted

TINY = REPO / "configs" / "tiny.yaml"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def sets(corpus: dict[str, str], **more) -> dict[str, object]:
    """The lab's common overrides: the tiny config on the synthetic corpus."""
    keys = {f"data.{k}": v for k, v in corpus.items()}
    keys.update({"tokenizer.vocab_size": 300, "tokenizer.character_coverage": 1.0})
    keys.update({"train.eval_every": 10, "train.batch_tokens": 256})
    return {**keys, **more}


def as_options(overrides: dict[str, object]) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


@pytest.mark.parametrize(
    "budget",
    [dict(updates=0), dict(minutes=0), dict(minutes=-1.0), dict(updates=-3), dict(updates=True)],
)
def test_a_budget_of_nothing_is_refused_in_one_line(budget) -> None:
    with pytest.raises(OptionError) as refused:
        Budget(**budget)
    assert len(str(refused.value).splitlines()) == 1


def test_a_budget_says_what_it_is() -> None:
    assert str(Budget(updates=550)) == "550 updates"
    assert str(Budget(minutes=0.05)) == "0.05 minutes"
    assert Budget(minutes=0.05).overrides() == ("train.max_minutes=0.05",)


def test_a_baseline_only_lab_is_one_run_a_seed() -> None:
    lab = make_lab(TINY, [], updates=30, seeds=(1, 2))
    assert lab.variants == ()
    assert [r.name for r in lab.runs()] == ["baseline-seed1", "baseline-seed2"]


@pytest.mark.parametrize(
    "variant, says",
    [
        ("long: train.max_steps=5000", "variant 'long': sets train.max_steps"),
        ("slow: train.max_minutes=60", "variant 'slow': sets train.max_minutes"),
        ("lucky: train.seed=7", "variant 'lucky': sets train.seed"),
        ("easy: data.test=/other.tsv", "variant 'easy': sets data.test, which every run"),
        ("bpe: tokenizer.model_type=bpe", "variant 'bpe': sets tokenizer.model_type, which"),
        ("en-de: data.tgt_lang=de", "variant 'en-de': sets data.tgt_lang, which every run"),
        ("one-head: model.n_heads=2", "'one-head' is a named variant's name"),
        ("baseline: model.n_heads=2", "and not 'baseline'"),
    ],
)
def test_a_variant_may_not_change_the_budget_the_seed_or_take_a_name(variant, says) -> None:
    with pytest.raises(OptionError, match=re.escape(says)):
        parse_variant(variant)


def test_a_variant_may_draw_its_batches_otherwise() -> None:
    sampled = parse_variant("sampled: data.src_sampling_alpha=0.1 data.drop_final_punct=0.5")
    assert sampled.overrides == ("data.src_sampling_alpha=0.1", "data.drop_final_punct=0.5")


def test_common_overrides_may_not_change_the_budget_or_the_seed() -> None:
    with pytest.raises(OptionError, match=r"--set: sets train\.seed"):
        make_lab(TINY, [], updates=30, overrides=("train.seed=3",))
    with pytest.raises(OptionError, match=r"--set: sets train\.max_steps"):
        make_lab(TINY, [], updates=30, overrides=(("train.max_steps", 9),))
    # at equal time the config's max_steps caps each run, and may be raised for all
    make_lab(TINY, [], minutes=1.0, overrides=("train.max_steps=100000",))


@pytest.mark.parametrize("probe", ["", "  ", "我打他\n他打我"])
def test_an_empty_or_multiline_probe_is_refused(probe) -> None:
    with pytest.raises(OptionError, match="--probe"):
        make_lab(TINY, [], updates=30, probes=(probe,))


def test_the_presets_config_is_found_from_any_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    quick = make_lab(None, [], preset="quick", overrides=("train.lr=1e-3",))
    assert quick.config.is_absolute() and quick.config.is_file()
    corpora = dict(quick.clone_paths)  # the config's corpora, found in the clone
    assert Path(corpora["data.train"]).is_file() and Path(corpora["data.dev"]).is_file()
    assert quick.overrides == (*QUICK.overrides, "train.lr=1e-3")  # the user's last
    assert quick.runs()[0].overrides[: len(corpora)] == quick.clone_paths
    assert quick.budget == QUICK.budget and len(quick.variants) == len(QUICK.variants)
    full = make_lab(None, [], preset="full")
    assert [v.name for v in full.variants] == list(LAB_VARIANTS) == list(FULL.variants)
    assert full.seeds == (1, 2) and full.budget == Budget(updates=2000)


def test_the_textbook_and_paper_presets_ask_every_question_once_at_one_size() -> None:
    """textbook: every part a model.variant takes out, and one head; paper: the rest of the
    named variants but the shape; both at the quick preset's size, so a quick lab's runs are
    the textbook's first three."""
    parts = {
        name for name, v in config.MODEL_VARIANTS.items() if v.lacks and v.positions != "learned"
    }
    assert set(TEXTBOOK.variants) == parts | {"one-head"}
    assert set(TEXTBOOK.variants) | set(PAPER.variants) == set(LAB_VARIANTS) - {"deep-encoder"}
    assert not set(TEXTBOOK.variants) & set(PAPER.variants)
    for preset in (TEXTBOOK, PAPER):
        assert preset.seeds == (1, 2)
        assert (preset.budget, preset.overrides) == (QUICK.budget, QUICK.overrides)
    textbook = make_lab(None, [], preset="textbook")
    quick = make_lab(None, [], preset="quick")
    assert textbook.runs()[:3] == quick.runs()


def test_no_dropout_trains_without_dropout_whatever_the_recipe_chose() -> None:
    lab = dataclasses.replace(
        make_lab(None, ["no-dropout"], preset="paper"), recipe=("model.dropout=0.1",)
    )
    base, no_dropout = lab.runs()[:2]
    dropout = [config.load(lab.config, list(r.overrides)).model.dropout for r in (base, no_dropout)]
    assert dropout == [0.1, 0.0]


def test_a_preset_lab_goes_on_in_a_moved_clone(tmp_path, monkeypatch) -> None:
    """The clone's corpora are found anew where it now lies, not asked of the lab: a rerun in
    a moved clone (or of a record without `located`, which holds them among the asked) goes on;
    a changed --set is still refused."""
    clones = [tmp_path / "old", tmp_path / "moved"]
    for clone in clones:
        (clone / "configs").mkdir(parents=True)
        (clone / "configs" / "default.yaml").write_bytes((REPO / QUICK.config).read_bytes())
    labs = []
    for clone in clones:
        monkeypatch.setattr(plan, "CLONE", clone)
        labs.append(make_lab(None, [], preset="quick"))
    old, moved = (LabRecord.of(lab) for lab in labs)
    assert old.located != moved.located and old.asked == moved.asked
    assert old.merged(moved, tmp_path).located == moved.located
    before = LabRecord(**{**old.__dict__, "located": {}})  # the clone's paths among the asked
    before.asked = {**old.asked, "overrides": jsonable((*labs[0].clone_paths, *QUICK.overrides))}
    assert before.merged(moved, tmp_path).asked == moved.asked
    changed = LabRecord.of(dataclasses.replace(labs[1], overrides=("train.lr=1e-3",)))
    with pytest.raises(OptionError, match="the common --set changed"):
        before.merged(changed, tmp_path)


def test_the_api_takes_one_string_as_one_probe_and_one_variant(monkeypatch) -> None:
    asked = {}

    def run_lab(plan, out, device):
        asked.update(plan=plan, out=out)
        return []

    monkeypatch.setattr(runner, "run_lab", run_lab)
    mtrain.lab(
        TINY,
        "one-head",
        updates=10,
        probes="我打他",
        overrides={"data.train": "corpus #2.tsv", "train.lr": 1e-3},
    )
    plan = asked["plan"]
    assert plan.probes == ("我打他",)
    assert [v.name for v in plan.variants] == ["one-head"]
    assert plan.overrides == (("data.train", "corpus #2.tsv"), ("train.lr", 1e-3))
    assert mtrain.lab(TINY, updates=10) == [] and asked["plan"].probes == PROBES
    mtrain.lab(TINY, None, updates=10, seeds=None)  # None: none
    assert asked["plan"].variants == () and asked["plan"].seeds == (1,)
    for wrong in (dict(variants=5), dict(seeds=1.5), dict(probes=7)):
        with pytest.raises(OptionError, match=f"{next(iter(wrong))}: expected a"):
            mtrain.lab(TINY, updates=10, **wrong)


def test_the_lab_directory_must_be_a_labs(tmp_path, corpus) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    for out, says in ((run, "a run's directory"), (mine, "holds other files and no lab")):
        with pytest.raises(OptionError, match=says):
            mtrain.lab(TINY, updates=10, out=out, overrides=sets(corpus))
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    runner.check_lab_dir(empty)  # an empty directory is fine


def test_a_rerun_asked_otherwise_is_refused_naming_the_change(tmp_path) -> None:
    lab = make_lab(TINY, ["one-head"], updates=10, probes=("我打他",))
    LabRecord.of(lab).write(tmp_path)
    changed = {  # each names what differs, old → new, in one line
        "the budget changed: 10 updates → 20 updates": dict(updates=20),
        "the budget changed: 10 updates → 2 minutes": dict(minutes=2.0),
        'the probes changed: dropped "我打他"; added "他打我"': dict(
            updates=10, probes=("他打我",)
        ),
        "the common --set changed: train.lr (not set) → 0.001": dict(
            updates=10, overrides=("train.lr=0.001",)
        ),
        "variant 'one-head' changed: model.n_heads 1 → 2, train.lr (not set) → 0.001": dict(
            updates=10
        ),
    }
    for says, options in changed.items():
        other = LabRecord.of(make_lab(TINY, ["one-head"], **{"probes": ("我打他",), **options}))
        if "variant" in says:  # its keys as another mtrain may name them
            other.variants["one-head"] = {"model": {"n_heads": 2}, "train": {"lr": 0.001}}
        with pytest.raises(OptionError, match=re.escape(says)) as refused:
            LabRecord.read(tmp_path).merged(other, tmp_path)
        assert "use another --out" in str(refused.value)
        assert len(str(refused.value).splitlines()) == 1
    text = tmp_path / "tiny.yaml"
    text.write_text(TINY.read_text() + "# edited\n")
    with pytest.raises(OptionError, match=r"the text of .*tiny\.yaml changed"):
        other = Lab(text, Budget(updates=10), lab.variants, probes=("我打他",))
        LabRecord.read(tmp_path).merged(LabRecord.of(other), tmp_path)
    # More seeds and variants go on, and are remembered.
    more = make_lab(TINY, ["one-head", "peek"], updates=10, seeds=(1, 2), probes=("我打他",))
    merged = LabRecord.read(tmp_path).merged(LabRecord.of(more), tmp_path)
    assert merged.seeds == [1, 2] and list(merged.variants) == ["one-head", "peek"]


def test_a_budget_is_compared_by_what_it_is(tmp_path) -> None:
    """A record whose budget lacks a key it does not use is the same budget; two that print
    alike are told apart."""
    lab = make_lab(TINY, [], updates=10)
    record = LabRecord.of(lab)
    record.asked["budget"] = {"updates": 10}
    record.write(tmp_path)
    LabRecord.read(tmp_path).merged(LabRecord.of(lab), tmp_path)
    LabRecord.of(make_lab(TINY, [], minutes=0.1)).write(tmp_path)
    longer = LabRecord.of(make_lab(TINY, [], minutes=0.1000001))
    with pytest.raises(OptionError, match=re.escape("0.1 minutes → 0.1000001 minutes")):
        LabRecord.read(tmp_path).merged(longer, tmp_path)


def fake_clone(root: Path, corpus: dict[str, str]) -> Path:
    """A clone whose presets' config is the tiny one, its corpora the synthetic one's."""
    (root / "configs").mkdir(parents=True)
    (root / QUICK.config).write_bytes(TINY.read_bytes())
    (root / "data" / "tatoeba").mkdir(parents=True)
    for split in ("train", "dev", "test"):
        (root / "data" / "tatoeba" / f"{split}.tsv").write_bytes(Path(corpus[split]).read_bytes())
    return root


def stop(config: Path, overrides: list, run_dir: Path, device: str) -> None:
    raise Interrupted(0, run_dir)  # as Ctrl-C stops the first run


def test_an_interrupted_preset_lab_given_data_paths_goes_on(corpus, tmp_path, monkeypatch) -> None:
    """`--preset quick --set data.prepared_dir=...` (or data.dev and data.test of one's own),
    stopped, then the same again: it goes on. Another path is refused naming it."""
    monkeypatch.setattr(plan, "CLONE", fake_clone(tmp_path / "clone", corpus))
    small = ("tokenizer.vocab_size=300", "tokenizer.character_coverage=1.0")
    given = (*small, f"data.prepared_dir={tmp_path / 'prepared'}")
    lab = make_lab(None, [], preset="quick", overrides=given)
    for _ in range(2):
        with pytest.raises(Interrupted):
            runner.run_lab(lab, tmp_path / "lab", "cpu", stop)
    for overrides in (given, (*small, f"data.dev={corpus['dev']}", f"data.test={corpus['test']}")):
        out = tmp_path / str(len(overrides))
        LabRecord.of(make_lab(None, [], preset="quick", overrides=overrides)).write(out)
        again = make_lab(None, [], preset="quick", overrides=overrides)
        LabRecord.read(out).merged(LabRecord.of(again), out)
    other = make_lab(None, [], preset="quick", overrides=(*small, "data.prepared_dir=/elsewhere"))
    says = f'data.prepared_dir "{tmp_path / "prepared"}" → "/elsewhere"'
    with pytest.raises(OptionError, match=re.escape(says)):
        LabRecord.read(tmp_path / "lab").merged(LabRecord.of(other), tmp_path / "lab")


@pytest.mark.parametrize("trained", [dict(max_steps=2, max_minutes=0), dict(max_minutes=0.5)])
def test_a_lab_without_lab_json_takes_no_other_budget(corpus, tmp_path, trained) -> None:
    """A lab directory whose runs were trained to another budget, with no lab.json to say so,
    is refused before anything trains."""
    from mtrain.run.directory import write_config

    out = tmp_path / "lab"
    (out / "baseline-seed1").mkdir(parents=True)
    write_config(out / "baseline-seed1", small_config(corpus, **trained))
    lab = make_lab(TINY, ["peek"], updates=1, overrides=tuple(sets(corpus).items()))
    with pytest.raises(OptionError, match="its run baseline-seed1 was trained to") as refused:
        runner.run_lab(lab, out, "cpu", stop)
    assert "not this lab's 1 updates" in str(refused.value)
    assert not (out / LAB_FILE).exists()
    if trained.get("max_steps") == 2:  # the lab it was: goes on
        with pytest.raises(Interrupted):
            runner.run_lab(dataclasses.replace(lab, budget=Budget(2)), out, "cpu", stop)


@pytest.mark.parametrize("held", ["checkpoints", "lock"])
def test_a_run_directory_train_would_refuse_is_refused_before_anything_trains(
    corpus, tmp_path, held
) -> None:
    """The lab's second run's directory holds checkpoints but no last.pt, or another process
    trains in it: `mtrain train` would refuse it as it opened it, and the lab refuses it in
    one line naming the run, before its first run trains (or anything is written)."""
    from mtrain.core.files import DirectoryLock
    from mtrain.run.directory import write_config

    out = tmp_path / "lab"
    second = out / "peek-seed1"
    second.mkdir(parents=True)
    lab = make_lab(TINY, ["peek"], updates=1, overrides=tuple(sets(corpus).items()))
    says = {"checkpoints": "holds checkpoints but no last.pt", "lock": "in use by another"}
    write_config(second, small_config(corpus, max_steps=1, max_minutes=0))  # this lab's budget
    with contextlib.ExitStack() as stack:
        if held == "checkpoints":
            (second / "best.pt").write_bytes(b"")
        else:  # a lock held on its own open file, as another process would hold it
            stack.enter_context(DirectoryLock(second))
        with pytest.raises(MtrainError, match=f"^lab run peek-seed1: {second}: {says[held]}"):
            runner.run_lab(lab, out, "cpu", stop)
    assert sorted(p.name for p in out.iterdir()) == ["peek-seed1"]


@pytest.mark.parametrize(
    "key, value",
    [
        ("asked", []),
        ("seeds", "12"),
        ("runs", []),
        ("recipe", [5]),
        ("variants", []),
        ("variants", {"../up": {}}),
        ("located", {"data": "x"}),
        ("asked", {"config_sha256": "x", "budget": {"updates": 0}, "overrides": {}, "probes": []}),
    ],
)
def test_a_lab_json_of_the_wrong_shape_is_one_line(corpus, tmp_path, key, value) -> None:
    lab = make_lab(TINY, [], updates=10, overrides=tuple(sets(corpus).items()))
    record = LabRecord.of(lab)
    (tmp_path / LAB_FILE).write_text(json.dumps({**record.__dict__, key: value}))
    with pytest.raises(OptionError) as refused:
        runner.run_lab(lab, tmp_path, "cpu", stop)
    said = str(refused.value)
    assert len(said.splitlines()) == 1 and said.startswith(f"{tmp_path / LAB_FILE}: ")
    assert key in said


def test_the_shape_check_knows_every_field_of_the_record() -> None:
    from mtrain.laboratory.record_shape import FIELDS

    assert set(FIELDS) == {f.name for f in dataclasses.fields(LabRecord)}


def test_a_lab_json_nested_too_deeply_is_one_line(tmp_path) -> None:
    (tmp_path / LAB_FILE).write_text("[" * 100_000)
    done = mtrain_command("lab", "-c", str(TINY), "--updates", "10", "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr == (
        f"mtrain: error: {tmp_path / LAB_FILE}: not a lab's record (nested too deeply); "
        "use another --out\n"
    )


def test_a_probe_that_is_not_utf8_is_refused_before_anything(corpus, tmp_path) -> None:
    out = tmp_path / "lab"
    with pytest.raises(OptionError, match=re.escape(r"--probe '\ud800': not valid UTF-8")):
        mtrain.lab(TINY, updates=10, out=out, probes=["\ud800"], overrides=sets(corpus))
    lab = ["lab", "-c", str(TINY), "--updates", "10", "--out", str(out)]
    done = mtrain_command(*lab, "--probe", b"\xff", *as_options(sets(corpus)))
    assert done.returncode == 2
    assert done.stderr == "mtrain: error: --probe '\\udcff': not valid UTF-8 text\n"
    assert not out.exists()


def test_a_path_of_bytes_that_are_not_utf8_is_kept_in_lab_json(tmp_path) -> None:
    odd = "/data/\udcff/prepared"  # a Linux path of bytes that are not UTF-8
    record = LabRecord.of(make_lab(TINY, [], updates=10, overrides=(("data.prepared_dir", odd),)))
    record.write(tmp_path / "lab")
    assert LabRecord.read(tmp_path / "lab").asked == record.asked


def test_out_onto_a_dangling_symlink_is_refused_naming_it(tmp_path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(OptionError, match=r"--out .*link: a symbolic link to .*gone, not there"):
        runner.check_lab_dir(tmp_path / "link")


def test_the_recipe_is_chosen_once_for_the_lab_from_the_budget(corpus) -> None:
    cfg = small_config(corpus, short_run_updates=1000, short_run_dropout=0.05, max_steps=5000)
    at_updates = make_lab(TINY, [], updates=999)
    assert runner.recipe(at_updates, cfg, 1.0) == (
        "model.dropout=0.05",
        "train.short_run_updates=0",
    )
    assert runner.recipe(make_lab(TINY, [], updates=1000), cfg, 1.0)[0] == "model.dropout=0.1"
    # at equal time, from the updates the measured speed reaches in the budget
    at_time = make_lab(TINY, [], minutes=1.0)
    assert runner.recipe(at_time, cfg, 10.0)[0] == "model.dropout=0.05"  # 600 planned
    assert runner.recipe(at_time, cfg, 20.0)[0] == "model.dropout=0.1"  # 1,200 planned


def test_every_run_is_checked_before_anything_trains(corpus, tmp_path) -> None:
    """A variant built on a run that is not there fails before the baseline trains."""
    out = tmp_path / "lab"
    kid = f"kid: train.init_from={tmp_path / 'no-such-run'}"
    with pytest.raises(MtrainError, match=r"lab run kid-seed1: train\.init_from: .*no such run"):
        mtrain.lab(TINY, [kid], out, updates=10, overrides=sets(corpus), device="cpu")
    assert not out.exists()


def test_a_stop_signal_in_the_last_validation_interrupts_after_saving(corpus, tmp_path) -> None:
    """SIGTERM while the last step validates: the run is saved (and finished), and training
    raises Interrupted, so that what called it (a lab) stops too."""
    cfg = small_config(corpus, max_steps=4, eval_every=100)

    class Stopped(scripted([1.0])):
        def __call__(self, step):
            signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns
            return super().__call__(step)

    trainer = build_trainer(cfg, tmp_path, CPU, make_validator=Stopped)
    with pytest.raises(Interrupted, match="interrupted at step 4"):
        trainer.run()
    assert peek_checkpoint(tmp_path / LAST)["step"] == 4
    assert finished_record(tmp_path / LAST) is not None  # a rerun has nothing to do


def test_a_diverging_variant_is_a_row_and_the_lab_goes_on(corpus, tmp_path, caplog) -> None:
    out = tmp_path / "lab"
    common = sets(
        corpus,
        **{"data.prepared_dir": str(tmp_path / "prepared"), "train.dev_examples": 0},
        **{"model.dropout": 0.3, "train.short_run_updates": 1000, "train.short_run_dropout": 0.05},
    )
    boom = "boom: train.lr=1e3 model.variant=no-layernorm"
    # A run built on another's weights reads its corpus in the parent's pieces: a prepared
    # corpus of its own, which the speed probe (the baseline's) does not prepare.
    parent = tmp_path / "parent"
    parent_keys = {"data.prepared_dir": str(tmp_path / "parent-prepared"), "train.max_steps": 2}
    mtrain.train(TINY, parent, {**common, **parent_keys, "train.eval_every": 2}, device="cpu")
    variants = [boom, "untied", f"kid: train.init_from={parent}"]
    caplog.clear()
    caplog.set_level("INFO")
    options = dict(updates=10, overrides=common, probes=["我打他"], device="cpu")
    rows = mtrain.lab(TINY, variants, out, **options)
    log = caplog.text
    diverged = re.search(r"run 2 of 4: boom-seed1 (diverged at step \d+: loss not finite)", log)
    assert diverged, log
    # the diverged run is a row that says so, and the run after it trained
    assert [(r.variant, r.status) for r in rows] == [
        ("baseline", ""),
        ("boom", diverged.group(1)),
        ("untied", ""),
        ("kid", ""),
    ]
    assert rows[2].parameters > rows[0].parameters  # each row counts its own run's model
    record = json.loads((out / LAB_FILE).read_text())
    assert record["runs"] == {"boom-seed1": {"diverged": diverged.group(1)}}
    assert (out / "report.md").is_file()
    # Both corpora were prepared, and the speed measured, before the first run's clock started.
    first_run = log.index("run 1 of 4: baseline-seed1")
    prepared = set(re.findall(r"prepared (\S+) in ", log))
    assert len(prepared) == 2 and prepared == set(
        re.findall(r"prepared (\S+) in ", log[:first_run])
    )
    assert re.search(
        r"lab: 4 runs of 10 updates; about \d+ min at [\d.]+ updates/s measured here; "
        r"ends about \d\d:\d\d",
        log,
    )
    # One recipe for every run, recorded: 10 updates are short of 1,000.
    assert record["recipe"] == ["model.dropout=0.05", "train.short_run_updates=0"]
    for name in ("baseline-seed1", "untied-seed1", "kid-seed1", "boom-seed1"):
        written = yaml.safe_load((out / name / "config.yaml").read_text())
        assert written["model"]["dropout"] == 0.05, name
        assert written["train"]["short_run_updates"] == 0, name

    # Again: the diverged run is not trained again, nor are the others.
    caplog.clear()
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/last.pt")}
    again = mtrain.lab(TINY, variants, out, **options)
    assert [r.dev_bleu for r in again] == [r.dev_bleu for r in rows]
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/last.pt")} == stamps
    assert "run 2 of 4: boom-seed1 diverged at step" in caplog.text
    assert "lab: 4 runs of 10 updates; all trained" in caplog.text
    with pytest.raises(OptionError, match="the budget changed: 10 updates → 30 updates"):
        mtrain.lab(TINY, variants, out, **{**options, "updates": 30})


def test_a_baseline_only_lab_at_equal_time_honours_its_minutes(corpus, tmp_path) -> None:
    out = tmp_path / "lab"
    common = as_options(sets(corpus, **{"train.max_steps": 100000}))
    lab = ["lab", "-c", str(TINY), "--minutes", "0.05", "--seeds", "1,2", "--out", str(out)]
    done = mtrain_command(*lab, "--probe", "我打他", "--device", "cpu", *common)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("| variant | changes | seed |")
    assert "lab: 2 runs of 0.05 minutes; about 0 min at" in done.stderr
    for name in ("baseline-seed1", "baseline-seed2"):
        state = peek_checkpoint(out / name / LAST)
        # ended by its 0.05 minutes (the last validation's time, which varies, not asserted)
        assert state["finished"]["limit"] == "max_minutes", name
        assert state["finished"]["max_minutes"] == 0.05 and 0 < state["step"] < 100000


def test_a_lab_stopped_by_sigterm_mid_run_resumes_to_the_same_result(
    corpus, tmp_path, caplog
) -> None:
    """SIGTERM once the baseline's first checkpoint is written (step 20 of 40): the lab stops
    with status 130; run again, it resumes to the weights of the same run trained uncut."""
    options = sets(corpus, **{"train.eval_every": 20, "train.dev_examples": 0})
    out = tmp_path / "stopped"
    lab = ["lab", "-c", str(TINY), "--updates", "40", "--out", str(out), "--device", "cpu"]
    command = [sys.executable, "-m", "mtrain", *lab, *as_options(options)]
    proc = subprocess.Popen(command, cwd=REPO, env=ENV, stderr=subprocess.PIPE, text=True)
    last = out / "baseline-seed1" / LAST
    while not last.exists() and proc.poll() is None:  # its first checkpoint
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "run the same command to go on" in stderr
    assert 20 <= peek_checkpoint(last)["step"] < 40 and finished_record(last) is None

    caplog.set_level("INFO")
    mtrain.lab(TINY, out=out, updates=40, overrides=options, device="cpu")
    assert "run 1 of 1: baseline-seed1 (the baseline; 40 updates): resuming" in caplog.text
    # The same run uncut, as the lab trains it (its recipe from lab.json).
    recipe = tuple(json.loads((out / LAB_FILE).read_text())["recipe"])
    plan = make_lab(TINY, [], updates=40, overrides=tuple(f"{k}={v}" for k, v in options.items()))
    run = dataclasses.replace(plan, recipe=recipe).runs()[0]
    mtrain.train(TINY, tmp_path / "uncut", list(run.overrides), device="cpu")
    for name in (LAST, "best.pt"):
        resumed = load_checkpoint(out / "baseline-seed1" / name)["model"]
        uncut = load_checkpoint(tmp_path / "uncut" / name)["model"]
        assert all(torch.equal(resumed[k], uncut[k]) for k in uncut), name


def test_the_api_lab_writes_its_lines_to_stderr_where_it_is_a_file(tmp_path) -> None:
    script = (
        "import logging, mtrain\n"
        "from mtrain.laboratory import runner\n"
        "def run_lab(*args):\n"
        "    logging.getLogger('mtrain').info('run 1 of 1: baseline-seed1')\n"
        "    return []\n"
        "runner.run_lab = run_lab\n"
        f"mtrain.lab({str(TINY)!r}, updates=10)\n"
    )
    with (tmp_path / "stderr").open("w") as stderr:
        done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, stderr=stderr)
    assert done.returncode == 0
    assert (tmp_path / "stderr").read_text() == "run 1 of 1: baseline-seed1\n"


def test_a_rerun_after_a_corpus_changed_is_refused_before_anything_trains(corpus, tmp_path):
    """A finished run's last.pt holds a hash of the corpora it was trained on (the dev and test
    sets among them: they shape the training pairs and chose best.pt): a rerun after one of them
    changed (the training corpus; the test set resampled at the same size) is refused in one
    line naming the run, before anything is prepared or trained (a seed added before it too),
    and nothing is rewritten."""
    data = tmp_path / "data"
    data.mkdir()
    files = {key: data / f"{key}.tsv" for key in ("train", "dev", "test")}
    for key, path in files.items():
        path.write_bytes(Path(corpus[key]).read_bytes())
    located = {**{k: str(p) for k, p in files.items()}, "prepared_dir": tmp_path / "prepared"}
    keys = sets(located, **{"train.precision": "fp32", "train.dev_examples": 0})
    out = tmp_path / "lab"
    mtrain.lab(
        TINY, [], out, updates=10, seeds=(2,), overrides=keys, probes=["我打他"], device="cpu"
    )

    def written() -> dict[Path, tuple[int, bytes]]:  # but the corpora and the run's lock
        every = (p for p in tmp_path.rglob("*") if p.is_file() and data not in p.parents)
        return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in every if p.name != ".lock"}

    changes = {
        "train": files["train"].read_text("utf-8") + "一\tone\n",
        "test": resampled(files["test"].read_text("utf-8")),
    }
    for key, text in changes.items():
        before = files[key].read_bytes()
        files[key].write_text(text, "utf-8")
        assert key == "train" or files[key].stat().st_size == len(before)
        kept = written()
        lab = ["lab", "-c", str(TINY), "--updates", "10", "--seeds", "1,2", "--out", str(out)]
        done = mtrain_command(*lab, "--probe", "我打他", "--device", "cpu", *as_options(keys))
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr  # one line, nothing logged before it
        run = out / "baseline-seed2"
        assert done.stderr.startswith(
            f"mtrain: error: lab run baseline-seed2: data.{key}: {files[key]} is not what "
            f"{run / LAST} was trained on"
        ), done.stderr
        assert written() == kept and not (out / "baseline-seed1").exists()
        files[key].write_bytes(before)
