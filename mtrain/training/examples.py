"""Example translations at every validation: which sentences, their greedy translations with
each output piece's cross-attention, and the record examples.jsonl keeps of them.

All examples are decoded in one greedy batch that records cross-attention as it goes, so that
watching them costs a small part of a validation (scripts/bench_examples.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mtrain.core.config import Config
from mtrain.data.pairs import pad, source_ids
from mtrain.data.text import normalize
from mtrain.data.tokenizer import Tokenizer
from mtrain.decoding.search import GreedyStep, greedy, length_limits
from mtrain.model.transformer import Transformer

# The longest dev source, in pieces, chosen as an example: a map a reader can take in at a glance.
SHORT = 12


@dataclass
class ExampleSource:
    """A sentence translated at every validation, and its reference where one is known."""

    source: str  # normalised
    reference: str | None


@dataclass
class ExampleTranslation:
    """An example's greedy translation by the model at one validation."""

    source: str
    reference: str | None
    translation: str
    src_pieces: list[str]  # what the encoder read, </s> last: the attention's columns
    tgt_pieces: list[str]  # what the decoder wrote, </s> last if it ended: the rows
    attention: torch.Tensor  # (layers, heads, len(tgt_pieces), len(src_pieces)) cross-attention

    def to_dict(self) -> dict[str, Any]:
        """The example as examples.jsonl holds it: attention weights to 3 decimals."""
        weights = self.attention.double().mul(1000).round().div(1000)
        return {
            "source": self.source,
            "reference": self.reference,
            "translation": self.translation,
            "src_pieces": self.src_pieces,
            "tgt_pieces": self.tgt_pieces,
            "attention": weights.tolist(),
        }


def choose(
    cfg: Config, tokenizer: Tokenizer, dev_sources: list[str], dev_refs: list[list[str]]
) -> list[ExampleSource]:
    """`train.examples` (with the dev set's reference where it holds the sentence), then
    `train.dev_examples` dev sentences of at most SHORT pieces, spread over the dev set."""
    lang, first_ref = cfg.data.src_lang, dict(zip(dev_sources, (refs[0] for refs in dev_refs)))
    chosen = [
        ExampleSource(s, first_ref.get(s)) for s in (normalize(t, lang) for t in cfg.train.examples)
    ]
    n = cfg.train.dev_examples
    if not n or not dev_sources:
        return chosen
    taken = {e.source for e in chosen}
    lengths = [len(ids) for ids in tokenizer.encode_src(dev_sources)]
    short = [i for i, n_pieces in enumerate(lengths) if n_pieces <= SHORT]
    short = [i for i in short if dev_sources[i] not in taken]
    picked = sorted({short[k * len(short) // n] for k in range(n)}) if short else []
    return chosen + [ExampleSource(dev_sources[i], dev_refs[i][0]) for i in picked]


class CrossAttention:
    """An observer for `greedy` that keeps each sentence's cross-attention, step by step."""

    def __init__(self, model: Transformer, batch: int):
        self.model = model
        self.steps: list[list[torch.Tensor]] = [[] for _ in range(batch)]  # (layers, h, S) each

    def __call__(self, event: GreedyStep) -> None:
        cross = self.model.attention_weights()["cross"]  # per layer (b, h, 1, S): newest query
        newest = torch.stack([w[:, :, -1] for w in cross], dim=1).float().cpu()  # (b, L, h, S)
        for i, row in enumerate(event.rows):
            self.steps[row].append(newest[i])

    def maps(self, row: int, src_len: int) -> torch.Tensor:
        """(layers, heads, steps, src_len): a sentence's weights, without the padding columns."""
        return torch.stack(self.steps[row], dim=2)[..., :src_len]


def translate_examples(
    model: Transformer,
    tokenizer: Tokenizer,
    cfg: Config,
    device: torch.device,
    examples: list[ExampleSource],
) -> list[ExampleTranslation]:
    """Translate the examples greedily in one batch, recording their cross-attention."""
    if not examples:
        return []
    ids = [
        source_ids(x, cfg.data.max_src_len)
        for x in tokenizer.encode_src([e.source for e in examples])
    ]
    src = pad(ids).to(device)  # (B, S)
    d = cfg.decode
    limits = length_limits(src, d.max_len_ratio, d.max_len_offset, cfg.data.max_tgt_len)
    recorder = CrossAttention(model, len(examples))
    model.eval()
    model.record_attention(True)
    try:
        out = greedy(model, src, limits, observe=recorder)
    finally:
        model.record_attention(False)
    texts = tokenizer.decode_tgt(out)
    results = []
    for row, (example, tokens) in enumerate(zip(examples, out)):
        attention = recorder.maps(row, len(ids[row]))
        ended = attention.size(2) > len(tokens)  # the last step wrote </s>
        tgt_pieces = tokenizer.tgt.id_to_piece(tokens) + (["</s>"] if ended else [])
        src_pieces = tokenizer.src.id_to_piece(ids[row])
        results.append(
            ExampleTranslation(
                example.source, example.reference, texts[row], src_pieces, tgt_pieces, attention
            )
        )
    return results
