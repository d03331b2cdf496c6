"""Preparing training corpora once: clean, train the tokenizer on a sample, encode in parallel,
and write flat memory-mapped token arrays that training reads without holding the corpus."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from mtrain import encode_worker
from mtrain.config import Config
from mtrain.corpus import (
    OPENERS,
    BadLine,
    Corpus,
    DataError,
    corpora,
    fingerprint,
    parse,
    raw_lines,
    read_pairs,
)
from mtrain.files import fcntl, sync_directory, write_atomic
from mtrain.text import normalize
from mtrain.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT = 1  # of the prepared directory; a change makes every prepared corpus stale
MANIFEST = "manifest.json"
CHUNK_LINES = 20_000  # lines a worker encodes at a time
# Bad lines are skipped and counted while they are at most 1% of the lines read (or 100);
# past that the corpus is refused: it is likely not what the config says it is.
BAD_SHARE, BAD_MIN = 0.01, 100
DROP_REASONS = ("empty side", "too long", "length ratio", "in dev or test", "duplicate")


def prepared_dir(cfg: Config) -> Path:
    """Where the training corpora of `cfg` are prepared: named for everything that shapes the
    prepared bytes, so another tokenizer or cleaning setting never reuses them."""
    return Path(cfg.data.prepared_dir) / f"{Path(corpora(cfg.data.train)[0].path).stem}-{_key(cfg)}"


def _key(cfg: Config) -> str:
    d, t = cfg.data, cfg.tokenizer
    shaping = {
        "format": FORMAT,
        "train": [list(map(str, c.files)) for c in corpora(d.train, d.swap_columns)],
        "swap": d.swap_columns,
        "heldout": [str(c) for key in ("dev", "test") for c in corpora(getattr(d, key))],
        "langs": [d.src_lang, d.tgt_lang],
        "lengths": [d.max_src_len, d.max_tgt_len, d.max_len_ratio],
        "tokenizer": vars(t),
    }
    return _sha256(json.dumps(shaping, sort_keys=True))[:12]


def file_identity(path: Path, known: dict | None = None) -> dict:
    """Size, modification time and SHA-256 of a file. The hash (about 1 GB/s) is reused from
    `known` when size and modification time are unchanged, so a fresh check costs a `stat`."""
    stat = path.stat()
    identity = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if known and all(known.get(k) == identity[k] for k in identity):
        return known
    return {**identity, "sha256": fingerprint(path)}


def _inputs(cfg: Config, manifest: dict | None = None) -> list[dict]:
    known = {item["path"]: item for item in (manifest or {}).get("inputs", [])}
    paths = [
        p
        for key in ("train", "dev", "test")
        for corpus in corpora(getattr(cfg.data, key))
        for p in corpus.files
    ]
    return [file_identity(p, known.get(str(p))) for p in paths]


def _read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_fresh(manifest: dict | None, inputs: list[dict]) -> bool:
    """Whether a prepared corpus's manifest records these inputs, in this format."""
    if manifest is None or manifest.get("format") != FORMAT:
        return False
    return [i["sha256"] for i in inputs] == [i["sha256"] for i in manifest["inputs"]]


def identity(manifest: dict) -> dict:
    """What makes two prepared corpora the same, on any machine: inputs, tokenizer, output."""
    keys = ("format", "dtype", "pairs", "tokens", "tokenizer")
    return {"inputs": [i["sha256"] for i in manifest["inputs"]]} | {k: manifest[k] for k in keys}


def data_digests(manifest: dict) -> dict[str, str]:
    """A hash of the training files' contents and one of the dev files', for checkpoints; a
    single file's is its own SHA-256, as checkpoints recorded before corpora were prepared."""
    n_train, n_dev = manifest["train_files"], manifest["dev_files"]
    digests = {}
    for key, inputs in (
        ("train", manifest["inputs"][:n_train]),
        ("dev", manifest["inputs"][n_train : n_train + n_dev]),
    ):
        hashes = [i["sha256"] for i in inputs]
        digests[key] = hashes[0] if len(hashes) == 1 else _sha256("".join(hashes))
    return digests


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def prepare(cfg: Config, workers: int | None = None) -> Path:
    """Prepare the training corpora of `cfg` unless they already are; return the directory.

    The work happens in a hidden temporary directory renamed into place when complete, under
    a lock, so an interrupted prepare is never taken for a finished one and two processes
    never prepare the same corpus at once.
    """
    target = prepared_dir(cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.with_name(f".{target.name}.lock")):
        # The files as they are; a hash is recomputed only for a file whose stat changed.
        manifest = _read_manifest(target)
        inputs = _inputs(cfg, manifest)
        if _is_fresh(manifest, inputs):
            return target
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        for pattern in (f".{target.name}.*.tmp", f".{target.name}.*.old"):
            for stale in target.parent.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)  # left by a killed prepare
        tmp.mkdir()
        try:
            manifest = _prepare_into(cfg, tmp, inputs, workers or len(os.sched_getaffinity(0)))
            _replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "prepared %s in %.0f s (tokenizer %.0f s): %d pairs read, %d kept; %s; "
        "%d bad lines skipped; %d source and %d target tokens",
        target,
        manifest["seconds"]["total"],
        manifest["seconds"]["tokenizer"],
        manifest["pairs_read"],
        manifest["pairs"],
        _drops(manifest["dropped"]),
        manifest["bad_lines"],
        manifest["tokens"]["src"],
        manifest["tokens"]["tgt"],
    )
    return target


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel however the holder ends
        yield


