"""Search over `model.encode` / `model.decode`: greedy and beam search, with a key/value cache.

Both searches take an optional `observe` callback that receives each step's state (a
`GreedyStep` or a `BeamStep`): what `mtrain translate --trace` prints and `--attention` draws.
Without one they do no extra work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtrain.model import Transformer
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Hypothesis:
    tokens: list[int]  # without <s> and </s>
    score: float | None  # beam search: log-probability / length penalty; greedy: None


@dataclass
class GreedyStep:
    """One step of greedy search, for the sentences still decoding."""

    step: int  # 1 for the first output token
    rows: list[int]  # the batch row (sentence) of each of the b rows below
    prefix: torch.Tensor  # (b, step) the decoder input so far, <s> first
    log_probs: torch.Tensor  # (b, tgt_vocab) the next token's log-probabilities
    chosen: list[int]  # the b tokens picked (the most likely ones)


@dataclass
class Candidate:
    """A live hypothesis extended by one token, as beam search ranked it."""

    origin: int  # which of the sentence's beam_size live hypotheses it extends
    token: int
    log_prob: float  # cumulative: the hypothesis' plus this token's
    fate: str  # "alive" (kept in the beam), "finished" or "pruned"
    score: float | None = None  # finished: log_prob / length penalty, the final ranking


@dataclass
class BeamStep:
    """One step of beam search: the live hypotheses going in and the candidates coming out."""

    step: int
    tokens: torch.Tensor  # (B * beam_size, step) live hypotheses' tokens, <s> first
    log_probs: torch.Tensor  # (B, beam_size) their cumulative log-probabilities; -inf: no one
    candidates: list[list[Candidate]]  # per sentence, best first; [] once a sentence is done
    select: torch.Tensor | None  # (B * beam_size,) the row each next hypothesis extends


Observer = Callable[[GreedyStep | BeamStep], None]


# Inputs only: the decoder reads <s> first and padding after a sentence, but outputs neither
# (an output <pad> would be read back as padding without the cache, and as a token with it).
NEVER_OUTPUT = torch.tensor([PAD_ID, BOS_ID])


def allowed(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) next-token logits, in fp32, with the tokens a search never outputs at -inf.

    In place when the logits are fp32 already: they are a step's fresh output, used once.
    """
    return logits.float().index_fill_(-1, NEVER_OUTPUT.to(logits.device), float("-inf"))


def length_limits(src: torch.Tensor, ratio: float, offset: int, cap: int) -> torch.Tensor:
    """(B, S) source ids -> (B,) output limits: ratio × source length + offset, at most cap."""
    src_len = (src != PAD_ID).sum(dim=1).float()
    return (src_len * ratio + offset).ceil().clamp(min=1, max=cap).long()


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's length normalisation (Wu et al., 2016): ((5 + length) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


