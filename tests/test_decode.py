import pytest
import torch

from mtrain.core.config import ModelConfig
from mtrain.core.runtime import quantize_int8
from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtrain.decoding.search import (
    OutputLayer,
    allowed,
    beam_search,
    greedy,
    length_limits,
)
from mtrain.model.transformer import Transformer

from .synthetic import model_ending_early, small_model

VOCAB = 20


def gnmt_penalty(length: int, alpha: float) -> float:
    """GNMT's length normalisation as the paper writes it, for reference."""
    return ((5 + length) / 6) ** alpha


def random_model(seed=0, norm="pre") -> Transformer:
    return small_model(VOCAB, VOCAB, norm=norm, seed=seed)


@pytest.fixture(scope="module")
def copy_model() -> Transformer:
    """A small model trained to copy its source: decoding must then reproduce the source."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=64, n_heads=4, n_encoder_layers=1, n_decoder_layers=1, d_ff=128, dropout=0.0
    )
    model = Transformer(cfg, VOCAB, VOCAB, max_len=16, pad_id=PAD_ID)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        body = torch.randint(4, VOCAB, (32, 5), generator=g)
        src = torch.cat([body, torch.full((32, 1), EOS_ID)], 1)
        tgt_in = torch.cat([torch.full((32, 1), BOS_ID), body], 1)
        loss = torch.nn.functional.cross_entropy(model(src, tgt_in).flatten(0, 1), src.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def sources():
    """A batch of mixed lengths: the second and third sentences are padded."""
    return torch.tensor(
        [
            [5, 9, 12, 7, 19, 8, 11, EOS_ID],
            [6, 6, 8, EOS_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID],
            [13, 4, 17, 10, EOS_ID, PAD_ID, PAD_ID, PAD_ID],
        ]
    )


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_cached_logits_equal_full_recomputation_at_every_step(norm):
    model = random_model(norm=norm)
    src = sources()
    tgt_in = torch.cat(
        [
            torch.full((3, 1), BOS_ID),
            torch.randint(4, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3)),
        ],
        dim=1,
    )
    memory, src_mask = model.encode(src)
    full = model.decode(tgt_in, memory, src_mask)  # (B, T, V)
    cache = model.start_cache(memory)
    for t in range(tgt_in.size(1)):
        step = model.decode(tgt_in[:, t : t + 1], memory, src_mask, cache)
        torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
    assert cache.length == tgt_in.size(1)


def test_the_output_layer_scores_as_the_output_projection():
    """Its transposed copy of the weight gives the projection's logits; int8 is used as is."""
    model = random_model()
    states = torch.randn(3, 2, 32)  # (B, T, d_model)
    with torch.no_grad():
        torch.testing.assert_close(OutputLayer(model)(states), model.output_projection(states))
        int8 = quantize_int8(random_model())
        assert OutputLayer(int8).weight_t is None
        assert torch.equal(OutputLayer(int8)(states), int8.output_projection(states))


def test_a_search_sees_weights_changed_in_place():
    """A search's output layer is made from the weights as they are: never stale after a
    training update (fused AdamW, as `mtrain train`, leaves version counters as they were), a
    load, or an in-place edit."""
    model = random_model()
    src, first = sources(), torch.full((3, 1), BOS_ID)
    limits = torch.tensor([6, 6, 6])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)

    def update():  # as update_step: train(), then a step
        model.train()
        model(src, first).square().mean().backward()
        optimizer.step()

    def load():
        model.load_state_dict(random_model(seed=1).state_dict())

    def edit():
        with torch.no_grad():
            model.output_projection.weight.mul_(1.5)  # tied: the target embeddings too

    model.eval()
    for change in (update, load, edit):
        before = greedy(model, src, limits)
        change()
        model.eval()
        after = greedy(model, src, limits)
        assert after == greedy(model, src, limits, use_cache=False) != before
        kept = OutputLayer(model)
        assert beam_search(model, src, limits, 3, 0.6, output=kept) == beam_search(
            model, src, limits, 3, 0.6
        )


