"""The statistics that compare systems (mtrain.core.significance): BLEU from each sentence's
statistics is sacreBLEU's, the paired bootstrap's p-value and interval agree and hold their
level on systems of equal quality, and Student's t for the mean over seeds."""

from __future__ import annotations

import numpy as np
import pytest
from sacrebleu.metrics import BLEU

from mtrain.core.metrics import (
    bleu_metric,
    bleu_of,
    corpus_bleu,
    score,
    sentence_statistics,
)
from mtrain.core.significance import (
    ALPHA,
    MAX_DF,
    holm,
    mean_difference,
    paired_bootstrap,
    pooled_seed_variance,
    resample_counts,
    t_quantile,
    t_tail,
)

WORDS = [f"w{i}" for i in range(60)]


def references(n: int, rng: np.random.Generator) -> list[list[str]]:
    return [[" ".join(rng.choice(WORDS, rng.integers(5, 20)))] for _ in range(n)]


def system(refs: list[list[str]], rng: np.random.Generator, error: float) -> list[str]:
    """A system's output: each reference word kept, or replaced by a random word (`error`)."""
    out = []
    for r in refs:
        words = r[0].split()
        wrong = rng.random(len(words)) < error
        other = rng.integers(0, len(WORDS), len(words))
        out.append(" ".join(WORDS[o] if x else w for w, x, o in zip(words, wrong, other)))
    return out


def test_bleu_from_sentence_statistics_is_sacrebleus() -> None:
    """Summed sentence statistics give corpus_score's BLEU exactly (several references, a
    sentence with fewer, an empty hypothesis, Chinese); bleu_of gives compute_bleu's."""
    refs = [["the cat sat on the mat", "a cat sat"], ["who am I"], ["I hit him", "he was hit"]]
    hyps = ["the cat sat on a mat", "", "I hit he"]
    stats = sentence_statistics(bleu_metric("en"), hyps, refs)
    assert corpus_bleu(stats.sum(axis=0)) == score(hyps, refs, "en").bleu
    zh = [["我打他"], ["他打我。"]]
    stats = sentence_statistics(bleu_metric("zh"), ["我打他", "他打"], zh)
    assert corpus_bleu(stats.sum(axis=0)) == score(["我打他", "他打"], zh, "zh").bleu

    rng = np.random.default_rng(0)
    for _ in range(3000):
        total = np.sort(rng.integers(0, 30, 4))[::-1]
        correct = [int(rng.integers(0, t + 1)) if rng.random() > 0.3 else 0 for t in total]
        row = [*correct, *map(int, total), int(total[0]), int(rng.integers(0, 40))]
        expected = BLEU.compute_bleu(row[:4], row[4:8], row[8], row[9], smooth_method="exp")
        assert bleu_of(np.array(row)) == pytest.approx(expected.score, rel=1e-12, abs=0)


def test_each_resample_is_sacrebleus_bleu_of_the_resampled_corpus() -> None:
    """The difference on a resample is corpus_score's BLEU of the corpus that resample draws
    (each sentence as often as drawn), the system's minus the baseline's."""
    rng = np.random.default_rng(1)
    refs = references(40, rng)
    base, other = system(refs, rng, 0.3), system(refs, rng, 0.2)
    _, compared = paired_bootstrap([("base", base), ("other", other)], refs, "en", 50)
    counts = resample_counts(40, 50, 0)
    for b in range(3):
        drawn = [i for i in range(40) for _ in range(counts[b, i])]
        bleus = [score([h[i] for i in drawn], [refs[i] for i in drawn], "en").bleu
                 for h in (base, other)]  # fmt: skip
        assert compared.differences[b] == pytest.approx(bleus[1] - bleus[0], abs=1e-9)
    assert compared.bleu == score(other, refs, "en").bleu


def test_systems_of_equal_quality_are_rarely_called_different() -> None:
    """100 comparisons of two systems drawn alike (200 sentences, the same references): at
    most 8 p-values below 0.05, and about half above 0.5, as a two-sided p-value is uniform
    where nothing differs (sacreBLEU's, one tail in effect, put all 100 below 0.5 and 8 below
    0.05, 7 of those with 0 in their interval)."""
    rng = np.random.default_rng(0)
    refs = references(200, rng)
    p_values = []
    for _ in range(100):
        pair = [("a", system(refs, rng, 0.3)), ("b", system(refs, rng, 0.3))]
        p_values.append(paired_bootstrap(pair, refs, "en")[1].p_value)
    assert sum(p < ALPHA for p in p_values) <= 8
    assert 35 <= sum(p > 0.5 for p in p_values) <= 65


