"""Batches by tokens: training's shape grid and its seeded stream, epoch after epoch; and the
length-sorted batches of the dev set and of translation.

Training batches are planned from the corpus's lengths alone: the `ShapeGrid` gives every pair
a cell and every cell a padded shape, and the `BatchStream` hands out the grid's batches in each
epoch's seeded order, each with the shape it is padded to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from mtrain.data.pairs import Batch, Example, Shape

# The shape grid. On the CPU, bf16 kernels are kept per (rows, source, target) shape a run
# meets, and CUDA graphs and torch.compile need few shapes, so training batches come in a small
# fixed set of shapes. Lengths are padded up to rungs: each length to DENSE_LENGTHS (short
# sentences are most of a corpus, where a padded position costs most), then a ladder growing
# by RUNG_RATIO. On the shipped corpus with configs/default.yaml this keeps 60 shapes and pads
# 4.8% of positions, against 164 shapes and 4.1% when every batch is padded to its longest.
DENSE_LENGTHS = 10
RUNG_RATIO = 1.2
MAX_SHAPES = 64  # the most distinct batch shapes of a run
FIRST_MIN_BATCHES = 2  # a length cell keeps a shape of its own if it fills this many batches


def rungs(longest: int) -> list[int]:
    """The lengths a batch is padded up to: 1..DENSE_LENGTHS, then ×RUNG_RATIO, then `longest`."""
    out = list(range(1, min(DENSE_LENGTHS, longest) + 1))
    while out[-1] < longest:
        out.append(min(longest, max(out[-1] + 1, round(out[-1] * RUNG_RATIO))))
    return out


class ShapeGrid:
    """Every training pair's cell on the grid, and each cell's batch shape.

    A cell is a (source rung, target rung) pair whose batches hold `batch_tokens // (source
    rung + target rung)` pairs. A cell holds the pairs whose lengths round up to it, less the
    pairs that do not fill its last batch (or all of them, when they fill fewer than
    `min_batches` batches): those move one rung up, source or target, whichever step is
    shorter, and the longest go, so each cell but the last fills whole batches. The last cell
    keeps what reaches it. `min_batches` grows until at most MAX_SHAPES cells remain. The plan
    depends on the lengths alone, so every epoch, every process and a resumed run meet the
    same shapes.
    """

    def __init__(self, src_len: np.ndarray, tgt_len: np.ndarray, batch_tokens: int):
        src = src_len.astype(np.int64)  # (N,) </s> included
        tgt = tgt_len.astype(np.int64) + 1  # (N,) decoder positions
        self.src_rungs = rungs(int(src.max(initial=1)))
        self.tgt_rungs = rungs(int(tgt.max(initial=1)))
        width = self.tgt_rungs[-1] + 1
        key = src * width + tgt  # (N,) the exact lengths as one number
        counts = np.bincount(key, minlength=(self.src_rungs[-1] + 1) * width).reshape(-1, width)
        self.batch_tokens = batch_tokens
        min_batches = FIRST_MIN_BATCHES
        while True:
            cells, self.shapes = self._plan(counts, min_batches)
            if len(self.shapes) <= MAX_SHAPES:
                break
            min_batches += 1
        # Pairs of one exact length, in index order, fill their cells in the order planned.
        order = np.argsort(key, kind="stable")
        plan = sorted(
            (a * width + b, cell, n) for (a, b), placed in cells.items() for cell, n in placed
        )
        self.cell_of = np.empty(len(src), np.uint8)  # MAX_SHAPES < 256
        self.cell_of[order] = np.repeat([c for _, c, _ in plan], [n for _, _, n in plan])
        self.sizes = np.bincount(self.cell_of, minlength=len(self.shapes))  # pairs per cell
        positions = sum(
            -(-int(n) // shape.rows) * shape.rows * (shape.src_len + shape.tgt_len)
            for shape, n in zip(self.shapes, self.sizes)
        )
        # Of an epoch's padded positions, the share that holds no token.
        self.padding = 1 - int(src.sum() + tgt.sum()) / max(positions, 1)

    def _plan(self, counts: np.ndarray, min_batches: int):
        """For each exact length, the pairs each cell takes; and the cells' shapes."""
        src_rungs, tgt_rungs = self.src_rungs, self.tgt_rungs
        n_src, n_tgt = len(src_rungs), len(tgt_rungs)
        rung_of_src = np.searchsorted(src_rungs, np.arange(counts.shape[0]))
        rung_of_tgt = np.searchsorted(tgt_rungs, np.arange(counts.shape[1]))
        pools: dict[tuple[int, int], dict[tuple[int, int], int]] = {}
        for a, b in zip(*np.nonzero(counts)):
            cell = (int(rung_of_src[a]), int(rung_of_tgt[b]))
            pools.setdefault(cell, {})[int(a), int(b)] = int(counts[a, b])
        placed: dict[tuple[int, int], list[tuple[int, int]]] = {}
        shapes: list[Shape] = []
        # By anti-diagonal: a cell's pairs only ever move to a cell planned later.
        for i, j in sorted(np.ndindex(n_src, n_tgt), key=lambda c: (c[0] + c[1], c[0])):
            pool = pools.pop((i, j), {})
            size = sum(pool.values())
            if not size:
                continue
            rows = max(1, self.batch_tokens // (src_rungs[i] + tgt_rungs[j]))
            if i == n_src - 1 and j == n_tgt - 1:
                keep, up_src = size, False
            else:
                keep = size // rows * rows
                keep = keep if keep >= min_batches * rows else 0
                # Up the shorter step: the pairs that move gain the fewest padded positions.
                up_src = j == n_tgt - 1 or (
                    i < n_src - 1
                    and src_rungs[i + 1] - src_rungs[i] < tgt_rungs[j + 1] - tgt_rungs[j]
                )
            kept, moved = split_pool(pool, keep, side=0 if up_src else 1)
            if kept:
                for length, n in kept:
                    placed.setdefault(length, []).append((len(shapes), n))
                shapes.append(Shape(rows, src_rungs[i], tgt_rungs[j]))
            target = pools.setdefault((i + 1, j) if up_src else (i, j + 1), {}) if moved else {}
            for length, n in moved:
                target[length] = target.get(length, 0) + n
        return placed, shapes

    def batches(self, rng: np.random.Generator) -> list[np.ndarray]:
        """One epoch's batches of pair indices: each cell's pairs in random order, cut into
        its rows, and the batches of all cells in random order."""
        n = len(self.cell_of)
        # 4-byte indices: at 10M pairs the process's peak fell from 596 to 472 MB.
        shuffled = rng.permutation(np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64))
        order = shuffled[np.argsort(self.cell_of[shuffled], kind="stable")]  # by cell, random
        del shuffled
        batches, start = [], 0
        for shape, size in zip(self.shapes, self.sizes.tolist()):
            batches += [
                order[s : min(s + shape.rows, start + size)]
                for s in range(start, start + size, shape.rows)
            ]
            start += size
        return [batches[i] for i in rng.permutation(len(batches))]

    def shape(self, indices: np.ndarray) -> Shape:
        """The shape of a batch of `batches`."""
        return self.shapes[self.cell_of[indices[0]]]


