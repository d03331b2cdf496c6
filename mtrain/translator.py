"""Text in, text out: normalise, encode, batch by length, search, detokenise, keep input order."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from mtrain.batching import length_batches
from mtrain.config import Config, DecodeConfig
from mtrain.data import pad, source_ids
from mtrain.decode import Hypothesis, Observer, OutputLayer, beam_search, greedy, length_limits
from mtrain.model import Transformer
from mtrain.text import normalize
from mtrain.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Translation:
    text: str
    score: float | None  # None from greedy search; 0.0 for an empty input line


@dataclass
class Inspection:
    """One sentence translated alone, with what the search read and wrote."""

    src: list[int]  # source ids, </s> last; [] for an empty line
    hypotheses: list[Hypothesis]  # tokens without </s>; best first
    translations: list[Translation]


class Translator:
    """Translates sentences with a trained model; output never depends on how input is batched.

    Its searches keep one `OutputLayer`, a copy of the model's output weights made here: make
    another Translator after the weights change.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        cfg: Config,
        device: torch.device,
        decode: DecodeConfig | None = None,
        nbest: int = 1,
        use_cache: bool = True,  # False re-runs the decoder over the whole prefix each step
        warn_truncated: bool = True,  # False where the reader of the sources warned once
    ):
        self.model, self.tokenizer, self.cfg, self.device = model, tokenizer, cfg, device
        self.decode = decode or cfg.decode
        self.nbest, self.use_cache = nbest, use_cache
        self.warn_truncated = warn_truncated
        self.output = OutputLayer(model) if model is not None else None

    def _limits(self, src: torch.Tensor) -> torch.Tensor:
        """(B,) the most tokens each sentence of a (B, S) batch may translate to."""
        d = self.decode
        return length_limits(src, d.max_len_ratio, d.max_len_offset, self.cfg.data.max_tgt_len)

    def _search(self, src: torch.Tensor, observe: Observer | None = None) -> list[list[Hypothesis]]:
        self.model.eval()
        d = self.decode
        limits = self._limits(src)
        if d.beam_size == 1 and self.nbest == 1:
            out = greedy(self.model, src, limits, self.use_cache, observe, self.output)
            return [[Hypothesis(tokens, None)] for tokens in out]
        return beam_search(
            self.model, src, limits, d.beam_size, d.alpha, self.nbest, observe, self.output
        )

    def _source_ids(self, sources: list[str]) -> list[list[int]]:
        """Normalised non-empty sentences -> source ids, truncated, </s> last."""
        max_src_len = self.cfg.data.max_src_len
        ids = self.tokenizer.encode_src(sources)
        too_long = sum(len(x) >= max_src_len for x in ids)
        if too_long and self.warn_truncated:
            log.warning("%d input sentence(s) truncated to %d tokens", too_long, max_src_len)
        return [source_ids(x, max_src_len) for x in ids]

    def inspect(self, text: str, observe: Observer) -> Inspection:
        """Translate one sentence alone, showing `observe` every step of the search."""
        source = normalize(text, self.cfg.data.src_lang)
        if not source:
            return Inspection([], [], [Translation("", 0.0)])
        (ids,) = self._source_ids([source])
        (hyps,) = self._search(torch.tensor([ids], device=self.device), observe)
        texts_out = self.tokenizer.decode_tgt([h.tokens for h in hyps])
        return Inspection(ids, hyps, [Translation(t, h.score) for t, h in zip(texts_out, hyps)])

    def translate_nbest(self, texts: list[str]) -> list[list[Translation]]:
        """Translate a list of sentences; each gets up to `nbest` translations, best first."""
        sources = [normalize(t, self.cfg.data.src_lang) for t in texts]
        todo = [i for i, s in enumerate(sources) if s]  # empty lines translate to empty lines
        ids = self._source_ids([sources[i] for i in todo])
        results = [[Translation("", 0.0)] for _ in texts]
        batch_tokens = max(self.decode.batch_tokens // self.decode.beam_size, 1)
        for batch in length_batches([len(x) for x in ids], batch_tokens):
            src = pad([ids[j] for j in batch]).to(self.device)
            for j, hyps in zip(batch, self._search(src)):
                texts_out = self.tokenizer.decode_tgt([h.tokens for h in hyps])
                results[todo[j]] = [Translation(t, h.score) for t, h in zip(texts_out, hyps)]
        return results

    def translate(self, texts: list[str]) -> list[str]:
        """Translate a list of sentences to their best translations, in input order."""
        return [nbest[0].text for nbest in self.translate_nbest(texts)]

    def stream(self, lines: Iterable[str], chunk_lines: int = 2000) -> Iterator[list[Translation]]:
        """Translate lines in chunks, so memory stays bounded however long the input is."""
        it = iter(lines)
        while chunk := list(itertools.islice(it, chunk_lines)):
            yield from self.translate_nbest(chunk)
