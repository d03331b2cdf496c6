"""Search over `model.encode` / `model.decode`: greedy and beam search, with a key/value cache.

Both searches take an optional `observe` callback that receives each step's state (a
`GreedyStep` or a `BeamStep`): what `mtrain translate --trace` prints and `--attention` draws.
Without one they do no extra work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtrain.model.transformer import Transformer


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
    """One step of beam search: the live hypotheses going in and the candidates coming out.

    Only sentences still decoding take part; each has w rows of hypotheses (w is 1 at the first
    step, when <s> is the only one, and beam_size after).
    """

    step: int
    rows: list[int]  # the batch row (sentence) of each of the b groups of w rows below
    tokens: torch.Tensor  # (b * w, step) live hypotheses' tokens, <s> first
    log_probs: torch.Tensor  # (b, w) their cumulative log-probabilities; -inf: no one
    candidates: list[list[Candidate]]  # per sentence, best first
    select: torch.Tensor | None  # (b' * beam_size,) the row each next hypothesis extends


Observer = Callable[[GreedyStep | BeamStep], None]


# Inputs only: the decoder reads <s> first and padding after a sentence, but outputs neither
# (an output <pad> would be read back as padding without the cache, and as a token with it).
NEVER_OUTPUT = torch.tensor([PAD_ID, BOS_ID])


def allowed(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) next-token logits, in fp32, with the tokens a search never outputs at -inf.

    In place when the logits are fp32 already: they are a step's fresh output, used once.
    """
    return logits.float().index_fill_(-1, NEVER_OUTPUT.to(logits.device), float("-inf"))


class OutputLayer:
    """The model's output projection for search steps, with its weight copied once into the
    (d_model, tgt_vocab) layout.

    A step multiplies a few rows by that weight, which on the CPU (MKL) runs faster in this
    layout than in nn.Linear's (tgt_vocab, d_model). The copy holds the weights as they are when
    it is made: make another after they change. An int8 projection (`quantize_int8`) is called
    as it is.
    """

    def __init__(self, model: Transformer):
        self.projection = model.output_projection
        weight = self.projection.weight  # a method, not a tensor, once quantized
        self.weight_t: torch.Tensor | None = None  # (d_model, tgt_vocab)
        if torch.is_tensor(weight):
            with torch.no_grad():
                self.weight_t = weight.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) decoder states -> (B, T, tgt_vocab) logits."""
        if self.weight_t is None:
            return self.projection(x)
        b, t, d = x.shape
        logits = torch.addmm(self.projection.bias, x.reshape(b * t, d), self.weight_t)
        return logits.view(b, t, -1)


def length_limits(src: torch.Tensor, ratio: float, offset: int, cap: int) -> torch.Tensor:
    """(B, S) source ids -> (B,) output limits: ratio × source length + offset, at most cap."""
    src_len = (src != PAD_ID).sum(dim=1).float()
    return (src_len * ratio + offset).ceil().clamp(min=1, max=cap).long()


def log_length_penalty(length: int, alpha: float) -> float:
    """The log of GNMT's length normalisation (Wu et al., 2016), ((5 + length) / 6) ** alpha.

    In logs because the penalty itself overflows a float for a large alpha on a long output.
    """
    return alpha * math.log((5 + length) / 6)


def normalized(log_prob: float, log_penalty: float) -> float:
    """A hypothesis' score: its log-probability divided by the length penalty, given as a log."""
    return log_prob * math.exp(-log_penalty)  # a huge penalty underflows to a score of 0


@torch.inference_mode()
def greedy(
    model: Transformer,
    src: torch.Tensor,
    limits: torch.Tensor,
    use_cache: bool = True,
    observe: Observer | None = None,
    output: OutputLayer | None = None,
) -> list[list[int]]:
    """Decode a (B, S) batch one step at a time, feeding back the most likely token.

    Sentence i ends at </s> or after limits[i] tokens and then leaves the batch. With the cache
    each step runs the decoder on the newest token only, and scores it with `output` (made
    here if not given); without it, on the whole prefix, through the model as it is.
    """
    memory, src_mask = model.encode(src)  # (B, S, d_model), (B, 1, 1, S)
    cache = model.start_cache(memory, int(limits.max())) if use_cache else None
    if use_cache and output is None:
        output = OutputLayer(model)
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
            logits = output(model.decoder_states(prefix[:, -1:], memory, src_mask, cache))[:, -1]
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
                cache = cache.select(keep)
    return out


def _fates(
    ranked: Iterable[tuple[float, int, int]], k: int, at_limit: bool, log_penalty: float
) -> list[Candidate]:
    """A sentence's best extensions (log-probability, origin, token), best first, with fates.

    An extension that ends (with </s>, or any at the length limit) finishes if it ranks among
    the best k, and is pruned otherwise; the best k others stay alive, and the rest are not
    considered.
    """
    fates, alive = [], 0
    for rank, (log_prob, origin, token) in enumerate(ranked):
        if log_prob == float("-inf") or alive == k:
            break
        if token == EOS_ID or at_limit:
            # a lower </s> is never chosen
            final = normalized(log_prob, log_penalty) if rank < k else None
            fate = "pruned" if final is None else "finished"
            fates.append(Candidate(origin, token, log_prob, fate, final))
        else:
            fates.append(Candidate(origin, token, log_prob, "alive"))
            alive += 1
    return fates