def test_preallocated_cache_equals_recomputation_over_long_outputs():
    """64 positions, as many as the model has: each step writes into buffers allocated once."""
    torch.manual_seed(5)
    cfg = ModelConfig(d_model=32, n_heads=4, n_encoder_layers=1, n_decoder_layers=2, d_ff=64)
    model = Transformer(cfg, VOCAB, VOCAB, max_len=64, pad_id=PAD_ID).eval()
    src = sources()
    g = torch.Generator().manual_seed(4)
    tgt_in = torch.cat(
        [torch.full((3, 1), BOS_ID), torch.randint(4, VOCAB, (3, 63), generator=g)], 1
    )
    memory, src_mask = model.encode(src)
    full = model.decode(tgt_in, memory, src_mask)  # (B, 64, V)
    cache = model.start_cache(memory)
    buffers = [(c.self_k.data_ptr(), c.self_v.data_ptr()) for c in cache.layers]
    t = 0
    for chunk in (1, 1, 5, 1, 56):  # one position at a time, and several at once
        step = model.decode(tgt_in[:, t : t + chunk], memory, src_mask, cache)
        torch.testing.assert_close(step, full[:, t : t + chunk], atol=1e-5, rtol=1e-5)
        t += chunk
    assert cache.length == 64
    # no copies
    assert [(c.self_k.data_ptr(), c.self_v.data_ptr()) for c in cache.layers] == buffers
    short = model.start_cache(memory, max_len=4)
    with pytest.raises(ValueError, match="holds 4 positions, not 5"):
        model.decode(tgt_in[:, :5], memory, src_mask, short)


def test_greedy_with_and_without_cache_agree_on_long_outputs():
    model = model_ending_early(VOCAB, eos_bias=float("-inf"), seed=6)  # never ends by itself
    limits = torch.tensor([39, 25, 32])  # the model has 40 positions
    cached = greedy(model, sources(), limits)
    assert [len(out) for out in cached] == limits.tolist()
    assert cached == greedy(model, sources(), limits, use_cache=False)


def test_greedy_with_and_without_cache_agree():
    model = random_model(seed=1)
    limits = torch.tensor([12, 12, 12])
    assert greedy(model, sources(), limits) == greedy(model, sources(), limits, use_cache=False)


def test_greedy_copies_and_stops_at_eos(copy_model):
    src = torch.tensor([[5, 9, 12, 7, 19, EOS_ID], [6, 6, 8, 4, 11, EOS_ID]])
    assert greedy(copy_model, src, torch.tensor([10, 10])) == [[5, 9, 12, 7, 19], [6, 6, 8, 4, 11]]


def test_a_sentence_decodes_the_same_alone_or_in_a_batch():
    model = random_model(seed=2)
    src = sources()
    limits = length_limits(src, 1.5, 3, cap=30)
    batched = greedy(model, src, limits)
    beamed = beam_search(model, src, limits, beam_size=3, alpha=0.6, nbest=3)
    for i in range(3):
        alone = src[i : i + 1, : int((src[i] != PAD_ID).sum())]
        assert greedy(model, alone, limits[i : i + 1]) == [batched[i]]
        alone_beam = beam_search(model, alone, limits[i : i + 1], 3, 0.6, nbest=3)[0]
        assert [h.tokens for h in alone_beam] == [h.tokens for h in beamed[i]]
        for a, b in zip(alone_beam, beamed[i]):
            assert a.score == pytest.approx(b.score, abs=1e-4)


def test_length_limit_is_respected():
    model = random_model(seed=3)
    src = sources()
    limits = torch.tensor([2, 4, 1])
    for out, limit in zip(greedy(model, src, limits), limits.tolist()):
        assert len(out) <= limit
    for hyps, limit in zip(beam_search(model, src, limits, 4, 0.6, nbest=4), limits.tolist()):
        assert hyps and all(len(h.tokens) <= limit for h in hyps)


def test_length_limits():
    src = torch.tensor([[5, 9, EOS_ID, PAD_ID], [6, 6, 8, EOS_ID]])
    assert length_limits(src, 2.0, 10, cap=15).tolist() == [15, 15]
    assert length_limits(src, 1.0, 10, cap=100).tolist() == [13, 14]
    assert length_limits(src, 1.5, 0, cap=100).tolist() == [5, 6]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_beam_of_one_is_greedy(seed):
    model = random_model(seed=seed)
    src = sources()
    limits = torch.tensor([10, 6, 8])
    beam = beam_search(model, src, limits, beam_size=1, alpha=0.6)
    assert [h[0].tokens for h in beam] == greedy(model, src, limits)


def test_nbest_is_sorted_and_distinct_and_scores_are_length_normalised():
    model = random_model(seed=4)
    src = sources()
    for hyps in beam_search(model, src, torch.tensor([8, 8, 8]), 5, 1.0, nbest=5):
        assert len(hyps) == 5
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 5


def test_beam_search_finds_the_copy(copy_model):
    src = torch.tensor([[5, 9, 12, 7, 19, EOS_ID], [6, 6, 8, 4, 11, EOS_ID]])
    best = beam_search(copy_model, src, torch.tensor([10, 10]), beam_size=4, alpha=0.6)
    assert [h[0].tokens for h in best] == [[5, 9, 12, 7, 19], [6, 6, 8, 4, 11]]


