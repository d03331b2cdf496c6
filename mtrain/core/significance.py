"""Is a difference in BLEU more than noise? The paired bootstrap over test sentences (the
resamples drawn once, and both the 95% interval and the two-sided p-value read from them, so the
two agree), Holm's correction of several p-values, and the mean over a few training seeds with a
Student's t interval that counts the seeds' noise and the test set's."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sacrebleu.metrics import BLEU

from mtrain.core.metrics import bleu_metric, bleu_of, corpus_bleu, sentence_statistics

ALPHA = 0.05  # 95% intervals; a p-value below this is significant
SAMPLES = 1000  # bootstrap resamples
SEED = 0  # the resamples' generator: the same test set gets the same resamples, run after run
MAX_DF = 1000  # t's degrees of freedom, at most (t(0.975, 1000) = 1.962, the normal's 1.960)


@dataclass
class Compared:
    """One system's BLEU beside the baseline's, by the paired bootstrap."""

    name: str
    bleu: float
    mean: float  # the bootstrap resamples' mean BLEU
    ci: float  # half the width of its 95% interval (of this system's BLEU alone)
    p_value: float | None  # two-sided; None for the baseline itself
    signature: str
    # The 95% interval of the difference from the baseline (this system's BLEU minus the
    # baseline's) over the same resamples; None for the baseline itself.
    low: float | None = None
    high: float | None = None
    # (samples,): that difference on each resample, the resamples in the order drawn
    differences: np.ndarray | None = None


def paired_bootstrap(
    systems: list[tuple[str, list[str]]],
    references: list[list[str]],
    tgt_lang: str,
    samples: int = SAMPLES,
    seed: int = SEED,
) -> list[Compared]:
    """Each system against the first (the baseline) on the same `samples` resamples of the test
    sentences, drawn once from `seed`: each system's BLEU on each resample, the difference from
    the baseline's, its 95% percentile interval and its two-sided p-value (`bootstrap_p`). A
    difference is significant (p < ALPHA) exactly where its interval leaves out 0; identical
    outputs give p = 1 and the interval [0, 0]."""
    if len(systems) < 2:
        raise ValueError("a paired test needs a baseline and at least one system")
    for name, hypotheses in systems:
        if len(hypotheses) != len(references):
            raise ValueError(
                f"{name}: {len(hypotheses)} hypotheses but {len(references)} reference sets"
            )
    tail_count(samples)  # refuses too few resamples
    bleu = bleu_metric(tgt_lang)
    counts = resample_counts(len(references), samples, seed)  # (samples, n)
    scored = []  # (BLEU, (samples,) BLEU on each resample) per system
    for _, hypotheses in systems:
        stats = sentence_statistics(bleu, hypotheses, references)  # (n, STATISTICS)
        scored.append((corpus_bleu(stats.sum(axis=0)), bleu_of(counts @ stats)))
    signature = bootstrap_signature(bleu, references, samples, seed)
    base = scored[0][1]
    found = []
    for i, ((name, _), (value, resampled)) in enumerate(zip(systems, scored)):
        low, high = percentile_interval(resampled)
        compared = Compared(name, value, float(resampled.mean()), (high - low) / 2, None, signature)
        if i:
            compared.differences = resampled - base
            compared.low, compared.high = percentile_interval(compared.differences)
            compared.p_value = bootstrap_p(compared.differences)
        found.append(compared)
    return found


def bootstrap_signature(bleu: BLEU, references: list[list[str]], samples: int, seed: int) -> str:
    """sacreBLEU's signature of a scored BLEU, with the references per sentence ("var" where
    they vary; the BLEU scored a sentence at a time knows only the last's), the resamples and
    their seed."""
    counts = {len(refs) for refs in references}
    signature = bleu.get_signature()
    for key, value in (
        ("nrefs", counts.pop() if len(counts) == 1 else "var"),
        ("bs", samples),
        ("seed", seed),
    ):
        signature.update(key, value)
    return str(signature)


def resample_counts(n: int, samples: int, seed: int) -> np.ndarray:
    """(samples, n): how often each of n sentences is drawn into each resample (n draws with
    replacement a resample), from numpy's generator seeded with `seed`."""
    draws = np.random.default_rng(seed).integers(0, n, size=(samples, n))
    rows = np.arange(samples)[:, None] * n  # each resample's own bins
    return np.bincount((draws + rows).ravel(), minlength=samples * n).reshape(samples, n)


