"""Preparing a corpus: inputs of every form, cleaning counts, and never a half-written result."""

from __future__ import annotations

import errno
import gzip
import lzma
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mtrain.core import config
from mtrain.data import encode_corpus
from mtrain.data import prepare as prepare_module
from mtrain.data import prepared as prepared_format
from mtrain.data.corpus import OPENERS, DataError, check_files, corpora, fingerprint
from mtrain.data.pairs import Batch, encode_pairs, read_parallel
from mtrain.data.prepare import prepare, prepared_dir
from mtrain.data.prepared import identity
from mtrain.data.token_corpus import TokenCorpus
from mtrain.data.tokenizer import Tokenizer
from mtrain.training.data import prepared_corpus

from .synthetic import REPO, number_pairs, overrides
from .test_training_data import Replies


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


# The command with chunks of 2 lines: a worker is nearly always about to send one to the parent.
SMALL_CHUNKS = """
from mtrain.data import encode_corpus
from mtrain.__main__ import main

encode_corpus.CHUNK_LINES = 2
main()
"""


@pytest.mark.parametrize("to_group", [False, True], ids=["the command", "its process group"])
def test_sigterm_while_encoding_stops_quietly_as_ctrl_c(tmp_path, corpus, to_group):
    """`timeout` and `docker stop` signal the command alone (its workers, left writing to a
    parent gone, printed BrokenPipeError tracebacks); systemd signals the whole group (a worker
    killed inside the task queue's lock would leave the parent's pool blocked for ever)."""
    train = write_tsv(tmp_path / "train.tsv", number_pairs(5_000, seed=7))
    for attempt in range(2):  # the race was lost about 4 times in 5
        root = tmp_path / f"prepared-{attempt}"
        sets = [*overrides({**corpus, "train": train}), f"data.prepared_dir={root}"]
        proc = subprocess.Popen(
            [sys.executable, "-c", SMALL_CHUNKS, "prepare", "--config", "configs/tiny.yaml"]
            + [f"--set={s}" for s in sets],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a group of its own, for the signal to the group
        )
        # Encoding has begun once the first chunk is written.
        while proc.poll() is None and not any(
            p.stat().st_size for p in root.glob(".*.tmp/src.bin")
        ):
            time.sleep(0.01)
        if to_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=120)[1]
        assert proc.returncode == 130 and "Traceback" not in stderr, stderr  # as Ctrl-C


def test_a_prepare_that_cannot_put_its_directory_in_place_keeps_the_earlier_one(
    tmp_path, corpus, monkeypatch
):
    """The one behaviour of files.replace_directory on failure: what was there stays whole."""
    train = write_tsv(tmp_path / "train.tsv", number_pairs(200, seed=5))
    cfg = cfg_for({**corpus, "train": str(train)}, tmp_path)
    first = prepare(cfg)
    before = token_files(first)
    write_tsv(train, number_pairs(250, seed=6))  # changed: to be prepared again

    def failing(rename):
        def rename_unless_done(src, dst, *args, **kwargs):
            if str(src).endswith(".tmp") and os.path.isdir(src):  # the finished directory
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
            return rename(src, dst, *args, **kwargs)

        return rename_unless_done

    monkeypatch.setattr(os, "rename", failing(os.rename))
    monkeypatch.setattr(os, "replace", failing(os.replace))
    with pytest.raises(OSError):
        prepare(cfg)
    monkeypatch.undo()
    assert token_files(first) == before
    assert not [p.name for p in first.parent.iterdir() if p.name.endswith((".tmp", ".old"))]


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


def test_the_corpora_hashed_unprepared_are_what_a_checkpoint_records(tmp_path, corpus):
    """`corpus_digests` (a resume's and a lab's check, without preparing) gives the hashes a
    checkpoint records of a prepared corpus, from its manifest or from the files alone."""
    pairs = number_pairs(200, seed=5)
    train = [
        str(write_tsv(tmp_path / f"{h}.tsv", part))
        for h, part in (("a", pairs[:90]), ("b", pairs[90:]))
    ]
    cfg = cfg_for({**corpus, "train": train}, tmp_path)
    recorded = prepared_format.data_digests(TokenCorpus(prepare(cfg)).manifest)
    assert prepare_module.corpus_digests(cfg) == recorded
    shutil.rmtree(tmp_path / "prepared")
    assert prepare_module.corpus_digests(cfg) == recorded
    assert recorded["test"] == fingerprint(Path(corpus["test"]))


