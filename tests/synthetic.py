"""A tiny synthetic translation task: Chinese digits to English number words."""

from __future__ import annotations

import random

DIGITS_ZH = "零一二三四五六七八九"
DIGITS_EN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def number_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Chinese digit strings and their English words: a tiny, learnable translation task."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(1, 6))]
        zh = "".join(DIGITS_ZH[d] for d in digits)
        pairs.append((zh, " ".join(DIGITS_EN[d] for d in digits)))
    return pairs
