"""`--trace`: the steps a search reports are the numbers a full forward pass gives."""

import re

import pytest
import torch

from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtrain.decoding.search import allowed, beam_search, greedy
from mtrain.decoding.trace import Tracer, format_trace

from .synthetic import model_ending_early, small_model


def gnmt_penalty(length: int, alpha: float) -> float:
    """GNMT's length normalisation as the paper writes it, for reference."""
    return ((5 + length) / 6) ** alpha


VOCAB = 20


def sources():
    return torch.tensor([[5, 9, 12, 7, 19, 8, EOS_ID], [6, 6, 8, EOS_ID, PAD_ID, PAD_ID, PAD_ID]])


def full_log_probs(model, src_row: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Teacher forcing without a cache: (len(tokens) + 1, V) log-probabilities after each prefix."""
    src = src_row[src_row != PAD_ID][None]
    memory, src_mask = model.encode(src)
    logits = model.decode(torch.tensor([[BOS_ID, *tokens]]), memory, src_mask)
    return torch.log_softmax(allowed(logits[0]), dim=-1)  # over the tokens a search may output


@pytest.mark.parametrize("eos_bias", [0.0, 4.0])
def test_greedy_trace_shows_the_probabilities_of_a_full_forward_pass(eos_bias):
    model = model_ending_early(VOCAB, eos_bias)
    src, limits = sources(), torch.tensor([9, 6])
    tracer = Tracer(k=4)
    outputs = greedy(model, src, limits, observe=tracer)
    for row, out in enumerate(outputs):
        steps = tracer.steps[row]
        chosen = [s.chosen for s in steps]
        assert chosen[: len(out)] == out and len(steps) in (len(out), len(out) + 1)
        full = full_log_probs(model, src[row], chosen[:-1])  # (steps, V)
        so_far = 0.0
        for t, step in enumerate(steps):
            assert step.inputs == [[BOS_ID, *chosen[:t]]]
            probs, ids = full[t].exp().topk(4)
            assert [i for i, _ in step.top] == ids.tolist()
            torch.testing.assert_close(
                torch.tensor([p for _, p in step.top]), probs, atol=1e-5, rtol=0
            )
            assert step.chosen == step.top[0][0]
            assert step.chosen_log_prob == pytest.approx(full[t, step.chosen].item(), abs=1e-5)
            assert step.log_probs[0] == pytest.approx(so_far, abs=1e-4)
            so_far += full[t, step.chosen].item()
    ended = [tracer.steps[r][-1].chosen == EOS_ID for r in range(2)]
    assert ended == [eos_bias > 0] * 2  # both endings are exercised


@pytest.mark.parametrize("eos_bias", [0.0, 2.0])
def test_beam_trace_shows_the_log_probabilities_of_a_full_forward_pass(eos_bias):
    model = model_ending_early(VOCAB, eos_bias, seed=1)
    src, limits, alpha = sources(), torch.tensor([7, 5]), 0.6
    tracer = Tracer()
    best = beam_search(model, src, limits, beam_size=3, alpha=alpha, observe=tracer)
    for row, hyps in enumerate(best):
        finished = []
        for step in tracer.steps[row]:
            for tokens, log_prob in zip(step.inputs, step.log_probs):
                assert tokens[0] == BOS_ID and len(tokens) == step.step
                full = full_log_probs(model, src[row], tokens[1:])
                expected = full[:-1].gather(1, torch.tensor(tokens[1:])[:, None]).sum()
                assert log_prob == pytest.approx(expected.item(), abs=1e-4)
            for c in step.candidates:
                full = full_log_probs(model, src[row], step.inputs[c.origin][1:])
                own = c.log_prob - step.log_probs[c.origin]
                assert own == pytest.approx(full[-1, c.token].item(), abs=1e-4)
                if c.fate == "finished":
                    assert c.score == pytest.approx(c.log_prob / gnmt_penalty(step.step, alpha))
                    finished.append(c.score)
        assert hyps[0].score == max(finished)


def test_format_trace_prints_the_traced_numbers(tokenizer):
    model = small_model(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, seed=2)
    src_ids = [*tokenizer.encode_src(["三一四"])[0], EOS_ID]
    tracer = Tracer(k=3)
    greedy(model, torch.tensor([src_ids]), torch.tensor([4]), observe=tracer)
    text = format_trace(src_ids, tracer.steps[0], tokenizer, "三一四")
    assert text.startswith("source: 三一四\n")
    assert " ".join(tokenizer.src.id_to_piece(src_ids)) in text
    assert " ".join(map(str, src_ids)) in text
    blocks = text.split("\nstep ")[1:]
    assert len(blocks) == len(tracer.steps[0])
    for block, step in zip(blocks, tracer.steps[0]):
        rows = re.findall(r"^  \d\. (\S+) +([\d.]+)", block, flags=re.M)
        assert [(tokenizer.tgt.id_to_piece(t), f"{p:.4f}") for t, p in step.top] == rows
        assert block.count("<- chosen") == 1
