"""model.variant: each variant is an ordinary run, and lacks what it says it lacks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

import mtrain
from mtrain.cli import app
from mtrain.core import config
from mtrain.core.config import VARIANTS, Config, ConfigError, ModelConfig
from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtrain.model.transformer import Transformer, variant_parts
from mtrain.training.start import check_resumable

from .synthetic import REPO, overrides

SWAPPED = [name for name in VARIANTS if name != "textbook"]


def variant_model(variant: str, seed: int = 0) -> Transformer:
    """A random two-layer model of `variant`, without dropout, in eval mode."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64, dropout=0.0
    )
    cfg = dataclasses.replace(cfg, variant=variant)
    return Transformer(cfg, 40, 40, max_len=30, pad_id=PAD_ID).eval()


def test_every_variant_is_one_swap_of_the_textbook():
    textbook = dataclasses.asdict(variant_parts("textbook"))
    for name in SWAPPED:
        changed = {
            k for k, v in dataclasses.asdict(variant_parts(name)).items() if textbook[k] != v
        }
        # no-layernorm also drops the LayerNorm that ends a pre-norm stack
        assert len(changed) == 1 or changed == {"connection", "final_norm"}, name


def test_an_unknown_variant_is_refused_naming_the_key_and_the_values():
    with pytest.raises(ConfigError) as refused:
        config.from_dict({"model": {"variant": "no-attention"}}, "x.yaml")
    message = str(refused.value)
    assert message.startswith("x.yaml: model.variant: expected one of textbook, no-positions")
    assert all(name in message for name in VARIANTS) and "'no-attention'" in message


def test_an_older_run_is_the_textbook():
    assert config.upgraded({"model": {}}, "old", lambda: 1)["model"]["variant"] == "textbook"
    assert config.upgraded({"model": {}, "version": 2}, "old")["model"]["variant"] == "textbook"
    assert Config().model.variant == "textbook"


def test_no_positions_makes_the_encoder_blind_to_order():
    """Permuting the source permutes the encoder output, and only that, without positions."""
    src = torch.tensor([[5, 6, 7, 8, 9, 10, EOS_ID], [11, 12, 13, 14, 15, 16, EOS_ID]])
    perm = torch.tensor([3, 0, 5, 1, 6, 2, 4])
    for variant, blind in (("no-positions", True), ("textbook", False)):
        model = variant_model(variant)
        with torch.no_grad():
            memory, _ = model.encode(src)  # (B, S, d_model)
            permuted, _ = model.encode(src[:, perm])
        same = torch.allclose(permuted, memory[:, perm], atol=1e-5)
        assert same == blind, variant


@pytest.mark.parametrize("variant, sees_ahead", [("peek", True), ("textbook", False)])
def test_peek_lets_teacher_forcing_see_later_targets(variant, sees_ahead):
    """In training a peeking decoder's earlier positions change with a later target; in
    evaluation (validation, decoding) they do not, as the textbook's never do."""
    model = variant_model(variant)
    src = torch.tensor([[5, 6, 7, EOS_ID]])
    tgt_in = torch.tensor([[BOS_ID, 8, 9, 10, 11]])
    later = tgt_in.clone()
    later[0, -1] = 12
    for training, changes in ((True, sees_ahead), (False, False)):
        model.train(training)  # dropout is 0: training differs in its masks only
        with torch.no_grad():
            a, b = model(src, tgt_in), model(src, later)  # (1, T, vocab)
        unchanged = torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)  # earlier positions
        assert unchanged != changes, training


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decoding_equals_the_full_forward(variant):
    """Step by step with the cache, the logits of teacher forcing in evaluation: peek too,
    whose look-ahead is lifted in training only (there the cache, which holds only the past,
    would differ from a forward that sees the future)."""
    model = variant_model(variant)
    src = torch.tensor([[5, 6, 7, 8, EOS_ID], [9, 10, EOS_ID, PAD_ID, PAD_ID]])
    tgt_in = torch.tensor([[BOS_ID, 11, 12, 13, 14, 15], [BOS_ID, 16, 17, 18, 19, 20]])
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        full = model.decode(tgt_in, memory, src_mask)  # (B, T, vocab)
        cache = model.start_cache(memory)
        steps = [model.decode(tgt_in[:, t : t + 1], memory, src_mask, cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def data(corpus) -> list[str]:
    return overrides(corpus, eval_every=2)


@pytest.mark.parametrize("variant", SWAPPED)
def test_a_variant_trains_resumes_and_translates(data, tmp_path, variant):
    tiny = REPO / "configs" / "tiny.yaml"
    settings = [*data, f"model.variant={variant}"]
    run = mtrain.train(tiny, tmp_path / "run", [*settings, "train.max_steps=2"], device="cpu")
    assert torch.load(run / "last.pt", weights_only=True)["step"] == 2
    mtrain.train(tiny, run, [*settings, "train.max_steps=4"], device="cpu")  # resumed
    assert torch.load(run / "last.pt", weights_only=True)["step"] == 4
    with pytest.raises(ConfigError, match=f"trained with model.variant='{variant}'"):
        check_resumable(run, config.load(tiny, data))

    model = mtrain.load(run, device="cpu")
    assert model.cfg.model.variant == variant
    greedy, beam = model.translate(["三四五", "六"], beam=1), model.translate("三四五", beam=3)
    assert len(greedy) == 2 and isinstance(beam, str)
    assert model.trace("三四五").translation == greedy[0]
    assert model.attention("三四五") is not None
    assert model.score("三四五", "three four five").pieces

    shown = CliRunner().invoke(app, ["info", str(run)])
    assert shown.exit_code == 0, shown.output
    assert f"variant {variant}: {VARIANTS[variant].lacks}" in shown.output