@torch.inference_mode()
def greedy(
    model: Transformer,
    src: torch.Tensor,
    limits: torch.Tensor,
    use_cache: bool = True,
    observe: Observer | None = None,
) -> list[list[int]]:
    """Decode a (B, S) batch one step at a time, feeding back the most likely token.

    Sentence i ends at </s> or after limits[i] tokens and then leaves the batch. With the cache
    each step runs the decoder on the newest token only; without it, on the whole prefix.
    """
    memory, src_mask = model.encode(src)  # (B, S, d_model), (B, 1, 1, S)
    cache = model.start_cache(memory) if use_cache else None
    batch = src.size(0)
    rows = torch.arange(batch, device=src.device)  # original row of each sentence still decoding
    prefix = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=src.device)  # (b, t)
    limits = limits.to(src.device)
    out: list[list[int]] = [[] for _ in range(batch)]
    step = 0
    while rows.numel():
        step += 1
        if cache is None:
            logits = model.decode(prefix, memory, src_mask)[:, -1]  # (b, tgt_vocab)
        else:
            logits = model.decode(prefix[:, -1:], memory, src_mask, cache)[:, -1]
        logits = allowed(logits)
        token = logits.argmax(dim=-1)  # (b,)
        if observe is not None:
            log_probs = torch.log_softmax(logits, dim=-1)
            observe(GreedyStep(step, rows.tolist(), prefix, log_probs, token.tolist()))
        for row, t in zip(rows.tolist(), token.tolist()):
            if t != EOS_ID:
                out[row].append(t)
        keep = ((token != EOS_ID) & (limits[rows] > step)).nonzero().squeeze(1)
        prefix = torch.cat([prefix, token[:, None]], dim=1)
        if keep.numel() < rows.numel():  # drop finished sentences from the work
            rows, prefix = rows[keep], prefix[keep]
            memory, src_mask = memory[keep], src_mask[keep]
            if cache is not None:
                cache = [c.select(keep) for c in cache]
    return out


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: torch.Tensor,
    limits: torch.Tensor,
    beam_size: int,
    alpha: float,
    nbest: int = 1,
    observe: Observer | None = None,
) -> list[list[Hypothesis]]:
    """Beam search over a (B, S) batch; returns each sentence's `nbest` best, best first.

    As in fairseq: each step ranks 2 × beam candidates; a candidate ending in </s> among the
    best `beam_size` is finished (scored with the length penalty), the best others stay alive.
    A sentence is done when it has `beam_size` finished hypotheses or reaches its length limit,
    where its alive hypotheses are finished as they are.
    """
    batch, k = src.size(0), beam_size
    device = src.device
    memory, src_mask = model.encode(src)
    expand = torch.arange(batch, device=device).repeat_interleave(k)  # (B*k,)
    memory, src_mask = memory[expand], src_mask[expand]
    cache = model.start_cache(memory)
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # one live hypothesis (<s>) per sentence at the start
    tokens = torch.full((batch * k, 1), BOS_ID, dtype=torch.long, device=device)  # (B*k, t)
    limits = limits.tolist()
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    done = [False] * batch
    step = 0
    while not all(done):
        step += 1
        logits = model.decode(tokens[:, -1:], memory, src_mask, cache)[:, -1]  # (B*k, V)
        log_probs = torch.log_softmax(allowed(logits), dim=-1)
        vocab = log_probs.size(-1)
        candidates = (scores.view(-1, 1) + log_probs).view(batch, k * vocab)
        top_scores, top_ids = candidates.topk(2 * k, dim=1)  # (B, 2k)
        origins, words = top_ids // vocab, top_ids % vocab
        new_scores = torch.full((batch, k), float("-inf"), device=device)
        new_origins = torch.zeros((batch, k), dtype=torch.long, device=device)
        new_words = torch.full((batch, k), PAD_ID, dtype=torch.long, device=device)
        report: list[list[Candidate]] = [[] for _ in range(batch)]
        for b, (row_scores, row_origins, row_words) in enumerate(
            zip(top_scores.tolist(), origins.tolist(), words.tolist())
        ):
            if done[b]:
                continue
            at_limit = step >= limits[b]
            alive = 0
            for rank, (score, origin, word) in enumerate(zip(row_scores, row_origins, row_words)):
                if score == float("-inf") or alive == k:
                    break
                if word == EOS_ID or at_limit:
                    final = None
                    if rank < k:  # </s> further down the ranking would never be chosen
                        prefix = tokens[b * k + origin, 1:].tolist()
                        body = prefix if word == EOS_ID else [*prefix, word]
                        final = score / length_penalty(step, alpha)
                        finished[b].append(Hypothesis(body, final))
                    if observe is not None:
                        fate = "pruned" if final is None else "finished"
                        report[b].append(Candidate(origin, word, score, fate, final))
                    continue
                new_scores[b, alive], new_origins[b, alive], new_words[b, alive] = (
                    score,
                    origin,
                    word,
                )
                alive += 1
                if observe is not None:
                    report[b].append(Candidate(origin, word, score, "alive"))
            done[b] = at_limit or len(finished[b]) >= k
        select = None
        if not all(done):
            select = (torch.arange(batch, device=device)[:, None] * k + new_origins).view(-1)
        if observe is not None:
            observe(BeamStep(step, tokens, scores, report, select))
        if select is None:
            break
        cache = [c.select(select) for c in cache]
        tokens = torch.cat([tokens[select], new_words.view(-1, 1)], dim=1)
        scores = new_scores
    return [sorted(h, key=lambda h: -h.score)[:nbest] for h in finished]
