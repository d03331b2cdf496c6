"""Corpus BLEU and chrF with sacrebleu, with any number of references per sentence; each
sentence's BLEU statistics, and BLEU from summed statistics (many sums at once: the resamples
of `core.significance`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sacrebleu.metrics import BLEU, CHRF

BLEU_TOKENIZERS = {"zh": "zh"}  # every other target language: 13a


@dataclass
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str


def reference_streams(references: list[list[str]]) -> list[list[str | None]]:
    """Per-sentence reference lists -> sacrebleu's streams, None where a sentence has fewer."""
    n = max((len(r) for r in references), default=1)
    return [[refs[j] if j < len(refs) else None for refs in references] for j in range(n)]


def bleu_metric(tgt_lang: str) -> BLEU:
    """sacrebleu's BLEU with its defaults, tokenising for `tgt_lang`."""
    return BLEU(tokenize=BLEU_TOKENIZERS.get(tgt_lang, "13a"))


def score(hypotheses: list[str], references: list[list[str]], tgt_lang: str) -> Scores:
    """Score hypotheses against one or more references each; BLEU tokenises for `tgt_lang`."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference sets")
    if not all(references):
        raise ValueError("every sentence needs at least one reference")
    streams = reference_streams(references)
    bleu = bleu_metric(tgt_lang)
    chrf = CHRF()
    return Scores(
        bleu=bleu.corpus_score(hypotheses, streams).score,
        chrf=chrf.corpus_score(hypotheses, streams).score,
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
    )


ORDERS = 4  # BLEU's n-gram orders
# A sentence's BLEU statistics, a row of 10: matched n-grams (n = 1..4), hypothesis n-grams
# (n = 1..4), hypothesis length, reference length (the closest reference's).
STATISTICS = 2 * ORDERS + 2


def sentence_statistics(
    bleu: BLEU, hypotheses: list[str], references: list[list[str]]
) -> np.ndarray:
    """(n, STATISTICS): each sentence's BLEU statistics, from sacrebleu's corpus_score of that
    sentence alone with all its references; their sum over sentences is the corpus's."""
    rows = []
    for hypothesis, refs in zip(hypotheses, references, strict=True):
        s = bleu.corpus_score([hypothesis], [[r] for r in refs])
        rows.append([*s.counts, *s.totals, s.sys_len, s.ref_len])
    return np.array(rows, dtype=np.int64).reshape(len(rows), STATISTICS)


def corpus_bleu(statistics: np.ndarray) -> float:
    """(STATISTICS,) a corpus's summed statistics -> its BLEU, by sacrebleu's
    `BLEU.compute_bleu` with BLEU's defaults: what `score` gives for the same sentences."""
    c = [int(x) for x in statistics]
    return BLEU.compute_bleu(c[:ORDERS], c[ORDERS:-2], c[-2], c[-1], smooth_method="exp").score


def bleu_of(statistics: np.ndarray) -> np.ndarray:
    """(..., STATISTICS) summed statistics -> (...) BLEU: `corpus_bleu` for many sums at once
    (to 1e-12; smoothing "exp": an order with no match counts 1/2, 1/4, ... of a match,
    halving at each such order)."""
    stats = np.asarray(statistics, dtype=np.float64)
    correct, total = stats[..., :ORDERS], stats[..., ORDERS : 2 * ORDERS]
    sys_len, ref_len = stats[..., -2], stats[..., -1]
    with np.errstate(divide="ignore", invalid="ignore"):
        brevity = np.where(sys_len >= ref_len, 1.0, np.exp(1 - ref_len / sys_len))
        halvings = np.cumsum(correct == 0, axis=-1)
        precision = np.where(correct > 0, 100.0 * correct / total, 100.0 / (2.0**halvings * total))
        bleu = brevity * np.exp(np.log(precision).sum(axis=-1) / ORDERS)
    # no match at all, or an order with no n-gram to match: sacrebleu's 0
    return np.where((correct > 0).any(axis=-1) & (total > 0).all(axis=-1), bleu, 0.0)