def split_pool(
    pool: dict[tuple[int, int], int], keep: int, side: int
) -> tuple[list[tuple[tuple[int, int], int]], list[tuple[tuple[int, int], int]]]:
    """Split a cell's pairs, counted by (source, decoder) length, into the `keep` shortest on
    `side` (0: source, 1: decoder) and the rest."""
    kept, moved = [], []
    for length in sorted(pool, key=lambda x: (x[side], x[1 - side])):
        n = pool[length]
        here = min(n, keep)
        if here:
            kept.append((length, here))
        if n > here:
            moved.append((length, n - here))
        keep -= here
    return kept, moved


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """A training batch before it is read: the indices of its pairs and its padded shape."""

    indices: np.ndarray  # (rows,) pair indices, at most `shape.rows`
    shape: Shape
    epoch: int = 0  # the batch's place in the stream: epoch `epoch`'s batch number `number`
    number: int = 0


class BatchStream:
    """Training batches on one shape grid, epoch after epoch, each epoch in its own seeded order.

    The grid is built once, from the lengths alone. Epoch e's order comes from a generator
    seeded with (seed, e) alone, so the stream's position is two numbers, the epoch and the
    batches of it already taken, and a resumed run takes exactly the batches an uninterrupted
    one would have. It yields each batch as a `BatchPlan`, the indices of its pairs and its
    shape, so that a process can skip the batches another process trains on without reading
    them.
    """

    def __init__(self, src_len: np.ndarray, tgt_len: np.ndarray, batch_tokens: int, seed: int):
        self.grid = ShapeGrid(src_len, tgt_len, batch_tokens)
        self.seed = seed
        self.epoch, self.batches_done = 0, 0
        self._order: tuple[int, list[np.ndarray]] | None = None  # the last epoch's, reused

    def epoch_order(self, epoch: int) -> list[np.ndarray]:
        """Epoch `epoch`'s batches of pair indices, in the order they are trained on."""
        order = self._order  # read once: the batch thread may replace it meanwhile
        if order is None or order[0] != epoch:
            order = epoch, self.grid.batches(np.random.default_rng([self.seed, epoch]))
            self._order = order
        return order[1]

    def order_digest(self, epoch: int | None = None) -> str:
        """SHA-256 of an epoch's batches, in order (the current epoch's by default): numpy
        promises its random streams only within one build, so machines and numpy versions
        are compared by this, not trusted to agree."""
        digest = hashlib.sha256()
        for batch in self.epoch_order(self.epoch if epoch is None else epoch):
            digest.update(len(batch).to_bytes(8, "little"))
            digest.update(batch.astype("<i8").tobytes())
        return digest.hexdigest()

    def __iter__(self) -> Iterator[BatchPlan]:
        for plan in self.plans(self.epoch, self.batches_done):
            self.passed(plan)
            yield plan

    def plans(self, epoch: int, batches_done: int) -> Iterator[BatchPlan]:
        """The batches from a position on, without moving the stream: `passed` moves it."""
        while True:
            order = self.epoch_order(epoch)
            for number in range(batches_done, len(order)):
                indices = order[number]
                yield BatchPlan(indices, self.grid.shape(indices), epoch, number)
            epoch, batches_done = epoch + 1, 0

    def passed(self, plan: BatchPlan) -> None:
        """Move the stream's position past the batch `plan`."""
        self.epoch, self.batches_done = plan.epoch, plan.number + 1

    def state_dict(self) -> dict:
        """The stream's position, and the digest of its epoch's order to check it by."""
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "batch_order": self.order_digest(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]


