"""A prepared training corpus, read from disk a batch at a time, and the seeded stream of
token batches over it.

Batching needs only the lengths arrays (4 bytes a pair); the token ids and their offsets stay
on disk, read a batch at a time, so memory does not grow with the corpus.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from mtrain.corpus import DataError
from mtrain.data import Batch, token_batches
from mtrain.prepare import MANIFEST
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID


class TokenCorpus:
    """The token ids of a prepared corpus: pair i is src[src_offsets[i]:src_offsets[i + 1]]."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        dtype = np.dtype(self.manifest["dtype"])
        self.src_len = np.load(directory / "src_len.npy")  # (N,) </s> included
        self.tgt_len = np.load(directory / "tgt_len.npy")  # (N,) pieces only
        self.src = TokenFile(directory, "src", dtype)
        self.tgt = TokenFile(directory, "tgt", dtype)

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

    def __init__(self, directory: Path, side: str, dtype: np.dtype):
        self.dtype = dtype
        path = directory / f"{side}_offsets.npy"
        offsets = np.load(path, mmap_mode="r")
        if offsets.dtype != np.int64:
            raise DataError(f"{path}: expected int64 offsets, found {offsets.dtype}")
        self.header = offsets.offset  # bytes before the first offset
        del offsets
        self.offsets = os.open(path, os.O_RDONLY)
        self.tokens = os.open(directory / f"{side}.bin", os.O_RDONLY)
        weakref.finalize(self, _close, self.offsets, self.tokens)

    def padded(self, indices: np.ndarray, lengths: np.ndarray, extra: int = 0) -> torch.Tensor:
        """(B, max length + extra) long tensor of the sequences `indices`, padded with PAD_ID."""
        size = self.dtype.itemsize
        out = np.full((len(indices), int(lengths.max()) + extra), PAD_ID, np.int64)
        for row, (i, n) in enumerate(zip(indices.tolist(), lengths.tolist())):
            start = int.from_bytes(os.pread(self.offsets, 8, self.header + 8 * i), "little")
            out[row, :n] = np.frombuffer(os.pread(self.tokens, n * size, start * size), self.dtype)
        return torch.from_numpy(out)


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


class BatchStream:
    """Training batches, epoch after epoch, each epoch in its own seeded order.

    Epoch e's order comes from a generator seeded with (seed, e) alone, so the stream's
    position is two numbers, the epoch and the batches of it already taken, and a resumed run
    takes exactly the batches an uninterrupted one would have. It yields each batch as the
    indices of its pairs, so that a process can skip the batches another process trains on.
    """

    def __init__(self, src_len: np.ndarray, tgt_len: np.ndarray, batch_tokens: int, seed: int):
        self.src_len, self.tgt_len = src_len, tgt_len
        self.batch_tokens, self.seed = batch_tokens, seed
        self.epoch, self.batches_done = 0, 0

    def epoch_order(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        return token_batches(self.src_len, self.tgt_len, self.batch_tokens, rng)

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            order = self.epoch_order(self.epoch)
            while self.batches_done < len(order):
                self.batches_done += 1
                yield order[self.batches_done - 1]
            self.epoch, self.batches_done = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]
