"""One worker process of `mtrain prepare`: raw lines in, cleaned token ids out.

It imports no torch, so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import signal
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import sentencepiece as spm

from mtrain.data.corpus import BadLine, read_line, usable
from mtrain.data.prepared import LENGTH_DTYPE
from mtrain.data.tokenizer import EOS_ID, too_long


@dataclass(frozen=True)
class Settings:
    """What every worker needs: the tokenizer and the cleaning rules."""

    src_proto: bytes
    tgt_proto: bytes
    src_lang: str
    tgt_lang: str
    max_src_len: int  # pieces, </s> included
    max_tgt_len: int
    max_len_ratio: float  # 0: no limit
    heldout: frozenset[str]  # normalised dev and test sources: a training pair with one leaks
    dtype: str  # of the token ids written


@dataclass
class Chunk:
    """Consecutive raw lines of one corpus file (or pair of files)."""

    corpus: int  # its index in data.train
    name: str
    swap: bool
    lines: list[tuple[int, bytes, bytes | None]]  # (line number, line, target line or None)


@dataclass
class Encoded:
    """A chunk's kept pairs as flat token arrays, with what was dropped and why."""

    src: np.ndarray  # source pieces then </s>, pair after pair
    tgt: np.ndarray  # target pieces (no <s> or </s>), pair after pair
    src_len: np.ndarray  # (N,)
    tgt_len: np.ndarray  # (N,)
    hashes: np.ndarray  # (N,) uint64 of the normalised pair: finds exact duplicates
    corpus: int  # its index in data.train
    lines: int
    counts: Counter = field(default_factory=Counter)
    bad: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, reason)


_settings: Settings | None = None
_src: spm.SentencePieceProcessor | None = None
_tgt: spm.SentencePieceProcessor | None = None


def init(settings: Settings) -> None:
    """Load the tokenizer once per worker, and leave stopping to the parent: Ctrl-C, sent to
    the whole process group, reaches the parent alone; SIGTERM (the parent's pool ending its
    workers, or sent to the group) ends a worker quietly."""
    global _settings, _src, _tgt
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)
    _settings = settings
    _src = spm.SentencePieceProcessor(model_proto=settings.src_proto)
    _tgt = spm.SentencePieceProcessor(model_proto=settings.tgt_proto)


def _exit(signum, frame) -> None:
    """End the worker without a traceback. Raised, not killed: a `with` it is in releases its
    lock, where a worker killed inside the task queue's would leave its parent's pool blocked
    on that lock for ever as it stops."""
    raise SystemExit(0)


def encode(chunk: Chunk) -> Encoded:
    """Parse, normalise, clean and encode a chunk, keeping input order."""
    s = _settings
    counts, bad, srcs, tgts = Counter(lines=len(chunk.lines)), [], [], []
    for number, line, tgt_line in chunk.lines:
        try:
            pair = read_line(number, line, tgt_line, chunk.swap, s.src_lang, s.tgt_lang)
        except BadLine as e:
            bad.append((chunk.name, number, str(e)))
            continue
        counts["read"] += 1
        src, tgt = pair or ("", "")  # a blank line of a TSV: a pair with empty sides
        if not usable(src, tgt):
            counts["empty side"] += 1
        elif src in s.heldout:
            counts["in dev or test"] += 1
        else:
            srcs.append(src)
            tgts.append(tgt)
    counts["bad"] = len(bad)
    src_ids, tgt_ids = _src.encode(srcs, out_type=int), _tgt.encode(tgts, out_type=int)
    kept, hashes = [], []
    for src, tgt, s_ids, t_ids in zip(srcs, tgts, src_ids, tgt_ids):
        # Dropped, not truncated: a cut target still ends in </s>, teaching the model to stop
        # early. The source gains </s>; the decoder's input and output each gain one token.
        if too_long(s_ids, s.max_src_len) or too_long(t_ids, s.max_tgt_len):
            counts["too long"] += 1
        elif s.max_len_ratio and max(len(s_ids), len(t_ids)) > s.max_len_ratio * min(
            len(s_ids), len(t_ids)
        ):
            counts["length ratio"] += 1
        else:
            kept.append((s_ids, t_ids))
            digest = hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=8).digest()
            hashes.append(int.from_bytes(digest, "little"))
    return Encoded(
        src=np.fromiter((i for s_ids, _ in kept for i in (*s_ids, EOS_ID)), s.dtype),
        tgt=np.fromiter((i for _, t_ids in kept for i in t_ids), s.dtype),
        src_len=np.array([len(s_ids) + 1 for s_ids, _ in kept], LENGTH_DTYPE),
        tgt_len=np.array([len(t_ids) for _, t_ids in kept], LENGTH_DTYPE),
        hashes=np.array(hashes, np.uint64),
        corpus=chunk.corpus,
        lines=len(chunk.lines),
        counts=counts,
        bad=bad,
    )
