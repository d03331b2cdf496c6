"""model.variant: each variant is an ordinary run, and lacks what it says it lacks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import mtrain
from mtrain.cli import app
from mtrain.core import config
from mtrain.core.config import MODEL_VARIANTS, Config, ConfigError, ModelConfig
from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtrain.model.transformer import PeekingMask, Transformer, variant_parts
from mtrain.training.start import check_resumable

from .synthetic import REPO, overrides

SWAPPED = [name for name in MODEL_VARIANTS if name != "textbook"]


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
    assert all(name in message for name in MODEL_VARIANTS) and "'no-attention'" in message


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


@pytest.mark.parametrize("variant", list(MODEL_VARIANTS))
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
    shown = model.attention("三四五")  # the maps of that translation: rows are distributions
    assert shown.source == model.trace("三四五").source_pieces
    assert len(shown.cross) == model.cfg.model.n_decoder_layers
    for cross in shown.cross:
        assert cross.shape == (model.cfg.model.n_heads, len(shown.output), len(shown.source))
        np.testing.assert_allclose(cross.sum(axis=-1), 1.0, atol=1e-5)
    assert model.score("三四五", "three four five").pieces

    shown = CliRunner().invoke(app, ["info", str(run)])
    assert shown.exit_code == 0, shown.output
    assert f"variant {variant}: {MODEL_VARIANTS[variant].lacks}" in shown.output


def test_no_scale_scores_are_sqrt_dk_times_the_textbooks():
    """Same weights, same input: the attention logits of no-scale are √d_k times the baseline's
    (log-weights are logits less a per-row constant), and its fused path (no weights kept)
    computes the textbook's with queries √d_k times larger."""
    src = torch.tensor([[5, 6, 7, 8, 9, EOS_ID], [10, 11, 12, EOS_ID, PAD_ID, PAD_ID]])
    textbook, no_scale = variant_model("textbook"), variant_model("no-scale")
    assert all(torch.equal(a, b) for a, b in zip(textbook.parameters(), no_scale.parameters()))
    d_k = 32 // 4
    logits = []
    for model in (textbook, no_scale):
        model.record_attention(True)
        with torch.no_grad():
            model.encode(src)
        weights = model.attention_weights()["encoder"][0][:, :, :, :4]  # (B, h, S, S), 4 keys
        log = weights[0].log()  # sentence 0's keys are all real: no -inf
        logits.append(log - log.mean(dim=-1, keepdim=True))  # the per-row constant removed
        model.record_attention(False)
    torch.testing.assert_close(logits[1], logits[0] * d_k**0.5, atol=1e-4, rtol=1e-4)

    x = torch.randn(2, 6, 32)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    attn = textbook.encoder.layers[0].self_attn
    with torch.no_grad():
        raw = no_scale.encoder.layers[0].self_attn(x, x, mask)
        scaled = textbook.encoder.layers[0].self_attn(x, x, mask)
        attn.q_proj.weight.mul_(d_k**0.5)
        attn.q_proj.bias.mul_(d_k**0.5)
        larger = attn(x, x, mask)
    torch.testing.assert_close(raw, larger, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(raw, scaled, atol=1e-3)


def silenced(layer: torch.nn.Module, keep: str = "") -> torch.nn.Module:
    """An encoder layer whose sublayers output zeros (every weight of theirs zeroed), or, with
    `keep="feed_forward"`, a feed-forward of no bias: ReLU(x W1) W2, so f(c x) = c f(x)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                continue
            if name.startswith("self_attn") or not keep or name.endswith("bias"):
                p.zero_()
    return layer


@pytest.mark.parametrize("variant, skips", [("textbook", True), ("no-residual", False)])
def test_no_residual_has_no_skip_connection(variant, skips):
    """Sublayers that output zeros: a layer with skip connections passes its input through,
    one without outputs zeros (pre-norm: nothing is added after the sublayer)."""
    layer = silenced(variant_model(variant).encoder.layers[0])
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        out = layer(x, torch.ones(2, 1, 1, 5, dtype=torch.bool))
    torch.testing.assert_close(out, x if skips else torch.zeros_like(x))


@pytest.mark.parametrize("variant, normalises", [("textbook", True), ("no-layernorm", False)])
def test_no_layernorm_has_no_layernorm_in_its_path(variant, normalises):
    """A LayerNorm takes the scale out of a sublayer's input: with a bias-free feed-forward
    (f(c x) = c f(x)) and a silent attention, the textbook's layer adds the same f(LN(x)) to
    x and to 10 x; without LayerNorm the layer is x + f(x), scaled by 10 with its input. And
    the textbook's encoder output rows are normalised (mean 0, variance 1), no-layernorm's not."""
    model = variant_model(variant)
    layer = silenced(model.encoder.layers[0], keep="feed_forward")
    x = torch.randn(2, 5, 32)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    with torch.no_grad():
        once, tenfold = layer(x, mask), layer(10 * x, mask)
    if normalises:
        torch.testing.assert_close(tenfold - 10 * x, once - x, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(tenfold, 10 * once, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(tenfold - 10 * x, once - x, atol=1e-2)

    with torch.no_grad():
        memory, _ = variant_model(variant).encode(torch.tensor([[5, 6, 7, 8, EOS_ID]]))
    rows_normalised = torch.allclose(memory.mean(-1), torch.zeros(1, 5), atol=1e-4) and (
        torch.allclose(memory.var(-1, unbiased=False), torch.ones(1, 5), atol=1e-2)
    )
    assert rows_normalised == normalises


def test_no_positions_leaves_the_decoder_order_through_its_causal_mask():
    """The decoder of no-positions is not a bag of pieces: each position attends to those
    before it, so its outputs for a permuted prefix are not the outputs permuted; only the
    encoder's are (test_no_positions_makes_the_encoder_blind_to_order)."""
    model = variant_model("no-positions")
    src = torch.tensor([[5, 6, 7, EOS_ID]])
    tgt_in = torch.tensor([[BOS_ID, 8, 9, 10, 11, 12]])
    perm = torch.tensor([0, 3, 1, 5, 2, 4])  # <s> stays first
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        states = model.decoder_states(tgt_in, memory, src_mask)  # (1, T, d_model)
        permuted = model.decoder_states(tgt_in[:, perm], memory, src_mask)
        # A decoder that saw every position (no mask) would be order-blind, as the encoder is.
        model.decoder_mask = PeekingMask().train()  # padding only: no causal mask
        unmasked = model.decoder_states(tgt_in, memory, src_mask)
        unmasked_permuted = model.decoder_states(tgt_in[:, perm], memory, src_mask)
    assert not torch.allclose(permuted, states[:, perm], atol=1e-3)
    torch.testing.assert_close(permuted[:, 0], states[:, 0])  # <s> sees itself alone, in both
    torch.testing.assert_close(unmasked_permuted, unmasked[:, perm], atol=1e-5, rtol=1e-4)