# Constants lowered so that a few hundred lines cross chunks, the tokenizer sample and the
# bad-line threshold, as millions of lines do with the real ones.


def in_memory_encoding(prepared: TokenCorpus, train: list[Path], corpus, cfg) -> None:
    """Assert that `prepared` holds the distinct pairs of `train`, in order, as encoded in
    memory by its own tokenizer."""
    tokenizer = Tokenizer.load(prepared.directory)
    pairs = [p for path in train for p in read_parallel(path, "zh", "en")]
    heldout = {
        s for key in ("dev", "test") for s, _ in read_parallel(Path(corpus[key]), "zh", "en")
    }
    pairs = [p for p in dict.fromkeys(pairs) if p[0] not in heldout]
    d = cfg.data
    got = Batch.collate(
        encode_pairs(tokenizer, pairs, d.max_src_len, d.max_tgt_len, drop_long=True)
    )
    batch = prepared.collate(np.arange(len(prepared)))
    assert len(prepared) == len(got.src) > 0
    for name in ("src", "tgt_in", "tgt_out"):
        a, b = getattr(batch, name), getattr(got, name)
        assert a.tolist() == b[:, : a.shape[1]].tolist() and (b[:, a.shape[1] :] == 0).all()


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(encode_corpus, "CHUNK_LINES", 7)


def test_chunks_and_the_tokenizer_sample_cross_their_sizes(tmp_path, corpus, small_chunks):
    """400 lines in 58 chunks of 7 over 2 workers, and a tokenizer sample of 150: an unordered
    pool or a wrong slice of a later chunk would show."""
    train = [write_tsv(tmp_path / "a.tsv", number_pairs(250, 21)), Path(corpus["train"])]
    cfg = cfg_for(corpus, tmp_path, train=[str(p) for p in train])
    cfg.tokenizer.input_sentence_size = 150
    prepared = TokenCorpus(prepare(cfg, workers=2))
    in_memory_encoding(prepared, train, corpus, cfg)
    assert prepared.manifest["pairs_read"] == 650


