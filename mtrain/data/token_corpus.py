"""A prepared training corpus (its format: prepared.py), read from disk a batch at a time.

Batching needs only the lengths arrays (4 bytes a pair); the token ids and their offsets stay
on disk, read a batch at a time, so memory does not grow with the corpus.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np
import torch

from mtrain.data.pairs import Batch
from mtrain.data.prepared import (
    DamagedCorpus,
    check_prepared,
    load_lengths,
    load_offsets,
    offsets_name,
    read_manifest,
    token_file,
    vocab_sizes,
)
from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


class TokenCorpus:
    """The token ids of a prepared corpus: pair i is src[src_offsets[i]:src_offsets[i + 1]]."""

    def __init__(self, directory: Path):
        """Open a prepared directory; DamagedCorpus unless its files agree with each other."""
        self.directory = directory
        self.manifest = read_manifest(directory)
        dtype = np.dtype(self.manifest["dtype"])
        self.src_len = load_lengths(directory, "src")  # (N,) </s> included
        self.tgt_len = load_lengths(directory, "tgt")  # (N,) pieces only
        check_prepared(directory, self.manifest, {"src": self.src_len, "tgt": self.tgt_len})
        vocab = vocab_sizes(directory, self.manifest)
        self.src = TokenFile(directory, "src", dtype, vocab.get("src"))
        self.tgt = TokenFile(directory, "tgt", dtype, vocab.get("tgt"))

    def __len__(self) -> int:
        return len(self.src_len)

    def collate(self, indices: np.ndarray) -> Batch:
        """The padded batch of pairs `indices`: src, <s> + tgt, tgt + </s>."""
        src = self.src.padded(indices, self.src_len[indices])
        tgt_len = self.tgt_len[indices]
        tgt = self.tgt.padded(indices, tgt_len, extra=1)
        tgt_in = torch.cat([torch.full((len(indices), 1), BOS_ID), tgt[:, :-1]], 1)
        tgt_out = tgt.scatter(1, torch.from_numpy(tgt_len.astype(np.int64))[:, None], EOS_ID)
        return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out)  # tgt_out: </s> after the last piece


class TokenFile:
    """One side's token ids, read a pair at a time with `pread`.

    Not memory-mapped: each random read of a map leaves its page and up to 64 KB of neighbours
    resident in the process, so a long run over a big corpus would come to hold it all.
    """

    def __init__(self, directory: Path, side: str, dtype: np.dtype, vocab: int | None = None):
        """`vocab`: the side's vocabulary size, which every id read must be below (None: the
        ids are not checked, for a corpus prepared before manifests recorded it)."""
        self.directory, self.side, self.dtype, self.vocab = directory, side, dtype, vocab
        offsets = load_offsets(directory, side)
        self.header = offsets.offset  # bytes before the first offset
        del offsets
        self.offsets = os.open(directory / offsets_name(side), os.O_RDONLY)
        self.tokens = os.open(token_file(directory, side), os.O_RDONLY)
        weakref.finalize(self, _close, self.offsets, self.tokens)

    def padded(self, indices: np.ndarray, lengths: np.ndarray, extra: int = 0) -> torch.Tensor:
        """(B, max length + extra) long tensor of the sequences `indices`, padded with PAD_ID."""
        size = self.dtype.itemsize
        out = np.full((len(indices), int(lengths.max()) + extra), PAD_ID, np.int64)
        for row, (i, n) in enumerate(zip(indices.tolist(), lengths.tolist())):
            start = int.from_bytes(self._read(self.offsets, 8, self.header + 8 * i), "little")
            out[row, :n] = np.frombuffer(
                self._read(self.tokens, n * size, start * size), self.dtype
            )
        if self.vocab is not None and int(out.max()) >= self.vocab:  # a damaged file: 0xFF...
            reason = f"{self.side}.bin holds ids past its vocabulary of {self.vocab}"
            raise DamagedCorpus(self.directory, reason)
        return torch.from_numpy(out)

    def _read(self, fd: int, size: int, offset: int) -> bytes:
        """`size` bytes at `offset`: a file cut short since it was opened is damage, not zeros."""
        data = os.pread(fd, size, offset)
        if len(data) != size:
            name = (
                offsets_name(self.side)
                if fd == self.offsets
                else token_file(self.directory, self.side).name
            )
            raise DamagedCorpus(self.directory, f"{name} ends before byte {offset + size}")
        return data


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def drop_final_punctuation(src: torch.Tensor, punctuation: torch.Tensor, p: float) -> torch.Tensor:
    """Sources as people type them: each loses its final punctuation piece with probability p.

    Nearly every training source ends in 。 ? or !, so without this a model reads a sentence
    typed without one as unfinished and translates it worse.
    """
    lengths = (src != PAD_ID).sum(1)  # (B,) pieces and </s>
    rows = torch.arange(len(src))
    last = src[rows, (lengths - 2).clamp(min=0)]  # (B,) the piece before </s>
    drop = torch.isin(last, punctuation) & (lengths >= 3) & (torch.rand(len(src)) < p)
    src = src.clone()
    src[rows[drop], lengths[drop] - 2] = EOS_ID
    src[rows[drop], lengths[drop] - 1] = PAD_ID
    return src
