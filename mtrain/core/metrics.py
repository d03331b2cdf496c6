"""Corpus BLEU and chrF with sacrebleu, with any number of references per sentence; the paired
bootstrap that compares systems, and Holm's correction of several comparisons' p-values."""

from __future__ import annotations

from collections.abc import Sequence
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


def score(hypotheses: list[str], references: list[list[str]], tgt_lang: str) -> Scores:
    """Score hypotheses against one or more references each; BLEU tokenises for `tgt_lang`."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference sets")
    if not all(references):
        raise ValueError("every sentence needs at least one reference")
    streams = reference_streams(references)
    bleu = BLEU(tokenize=BLEU_TOKENIZERS.get(tgt_lang, "13a"))
    chrf = CHRF()
    return Scores(
        bleu=bleu.corpus_score(hypotheses, streams).score,
        chrf=chrf.corpus_score(hypotheses, streams).score,
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
    )


@dataclass
class Compared:
    """One system's BLEU beside the baseline's, by sacrebleu's paired bootstrap resampling."""

    name: str
    bleu: float
    mean: float  # the bootstrap resamples' mean BLEU
    ci: float  # half the width of its 95% confidence interval (of this system's BLEU alone)
    p_value: float | None  # None for the baseline itself
    signature: str
    # The 95% interval of the difference from the baseline (this system's BLEU minus the
    # baseline's) over the same resamples; None for the baseline itself.
    low: float | None = None
    high: float | None = None


def paired_bootstrap(
    systems: list[tuple[str, list[str]]],
    references: list[list[str]],
    tgt_lang: str,
    samples: int = 1000,
) -> list[Compared]:
    """Each system against the first (the baseline): what `sacrebleu --paired-bs` computes,
    with its fixed seed, and the interval of each difference over the same resamples. A system
    whose BLEU is the baseline's gets p = 1: sacrebleu counts the resamples whose difference
    exceeds the real one strictly, and so gives two systems that score alike on every resample
    (identical outputs, or both 0) 1/(samples + 1), the smallest p-value it can give, where
    there is no difference at all to explain."""
    from sacrebleu.significance import PairedTest

    if len(systems) < 2:
        raise ValueError("a paired test needs a baseline and at least one system")
    bleu = BLEU(tokenize=BLEU_TOKENIZERS.get(tgt_lang, "13a"))
    streams = reference_streams(references)
    test = PairedTest(systems, {"BLEU": bleu}, streams, test_type="bs", n_samples=samples)
    signatures, scores = test()
    base = scores["BLEU"][0].score
    counts = resample_counts(len(references), samples, test._seed)
    resampled = [resampled_bleu(bleu, hypotheses, streams, counts) for _, hypotheses in systems]
    intervals = [None, *(interval(r - resampled[0]) for r in resampled[1:])]
    return [
        Compared(
            name,
            result.score,
            float(result.mean),
            float(result.ci),
            None if i == 0 else 1.0 if result.score == base else float(result.p_value),
            str(signatures["BLEU"]),
            *(intervals[i] or (None, None)),
        )
        for i, (name, result) in enumerate(zip(scores["System"], scores["BLEU"]))
    ]


def resample_counts(n: int, samples: int, seed: int | None) -> np.ndarray:
    """(samples, n): how often each sentence is drawn into each resample; the draws are
    sacrebleu's own (`_paired_bs_test` seeds a generator with `seed` for every system)."""
    draws = np.random.default_rng(seed).choice(n, size=(samples, n), replace=True)
    return np.stack([np.bincount(row, minlength=n) for row in draws])


def resampled_bleu(
    bleu: BLEU, hypotheses: list[str], streams: list[list[str | None]], counts: np.ndarray
) -> np.ndarray:
    """A system's BLEU on each resample, from its sentences' n-gram statistics."""
    stats = np.array(bleu._extract_corpus_statistics(hypotheses, streams), dtype=np.int64)
    return np.array([bleu._compute_score_from_stats(list(s)).score for s in counts @ stats])


def interval(differences: np.ndarray) -> tuple[float, float]:
    """The 95% percentile interval of resampled differences, cut as sacrebleu cuts its own."""
    ordered = np.sort(differences)
    cut = len(ordered) // 40
    return float(ordered[cut]), float(ordered[len(ordered) - cut - 1])


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest of m is
    multiplied by m - i + 1 (capped at 1), and none is smaller than the one before it. A
    comparison is significant at level a where its adjusted p-value is below a; the chance of
    any false "effect" among the m stays below a."""
    m = len(p_values)
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
