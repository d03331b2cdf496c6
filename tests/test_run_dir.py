"""Checkpoint averaging, and glances at a checkpoint that read its step or its end."""

import pytest
import torch

from mtrain.core.config import TrainConfig
from mtrain.run.directory import (
    LAST,
    CheckpointError,
    average_checkpoints,
    finished_record,
    load_checkpoint,
    peek_checkpoint,
    save_checkpoint,
)
from mtrain.training.state import Checkpoints

from .synthetic import small_model


def save_model(path, model, step, tokenizer="abc"):
    save_checkpoint(path, {"model": model.state_dict(), "tokenizer": tokenizer, "step": step})
    return path


def test_averaging_identical_checkpoints_is_the_identity(tmp_path):
    model = small_model(30, 40)
    paths = [save_model(tmp_path / f"step-{i}.pt", model, i) for i in range(3)]
    averaged = average_checkpoints(paths)
    assert averaged["steps"] == [0, 1, 2] and averaged["step"] == 2
    for name, tensor in model.state_dict().items():
        assert torch.equal(averaged["model"][name], tensor), name


def test_averaging_takes_the_mean_and_keeps_tied_weights_tied(tmp_path):
    a, b = small_model(30, 40, seed=1), small_model(30, 40, seed=2)
    averaged = average_checkpoints(
        [save_model(tmp_path / "a.pt", a, 1), save_model(tmp_path / "b.pt", b, 2)]
    )
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(averaged["model"][name], (tensor + b.state_dict()[name]) / 2)
    model = small_model(30, 40)
    model.load_state_dict(averaged["model"])
    assert model.output_projection.weight is model.tgt_embed.tokens.weight


def test_averaging_refuses_checkpoints_of_other_tokenizers_or_shapes(tmp_path):
    a = save_model(tmp_path / "a.pt", small_model(30, 40), 1)
    other_tokenizer = save_model(tmp_path / "b.pt", small_model(30, 40), 2, tokenizer="xyz")
    with pytest.raises(CheckpointError, match="SentencePiece models differ"):
        average_checkpoints([a, other_tokenizer])
    other_shape = save_model(tmp_path / "c.pt", small_model(30, 50), 3)
    with pytest.raises(CheckpointError, match="cannot average"):
        average_checkpoints([a, other_shape])


@pytest.mark.parametrize(
    "state, why",
    [
        ({"model": {}, "step": "7"}, "'step' holds a str"),
        ({"model": {"w": [1.0]}, "step": 7}, "other things than named tensors"),
        ({"step": 7}, "no model weights"),
    ],
)
def test_a_glance_at_a_checkpoint_refuses_what_loading_it_refuses(tmp_path, state, why):
    path = tmp_path / LAST
    save_checkpoint(path, {**state, "finished": {"reason": "max_steps", "lr": 0.0}})
    with pytest.raises(CheckpointError, match=why):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=why):
        peek_checkpoint(path)
    with pytest.raises(CheckpointError, match=why):
        Checkpoints(tmp_path, TrainConfig()).held()
    assert finished_record(path) is None  # `mtrain info` shows no end read from it


def test_a_glance_at_a_checkpoint_reads_its_step_and_end(tmp_path):
    path = save_model(tmp_path / LAST, small_model(30, 40), 7)
    assert Checkpoints(tmp_path, TrainConfig()).held().step == 7
    assert finished_record(path) is None  # still running
    finished = {"reason": "max_steps", "limit": 7, "lr": 0.0}
    save_checkpoint(path, {**load_checkpoint(path), "finished": finished})
    assert finished_record(path) == finished
