"""Training batches: the shape grid, the seeded stream over it and its digest; and the
length-sorted batches of the dev set and of translation."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtrain.core import config
from mtrain.data import batching
from mtrain.data.batching import (
    BatchStream,
    ShapeGrid,
    length_batches,
    sorted_batches,
    split_batches,
)
from mtrain.data.prepare import prepare
from mtrain.data.token_corpus import TokenCorpus

REPO = Path(__file__).resolve().parent.parent


def random_lengths(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(2, 31, n).astype(np.uint16), rng.integers(1, 30, n).astype(np.uint16)


def greedy_batches(order, src_len, tgt_len, batch_tokens):
    """The one-pair-at-a-time greedy batching that split_batches computes a batch at a time."""
    batches, current, max_src, max_tgt = [], [], 0, 0
    for i in order:
        new_src, new_tgt = max(max_src, int(src_len[i])), max(max_tgt, int(tgt_len[i]) + 1)
        if current and (len(current) + 1) * (new_src + new_tgt) > batch_tokens:
            batches.append(current)
            current, new_src, new_tgt = [], int(src_len[i]), int(tgt_len[i]) + 1
        current.append(int(i))
        max_src, max_tgt = new_src, new_tgt
    return [*batches, current]


def test_grid_batches_cover_every_pair_once_within_budget():
    src_len, tgt_len = random_lengths(500)
    grid = ShapeGrid(src_len, tgt_len, 200)
    batches = grid.batches(np.random.default_rng(1))
    flat = sorted(int(i) for b in batches for i in b)
    assert flat == list(range(500))
    for b in batches:
        assert len(b) * (src_len[b].max() + tgt_len[b].max() + 1) <= 200
    same = grid.batches(np.random.default_rng(1))
    assert all(np.array_equal(a, b) for a, b in zip(batches, same))
    other = grid.batches(np.random.default_rng(2))
    assert not all(np.array_equal(a, b) for a, b in zip(batches, other))


def test_split_batches_is_the_greedy_partition():
    src_len, tgt_len = random_lengths(2000, seed=4)
    src_len[:3] = 60  # pairs that fill a batch alone
    order = np.random.default_rng(5).permutation(2000)
    order = order[np.lexsort((tgt_len[order], src_len[order]))]
    got = [b.tolist() for b in split_batches(order, src_len, tgt_len, 150)]
    assert got == greedy_batches(order, src_len, tgt_len, 150)
    shuffled = np.random.default_rng(6).permutation(2000)  # any order, not only sorted
    got = [b.tolist() for b in split_batches(shuffled, src_len, tgt_len, 150)]
    assert got == greedy_batches(shuffled, src_len, tgt_len, 150)


def test_batch_stream_resumes_exactly_where_it_stopped():
    src_len, tgt_len = random_lengths(300)
    stream = BatchStream(src_len, tgt_len, 200, seed=3)
    batches = iter(stream)
    for _ in range(70):  # past the end of the first epoch
        next(batches)
    assert stream.epoch == 1
    state = stream.state_dict()
    expected = [next(batches).indices for _ in range(40)]

    resumed = BatchStream(src_len, tgt_len, 200, seed=3)
    resumed.load_state_dict(state)
    got = [b.indices for b, _ in zip(resumed, range(40))]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_the_batch_order_digest_is_of_the_final_order(monkeypatch):
    src_len, tgt_len = random_lengths(300)
    stream = BatchStream(src_len, tgt_len, 200, seed=3)
    digest = stream.order_digest()
    assert stream.state_dict()["batch_order"] == digest
    assert BatchStream(src_len, tgt_len, 200, seed=3).order_digest() == digest
    assert stream.order_digest(1) != digest  # each epoch its own order
    assert BatchStream(src_len, tgt_len, 200, seed=4).order_digest() != digest
    swapped = BatchStream(src_len, tgt_len, 200, seed=3)
    order = swapped.epoch_order(0)
    order[0], order[1] = order[1], order[0]  # the same batches, two of them swapped
    assert swapped.order_digest() != digest


@pytest.fixture(scope="module")
def shipped_corpus(tmp_path_factory) -> tuple[TokenCorpus, config.Config]:
    """The shipped training corpus, prepared as configs/default.yaml prepares it."""
    cfg = config.load(REPO / "configs" / "default.yaml")
    for key in ("train", "dev", "test"):
        setattr(cfg.data, key, str(REPO / getattr(cfg.data, key)))
    cfg.data.prepared_dir = str(tmp_path_factory.mktemp("prepared"))
    return TokenCorpus(prepare(cfg, workers=2)), cfg


def test_shipped_corpus_meets_few_shapes_little_padding_and_full_batches(shipped_corpus):
    corpus, cfg = shipped_corpus
    budget = cfg.train.batch_tokens
    stream = BatchStream(corpus.src_len, corpus.tgt_len, budget, cfg.train.seed)
    grid = stream.grid
    met, tokens, positions = set(), 0, 0
    for epoch in range(3):  # the grid depends on the lengths alone: epochs meet the same shapes
        batches = stream.epoch_order(epoch)
        assert sorted(np.concatenate(batches).tolist()) == list(range(len(corpus)))
        for indices in batches:
            batch = corpus.collate(indices).padded_to(grid.shape(indices))
            rows, src_len = batch.src.shape
            met.add((rows, src_len, batch.tgt_in.size(1)))
            assert rows * (src_len + batch.tgt_in.size(1)) <= budget
            if epoch == 0:
                tokens += batch.n_tokens
                positions += batch.src.numel() + batch.tgt_out.numel()
    assert met == {(s.rows, s.src_len, s.tgt_len) for s in grid.shapes}
    assert len(met) <= batching.MAX_SHAPES
    padding = 1 - tokens / positions
    assert padding == pytest.approx(grid.padding) and padding < 0.10
    assert tokens == corpus.src_len.sum() + corpus.tgt_len.sum() + len(corpus)  # </s> or <s>
    # Batches stay full: about as many updates an epoch as batches padded to their longest.
    unpadded = sorted_batches(corpus.src_len, corpus.tgt_len, budget, np.random.default_rng(0))
    assert len(batches) <= 1.02 * len(unpadded)


# Lengths up to 71 source and decoder positions; budgets that hold one pair of each.


lengths = st.lists(st.tuples(st.integers(1, 71), st.integers(0, 70)), min_size=1, max_size=3000)


@settings(max_examples=60, deadline=None)
@given(lengths, st.integers(142, 4000), st.integers(0, 2**32 - 1), st.integers(3, 64))
def test_grid_batches_cover_each_pair_once_in_few_full_shapes(pairs, budget, seed, max_shapes):
    src_len = np.array([s for s, _ in pairs], np.uint16)
    tgt_len = np.array([t for _, t in pairs], np.uint16)
    original, batching.MAX_SHAPES = batching.MAX_SHAPES, max_shapes  # crosses the search for fewer
    try:
        grid, again = [ShapeGrid(src_len, tgt_len, budget) for _ in range(2)]
    finally:
        batching.MAX_SHAPES = original
    assert len(grid.shapes) <= max_shapes
    batches = grid.batches(np.random.default_rng(seed))
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(pairs)))
    partial = 0
    for indices in batches:
        shape = grid.shape(indices)
        assert shape.rows * (shape.src_len + shape.tgt_len) <= budget
        assert src_len[indices].max() <= shape.src_len
        assert tgt_len[indices].max() + 1 <= shape.tgt_len
        assert len(indices) <= shape.rows
        partial += len(indices) < shape.rows
    assert partial <= 1  # only the last cell may end in a batch it does not fill
    # The same lengths, budget and seed make the same batches (what an exact resume relies on).
    repeated = again.batches(np.random.default_rng(seed))
    assert len(repeated) == len(batches)
    assert all(np.array_equal(a, b) for a, b in zip(batches, repeated))


def test_the_stream_builds_its_grid_once_and_hands_out_each_batch_with_its_shape(monkeypatch):
    built = []

    class Counted(ShapeGrid):
        def __init__(self, *args):
            built.append(args)
            super().__init__(*args)

    monkeypatch.setattr(batching, "ShapeGrid", Counted)
    src_len, tgt_len = random_lengths(300)
    stream = BatchStream(src_len, tgt_len, 200, seed=3)
    plans = [plan for plan, _ in zip(stream, range(3 * len(stream.epoch_order(0))))]
    assert stream.epoch >= 2 and len(built) == 1  # three epochs, one grid
    for plan in plans:
        assert plan.shape == stream.grid.shape(plan.indices)
        assert len(plan.indices) <= plan.shape.rows
        assert src_len[plan.indices].max() <= plan.shape.src_len
        assert tgt_len[plan.indices].max() + 1 <= plan.shape.tgt_len


def test_length_batches_sort_and_respect_the_budget():
    lengths = [5, 1, 9, 3, 3, 7, 2]
    batches = length_batches(lengths, 10)
    assert sorted(i for b in batches for i in b) == list(range(7))
    order = [lengths[i] for b in batches for i in b]
    assert order == sorted(order)
    assert all(len(b) * max(lengths[i] for i in b) <= 10 for b in batches)