def p_of(far: int, samples: int) -> float:
    """The two-sided p-value where `far` of `samples` resampled differences lie on the far side
    of 0 (the side with fewer; 0 itself counts on both): twice the Monte Carlo tail
    (far + 1) / (samples + 1), at most 1."""
    return min(1.0, 2 * (far + 1) / (samples + 1))


def tail_count(samples: int, alpha: float = ALPHA) -> int:
    """The most resampled differences that may lie on the far side of 0 with p still below
    `alpha`: the percentile interval leaves out this many at each end, so that it leaves out 0
    exactly where p < alpha."""
    far = -1
    while p_of(far + 1, samples) < alpha:
        far += 1
    if far < 0:
        raise ValueError(f"{samples} bootstrap resamples: too few for p < {alpha:g}")
    return far


def bootstrap_p(differences: np.ndarray) -> float:
    """Two-sided p-value of resampled differences: `p_of` the count on the far side of 0."""
    far = min(int((differences <= 0).sum()), int((differences >= 0).sum()))
    return p_of(far, len(differences))


def percentile_interval(values: np.ndarray, alpha: float = ALPHA) -> tuple[float, float]:
    """The percentile interval of resampled values: `tail_count` of them left out at each end
    (24 of 1,000 for 95%)."""
    ordered = np.sort(values)
    cut = tail_count(len(ordered), alpha)
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


def t_tail(t: float, df: int) -> float:
    """P(|T| > t) for Student's t with `df` (whole) degrees of freedom: the finite series of
    Abramowitz and Stegun 26.7.3 (odd df) and 26.7.4 (even)."""
    theta = math.atan2(abs(t), math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    total = 0.0
    if df % 2:
        term = math.cos(theta)
        for i in range((df - 1) // 2):
            total += term
            term *= cos2 * (2 * i + 2) / (2 * i + 3)
        inside = 2 / math.pi * (theta + sin * total)
    else:
        term = 1.0
        for i in range(df // 2):
            total += term
            term *= cos2 * (2 * i + 1) / (2 * i + 2)
        inside = sin * total
    return max(0.0, 1.0 - inside)


@functools.cache
def t_quantile(df: int, alpha: float = ALPHA) -> float:
    """The t with P(|T| > t) = alpha, T Student's with `df` degrees of freedom (12.71 for 1 and
    95%, 4.30 for 2, 2.57 for 5, 1.96 for many)."""
    low, high = 0.0, 1.0
    while t_tail(high, df) > alpha:
        low, high = high, 2 * high
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if t_tail(middle, df) > alpha else (low, middle)
    return high


def pooled_seed_variance(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """The variance of one run's score from seed to seed, pooled over systems (each value about
    its own system's mean), and its degrees of freedom: the sum of (k - 1) over the groups."""
    df = sum(len(g) - 1 for g in groups if len(g) > 1)
    squares = sum(sum((v - statistics.fmean(g)) ** 2 for v in g) for g in groups if len(g) > 1)
    return (squares / df if df else math.nan), df


@dataclass
class MeanDifference:
    """A variant's mean difference from the baseline over its seeds, with its interval."""

    mean: float
    low: float
    high: float
    seeds: int
    df: int  # of the t that sized the interval

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    @property
    def beyond_noise(self) -> bool:
        return self.low > 0 or self.high < 0


def mean_difference(
    deltas: Sequence[float],
    resampled: Sequence[np.ndarray],
    seed_variance: float,
    seed_df: int,
    alpha: float = ALPHA,
) -> MeanDifference:
    """The mean of k per-seed differences and its interval, mean ± t × √(seed part + test-set
    part). The seed part, 2 s² / k: the variant's mean over k seeds and the baseline's, each
    with the pooled seed variance s² (`pooled_seed_variance`, `seed_df` degrees of freedom). The
    test-set part: the variance, over the resamples, of the mean of the k resampled differences
    (`resampled`: (samples,) a seed, each on the same resamples). t is Student's for the
    Welch-Satterthwaite degrees of freedom, seed_df × (total / seed part)²: seed_df where the
    seeds' noise is all there is, more as the test set's (whose variance is known) outweighs it."""
    k = len(deltas)
    seed_part = 2 * seed_variance / k
    test_part = float(np.var(np.mean(np.stack(resampled), axis=0), ddof=1))
    total = seed_part + test_part
    df = MAX_DF if seed_part == 0 else min(MAX_DF, math.floor(seed_df * (total / seed_part) ** 2))
    mean = statistics.fmean(deltas)
    half = t_quantile(df, alpha) * math.sqrt(total)
    return MeanDifference(mean, mean - half, mean + half, k, df)
