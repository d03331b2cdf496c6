"""Shared fixtures: a small generated corpus and a tokenizer trained on it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mtrain.config import TokenizerConfig
from mtrain.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
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


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> Tokenizer:
    pairs = number_pairs(500)
    out = tmp_path_factory.mktemp("tok")
    cfg = TokenizerConfig(vocab_size=300, character_coverage=1.0)
    return Tokenizer.train([s for s, _ in pairs], [t for _, t in pairs], cfg, "zh", "en", out)
