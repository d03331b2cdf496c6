"""What a run trains on, compared where it could differ: the batch order, the corpus counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from mtrain.core import config
from mtrain.core.distributed import Group
from mtrain.data import batching
from mtrain.data.corpus import DataError
from mtrain.data.prepared import identity
from mtrain.run.directory import CheckpointError
from mtrain.training.data import TrainingData

from .synthetic import REPO, overrides


@dataclass(frozen=True)
class Replies(Group):
    """A rank of a group whose broadcasts answer `replies`, one after another."""

    replies: list = field(default_factory=list)

    def broadcast(self, obj, startup=False):
        return self.replies.pop(0)


@pytest.fixture
def cfg(corpus, tmp_path) -> config.Config:
    return config.load(REPO / "configs" / "tiny.yaml", overrides(corpus))


def reordered(batches):
    """`ShapeGrid.batches` as another numpy build might give it: the same batches, another
    order."""
    return lambda *args: batches(*args)[::-1]


def test_a_resume_in_another_batch_order_is_refused(cfg, tmp_path, monkeypatch):
    state = TrainingData(cfg, tmp_path, Group(), False).state_dict()
    assert len(state["batch_order"]) == 64
    TrainingData(cfg, tmp_path, Group(), False).check_unchanged(state, tmp_path / "last.pt")
    monkeypatch.setattr(batching.ShapeGrid, "batches", reordered(batching.ShapeGrid.batches))
    other = TrainingData(cfg, tmp_path, Group(), False)
    with pytest.raises(CheckpointError, match=r"last\.pt: epoch 0's batch order differs here"):
        other.check_unchanged(state, tmp_path / "last.pt")


def test_a_resume_onto_other_corpus_counts_is_refused(cfg, tmp_path):
    data = TrainingData(cfg, tmp_path, Group(), False)
    state = data.state_dict()
    manifest = data.corpus.manifest
    assert state["corpus"] == {"pairs": manifest["pairs"], "tokens": manifest["tokens"]}
    state["corpus"] = {**state["corpus"], "pairs": manifest["pairs"] + 1}
    with pytest.raises(CheckpointError, match="other counts than the corpus"):
        data.check_unchanged(state, tmp_path / "last.pt")


def test_a_rank_whose_batch_order_differs_from_rank_0s_is_refused(cfg, tmp_path, monkeypatch):
    main = TrainingData(cfg, tmp_path, Group(), False)
    expected = identity(main.corpus.manifest), (main.stream.order_digest(0), np.__version__)
    TrainingData(cfg, tmp_path, Replies(rank=1, world_size=2, replies=list(expected)), False)
    monkeypatch.setattr(batching.ShapeGrid, "batches", reordered(batching.ShapeGrid.batches))
    group = Replies(rank=1, world_size=2, replies=list(expected))
    with pytest.raises(DataError, match="rank 1: the batch order differs from rank 0's"):
        TrainingData(cfg, tmp_path, group, False)
