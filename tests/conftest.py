"""Shared fixtures: a small generated corpus, a tokenizer trained on it, and a tiny trained run."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtrain.core.config import TokenizerConfig
from mtrain.data.tokenizer import Tokenizer

from .console import mtrain
from .synthetic import number_pairs


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> Tokenizer:
    pairs = number_pairs(500)
    out = tmp_path_factory.mktemp("tok")
    cfg = TokenizerConfig(vocab_size=300, tgt_vocab_size=0, character_coverage=1.0)
    return Tokenizer.train([s for s, _ in pairs], [t for _, t in pairs], cfg, "zh", "en", out)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("corpus")
    paths = {}
    for name, n, seed in (("train", 400, 1), ("dev", 20, 2), ("test", 20, 3)):
        path = root / f"{name}.tsv"
        path.write_text("".join(f"{zh}\t{en}\n" for zh, en in number_pairs(n, seed)), "utf-8")
        paths[name] = str(path)
    paths["prepared_dir"] = str(root / "prepared")  # shared by the tests: prepared once
    return paths


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """The tiny config trained for 120 steps through the console script, once for every module."""
    out = tmp_path_factory.mktemp("runs") / "tiny"
    result = mtrain(
        "train",
        "--config",
        "configs/tiny.yaml",
        "--out",
        str(out),
        "--set",
        "train.max_steps=120",
        "--set",
        "train.eval_every=60",
        "--set",
        "train.keep_last=2",
        "--set",
        "train.max_minutes=0",  # the steps, not this machine's speed, decide what is trained
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)  # stdout holds the result only
    return out
