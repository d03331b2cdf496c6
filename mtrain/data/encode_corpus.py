"""The work of `mtrain prepare` inside its temporary directory: sample the corpus for the
tokenizer, train it, encode every pair in a pool of workers, drop exact duplicates, and write
the flat token files with their lengths and offsets."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mtrain.core import progress as progress_bar
from mtrain.core.config import Config
from mtrain.data import encode_worker
from mtrain.data.corpus import (
    OPENERS,
    BadLine,
    Corpus,
    DataError,
    corpora,
    raw_lines,
    read_line,
    read_pairs,
    usable,
)
from mtrain.data.prepared import LENGTH_DTYPE, compact, token_dtype, token_file, write_lengths
from mtrain.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CHUNK_LINES = 20_000  # lines a worker encodes at a time
# Bad lines are skipped and counted while they are at most 1% of a file's lines read (or 100);
# past that the corpus is refused: it is likely not what the config says it is.
BAD_SHARE, BAD_MIN = 0.01, 100
BAD_SHOWN = 5  # bad lines named in a warning, per corpus
DROP_REASONS = ("empty side", "too long", "length ratio", "in dev or test", "duplicate")


@dataclass
class FileCounts:
    """What one corpus of data.train gave: its lines, its bad lines and its pairs."""

    lines: int = 0
    bad: int = 0
    first_bad: str = ""  # file:line: reason
    pairs: int = 0  # encoded and kept, before exact duplicates are dropped
    shown: list[str] = field(default_factory=list)


def encode_corpus(
    cfg: Config,
    out: Path,
    workers: int,
    progress: bool = True,
    digests: dict[Path, Any] | None = None,
    tokenizer: Tokenizer | None = None,
) -> dict:
    """Write the tokenizer and the token files of `cfg`'s training corpora into `out`; return
    what the manifest records of them: counts, tokens, tokenizer, dtype, checksums and timings.
    `progress` shows bars on stderr; `digests` gains the SHA-256 of every training file;
    `tokenizer`: the models to encode with (a parent run's), written as they are, not trained."""
    d = cfg.data
    began = time.monotonic()
    train = corpora(d.train, d.swap_columns)
    sample, n_lines = _sample(train, cfg, progress, digests)
    sampled = time.monotonic()
    tokenizer = _tokenizer(cfg, sample, out, tokenizer)
    del sample
    trained = time.monotonic()
    vocab = tokenizer.vocab_sizes()
    dtype = token_dtype(vocab)
    settings = encode_worker.Settings(
        *tokenizer.protos(), d.src_lang, d.tgt_lang, d.max_src_len, d.max_tgt_len,
        d.max_len_ratio, _heldout_sources(cfg), dtype.str,
    )  # fmt: skip
    lengths, hashes, counts, files = _encode(train, settings, out, n_lines, workers, progress)
    keep = _first_occurrences(hashes)
    counts["duplicate"] = int(len(keep) - keep.sum())
    if not keep.any():
        raise DataError(f"data.train: {train[0]}: no usable sentence pairs ({drops(counts)})")
    _check_every_corpus_contributes(train, files, keep)
    if not keep.all():
        compact(out, lengths, keep, dtype)
        lengths = lengths[keep]
    checksums = write_lengths(out, lengths)
    return {
        "train_files": sum(len(c.files) for c in train),
        "dev_files": len(corpora(d.dev)[0].files),
        "dtype": dtype.str,
        "pairs_read": counts["read"],
        "pairs": len(lengths),
        "dropped": {r: counts[r] for r in DROP_REASONS},
        "bad_lines": counts["bad"],
        "tokens": {"src": int(lengths[:, 0].sum()), "tgt": int(lengths[:, 1].sum())},
        "tokenizer": tokenizer.fingerprint(),
        "vocab": vocab,
        "files": checksums,
        "seconds": {
            "sample": round(sampled - began, 1),
            "tokenizer": round(trained - sampled, 1),
            "total": round(time.monotonic() - began, 1),
        },
    }


def _tokenizer(
    cfg: Config, sample: list[tuple[str, str]], out: Path, given: Tokenizer | None
) -> Tokenizer:
    """The tokenizer trained on `sample` into `out`, or the `given` one written there as it is."""
    if given is not None:
        given.write(out)
        return given
    src, tgt = [s for s, _ in sample], [t for _, t in sample]
    return Tokenizer.train(src, tgt, cfg.tokenizer, cfg.data.src_lang, cfg.data.tgt_lang, out)


def drops(counts: dict) -> str:
    return "dropped: " + ", ".join(f"{counts[r]} {r}" for r in DROP_REASONS)


def _heldout_sources(cfg: Config) -> frozenset[str]:
    """The normalised dev and test sources: a training pair with one of them leaks."""
    d = cfg.data
    return frozenset(
        src
        for key in ("dev", "test")
        for c in corpora(getattr(d, key), d.swap_columns)
        for src, _ in read_pairs(c, d.src_lang, d.tgt_lang)
    )


def _sample(
    train: list[Corpus], cfg: Config, progress: bool = True, digests: dict | None = None
) -> tuple[list[tuple[str, str]], int]:
    """A seeded uniform sample of `tokenizer.input_sentence_size` pairs (all of them, in order,
    when the corpus is smaller) for the tokenizer, and the corpus's line count.

    Reservoir sampling over raw lines: one pass, memory bounded by the sample, whatever the
    size of the corpus; only the sampled lines are parsed and normalised. The same pass hashes
    the files into `digests`, so that a first prepare reads each file twice, not three times.
    """
    size, rng = cfg.tokenizer.input_sentence_size, random.Random(0)
    reservoir: list[tuple[Corpus, int, bytes, bytes | None]] = []
    seen = 0
    # Progress in bytes of text read: the file sizes, where no file is compressed.
    files = [p for c in train for p in c.files]
    compressed = any(p.suffix in OPENERS for p in files)
    total = None if compressed else sum(p.stat().st_size for p in files)
    bar = progress_bar.bar(
        total=total, desc="sample", unit="B", unit_scale=True, leave=False, disable=not progress
    )
    with bar:
        for corpus in train:
            read = 0
            for number, line, tgt_line in raw_lines(corpus, digests):
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
    return _parse_sample(reservoir, cfg, train), seen


def _parse_sample(
    reservoir: list[tuple[Corpus, int, bytes, bytes | None]], cfg: Config, train: list[Corpus]
) -> list[tuple[str, str]]:
    d, sample, first_bad = cfg.data, [], None
    for corpus, number, line, tgt_line in reservoir:
        try:
            pair = read_line(number, line, tgt_line, corpus.swap, d.src_lang, d.tgt_lang)
        except BadLine as e:
            first_bad = first_bad or f"{corpus.path}:{number}: {e}"
            continue
        if pair and usable(*pair):
            sample.append(pair)
    if not sample and first_bad:
        raise DataError(f"{first_bad}; data.train has no readable sentence pair")
    if not sample:
        raise DataError(f"{train[0]}: no sentence pairs with both sides non-empty")
    return sample


def _encode(
    train: list[Corpus],
    settings: encode_worker.Settings,
    out: Path,
    n_lines: int,
    workers: int,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray, Counter, list[FileCounts]]:
    """Encode every line in a pool of workers, appending to src.bin and tgt.bin in input order;
    return the (N, 2) lengths and (N,) hashes of the pairs kept, the counts by reason, and
    what each corpus gave."""
    counts, lengths, hashes = Counter(), [], []
    files = [FileCounts() for _ in train]
    bar = progress_bar.bar(
        total=n_lines,
        desc="prepare",
        unit="line",
        unit_scale=True,
        dynamic_ncols=True,
        disable=not progress,
    )
    # Forked, as PyTorch's DataLoader workers are: spawn would re-run the caller's script.
    context = multiprocessing.get_context("fork")
    with (
        sigterm_as_ctrl_c(),
        context.Pool(workers, encode_worker.init, (settings,)) as pool,
        token_file(out, "src").open("wb") as src_bin,
        token_file(out, "tgt").open("wb") as tgt_bin,
        bar,
    ):
        for chunk in pool.imap(encode_worker.encode, _chunks(train)):
            src_bin.write(chunk.src.tobytes())
            tgt_bin.write(chunk.tgt.tobytes())
            lengths.append(np.stack([chunk.src_len, chunk.tgt_len], 1))
            hashes.append(chunk.hashes)
            counts.update(chunk.counts)
            _count_bad(chunk, files[chunk.corpus])
            files[chunk.corpus].pairs += len(chunk.hashes)
            bar.update(chunk.lines)
        # Workers told to stop and waited for: the `with` alone would terminate them, and a
        # worker killed inside the task queue's lock can leave its replacement blocked on it
        # for ever (Pool.terminate's race with its own repopulation; seen hanging the suite).
        pool.close()
        pool.join()
    if not lengths:
        return np.zeros((0, 2), LENGTH_DTYPE), np.zeros(0, np.uint64), counts, files
    return np.concatenate(lengths), np.concatenate(hashes), counts, files


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Within this block SIGTERM (what `timeout`, systemd and `docker stop` send) stops as
    Ctrl-C does: the pool ends its workers as it unwinds, where a parent killed outright would
    leave them to fail writing to it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers are the main thread's to set
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _chunks(train: list[Corpus]) -> Iterator[encode_worker.Chunk]:
    for index, corpus in enumerate(train):
        lines: list[tuple[int, bytes, bytes | None]] = []
        for record in raw_lines(corpus):
            lines.append(record)
            if len(lines) == CHUNK_LINES:
                yield encode_worker.Chunk(index, str(corpus.path), corpus.swap, lines)
                lines = []
        if lines:
            yield encode_worker.Chunk(index, str(corpus.path), corpus.swap, lines)


def _count_bad(chunk: encode_worker.Encoded, file: FileCounts) -> None:
    """Warn of a corpus's first bad lines; refuse it once they pass its share of its lines."""
    file.lines += chunk.lines
    file.bad += len(chunk.bad)
    for name, number, reason in chunk.bad[: max(0, BAD_SHOWN - len(file.shown))]:
        file.shown.append(f"{name}:{number}")
        log.warning("%s:%d: %s; line skipped", name, number, reason)
    if chunk.bad and not file.first_bad:
        name, number, reason = chunk.bad[0]
        file.first_bad = f"{name}:{number}: {reason}"
    if file.bad > max(BAD_MIN, BAD_SHARE * file.lines):
        raise DataError(
            f"{file.first_bad}; {file.bad} of the first {file.lines} lines cannot be read, more "
            f"than {BAD_SHARE:.0%}: is this file the corpus the config means?"
        )


def _check_every_corpus_contributes(
    train: list[Corpus], files: list[FileCounts], keep: np.ndarray
) -> None:
    """Refuse a list of corpora one of which gives no pair: an empty or wrong file, or a copy."""
    ends = np.cumsum([file.pairs for file in files])
    for corpus, file, end in zip(train, files, ends):
        if not keep[end - file.pairs : end].any():
            duplicates = f", {file.pairs} duplicates of earlier pairs" if file.pairs else ""
            raise DataError(
                f"data.train: {corpus} contributes no sentence pair ({file.lines} lines, "
                f"{file.bad} bad{duplicates}): remove it from the list, or check the file"
            )


def _first_occurrences(hashes: np.ndarray) -> np.ndarray:
    """A mask keeping the first of each group of equal hashes (exact duplicate pairs)."""
    keep = np.zeros(len(hashes), bool)
    keep[np.unique(hashes, return_index=True)[1]] = True
    return keep
