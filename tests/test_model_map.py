"""`mtrain info`: the textbook parts of the model and parameter counts with ties counted once."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mtrain.cli import app
from mtrain.core import config
from mtrain.core.config import ModelConfig
from mtrain.model import parameter_map
from mtrain.model.transformer import Transformer
from mtrain.run.directory import write_config
from mtrain.training.build import build_trainer

from .synthetic import REPO, small_config


@pytest.mark.parametrize(
    "tie, joint, norm", [(True, False, "pre"), (True, True, "pre"), (False, False, "post")]
)
def test_counts_equal_the_models_parameters(tie, joint, norm):
    cfg = ModelConfig(
        d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=1, d_ff=48, norm=norm,
        tie_embeddings=tie,
    )  # fmt: skip
    model = Transformer(cfg, 300, 300 if joint else 280, 20, 0, joint_vocab=joint)
    parts = parameter_map.parts(model)
    total = sum(p.numel() for p in model.parameters())  # counts a shared tensor once
    assert parameter_map.total(parts) == total
    assert sum(p.parameters for p in parts if p.depth == 1) == total  # the top parts partition it
    leaves = [
        p for i, p in enumerate(parts) if i + 1 == len(parts) or parts[i + 1].depth <= p.depth
    ]
    assert sum(p.parameters for p in leaves) == total
    names = [p.name for p in parts]
    assert names.count("masked self-attention") == 1 and names.count("self-attention") == 2
    projection = parts[-1]
    if tie:
        owner = "source embedding" if joint else "target embedding"
        assert projection.tied_to == owner
        assert projection.parameters == (300 if joint else 280)  # the bias only
        assert "output projection" in next(p for p in parts if p.name == owner).shared_with
    else:
        assert not projection.tied_to and projection.parameters == 32 * 280 + 280


def test_info_json_on_a_run(corpus, tmp_path):
    cfg = small_config(corpus, max_steps=10, eval_every=10)
    trainer = build_trainer(cfg, tmp_path, torch.device("cpu"))
    trainer.run()
    write_config(tmp_path, cfg)
    result = CliRunner().invoke(app, ["info", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["parameters"] == sum(p.numel() for p in trainer.model.parameters())
    assert info["tokenizer"]["src_vocab"] == trainer.data.tokenizer.src_vocab_size
    assert info["training"]["steps"] == 10
    assert {"last.pt", "best.pt"} <= set(info["training"]["checkpoints"])
    assert info["config"]["model"]["d_model"] == cfg.model.d_model

    text = CliRunner().invoke(app, ["info", str(tmp_path)])
    assert text.exit_code == 0, text.output
    assert f"total: {info['parameters']:,} parameters" in text.stdout
    assert "cross-attention" in text.stdout and "best dev BLEU" in text.stdout


def test_info_of_a_config_before_training():
    path = REPO / "configs" / "default.yaml"
    result = CliRunner().invoke(app, ["info", "--config", str(path)])
    assert result.exit_code == 0, result.output
    cfg = config.load(path)
    vocab, max_len = (cfg.tokenizer.vocab_size, cfg.tokenizer.tgt_size), cfg.data.max_src_len
    model = Transformer(cfg.model, *vocab, max_len, 0)
    assert f"total: {sum(p.numel() for p in model.parameters()):,} parameters" in result.stdout
