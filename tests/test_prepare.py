"""Preparing a corpus: inputs of every form, cleaning counts, and never a half-written result."""

from __future__ import annotations

import gzip
import lzma
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mtrain import config
from mtrain import prepare as prepare_module
from mtrain.corpus import DataError
from mtrain.data import Batch, encode_pairs, read_parallel
from mtrain.dataset import TokenCorpus
from mtrain.prepare import prepare
from mtrain.tokenizer import Tokenizer

from .synthetic import REPO, number_pairs, overrides


def write_tsv(path: Path, pairs, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(f"{zh}\t{en}\n" for zh, en in pairs)
    return path


def cfg_for(corpus, root: Path, **data) -> config.Config:
    cfg = config.load(REPO / "configs" / "tiny.yaml", overrides(corpus))
    cfg.data.prepared_dir = str(root / "prepared")
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def token_files(directory: Path) -> dict[str, bytes]:
    names = ("src.bin", "tgt.bin", "src_len.npy", "tgt_len.npy", "spm.src.model", "spm.tgt.model")
    return {name: (directory / name).read_bytes() for name in names}


def test_prepared_pairs_are_the_in_memory_encoding(corpus, tmp_path):
    cfg = cfg_for(corpus, tmp_path)
    prepared = TokenCorpus(prepare(cfg, workers=2))
    tokenizer = Tokenizer.load(prepared.directory)
    pairs = list(dict.fromkeys(read_parallel(Path(corpus["train"]), "zh", "en")))  # distinct
    heldout = {
        s for key in ("dev", "test") for s, _ in read_parallel(Path(corpus[key]), "zh", "en")
    }
    pairs = [p for p in pairs if p[0] not in heldout]
    d = cfg.data
    expected = encode_pairs(tokenizer, pairs, d.max_src_len, d.max_tgt_len, drop_long=True)
    got = Batch.collate(expected)
    batch = prepared.collate(np.arange(len(prepared)))
    assert len(prepared) == len(expected) > 0
    for name in ("src", "tgt_in", "tgt_out"):  # the same pairs, in input order
        a, b = getattr(batch, name), getattr(got, name)
        assert a.tolist() == b[:, : a.shape[1]].tolist() and (b[:, a.shape[1] :] == 0).all()


def test_training_reads_token_files_without_mapping_them(corpus, tmp_path):
    """Random reads of a memory map keep their neighbourhood resident: a long run over a big
    corpus would come to hold all of it. Batches are read with pread instead."""
    prepared = TokenCorpus(prepare(cfg_for(corpus, tmp_path), workers=1))
    batch = prepared.collate(np.arange(len(prepared))[::-3])
    assert (batch.src != 0).any()
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(prepared.directory) not in maps.read_text()


def test_compressed_files_and_file_pairs_prepare_the_same_bytes(tmp_path):
    pairs = number_pairs(300, seed=7)
    heldout = [("九九九九九九九", "nine nine nine nine nine nine nine")]
    dev = str(write_tsv(tmp_path / "dev.tsv", heldout))
    corpus = {"train": dev, "dev": dev, "test": dev}  # train: set below
    (tmp_path / "c.zh").write_text("".join(f"{zh}\n" for zh, _ in pairs), "utf-8")
    with lzma.open(tmp_path / "c.en.xz", "wt", encoding="utf-8") as f:
        f.writelines(f"{en}\n" for _, en in pairs)
    forms = {
        "plain": str(write_tsv(tmp_path / "c.tsv", pairs)),
        "gzip": str(write_tsv(tmp_path / "c.tsv.gz", pairs, gzip.open)),
        "pair": {"src": str(tmp_path / "c.zh"), "tgt": str(tmp_path / "c.en.xz")},
        "two halves": [
            str(write_tsv(tmp_path / "a.tsv", pairs[:100])),
            {"src": str(tmp_path / "c.zh"), "tgt": str(tmp_path / "c.en.xz")},
        ],
    }
    prepared = {}
    for name, train in forms.items():
        cfg = cfg_for(corpus, tmp_path / name, train=train)
        prepared[name] = token_files(prepare(cfg, workers=2))
    assert prepared["plain"] == prepared["gzip"] == prepared["pair"]
    # The second corpus repeats the first's 100 pairs: duplicates, dropped.
    halves = TokenCorpus(
        prepare(cfg_for(corpus, tmp_path / "two halves", train=forms["two halves"]))
    )
    assert halves.manifest["dropped"]["duplicate"] >= 100
    assert (
        halves.manifest["pairs"]
        == TokenCorpus(prepare(cfg_for(corpus, tmp_path / "plain", train=forms["plain"]))).manifest[
            "pairs"
        ]
    )


def test_every_dropped_pair_is_counted_by_reason(tmp_path):
    dev = write_tsv(tmp_path / "dev.tsv", [("三三三三三", "three three three three three")])
    base = list(dict.fromkeys(p for p in number_pairs(300, seed=11) if p[0] != "三三三三三"))
    crafted = [
        f"{base[0][0]}\t{base[0][1]}\n",  # duplicate
        "\tone\n",  # empty side
        "一\t\n",  # empty side
        "\n",  # blank line: an empty pair
        "三三三三三\tthree three three three three\n",  # its source is a dev sentence
        "一\t" + "one two " * 40 + "\n",  # too long
        "一二三四五六七八九零一二三四五六七八九\tone\n",  # length ratio
        "only one column\n",  # bad line
        "a\tb\tc\n",  # bad line
    ]
    train = tmp_path / "train.tsv"
    text = "".join(f"{zh}\t{en}\n" for zh, en in base) + "".join(crafted)
    train.write_bytes(text.encode() + b"\xff\xfe\tbad utf-8\n")
    corpus = {"train": str(train), "dev": str(dev), "test": str(dev)}
    manifest = TokenCorpus(prepare(cfg_for(corpus, tmp_path, max_len_ratio=3.0))).manifest
    assert manifest["dropped"] == {
        "empty side": 3,
        "too long": 1,
        "length ratio": 1,
        "in dev or test": 1,
        "duplicate": 1,
    }
    assert manifest["bad_lines"] == 3
    assert manifest["pairs"] == len(base)
    assert manifest["pairs_read"] == len(base) + len(crafted) - 2


def mtrain(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "mtrain", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, **kwargs)


def test_unequal_line_counts_name_both_files(tmp_path, corpus):
    (tmp_path / "a.zh").write_text("一\n二\n三\n", "utf-8")
    (tmp_path / "a.en").write_text("one\ntwo\n", "utf-8")
    sets = [f"data.{k}={v}" for k, v in corpus.items() if k != "train"]
    sets.append(f"data.train={{src: {tmp_path / 'a.zh'}, tgt: {tmp_path / 'a.en'}}}")
    sets.append(f"data.prepared_dir={tmp_path / 'prepared'}")
    done = mtrain(
        "prepare", "--config", str(REPO / "configs/tiny.yaml"), *(f"--set={s}" for s in sets)
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"mtrain: error: {tmp_path / 'a.zh'} has 3 lines but {tmp_path / 'a.en'} has 2: "
        "a source and a target file must have one line each per sentence pair"
    )
    assert [p.suffix for p in (tmp_path / "prepared").iterdir()] == [".lock"]  # nothing else


def test_a_corpus_of_bad_lines_is_refused(tmp_path, corpus):
    train = tmp_path / "train.tsv"
    train.write_text("".join(f"{i} no tab here\n" for i in range(300)), "utf-8")
    cfg = cfg_for({**corpus, "train": str(train)}, tmp_path)
    with pytest.raises(DataError, match=r"train\.tsv:1: expected 2 or 4 tab-separated columns"):
        prepare(cfg)
    with train.open("a", encoding="utf-8") as f:  # readable pairs, but too few
        f.writelines(f"{zh}\t{en}\n" for zh, en in number_pairs(100))
    with pytest.raises(DataError, match=r"train\.tsv:1: .*; 300 of the first 400 lines cannot"):
        prepare(cfg)


def test_an_interrupted_prepare_is_redone_to_the_same_bytes(tmp_path, corpus):
    whole = prepare(cfg_for(corpus, tmp_path / "whole"))
    root = tmp_path / "killed" / "prepared"
    sets = [*overrides(corpus), f"data.prepared_dir={root}"]
    command = [sys.executable, "-m", "mtrain", "prepare", "--config", "configs/tiny.yaml"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # At the lowest priority, so that its encoding workers, one per core, cannot keep this
    # process from seeing the tokenizer file in time on a busy machine.
    proc = subprocess.Popen(
        [*command, *(f"--set={s}" for s in sets)],
        cwd=REPO,
        env=env,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(19),
    )
    # Kill it once its tokenizer is written: in the middle of its work.
    while proc.poll() is None and not list(root.glob(".*.tmp/spm.tgt.model")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not [p for p in root.iterdir() if not p.name.startswith(".")]  # nothing finished
    again = mtrain(*command[3:], *(f"--set={s}" for s in sets), cwd=REPO)
    assert again.returncode == 0, again.stderr
    redone = Path(again.stdout.strip())
    assert redone.name == whole.name
    assert token_files(redone) == token_files(whole)
    assert not list(root.glob(".*.tmp"))  # the killed run's leftovers are gone


def test_a_changed_corpus_is_prepared_again(tmp_path, corpus):
    train = write_tsv(tmp_path / "train.tsv", number_pairs(200, seed=5))
    cfg = cfg_for({**corpus, "train": str(train)}, tmp_path)
    first = prepare(cfg)
    before = TokenCorpus(first).manifest
    os.utime(train, ns=(1, 1))  # touched, not changed: the hash says it is the same corpus
    assert prepare(cfg) == first
    touched = TokenCorpus(first).manifest
    assert touched["inputs"][0]["mtime_ns"] == 1  # the new stat kept: hashed once, not always
    assert {**touched, "inputs": before["inputs"]} == before
    with train.open("a", encoding="utf-8") as f:
        f.write("八八八八\teight eight eight eight\n")
    after = TokenCorpus(prepare(cfg)).manifest
    assert after["inputs"][0]["sha256"] != before["inputs"][0]["sha256"]
    assert after["pairs_read"] == before["pairs_read"] + 1


def test_a_touched_corpus_is_hashed_once_not_at_every_start(tmp_path, corpus, monkeypatch):
    train = write_tsv(tmp_path / "train.tsv", number_pairs(200, seed=5))
    cfg = cfg_for({**corpus, "train": str(train)}, tmp_path)
    first = prepare(cfg)
    os.utime(train, ns=(1, 1))
    assert prepare(cfg) == first  # hashes the touched file, finds it unchanged
    hashed = []
    monkeypatch.setattr(prepare_module, "fingerprint", lambda path: hashed.append(path))
    assert prepare(cfg) == first
    assert hashed == []