def _finished(fates: list[Candidate], prefixes: torch.Tensor) -> list[Hypothesis]:
    """The hypotheses a sentence's finished candidates make; prefixes (w, t): its live ones."""
    ended = []
    for c in fates:
        if c.fate == "finished":
            body = prefixes[c.origin, 1:].tolist()  # without <s>
            ended.append(Hypothesis(body if c.token == EOS_ID else [*body, c.token], c.score))
    return ended


def _next_beam(alive: list[Candidate], k: int) -> list[Candidate]:
    """A sentence's k alive extensions; a place no extension fills holds no one (-inf)."""
    return alive + [Candidate(0, PAD_ID, float("-inf"), "alive")] * (k - len(alive))


def _sort(
    rows: list[int],
    ranked: Iterable,
    at_limit: list[bool],
    tokens: torch.Tensor,
    k: int,
    penalty: float,
    finished: list[list[Hypothesis]],
) -> tuple[list, list[int], list, list[int]]:
    """One step's fates of each sentence's ranked candidates, its finished hypotheses added to
    `finished`; and for what goes on: the sentences going (their place in `rows`), their next
    beams, and the row of `tokens` (b * w, t) each of those extends."""
    width = tokens.size(0) // len(rows)
    fates, going, beams, extends = [], [], [], []
    for i, (sentence, row_ranked) in enumerate(zip(rows, ranked)):
        fates.append(_fates(zip(*row_ranked), k, at_limit[i], penalty))
        finished[sentence] += _finished(fates[i], tokens[i * width : (i + 1) * width])
        if not (at_limit[i] or len(finished[sentence]) >= k):
            beam = _next_beam([c for c in fates[i] if c.fate == "alive"], k)
            going.append(i)
            beams += beam
            extends += [i * width + c.origin for c in beam]
    return fates, going, beams, extends


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: torch.Tensor,
    limits: torch.Tensor,
    beam_size: int,
    alpha: float,
    nbest: int = 1,
    observe: Observer | None = None,
    output: OutputLayer | None = None,
) -> list[list[Hypothesis]]:
    """Beam search over a (B, S) batch; returns each sentence's `nbest` best, best first.

    As in fairseq: each step ranks 2 × beam candidates; a candidate ending in </s> among the
    best `beam_size` is finished (scored with the length penalty), the best others stay alive.
    A sentence is done when it has `beam_size` finished hypotheses or reaches its length limit,
    where its alive hypotheses are finished as they are; then it leaves the batch, so each step
    decodes only the live hypotheses of the sentences still going. Steps are scored with
    `output`, made here if not given.
    """
    k, device = beam_size, src.device
    output = output or OutputLayer(model)
    memory, src_mask = model.encode(src)  # (b, S, d_model), (b, 1, 1, S): a row per sentence
    cache = model.start_cache(memory, int(limits.max()))
    rows = list(range(src.size(0)))  # the sentence of each group of w rows still decoding
    # At the first step each sentence has one live hypothesis, <s>: w is 1, then beam_size.
    tokens = torch.full((len(rows), 1), BOS_ID, dtype=torch.long, device=device)  # (b * w, t)
    scores = torch.zeros((len(rows), 1), device=device)  # (b, w) cumulative log-probabilities
    finished: list[list[Hypothesis]] = [[] for _ in rows]
    limits = limits.tolist()
    step = 0
    while rows:
        step += 1
        states = model.decoder_states(tokens[:, -1:], memory, src_mask, cache)  # (b * w, 1, d)
        logits = output(states)[:, -1]  # (b * w, V)
        log_probs = torch.log_softmax(allowed(logits), dim=-1)
        width, vocab = scores.size(1), log_probs.size(-1)
        candidates = (scores.view(-1, 1) + log_probs).view(len(rows), width * vocab)
        top, ids = candidates.topk(min(2 * k, width * vocab), dim=1)  # (b, 2k)
        ranked = zip(top.tolist(), (ids // vocab).tolist(), (ids % vocab).tolist())
        penalty = log_length_penalty(step, alpha)
        ends = [step >= limits[sentence] for sentence in rows]
        fates, going, beams, extends = _sort(rows, ranked, ends, tokens, k, penalty, finished)
        # (b' * k,) the row each next hypothesis extends, for the b' sentences going on
        select = torch.tensor(extends, device=device) if going else None
        if observe is not None:
            observe(BeamStep(step, rows, tokens, scores, fates, select))
        if select is None:
            break
        if len(going) < len(rows) or width < k:  # each sentence's rows change: all state follows
            memory, src_mask = memory[select], src_mask[select]
            cache = cache.select(select)
        else:  # only hypotheses within sentences move; their cross-attention state is shared
            cache = cache.reorder(select)
        rows = [rows[i] for i in going]
        next_tokens = torch.tensor([[c.token] for c in beams], device=device)  # (b' * k, 1)
        tokens = torch.cat([tokens[select], next_tokens], dim=1)
        scores = torch.tensor([c.log_prob for c in beams], device=device).view(len(rows), k)
    return [sorted(h, key=lambda h: -h.score)[:nbest] for h in finished]