def sorted_batches(
    src_len: np.ndarray, tgt_len: np.ndarray, batch_tokens: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Group pair indices into batches of at most `batch_tokens` padded tokens.

    Pairs are sorted by (source, target) length, ties in random order, so each batch holds
    similar lengths and little padding; the order of the batches is then shuffled. `tgt_len`
    counts pieces: the decoder's side of a pair is one longer (<s> or </s>).
    """
    n = len(src_len)
    shuffled = rng.permutation(np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64))
    key = src_len[shuffled].astype(np.uint32) << 16 | tgt_len[shuffled].astype(np.uint32)
    order = shuffled[np.argsort(key, kind="stable")]  # by (source, target) length, ties random
    del shuffled, key
    batches = split_batches(order, src_len, tgt_len, batch_tokens)
    return [batches[i] for i in rng.permutation(len(batches))]


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices of sources sorted by length (ties in input order), cut into batches of at most
    `batch_tokens` padded tokens: the batches of translation, which has no target."""
    src_len = np.array(lengths, dtype=np.int64)
    order = np.argsort(src_len, kind="stable")
    return [batch.tolist() for batch in split_batches(order, src_len, None, batch_tokens)]


def split_batches(
    order: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray | None, batch_tokens: int
) -> list[np.ndarray]:
    """Cut `order` into consecutive batches, each the most pairs that fit in `batch_tokens`.

    A batch of k pairs costs k × (longest source + longest target), which only grows with k,
    so each cut is a binary search; the longest pair is no shorter than the first, so k is at
    most batch_tokens // (first pair's cost): that bounds how far it looks. The result is the
    greedy one-pair-at-a-time partition, computed a batch at a time. With no `tgt_len`, the
    batches hold sources alone, and k sources cost k × the longest.
    """
    src = src_len[order].astype(np.int32)
    tgt = np.zeros_like(src) if tgt_len is None else tgt_len[order].astype(np.int32) + 1
    batches, start, n = [], 0, len(order)
    while start < n:
        window = min(n - start, batch_tokens // int(src[start] + tgt[start]) + 1)
        end = start + window
        cost = np.arange(1, window + 1) * (
            np.maximum.accumulate(src[start:end]) + np.maximum.accumulate(tgt[start:end])
        )
        size = max(1, int(np.searchsorted(cost, batch_tokens, side="right")))
        batches.append(order[start : start + size])
        start += size
    return batches


def example_batches(examples: list[Example], batch_tokens: int) -> Iterator[Batch]:
    """Padded batches of in-memory examples (dev), grouped by length in a fixed order."""
    src_len = np.array([len(ex.src) for ex in examples])
    tgt_len = np.array([len(ex.tgt) for ex in examples])
    for indices in sorted_batches(src_len, tgt_len, batch_tokens, np.random.default_rng(0)):
        yield Batch.collate([examples[i] for i in indices])
