"""Checkpoint averaging."""

import pytest
import torch

from mtrain.run_dir import CheckpointError, average_checkpoints, save_checkpoint

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