def test_the_tokenizer_sample_is_uniform_over_every_file(tmp_path, corpus):
    lines = [(f"{i:05d}", "x") for i in range(4000)]
    train = [
        write_tsv(tmp_path / "a.tsv", lines[:1000]),
        write_tsv(tmp_path / "b.tsv", lines[1000:]),
    ]
    cfg = cfg_for(corpus, tmp_path, train=[str(p) for p in train])
    cfg.tokenizer.input_sentence_size = 400
    digests = {}
    sample, n_lines = encode_corpus._sample(corpora(cfg.data.train), cfg, False, digests)
    assert n_lines == 4000 and len(sample) == 400
    quarters = np.bincount([int(src) // 1000 for src, _ in sample], minlength=4)
    assert (quarters > 70).all(), quarters  # 100 each expected; a biased reservoir is far off
    # The same pass hashed the files, as stored.
    assert {p: d.hexdigest() for p, d in digests.items()} == {p: fingerprint(p) for p in train}


def test_a_first_prepare_hashes_the_training_files_while_sampling(tmp_path, corpus, monkeypatch):
    train = write_tsv(tmp_path / "train.tsv.gz", number_pairs(300, 4), gzip.open)
    cfg = cfg_for({**corpus, "train": str(train)}, tmp_path)
    hashed = []
    real = prepare_module.fingerprint
    monkeypatch.setattr(prepare_module, "fingerprint", lambda p: hashed.append(p) or real(p))
    manifest = TokenCorpus(prepare(cfg)).manifest
    assert train not in hashed and hashed  # the dev and test files, read once by themselves
    assert manifest["inputs"][0]["sha256"] == real(train)


def test_token_ids_are_int32_past_a_uint16_vocabulary(tmp_path, corpus, monkeypatch, small_chunks):
    uint16 = TokenCorpus(prepare(cfg_for(corpus, tmp_path / "uint16")))
    monkeypatch.setattr(prepared_format, "UINT16_IDS", 100)  # below the vocabulary of 300
    cfg = cfg_for(corpus, tmp_path / "int32")
    int32 = TokenCorpus(prepare(cfg, workers=2))
    assert int32.manifest["dtype"] == "<i4" and uint16.manifest["dtype"] == "<u2"
    size = (int32.directory / "src.bin").stat().st_size
    assert size == 4 * int32.manifest["tokens"]["src"]
    everything = np.arange(len(uint16))
    a, b = uint16.collate(everything), int32.collate(everything)
    assert all(getattr(a, k).equal(getattr(b, k)) for k in ("src", "tgt_in", "tgt_out"))
    in_memory_encoding(int32, [Path(corpus["train"])], corpus, cfg)


@pytest.mark.parametrize("bad", [3, 4])
def test_the_bad_line_limit_is_per_file_and_names_its_first(
    tmp_path, corpus, monkeypatch, bad, small_chunks
):
    """A second file with 4 bad lines of 24 is refused at a limit of 3 a file, though the 4 are
    under 1% of all 424 lines; it is named by its first bad line, in another chunk."""
    monkeypatch.setattr(encode_corpus, "BAD_MIN", 3)
    good = [f"{zh}\t{en}\n" for zh, en in number_pairs(20, 31)]
    lines = good[:]
    for i in range(bad):  # lines 3, 10, 17 and 24: one in each chunk of 7
        lines.insert(2 + 7 * i, f"bad line {i}\n")
    second = tmp_path / "second.tsv"
    second.write_text("".join(lines), "utf-8")
    cfg = cfg_for(corpus, tmp_path, train=[corpus["train"], str(second)])
    if bad == 3:
        assert TokenCorpus(prepare(cfg)).manifest["bad_lines"] == 3
        return
    message = r"second\.tsv:3: expected 2 or 4 .*; 4 of the first 24 lines cannot be read"
    with pytest.raises(DataError, match=message):
        prepare(cfg)


@pytest.mark.parametrize("content", ["", "no tab\n" * 50, "copy"])
def test_a_corpus_that_gives_no_pair_is_named(tmp_path, corpus, content):
    """An empty file, one of bad lines only (under the limit after a good one), a copy of
    an earlier corpus: each is named, not taken in silently."""
    other = tmp_path / "other.tsv"
    if content == "copy":
        shutil.copy(corpus["train"], other)
    else:
        other.write_text(content, "utf-8")
    cfg = cfg_for(corpus, tmp_path, train=[corpus["train"], str(other)])
    with pytest.raises(DataError, match=rf"data\.train: {other} contributes no sentence pair"):
        prepare(cfg)


@pytest.mark.parametrize("suffix", [".gz", ".xz"])
def test_a_corrupt_archive_is_named(tmp_path, corpus, suffix):
    train = write_tsv(tmp_path / f"train.tsv{suffix}", number_pairs(300, 4), OPENERS[suffix])
    data = bytearray(train.read_bytes())
    # gz: deflate's block header, after the 10-byte header and the file's name
    data[data.index(0, 10) + 3 if suffix == ".gz" else len(data) // 2] ^= 0xFF
    train.write_bytes(data)
    with pytest.raises(DataError, match=rf"^{train}: cannot read \("):
        prepare(cfg_for({**corpus, "train": str(train)}, tmp_path))


def test_lengths_past_uint16_are_refused_by_the_config(corpus):
    sets = [*overrides(corpus), "train.batch_tokens=200000"]
    with pytest.raises(config.ConfigError, match=r"data\.max_src_len: at most 65535, got 70000"):
        config.load(REPO / "configs" / "tiny.yaml", [*sets, "data.max_src_len=70000"])
    config.load(REPO / "configs" / "tiny.yaml", [*sets, "data.max_tgt_len=65535"])


def test_an_input_changed_while_prepared_is_refused(tmp_path, corpus, monkeypatch):
    train = write_tsv(tmp_path / "train.tsv", number_pairs(200, 5))
    cfg = cfg_for({**corpus, "train": str(train)}, tmp_path)
    real = prepare_module.encode_corpus

    def appended_meanwhile(*args, **kwargs):
        with train.open("a", encoding="utf-8") as f:
            f.write("八\teight\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "encode_corpus", appended_meanwhile)
    with pytest.raises(DataError, match=f"{train} changed while it was being prepared"):
        prepare(cfg)
    assert [p.name for p in (tmp_path / "prepared").iterdir()] == [
        f".{prepared_dir(cfg).name}.lock"
    ]


def test_other_ranks_prepare_without_progress_bars(tmp_path, corpus, capsys):
    cfg = cfg_for(corpus, tmp_path / "main")
    expected = identity(TokenCorpus(prepare(cfg)).manifest)
    capsys.readouterr()
    other = cfg_for(corpus, tmp_path / "other")  # another machine: prepares its own copy
    prepared_corpus(other, tmp_path, Replies(rank=1, world_size=2, replies=[expected]), False)
    assert capsys.readouterr().err == ""


def test_a_rank_whose_corpus_differs_from_rank_0s_is_refused(tmp_path, corpus):
    cfg = cfg_for(corpus, tmp_path)
    expected = identity(TokenCorpus(prepare(cfg)).manifest)
    group = Replies(rank=1, world_size=2, replies=[{**expected, "pairs": 1}])
    with pytest.raises(DataError, match=rf"rank 1: {prepared_dir(cfg)} differs from rank 0's"):
        prepared_corpus(cfg, tmp_path, group, False)


def test_workers_stay_within_the_cgroup_cpu_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker --cpus=1.5
    assert prepare_module.available_cpus(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert prepare_module.available_cpus(tmp_path) == 8
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert prepare_module.available_cpus(tmp_path) == 3


def test_a_read_only_prepared_corpus_can_be_trained_on(tmp_path, corpus, monkeypatch):
    cfg = cfg_for(corpus, tmp_path)
    target = prepare(cfg)
    target.with_name(f".{target.name}.lock").unlink()
    real_open = Path.open

    def read_only(path, mode="r", *args, **kwargs):
        if tmp_path / "prepared" in Path(path).parents and set(mode) & set("wa+"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", read_only)
    assert prepare(cfg) == target
    os.utime(Path(corpus["dev"]))  # touched: hashed again, its new stat cannot be kept
    assert prepare(cfg) == target


def test_a_full_disk_names_the_prepared_directory(tmp_path, corpus, monkeypatch):
    def full(cfg, out, *args):
        (out / "src.bin").write_bytes(b"")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare_module, "encode_corpus", full)
    cfg = cfg_for(corpus, tmp_path)
    with pytest.raises(OSError) as e:
        prepare(cfg)
    assert e.value.filename == str(prepared_dir(cfg)) and e.value.errno == errno.ENOSPC


def test_prepared_dir_naming_a_file_is_named_with_its_key(tmp_path, corpus):
    (tmp_path / "prepared").write_text("mine")
    with pytest.raises(DataError, match=f"data.prepared_dir: {tmp_path / 'prepared'} is a file"):
        prepare(cfg_for(corpus, tmp_path))
    assert (tmp_path / "prepared").read_text() == "mine"


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_device_as_a_corpus_is_named_for_what_it_is(tmp_path, kind):
    path = Path("/dev/null") if kind == "device" else tmp_path / "pipe"
    if kind == "fifo":
        os.mkfifo(path)
    what = "a character device" if kind == "device" else r"a named pipe \(FIFO\)"
    with pytest.raises(DataError, match=f"^data.train: {path} is {what}, not a corpus file$"):
        check_files(str(path), "data.train")


def test_a_second_prepare_says_whom_it_waits_for(tmp_path, corpus):
    """Two prepares of one corpus: the second waits for the first's lock, and says so."""
    root = tmp_path / "prepared"
    sets = [*overrides({**corpus, "prepared_dir": str(root)})]
    command = [sys.executable, "-m", "mtrain", "prepare", "--config", "configs/tiny.yaml"]
    command += [f"--set={s}" for s in sets]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: os.nice(19),
    )
    try:
        while first.poll() is None and not list(root.glob(".*.tmp")):  # it holds the lock
            time.sleep(0.01)
        assert first.poll() is None, "the first prepare ended before it could be held"
        first.send_signal(signal.SIGSTOP)
        second = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        ready, _, _ = select.select([second.stderr], [], [], 300)  # a hang fails, not waits
        line = second.stderr.readline() if ready else "(nothing)"  # its first words: it waits
        assert f"waiting for mtrain pid {first.pid} on " in line, line
        assert "to finish a prepare of" in line
    finally:
        first.send_signal(signal.SIGCONT)
    out, _ = first.communicate()
    assert first.returncode == 0
    out2, err2 = second.communicate()
    assert second.returncode == 0, err2
    assert out.strip() == out2.strip()
    assert "prepared " not in err2  # it found the first's work done
