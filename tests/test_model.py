import pytest
import torch
import torch.nn.functional as F

from mtrain.core.config import ModelConfig
from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtrain.model.transformer import Dropout, Transformer, attention, causal_mask, padding_mask

from .synthetic import small_model

VOCAB = 50


def make_model(norm="pre", seed=0) -> Transformer:
    return small_model(VOCAB, VOCAB + 7, norm=norm, seed=seed)


def tokens(batch, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (batch, length), generator=g)


def test_masks():
    m = padding_mask(torch.tensor([[5, 6, PAD_ID]]), PAD_ID)
    assert m.shape == (1, 1, 1, 3) and m.tolist() == [[[[True, True, False]]]]
    c = causal_mask(3, torch.device("cpu"))
    assert c[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_output_shapes(norm):
    model = make_model(norm)
    src, tgt_in = tokens(3, 9), tokens(3, 7)
    memory, src_mask = model.encode(src)
    assert memory.shape == (3, 9, 32) and src_mask.shape == (3, 1, 1, 9)
    logits = model(src, tgt_in)
    assert logits.shape == (3, 7, VOCAB + 7)
    assert torch.equal(logits, model.decode(tgt_in, memory, src_mask))


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_decoder_is_causal(norm):
    """Changing future decoder tokens leaves earlier logits unchanged."""
    model = make_model(norm)
    src, tgt_in = tokens(2, 6), tokens(2, 8)
    changed = tgt_in.clone()
    changed[:, 5:] = tokens(2, 3, seed=9)
    a, b = model(src, tgt_in), model(src, changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_padding_invariance(norm):
    """Extra padding on source or target leaves the logits of real positions unchanged."""
    model = make_model(norm)
    src, tgt_in = tokens(2, 6), tokens(2, 5)
    padded_src = F.pad(src, (0, 4), value=PAD_ID)
    padded_tgt = F.pad(tgt_in, (0, 3), value=PAD_ID)
    reference = model(src, tgt_in)
    torch.testing.assert_close(model(padded_src, tgt_in), reference)
    torch.testing.assert_close(model(src, padded_tgt)[:, :5], reference)


def test_batch_invariance():
    """A sentence's logits do not depend on the other, shorter sentences in its batch."""
    model = make_model()
    src, tgt_in = tokens(1, 7), tokens(1, 6)
    short_src = F.pad(tokens(1, 3, seed=5), (0, 4), value=PAD_ID)
    short_tgt = F.pad(tokens(1, 2, seed=6), (0, 4), value=PAD_ID)
    batched = model(torch.cat([src, short_src]), torch.cat([tgt_in, short_tgt]))
    torch.testing.assert_close(batched[:1], model(src, tgt_in))


def test_source_matters():
    model = make_model()
    tgt_in = tokens(1, 5)
    a, b = model(tokens(1, 6, seed=1), tgt_in), model(tokens(1, 6, seed=2), tgt_in)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_tiny_model_overfits_a_small_batch(norm, autocast):
    model = make_model(norm).train()
    src = tokens(4, 6)
    body = tokens(4, 5, seed=3)
    tgt_in = torch.cat([torch.full((4, 1), BOS_ID), body], dim=1)
    tgt_out = torch.cat([body, torch.full((4, 1), EOS_ID)], dim=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert loss.item() < 0.05
    assert torch.equal(model(src, tgt_in).argmax(-1), tgt_out)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("joint", [True, False])
def test_embedding_tying(tie, joint):
    model = Transformer(ModelConfig(tie_embeddings=tie), 40, 40, 16, PAD_ID, joint_vocab=joint)
    target = model.tgt_embed.tokens.weight
    assert (model.output_projection.weight is target) == tie
    assert (model.src_embed.tokens.weight is target) == (tie and joint)
    shared = 40 * 256 * ((2 if joint else 1) if tie else 0)
    untied = Transformer(ModelConfig(tie_embeddings=False), 40, 40, 16, PAD_ID)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == sum(p.numel() for p in untied.parameters()) - shared


def test_dropout_drops_at_its_rate_and_keeps_the_mean():
    torch.manual_seed(0)
    dropout = Dropout(0.1)
    x = torch.ones(1000, 1000, requires_grad=True)
    y = dropout(x)
    dropped = y == 0
    assert dropped.float().mean().item() == pytest.approx(0.1, abs=0.002)
    torch.testing.assert_close(y[~dropped], torch.full_like(y[~dropped], 1 / 0.9))
    y.sum().backward()  # the gradient flows through kept positions only, scaled alike
    assert torch.equal(x.grad, y.detach())
    assert not torch.equal(dropout(x), dropout(x))  # a new mask each call
    assert dropout.eval()(x) is x


def test_attention_computes_in_fp32_under_cpu_bf16_autocast():
    """There the bf16 kernel's backward is ~10x slower than fp32's: attention takes bf16
    queries, keys and values up to fp32 and gives what fp32 attention gives, to the bit."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g).bfloat16() for _ in range(3))
    mask = causal_mask(5, q.device)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert attention(q, k, v, mask).dtype == torch.bfloat16  # outside autocast: as given


def test_the_model_attends_in_fp32_under_cpu_bf16_autocast(monkeypatch):
    fused, seen = F.scaled_dot_product_attention, []

    def recording(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return fused(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = make_model()
    tgt_in = torch.cat([torch.full((2, 1), BOS_ID), tokens(2, 4, seed=3)], dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens(2, 5), tgt_in)
    assert len(seen) == 6  # 2 encoder layers' self-attention, 2 decoder layers' self and cross
    assert set(seen) == {(torch.float32,) * 3}
