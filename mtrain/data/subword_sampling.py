"""Subword sampling (Kudo, 2018): training sources cut afresh at each use.

The prepared corpus stores each source in its best segmentation. With sampling, each batch's
sources are decoded back to text and cut again, each into one of the source model's `NBEST`
best segmentations, drawn with probability ∝ P^alpha. Targets keep their stored segmentation,
so the loss counts the same tokens. A batch's draws come from a generator seeded with the run's
seed and the batch's place in the stream alone, so they do not depend on the thread that makes
the batch, nor on when: a resumed run draws what an uninterrupted one does.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import sentencepiece as spm
import torch

from mtrain.data.batching import BatchPlan
from mtrain.data.tokenizer import EOS_ID, PAD_ID

NBEST = 16  # segmentations a source is drawn from
# Batches are planned for sources this share longer than stored (at least one piece), so that
# a longer cut fits the batch's width. On the shipped corpus with configs/default.yaml, alpha
# 0.2 then changes 54% of the sources (61% with no width limit, 16% with no room), and padding
# takes 6.6% of a batch's positions instead of 4.1%.
ROOM = 0.05
DRAWS = 0x5357  # keeps the draws' generators apart from the epochs' orders, seeded [seed, epoch]


def planned_lengths(src_len: np.ndarray, max_src_len: int) -> np.ndarray:
    """(N,) the source lengths, </s> included, that batches are planned for: with `ROOM`, but
    never past `max_src_len`, the longest source the model reads."""
    room = np.ceil(src_len * ROOM).astype(np.int64)  # (N,)
    longer = np.minimum(src_len.astype(np.int64) + room, max_src_len)
    return np.maximum(longer, src_len).astype(src_len.dtype)


class SourceSampler:
    """Draws each training source's segmentation from the source model's n best."""

    def __init__(self, model_proto: bytes, alpha: float, seed: int):
        """`model_proto`: the serialised source SentencePiece model (a unigram model)."""
        # A processor of its own, as it runs in the batch thread; one thread for its batch
        # calls, not one per core beside training's.
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto, num_threads=1)
        self.alpha, self.seed = alpha, seed
        # (V,) each piece's log probability: a segmentation's log P is the sum over its pieces.
        self.log_p = np.array([self.sp.get_score(i) for i in range(self.sp.get_piece_size())])

    def generator(self, plan: BatchPlan) -> np.random.Generator:
        """The generator of batch `plan`'s draws: its place in the stream decides them."""
        return np.random.default_rng([self.seed, plan.epoch, plan.number, DRAWS])

    def resegment(self, src: torch.Tensor, width: int, rng: np.random.Generator) -> torch.Tensor:
        """`src` (B, S) stored sources, each cut again: (B, S') with S' <= `width`, </s> included.

        A source draws only among the segmentations that leave room for </s> within `width`,
        so the batch keeps its planned shape; the stored one, the best, always fits.
        """
        lengths = (src != PAD_ID).sum(1).tolist()  # pieces and </s>
        stored = [row[: n - 1] for row, n in zip(src.tolist(), lengths)]
        nbests = self.sp.nbest_encode(self.sp.decode(stored), nbest_size=NBEST, out_type=int)
        candidates = [c for cands in nbests for c in cands]
        sizes = np.array([len(c) for c in candidates])  # (C,) pieces of each candidate
        ids = np.fromiter(itertools.chain.from_iterable(candidates), np.int64, int(sizes.sum()))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # (C,) empty texts are not trained
        logits = (self.alpha * np.add.reduceat(self.log_p[ids], starts)).tolist()  # (C,)
        draws = rng.random(len(stored)).tolist()  # (B,) one uniform draw a source
        chosen, first = [], 0
        for own, cands, u in zip(stored, nbests, draws):
            fits = [k for k, c in enumerate(cands) if len(c) < width]
            chosen.append(draw(cands, fits, logits[first : first + len(cands)], u) or own)
            first += len(cands)
        out = np.full((len(chosen), max(map(len, chosen)) + 1), PAD_ID, np.int64)
        for row, pieces in enumerate(chosen):
            out[row, : len(pieces)] = pieces
            out[row, len(pieces)] = EOS_ID
        return torch.from_numpy(out)


def draw(cands: list[list[int]], fits: list[int], logits: list[float], u: float) -> list[int]:
    """The candidate among `fits` that the uniform draw `u` picks, with probability ∝
    exp(logit); none when none fits."""
    if not fits:
        return []
    top = max(logits[k] for k in fits)
    weights = [math.exp(logits[k] - top) for k in fits]
    target, total = u * sum(weights), 0.0
    for k, weight in zip(fits, weights):
        total += weight
        if total > target:
            return cands[k]
    return cands[fits[-1]]  # rounding: u close to 1