def _replace_dir(new: Path, target: Path) -> None:
    old = target.with_name(f".{target.name}.{os.getpid()}.old")
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)
    sync_directory(target.parent)  # make the renames durable


def _prepare_into(cfg: Config, out: Path, inputs: list[dict], workers: int) -> dict:
    d = cfg.data
    began = time.monotonic()
    train = corpora(d.train, d.swap_columns)
    heldout = {
        src
        for key in ("dev", "test")
        for c in corpora(getattr(d, key), d.swap_columns)
        for src, _ in read_pairs(c, d.src_lang, d.tgt_lang)
    }
    sample, n_lines = _sample(train, cfg)
    sampled = time.monotonic()
    tokenizer = Tokenizer.train(
        [s for s, _ in sample], [t for _, t in sample], cfg.tokenizer, d.src_lang, d.tgt_lang, out
    )
    del sample
    trained = time.monotonic()
    dtype = (
        np.uint16
        if max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size) <= 1 << 16
        else np.int32
    )
    settings = encode_worker.Settings(
        *tokenizer.protos(),
        d.src_lang,
        d.tgt_lang,
        d.max_src_len,
        d.max_tgt_len,
        d.max_len_ratio,
        frozenset(heldout),
        np.dtype(dtype).str,
    )
    counts, lengths, hashes = Counter(), [], []
    bar = tqdm(total=n_lines, desc="prepare", unit="line", unit_scale=True, dynamic_ncols=True)
    # Forked, as PyTorch's DataLoader workers are: spawn would re-run the caller's script.
    context = multiprocessing.get_context("fork")
    with (
        context.Pool(workers, encode_worker.init, (settings,)) as pool,
        (out / "src.bin").open("wb") as src_bin,
        (out / "tgt.bin").open("wb") as tgt_bin,
        bar,
    ):
        for chunk in pool.imap(encode_worker.encode, _chunks(train)):
            src_bin.write(chunk.src.tobytes())
            tgt_bin.write(chunk.tgt.tobytes())
            lengths.append(np.stack([chunk.src_len, chunk.tgt_len], 1))
            hashes.append(chunk.hashes)
            counts.update(chunk.counts)
            _report_bad(chunk.bad, counts)
            bar.update(chunk.lines)
    lengths = np.concatenate(lengths) if lengths else np.zeros((0, 2), np.uint16)
    keep = _first_occurrences(np.concatenate(hashes) if hashes else np.zeros(0, np.uint64))
    counts["duplicate"] = int(len(keep) - keep.sum())
    if not keep.any():
        raise DataError(f"data.train: {train[0]}: no usable sentence pairs ({_drops(counts)})")
    if not keep.all():
        _compact(out, lengths, keep, dtype)
        lengths = lengths[keep]
    for side, column in (("src", 0), ("tgt", 1)):
        np.save(out / f"{side}_len.npy", lengths[:, column].astype(np.uint16))
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths[:, column], out=offsets[1:])
        np.save(out / f"{side}_offsets.npy", offsets)
    manifest = {
        "format": FORMAT,
        "inputs": inputs,
        "train_files": sum(len(c.files) for c in train),
        "dev_files": len(corpora(d.dev)[0].files),
        "dtype": np.dtype(dtype).str,
        "pairs_read": counts["read"],
        "pairs": len(lengths),
        "dropped": {r: counts[r] for r in DROP_REASONS},
        "bad_lines": counts["bad"],
        "tokens": {"src": int(lengths[:, 0].sum()), "tgt": int(lengths[:, 1].sum())},
        "tokenizer": tokenizer.fingerprint(),
        "seconds": {
            "sample": round(sampled - began, 1),
            "tokenizer": round(trained - sampled, 1),
            "total": round(time.monotonic() - began, 1),
        },
    }
    for name in ("src.bin", "tgt.bin", "src_len.npy", "tgt_len.npy"):
        with (out / name).open("rb+") as f:
            os.fsync(f.fileno())
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def _drops(counts: dict) -> str:
    return "dropped: " + ", ".join(f"{counts[r]} {r}" for r in DROP_REASONS)