def test_beam_scores_are_log_probabilities(copy_model):
    """A finished hypothesis' score is the sum of its tokens' log-probabilities / penalty."""
    src = torch.tensor([[5, 9, 12, EOS_ID]])
    (hyp,) = beam_search(copy_model, src, torch.tensor([10]), beam_size=2, alpha=0.6)[0][:1]
    memory, src_mask = copy_model.encode(src)
    tgt_in = torch.tensor([[BOS_ID, *hyp.tokens]])
    tgt_out = torch.tensor([[*hyp.tokens, EOS_ID]])
    # over the tokens a search may output
    log_probs = torch.log_softmax(allowed(copy_model.decode(tgt_in, memory, src_mask)), -1)
    total = log_probs.gather(-1, tgt_out[..., None]).sum().item()
    assert hyp.score == pytest.approx(total / gnmt_penalty(len(hyp.tokens) + 1, 0.6), abs=1e-4)


def test_pad_and_start_symbol_are_never_output_and_the_cache_still_agrees():
    model = small_model(VOCAB, VOCAB, seed=3)
    with torch.no_grad():  # a model that would rather say <pad> and <s> than anything else
        model.output_projection.bias[PAD_ID] += 50.0
        model.output_projection.bias[BOS_ID] += 40.0
    src = torch.tensor([[5, 9, 12, EOS_ID], [6, 6, 8, EOS_ID]])
    limits = torch.tensor([6, 6])
    cached, uncached = greedy(model, src, limits), greedy(model, src, limits, use_cache=False)
    assert cached == uncached
    beams = beam_search(model, src, limits, beam_size=3, alpha=0.6, nbest=3)
    for out in [*cached, *(h.tokens for hyps in beams for h in hyps)]:
        assert out and PAD_ID not in out and BOS_ID not in out


def reference_beam(model, src_row, limit, k, alpha) -> list[tuple[list[int], float]]:
    """Textbook beam search over one sentence, with the rules of `beam_search` (fairseq's):
    the whole prefix recomputed for each hypothesis, nothing dropped, Python floats."""
    src = src_row[src_row != PAD_ID][None]
    memory, src_mask = model.encode(src)
    live, finished = [([], 0.0)], []  # (tokens, cumulative log-probability)
    for step in range(1, limit + 1):
        ranked = []
        for tokens, so_far in live:
            logits = model.decode(torch.tensor([[BOS_ID, *tokens]]), memory, src_mask)[0, -1]
            log_probs = torch.log_softmax(allowed(logits), dim=-1).tolist()
            ranked += [(so_far + lp, tokens, t) for t, lp in enumerate(log_probs)]
        ranked = sorted(ranked, key=lambda c: -c[0])[: 2 * k]
        live = []
        for rank, (log_prob, tokens, t) in enumerate(ranked):
            if log_prob == float("-inf") or len(live) == k:
                break
            if t == EOS_ID or step == limit:
                if rank < k:
                    body = tokens if t == EOS_ID else [*tokens, t]
                    finished.append((body, log_prob / gnmt_penalty(step, alpha)))
            else:
                live.append(([*tokens, t], log_prob))
        if step == limit or len(finished) >= k:
            return sorted(finished, key=lambda h: -h[1])
    raise AssertionError("unreachable: the limit ends every search")


def test_beam_search_that_drops_finished_sentences_equals_a_textbook_beam():
    """Sentences that finish at different steps leave the batch; the others are unaffected."""
    model = model_ending_early(VOCAB, eos_bias=1.5, seed=7)
    src = torch.cat([sources(), torch.tensor([[9, 4, EOS_ID, *[PAD_ID] * 5]])])
    limits = torch.tensor([12, 3, 9, 6])
    going = []  # the sentences decoded at each step
    out = beam_search(model, src, limits, 3, 0.6, nbest=3, observe=lambda e: going.append(e.rows))
    assert going[0] == [0, 1, 2, 3]
    assert len({tuple(rows) for rows in going}) >= 3  # they left at different steps
    for i, hyps in enumerate(out):
        expected = reference_beam(model, src[i], int(limits[i]), 3, 0.6)[:3]
        assert [h.tokens for h in hyps] == [tokens for tokens, _ in expected]
        assert [h.score for h in hyps] == pytest.approx([score for _, score in expected], abs=1e-4)


def test_a_huge_length_penalty_ranks_without_overflow(copy_model):
    """((5 + length) / 6) ** alpha overflows a float for alpha 10,000 from length 2: in logs,
    the scores of long outputs underflow to 0 and rank first, as the penalty says they should."""
    src = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, EOS_ID]])
    with pytest.raises(OverflowError):
        gnmt_penalty(2, 1e4)
    (hyps,) = beam_search(copy_model, src, torch.tensor([12]), beam_size=3, alpha=1e4, nbest=3)
    assert all(h.score <= 0 for h in hyps) and len(hyps[0].tokens) >= len(hyps[-1].tokens)
