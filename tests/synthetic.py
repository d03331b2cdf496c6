"""Small things to test with: a synthetic translation task and small random models."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from mtrain.core import config
from mtrain.core.config import ModelConfig
from mtrain.data.tokenizer import EOS_ID, PAD_ID
from mtrain.decoding.translator import Translator
from mtrain.model.transformer import Transformer

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


def resampled(text: str) -> str:
    """A TSV corpus's text with each source paired with the next line's target: other pairs of
    the same sentences, of the same size (a test set resampled)."""
    pairs = [line.split("\t", 1) for line in text.splitlines(keepends=True)]
    sources = [source for source, _ in pairs]
    return "".join(f"{s}\t{t}" for s, (_, t) in zip(sources[1:] + sources[:1], pairs))


def small_model(
    src_vocab: int, tgt_vocab: int, norm: str = "pre", seed: int = 0, layers: int = 2
) -> Transformer:
    """A randomly initialised Transformer with d_model 32, in eval mode, without dropout."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        d_model=32,
        n_heads=4,
        n_encoder_layers=layers,
        n_decoder_layers=layers,
        d_ff=64,
        dropout=0.0,
        norm=norm,
    )
    return Transformer(cfg, src_vocab, tgt_vocab, max_len=40, pad_id=PAD_ID).eval()


def small_translator(tokenizer, decode: config.DecodeConfig) -> Translator:
    """A random one-layer model with short limits (12 source, 16 target tokens), on the CPU."""
    torch.manual_seed(0)
    cfg = config.Config(
        data=config.DataConfig(max_src_len=12, max_tgt_len=16),
        model=ModelConfig(
            d_model=32, n_heads=4, n_encoder_layers=1, n_decoder_layers=1, d_ff=64, dropout=0.0
        ),
        decode=decode,
    )
    model = Transformer(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, 16, PAD_ID)
    return Translator(model, tokenizer, cfg, torch.device("cpu"))


def overrides(corpus, **train_keys) -> list[str]:
    """`--set` values that make configs/tiny.yaml train on the synthetic corpus."""
    values = [f"data.{k}={v}" for k, v in corpus.items()] + [
        "tokenizer.vocab_size=300",
        "tokenizer.character_coverage=1.0",
        "train.batch_tokens=256",
        "train.max_minutes=0",
    ]
    return values + [f"train.{k}={v}" for k, v in train_keys.items()]


def small_config(corpus, **train_keys) -> config.Config:
    return config.load(REPO / "configs" / "tiny.yaml", overrides(corpus, **train_keys))


def model_ending_early(vocab: int, eos_bias: float, seed: int = 0) -> Transformer:
    """A small random model; a larger `eos_bias` makes it end sentences with </s> sooner."""
    model = small_model(vocab, vocab, seed=seed)
    with torch.no_grad():
        model.output_projection.bias[EOS_ID] += eos_bias
    return model
