"""A run built on another (`train.init_from`): the parent's weights and pieces at step 0, its
lineage recorded, every bad parent refused before anything is written, resumed bit-exact."""

from __future__ import annotations

import contextlib
import io
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mtrain import cli
from mtrain.core import config
from mtrain.core.files import DirectoryLock
from mtrain.data.tokenizer import SRC_MODEL, TGT_MODEL, Tokenizer
from mtrain.run.directory import load_checkpoint
from mtrain.run.lineage import weights_digest
from mtrain.training.build import build_trainer

from .console import mtrain
from .synthetic import REPO, number_pairs, overrides
from .test_distributed import ENV as TORCHRUN_ENV
from .test_distributed import free_port, start_rank, torchrun

CPU = torch.device("cpu")


class Payload:
    """An object a checkpoint may not hold: unpickling it could run code."""


def run_cli(*args: str) -> tuple[int, str, str]:
    """`mtrain ARGS` in this process: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    sigterm = signal.getsignal(signal.SIGTERM)
    status = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main(list(args))
    except SystemExit as e:
        status = e.code
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    return status, out.getvalue(), err.getvalue()


def sets(settings: list[str]) -> list[str]:
    return [f"--set={s}" for s in settings]


@pytest.fixture(scope="module")
def parent(corpus, tmp_path_factory) -> Path:
    """The tiny config trained 10 updates on the synthetic corpus: the run others build on."""
    out = tmp_path_factory.mktemp("parent") / "run"
    settings = overrides(corpus, max_steps=10, eval_every=5)
    done = mtrain("train", "--config", "configs/tiny.yaml", "--out", str(out), *sets(settings))
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def own_corpus(corpus, tmp_path_factory) -> dict[str, str]:
    """Another training corpus (the user's own), with the same dev and test sets."""
    root = tmp_path_factory.mktemp("own")
    path = root / "train.tsv"
    path.write_text("".join(f"{zh}\t{en}\n" for zh, en in number_pairs(200, 9)), "utf-8")
    return {**corpus, "train": str(path), "prepared_dir": str(root / "prepared")}


def child_settings(own_corpus, **train_keys) -> list[str]:
    return overrides(own_corpus, **{"eval_every": 3, "max_steps": 6, **train_keys})


def test_a_run_starts_from_its_parents_weights_and_encodes_with_its_pieces(
    parent, own_corpus, tmp_path
):
    cfg = config.load(REPO / "configs" / "tiny.yaml", child_settings(own_corpus))
    cfg.train.init_from = str(parent)
    trainer = build_trainer(cfg, tmp_path, CPU)  # reads the parent itself: the Python API
    weights = load_checkpoint(parent / "best.pt")["model"]
    mine = trainer.model.state_dict()
    assert mine.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(mine[name], tensor), name
    record = trainer.state.parent
    assert record["run"] == str(parent) and record["checkpoint"] == "best.pt"
    assert record["step"] == load_checkpoint(parent / "best.pt")["step"]
    assert record["weights"] == weights_digest(mine)
    # The new corpus is encoded with the parent's pieces, which the run keeps as its own.
    pieces = Tokenizer.load(parent).fingerprint()
    assert trainer.data.corpus.manifest["tokenizer"] == pieces
    for name in (SRC_MODEL, TGT_MODEL):
        assert (tmp_path / name).read_bytes() == (parent / name).read_bytes()
    assert trainer.data.corpus.manifest["pairs"] <= 200  # the user's corpus, not the parent's
    assert Path(own_corpus["prepared_dir"]) in trainer.data.corpus.directory.parents
    trainer.run()
    assert load_checkpoint(tmp_path / "last.pt")["parent"] == record


def test_lineage_in_config_yaml_info_and_checkpoints(parent, own_corpus, tmp_path):
    out = tmp_path / "child"
    done = mtrain(
        "train",
        "--config",
        "configs/tiny.yaml",
        "--out",
        str(out),
        "--init-from",
        str(parent),
        *sets(child_settings(own_corpus)),
    )
    assert done.returncode == 0, done.stderr
    step = load_checkpoint(parent / "best.pt")["step"]
    assert f"starting from {parent} best.pt (update {step}" in done.stderr
    record = yaml.safe_load((out / "config.yaml").read_text())
    assert record["train"]["init_from"] == str(parent)
    lineage = record["parent"]
    assert {k: lineage[k] for k in ("run", "checkpoint", "step")} == {
        "run": str(parent),
        "checkpoint": "best.pt",
        "step": step,
    }
    assert lineage["weights"] == weights_digest(load_checkpoint(parent / "best.pt")["model"])
    for name in ("last.pt", "best.pt"):
        assert load_checkpoint(out / name)["parent"] == lineage
    said = f"fine-tuned from {parent} best.pt (update {step})"
    info = mtrain("info", str(out))
    assert info.returncode == 0, info.stderr
    assert said in info.stdout.splitlines()[:2]
    # A copy whose config.yaml lost the record still says where it came from: its checkpoints do.
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    record.pop("parent")
    (copy / "config.yaml").write_text(yaml.safe_dump(record, allow_unicode=True))
    status, stdout, stderr = run_cli("info", str(copy))
    assert status == 0, stderr
    assert said in stdout
    assert mtrain("info", str(parent)).stdout.count("fine-tuned") == 0


def test_a_config_without_model_and_tokenizer_takes_the_parents(parent, own_corpus, tmp_path):
    """The sections a config leaves out come from the parent; its dropout is its own."""
    cfg = tmp_path / "finetune.yaml"
    data = {k: own_corpus[k] for k in ("train", "dev", "test", "prepared_dir")}
    train = {"max_steps": 3, "eval_every": 3, "max_minutes": 0, "batch_tokens": 256}
    cfg.write_text(yaml.safe_dump({"data": data, "model": {"dropout": 0.3}, "train": train}))
    out = tmp_path / "child"
    status, _, stderr = run_cli(
        "train", "--config", str(cfg), "--out", str(out), "--init-from", str(parent)
    )
    assert status == 0, stderr
    mine, theirs = config.load(out / "config.yaml"), config.load(parent / "config.yaml")
    assert mine.tokenizer == theirs.tokenizer
    assert mine.model.d_model == theirs.model.d_model == 64
    assert (mine.model.dropout, theirs.model.dropout) == (0.3, 0.1)
    assert mine.train.max_steps == 3  # the rest is the new config's


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("mtrain: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def refused(init_from: str, own_corpus, tmp_path, *settings: str) -> str:
    """Train from `init_from`: its one error line, once shown that nothing was written."""
    out, prepared = tmp_path / "child", tmp_path / "prepared"
    status, stdout, stderr = run_cli(
        "train",
        "--config",
        "configs/tiny.yaml",
        "--out",
        str(out),
        "--init-from",
        init_from,
        *sets([*child_settings(own_corpus), f"data.prepared_dir={prepared}", *settings]),
    )
    assert status == 2, stderr
    assert stdout == ""
    assert not out.exists() and not prepared.exists()
    return one_error_line(stderr)


def test_a_config_that_sets_the_parents_sections_otherwise_is_refused(parent, own_corpus, tmp_path):
    line = refused(str(parent), own_corpus, tmp_path, "model.d_model=32")
    assert f"train.init_from: model.d_model is 32 here and 64 in {parent}" in line
    line = refused(str(parent), own_corpus, tmp_path, "tokenizer.vocab_size=400")
    assert "tokenizer.vocab_size is 400 here and 300 in" in line
    line = refused(str(parent), own_corpus, tmp_path, "data.src_lang=ja")
    assert "data.src_lang is 'ja' here and 'zh' in" in line


def test_a_learned_positions_child_keeps_its_parents_table(corpus, own_corpus, tmp_path):
    """A learned-positions model has a row per position, as many as the longer of
    data.max_src_len and data.max_tgt_len: a child of other lengths is refused in one line
    naming the keys and their values, before anything is written (not a size mismatch)."""
    learned = tmp_path / "learned"
    settings = [*overrides(corpus, max_steps=1, eval_every=1), "model.variant=learned-positions"]
    status, _, stderr = run_cli(
        "train", "--config", "configs/tiny.yaml", "--out", str(learned), *sets(settings)
    )
    assert status == 0, stderr
    child = ("model.variant=learned-positions", "data.max_src_len=16", "data.max_tgt_len=24")
    line = refused(str(learned), own_corpus, tmp_path, *child)
    assert line.startswith("mtrain: error: train.init_from: model.variant='learned-positions'")
    assert "data.max_src_len=32, data.max_tgt_len=32" in line, line
    assert "data.max_src_len=16 and data.max_tgt_len=24" in line, line


def copy_of(parent: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "parent"
    shutil.copytree(parent, copy)
    return copy


def no_parent(parent, tmp_path) -> tuple[str, str]:
    return str(tmp_path / "nowhere"), "nowhere: no such run"


def not_a_run(parent, tmp_path) -> tuple[str, str]:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    return str(tmp_path / "notes"), "notes: not a run directory (no config.yaml)"


def no_such_checkpoint(parent, tmp_path) -> tuple[str, str]:
    return str(parent / "step-00000099.pt"), "step-00000099.pt: no such checkpoint"


def damaged(parent, tmp_path) -> tuple[str, str]:
    copy = copy_of(parent, tmp_path)
    (copy / "best.pt").write_bytes((copy / "best.pt").read_bytes()[:1000])
    return str(copy), "best.pt: not a loadable mtrain checkpoint (truncated or corrupt)"


def pickled_code(parent, tmp_path) -> tuple[str, str]:
    copy = copy_of(parent, tmp_path)
    torch.save({"model": Payload(), "step": 1}, copy / "best.pt")
    return str(copy), "best.pt: not a loadable mtrain checkpoint (it holds Python objects"


def ct2_export(parent, tmp_path) -> tuple[str, str]:
    export = tmp_path / "export"
    export.mkdir()
    for name in ("model.bin", "mtrain.yaml", "config.json", SRC_MODEL, TGT_MODEL):
        (export / name).write_bytes(b"x")
    return str(export), "export: a CTranslate2 export, which translates but does not train"


def no_tokenizer(parent, tmp_path) -> tuple[str, str]:
    copy = copy_of(parent, tmp_path)
    (copy / TGT_MODEL).unlink()
    return str(copy), f"{TGT_MODEL}: no such file (a SentencePiece model of the run)"


@pytest.mark.parametrize(
    "bad",
    [
        no_parent,
        not_a_run,
        no_such_checkpoint,
        damaged,
        pickled_code,
        ct2_export,
        no_tokenizer,
    ],
)
def test_a_bad_parent_is_one_line_and_nothing_is_written(parent, own_corpus, tmp_path, bad):
    init_from, says = bad(parent, tmp_path)
    line = refused(init_from, own_corpus, tmp_path)
    assert "train.init_from: " in line and says in line, line


def test_a_parent_in_training_is_read_as_it_is(parent, own_corpus, tmp_path):
    """Its checkpoints are replaced whole: what the run reads is one of them, and it says so."""
    with DirectoryLock(parent):  # as a training process holds it
        done = mtrain(
            "train",
            "--config",
            "configs/tiny.yaml",
            "--out",
            str(tmp_path / "child"),
            "--init-from",
            str(parent),
            *sets(child_settings(own_corpus, max_steps=1)),
        )
    assert done.returncode == 0, done.stderr
    assert f"{parent} is being trained now (pid " in done.stderr
    assert "starting from best.pt as it is at this moment" in done.stderr


def python_mtrain_train(out: Path, init_from: Path, settings: list[str]) -> list[str]:
    train = [sys.executable, "-m", "mtrain", "train", "--config", "configs/tiny.yaml"]
    return [*train, "--out", str(out), "--init-from", str(init_from), *sets(settings)]


def test_a_fine_tuned_run_resumes_bit_exact_with_its_parent_gone(parent, own_corpus, tmp_path):
    source = copy_of(parent, tmp_path)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    env = {**TORCHRUN_ENV}

    def train(out: Path, max_steps: int) -> None:
        done = subprocess.run(
            python_mtrain_train(out, source, child_settings(own_corpus, max_steps=max_steps)),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr

    train(whole, 9)
    train(parts, 5)  # a stop between two validations: the resume continues mid-stream
    shutil.rmtree(source)  # after the first checkpoint the parent is not needed
    train(parts, 9)
    a, b = load_checkpoint(whole / "last.pt"), load_checkpoint(parts / "last.pt")
    assert a["step"] == b["step"] == 9
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["parent"] == b["parent"] and b["parent"]["run"] == str(source)
    assert yaml.safe_load((parts / "config.yaml").read_text())["parent"] == a["parent"]


def test_two_processes_take_the_parent_from_rank_0(parent, own_corpus, tmp_path):
    out = tmp_path / "child"
    settings = [f"train.init_from={parent}", *child_settings(own_corpus, max_steps=4)]
    done = subprocess.run(
        torchrun(out, own_corpus, *settings), cwd=REPO, env=TORCHRUN_ENV, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert f"starting from {parent} best.pt".encode() in done.stderr
    state = load_checkpoint(out / "last.pt")
    assert state["step"] == 4 and len(state["rng"]) == 2
    assert state["parent"]["run"] == str(parent)
    assert yaml.safe_load((out / "config.yaml").read_text())["parent"] == state["parent"]


def test_rank_1_needs_no_access_to_the_parent(parent, own_corpus, tmp_path):
    """Two machines without a shared disk: the parent's path leads nowhere on rank 1's."""
    port, runs = free_port(), [tmp_path / "run", tmp_path / "elsewhere"]
    settings = child_settings(own_corpus, max_steps=4)
    procs = []
    for rank, init_from in enumerate([parent, tmp_path / "not-on-this-machine"]):
        settings_of_rank = [*settings, f"train.init_from={init_from}"]
        procs.append(start_rank(rank, port, ["-m", "mtrain"], runs[rank], settings_of_rank))
    stderr = [proc.communicate(timeout=300)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], stderr
    assert load_checkpoint(runs[0] / "last.pt")["parent"]["run"] == str(parent)
    assert not runs[1].exists()


def test_a_child_is_checked_again_with_its_parents_sections():
    """A BPE parent has no n best segmentations: a child that samples them is refused at
    once, in one line naming the key, not in the batch thread."""
    from mtrain.run import lineage

    tiny = REPO / "configs" / "tiny.yaml"
    bpe = config.load(tiny, ["tokenizer.model_type=bpe"])
    child = config.load(tiny, ["data.src_sampling_alpha=0.5"])  # unigram by itself: fine
    with pytest.raises(config.ConfigError, match=r"^train\.init_from: .*data\.src_sampling_alpha"):
        lineage.inherit(child, bpe, "PARENT", set())


def test_a_child_resumes_however_its_parent_is_named_and_keeps_its_own(
    parent, own_corpus, tmp_path, monkeypatch
):
    """Begun with a target size that means the parent's (300: its vocab_size, which its
    tgt_vocab_size 0 means), the parent named relative to one directory; resumed from another
    (where that name means nothing), with the shipped config that names no parent, and with
    RUN/best.pt: a resume never reads the parent, and the run keeps the one it began from."""
    out, tiny = tmp_path / "child", str(REPO / "configs" / "tiny.yaml")
    monkeypatch.chdir(parent.parent)

    def train(max_steps: int, *init_from: str) -> None:
        settings = child_settings(own_corpus, max_steps=max_steps)
        args = ["train", "--config", tiny, "--out", str(out), *init_from]
        status, _, stderr = run_cli(*args, *sets([*settings, "tokenizer.tgt_vocab_size=300"]))
        assert status == 0, stderr
        assert config.load(out / "config.yaml").train.init_from == str(parent)

    train(3, "--init-from", parent.name)
    monkeypatch.chdir(tmp_path)
    train(4, "--init-from", parent.name)
    train(5)
    train(6, "--init-from", str(parent / "best.pt"))
    assert load_checkpoint(out / "last.pt")["parent"]["run"] == str(parent)