@pytest.mark.parametrize("samples", [40, 99, 1000])
def test_significant_exactly_where_the_interval_leaves_out_zero(samples) -> None:
    """On systems from alike to far apart, and on test sets from 1 sentence to 60: p < 0.05
    if and only if the 95% interval leaves out 0; identical outputs, p = 1 and [0, 0]."""
    rng = np.random.default_rng(samples)
    seen = set()
    for case in range(60):
        refs = references(int(rng.integers(1, 60)), rng)
        base = system(refs, rng, 0.3)
        other = list(base) if case % 10 == 0 else system(refs, rng, rng.uniform(0.1, 0.5))
        _, c = paired_bootstrap([("base", base), ("other", other)], refs, "en", samples)
        excludes = c.low > 0 or c.high < 0
        assert (c.p_value < ALPHA) == excludes, (c.p_value, c.low, c.high)
        assert c.low <= np.median(c.differences) <= c.high
        if other == base:
            assert (c.p_value, c.low, c.high) == (1.0, 0.0, 0.0)
        seen.add(excludes)
    assert seen == {True, False}  # both kinds met


def test_sacrebleus_seed_changes_nothing(monkeypatch) -> None:
    """The resamples are drawn from our own generator: SACREBLEU_SEED (0, none, another)
    changes neither the p-value nor the interval, and they still agree."""
    rng = np.random.default_rng(2)
    refs = references(80, rng)
    pair = [("a", system(refs, rng, 0.3)), ("b", system(refs, rng, 0.25))]
    monkeypatch.delenv("SACREBLEU_SEED", raising=False)
    expected = paired_bootstrap(pair, refs, "en")[1]
    for seed in ("0", "none", "7"):
        monkeypatch.setenv("SACREBLEU_SEED", seed)
        for _ in range(2):
            c = paired_bootstrap(pair, refs, "en")[1]
            assert (c.p_value, c.low, c.high) == (expected.p_value, expected.low, expected.high)
            assert (c.p_value < ALPHA) == (c.low > 0 or c.high < 0)


def test_too_few_resamples_are_refused() -> None:
    refs = [["a cat sat"], ["who am I"]]
    with pytest.raises(ValueError, match="39 bootstrap resamples: too few"):
        paired_bootstrap([("a", ["a cat", "who"]), ("b", ["a cat sat", "I"])], refs, "en", 39)


def test_holm_adjusts_as_computed_by_hand() -> None:
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.02, 0.6]) == pytest.approx([0.04, 0.6])
    assert holm([0.6, 0.7]) == [1.0, 1.0]  # capped at 1, and never below the one before
    assert holm([0.3]) == [0.3]  # one comparison: nothing to correct


def test_students_t_is_the_tables() -> None:
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 30: 2.042}
    for df, t in table.items():
        assert t_quantile(df) == pytest.approx(t, abs=1e-3)
    assert t_quantile(MAX_DF) == pytest.approx(1.962, abs=1e-3)
    assert t_quantile(2, 0.10) == pytest.approx(2.920, abs=1e-3)
    assert t_tail(0.0, 3) == pytest.approx(1.0)
    assert t_tail(1.0, 1) == pytest.approx(0.5)  # Cauchy: P(|T| > 1) = 1/2
    assert t_tail(float("inf"), 4) == 0.0


def test_the_mean_over_seeds_and_its_interval() -> None:
    """By hand: variance pooled over systems, each about its own mean; with no test-set noise
    the interval is mean ± t(df) √(2 s² / k); test-set noise widens it and adds degrees of
    freedom."""
    variance, df = pooled_seed_variance([[20.0, 20.4], [17.0, 17.2], [5.0]])
    assert (variance, df) == (pytest.approx((0.08 + 0.02) / 2), 2)
    steady = [np.full(100, -3.0), np.full(100, -3.2)]
    mean = mean_difference([-3.0, -3.2], steady, variance, df)
    assert (mean.mean, mean.seeds, mean.df) == (pytest.approx(-3.1), 2, 2)
    assert mean.half_width == pytest.approx(4.303 * (2 * 0.05 / 2) ** 0.5, abs=1e-3)
    assert mean.beyond_noise
    noise = np.resize([-2.0, 2.0], 100)  # the same resamples for both seeds
    noisy = mean_difference([-3.0, -3.2], [noise - 3.0, noise - 3.2], variance, df)
    assert noisy.half_width > mean.half_width and df < noisy.df <= MAX_DF
    test_part = np.var(noise, ddof=1)
    expected = t_quantile(noisy.df) * (2 * variance / 2 + test_part) ** 0.5
    assert noisy.half_width == pytest.approx(expected)
    assert not noisy.beyond_noise