def _sample(train: list[Corpus], cfg: Config) -> tuple[list[tuple[str, str]], int]:
    """A seeded uniform sample of `tokenizer.input_sentence_size` pairs (all of them, in order,
    when the corpus is smaller) for the tokenizer, and the corpus's line count.

    Reservoir sampling over raw lines: one pass, memory bounded by the sample, whatever the
    size of the corpus; only the sampled lines are parsed and normalised.
    """
    size, rng = cfg.tokenizer.input_sentence_size, random.Random(0)
    reservoir: list[tuple[Corpus, int, bytes, bytes | None]] = []
    seen = 0
    # Progress in bytes of text read: the file sizes, where no file is compressed.
    files = [p for c in train for p in c.files]
    compressed = any(p.suffix in OPENERS for p in files)
    total = None if compressed else sum(p.stat().st_size for p in files)
    with tqdm(total=total, desc="sample", unit="B", unit_scale=True, leave=False) as bar:
        for corpus in train:
            read = 0
            for number, line, tgt_line in raw_lines(corpus):
                seen += 1
                read += len(line) + (len(tgt_line) if tgt_line is not None else 0)
                if number % 65536 == 0:
                    bar.update(read)
                    read = 0
                if len(reservoir) < size:
                    reservoir.append((corpus, number, line, tgt_line))
                else:
                    slot = rng.randrange(seen)
                    if slot < size:
                        reservoir[slot] = (corpus, number, line, tgt_line)
            bar.update(read)
    d, sample, first_bad = cfg.data, [], None
    for corpus, number, line, tgt_line in reservoir:
        try:
            src, tgt = parse(number, line, tgt_line, corpus.swap)
        except BadLine as e:
            first_bad = first_bad or f"{corpus.path}:{number}: {e}"
            continue
        src, tgt = normalize(src, d.src_lang), normalize(tgt, d.tgt_lang)
        if src and tgt:
            sample.append((src, tgt))
    if not sample and first_bad:
        raise DataError(f"{first_bad}; data.train has no readable sentence pair")
    if not sample:
        raise DataError(f"{train[0]}: no sentence pairs with both sides non-empty")
    return sample, seen


def _chunks(train: list[Corpus]) -> Iterator[encode_worker.Chunk]:
    for corpus in train:
        lines: list[tuple[int, bytes, bytes | None]] = []
        for record in raw_lines(corpus):
            lines.append(record)
            if len(lines) == CHUNK_LINES:
                yield encode_worker.Chunk(str(corpus.path), corpus.swap, lines)
                lines = []
        if lines:
            yield encode_worker.Chunk(str(corpus.path), corpus.swap, lines)


def _report_bad(bad: list[tuple[str, int, str]], counts: Counter) -> None:
    for name, number, reason in bad[: max(0, 5 - (counts["bad"] - len(bad)))]:
        log.warning("%s:%d: %s; line skipped", name, number, reason)
    if counts["bad"] > max(BAD_MIN, BAD_SHARE * counts["lines"]):
        name, number, reason = bad[0] if bad else ("data.train", 0, "bad lines")
        raise DataError(
            f"{name}:{number}: {reason}; {counts['bad']} of the first {counts['lines']} lines "
            f"cannot be read, more than {BAD_SHARE:.0%}: is this file the corpus the config "
            "means?"
        )


def _first_occurrences(hashes: np.ndarray) -> np.ndarray:
    """A mask keeping the first of each group of equal hashes (exact duplicate pairs)."""
    keep = np.zeros(len(hashes), bool)
    keep[np.unique(hashes, return_index=True)[1]] = True
    return keep


def _compact(out: Path, lengths: np.ndarray, keep: np.ndarray, dtype: Any) -> None:
    """Rewrite the token files without the pairs `keep` drops, a bounded slice at a time."""
    for side, column in (("src", 0), ("tgt", 1)):
        tokens = np.memmap(out / f"{side}.bin", dtype=dtype, mode="r")
        ends = np.cumsum(lengths[:, column], dtype=np.int64)
        with (out / f"{side}.new").open("wb") as f:
            step = 1 << 20
            for first in range(0, len(lengths), step):
                last = min(first + step, len(lengths))
                begin = ends[first - 1] if first else 0
                part_keep = np.repeat(keep[first:last], lengths[first:last, column])
                f.write(np.asarray(tokens[begin : ends[last - 1]])[part_keep].tobytes())
        del tokens
        os.replace(out / f"{side}.new", out / f"{side}.bin")
