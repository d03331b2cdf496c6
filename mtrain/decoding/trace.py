"""A step-by-step record of a search (`--trace`): collected from the search, formatted as text."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mtrain.data.tokenizer import EOS_ID, Tokenizer
from mtrain.decoding.search import BeamStep, Candidate, GreedyStep


@dataclass
class TraceStep:
    """What the search saw at one step of one sentence."""

    step: int
    inputs: list[list[int]]  # decoder input of each live hypothesis (one in greedy), <s> first
    log_probs: list[float]  # their cumulative log-probabilities
    # greedy: the k likeliest next tokens with their probabilities, and the one picked
    top: list[tuple[int, float]] = field(default_factory=list)
    chosen: int | None = None  # greedy: the token picked
    chosen_log_prob: float = 0.0  # greedy: its log-probability
    candidates: list[Candidate] = field(default_factory=list)  # beam: the ranked extensions


class Tracer:
    """An observer for `greedy` / `beam_search` that keeps every step, per batch row."""

    def __init__(self, k: int = 5):
        self.k = k
        self.steps: dict[int, list[TraceStep]] = {}

    def __call__(self, event: GreedyStep | BeamStep) -> None:
        if isinstance(event, GreedyStep):
            self._greedy(event)
        else:
            self._beam(event)

    def _greedy(self, event: GreedyStep) -> None:
        probs, ids = event.log_probs.exp().topk(min(self.k, event.log_probs.size(-1)))  # (b, k)
        picked = torch.tensor(event.chosen, device=event.log_probs.device)
        chosen = event.log_probs.gather(1, picked[:, None])[:, 0]  # (b,)
        for i, row in enumerate(event.rows):
            steps = self.steps.setdefault(row, [])
            so_far = steps[-1].log_probs[0] + steps[-1].chosen_log_prob if steps else 0.0
            step = TraceStep(event.step, [event.prefix[i].tolist()], [so_far])
            step.top = list(zip(ids[i].tolist(), probs[i].tolist()))
            step.chosen, step.chosen_log_prob = event.chosen[i], chosen[i].item()
            steps.append(step)

    def _beam(self, event: BeamStep) -> None:
        width = event.log_probs.size(1)
        for i, (row, candidates) in enumerate(zip(event.rows, event.candidates)):
            scores = event.log_probs[i].tolist()
            live = [j for j in range(width) if scores[j] != -math.inf]  # always the first ones
            inputs = [event.tokens[i * width + j].tolist() for j in live]
            step = TraceStep(event.step, inputs, [scores[j] for j in live])
            step.candidates = candidates
            self.steps.setdefault(row, []).append(step)


FATES = {"alive": "stays in the beam", "pruned": "dropped: ranked below the beam width"}


def _pieces(tokenizer: Tokenizer, ids: list[int]) -> str:
    return " ".join(tokenizer.tgt.id_to_piece(ids))


def _greedy_step(step: TraceStep, tokenizer: Tokenizer) -> list[str]:
    lines = [
        f"step {step.step}   decoder input: {_pieces(tokenizer, step.inputs[0])}"
        f"   (log-probability so far {step.log_probs[0]:.4f})"
    ]
    width = max(len(tokenizer.tgt.id_to_piece(t)) for t, _ in step.top)
    for rank, (token, prob) in enumerate(step.top, 1):
        mark = "  <- chosen" if token == step.chosen else ""
        lines.append(f"  {rank}. {tokenizer.tgt.id_to_piece(token):<{width}}  {prob:.4f}{mark}")
    return lines


def _beam_step(step: TraceStep, tokenizer: Tokenizer) -> list[str]:
    lines = [f"step {step.step}   live hypotheses, cumulative log-probability:"]
    for j, (tokens, log_prob) in enumerate(zip(step.inputs, step.log_probs)):
        lines.append(f"  [{j}] {log_prob:8.4f}  {_pieces(tokenizer, tokens)}")
    lines.append("  their best extensions, best first: + piece, its log-probability, the sum")
    for c in step.candidates:
        if c.fate == "finished":
            how = "with </s>" if c.token == EOS_ID else "at the length limit"
            fate = f"finished {how}: score {c.score:.4f} after the length penalty"
        else:
            fate = FATES[c.fate]
        piece = tokenizer.tgt.id_to_piece(c.token)
        own = c.log_prob - step.log_probs[c.origin]
        lines.append(f"  [{c.origin}] + {piece:<12} {own:8.4f} {c.log_prob:9.4f}  {fate}")
    return lines


def format_trace(
    src_ids: list[int], steps: list[TraceStep], tokenizer: Tokenizer, text: str
) -> str:
    """The trace of one sentence as text: its source pieces and ids, then one block per step."""
    pieces = tokenizer.src.id_to_piece(src_ids)
    lines = [
        f"source: {text}",
        f"  pieces: {' '.join(pieces)}",
        f"  ids:    {' '.join(map(str, src_ids))}",
    ]
    for step in steps:
        greedy = step.chosen is not None
        lines += _greedy_step(step, tokenizer) if greedy else _beam_step(step, tokenizer)
    return "\n".join(lines)
