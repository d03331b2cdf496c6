"""Text in, text out: normalise, encode, batch by length, search, detokenise, keep input order.

The text side (`Sentences`) is shared by composition with the CTranslate2 engine, whose
search is not ours; `SearchedText` turns it into the calls both engines answer, and
`TextTranslator` is what the commands and the server use of either.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from mtrain.core.config import Config, DecodeConfig
from mtrain.data.batching import length_batches
from mtrain.data.pairs import pad, source_ids
from mtrain.data.text import normalize
from mtrain.data.tokenizer import Tokenizer, too_long
from mtrain.decoding.search import (
    Hypothesis,
    Observer,
    OutputLayer,
    beam_search,
    greedy,
    length_limits,
)
from mtrain.model.transformer import Transformer

log = logging.getLogger(__name__)


@dataclass
class Translation:
    text: str
    score: float | None  # None from greedy search; 0.0 for an empty input line


@dataclass
class Source:
    """A sentence as the model reads it."""

    ids: list[int]  # source ids cut at data.max_src_len, </s> last; [] for an empty line
    truncated: bool  # pieces were cut off


@dataclass
class Inspection:
    """One sentence translated alone, with what the search read and wrote."""

    src: list[int]  # source ids, </s> last; [] for an empty line
    hypotheses: list[Hypothesis]  # tokens without </s>; best first
    translations: list[Translation]


# search(src, limits, observe) -> each sentence's hypotheses, best first, for a (B, S) batch
# of source ids and its (B,) output limits
Search = Callable[[torch.Tensor, torch.Tensor, Observer | None], list[list[Hypothesis]]]


class Sentences:
    """Text in, text out around a search, whichever engine runs it: normalise, encode, batch by
    length, search, detokenise, keep input order."""

    def __init__(
        self, tokenizer: Tokenizer, cfg: Config, decode: DecodeConfig, warn_truncated: bool = True
    ):
        self.tokenizer, self.cfg, self.decode = tokenizer, cfg, decode
        self.warn_truncated = warn_truncated

    def limits(self, src: torch.Tensor) -> torch.Tensor:
        """(B,) the most tokens each sentence of a (B, S) batch may translate to."""
        d = self.decode
        return length_limits(src, d.max_len_ratio, d.max_len_offset, self.cfg.data.max_tgt_len)

    def sources(self, texts: list[str], warn: bool = False) -> list[Source]:
        """Each text normalised and encoded as the model reads it; `warn`: log the truncated."""
        max_src_len = self.cfg.data.max_src_len
        normalized = [normalize(t, self.cfg.data.src_lang) for t in texts]
        encoded = iter(self.tokenizer.encode_src([t for t in normalized if t]))
        out = []
        for text in normalized:
            pieces = next(encoded) if text else []  # empty lines translate to empty lines
            ids = source_ids(pieces, max_src_len) if text else []
            out.append(Source(ids, too_long(pieces, max_src_len)))
        cut = sum(s.truncated for s in out)
        if cut and warn and self.warn_truncated:
            log.warning("%d input sentence(s) truncated to %d tokens", cut, max_src_len)
        return out

    def translate(self, sources: list[Source], search: Search) -> list[list[Translation]]:
        """Each source's translations, best first, searched in batches of similar lengths."""
        todo = [i for i, s in enumerate(sources) if s.ids]
        results = [[Translation("", 0.0)] for _ in sources]
        batch_tokens = max(self.decode.batch_tokens // self.decode.beam_size, 1)
        for batch in length_batches([len(sources[i].ids) for i in todo], batch_tokens):
            src = pad([sources[todo[j]].ids for j in batch])
            for j, hyps in zip(batch, search(src, self.limits(src), None)):
                texts_out = self.tokenizer.decode_tgt([h.tokens for h in hyps])
                results[todo[j]] = [Translation(t, h.score) for t, h in zip(texts_out, hyps)]
        return results

    def inspect(self, source: Source, search: Search, observe: Observer) -> Inspection:
        """Search one sentence alone, showing `observe` every step the search shows."""
        if not source.ids:
            return Inspection([], [], [Translation("", 0.0)])
        src = torch.tensor([source.ids])
        (hyps,) = search(src, self.limits(src), observe)
        texts_out = self.tokenizer.decode_tgt([h.tokens for h in hyps])
        return Inspection(
            source.ids, hyps, [Translation(t, h.score) for t, h in zip(texts_out, hyps)]
        )


class TextTranslator(Protocol):
    """What the commands and the server use of a translator, whichever engine searches."""

    tokenizer: Tokenizer
    cfg: Config
    decode: DecodeConfig
    nbest: int

    def sources(self, texts: list[str]) -> list[Source]: ...

    def translate_sources(self, sources: list[Source]) -> list[list[Translation]]: ...

    def inspect(self, text: str, observe: Observer) -> Inspection: ...

    def translate_nbest(self, texts: list[str]) -> list[list[Translation]]: ...

    def translate(self, texts: list[str]) -> list[str]: ...

    def stream(
        self, lines: Iterable[str], chunk_lines: int = 2000
    ) -> Iterator[list[Translation]]: ...

    def with_options(self, decode: DecodeConfig, nbest: int) -> TextTranslator: ...


class SearchedText:
    """What both engines share around their own `_search`: the text side (`self.text`, a
    `Sentences`) turned into the calls the commands and the server make."""

    text: Sentences

    def _search(
        self, src: torch.Tensor, limits: torch.Tensor, observe: Observer | None = None
    ) -> list[list[Hypothesis]]:
        raise NotImplementedError

    def sources(self, texts: list[str]) -> list[Source]:
        """Each text as the model reads it (no warning: the caller reports truncation)."""
        return self.text.sources(texts)

    def translate_sources(self, sources: list[Source]) -> list[list[Translation]]:
        """Each source's translations, up to `nbest`, best first."""
        return self.text.translate(sources, self._search)

    def inspect(self, text: str, observe: Observer) -> Inspection:
        """Translate one sentence alone, showing `observe` every step the search shows."""
        (source,) = self.text.sources([text], warn=True)
        return self.inspect_source(source, observe)

    def inspect_source(self, source: Source, observe: Observer) -> Inspection:
        """`inspect` of a sentence encoded already."""
        return self.text.inspect(source, self._search, observe)

    def translate_nbest(self, texts: list[str]) -> list[list[Translation]]:
        """Translate a list of sentences; each gets up to `nbest` translations, best first."""
        return self.translate_sources(self.text.sources(texts, warn=True))

    def translate(self, texts: list[str]) -> list[str]:
        """Translate a list of sentences to their best translations, in input order."""
        return [nbest[0].text for nbest in self.translate_nbest(texts)]

    def stream(self, lines: Iterable[str], chunk_lines: int = 2000) -> Iterator[list[Translation]]:
        """Translate lines in chunks, so memory stays bounded however long the input is."""
        it = iter(lines)
        while chunk := list(itertools.islice(it, chunk_lines)):
            yield from self.translate_nbest(chunk)


class Translator(SearchedText):
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
        output: OutputLayer | None = None,  # another Translator's, on the same weights
    ):
        self.model, self.tokenizer, self.cfg, self.device = model, tokenizer, cfg, device
        self.decode = decode or cfg.decode
        self.nbest, self.use_cache = nbest, use_cache
        self.text = Sentences(tokenizer, cfg, self.decode, warn_truncated)
        self.output = output or OutputLayer(model)

    def with_options(self, decode: DecodeConfig, nbest: int) -> Translator:
        """This translator with other search options (the output weights are shared)."""
        return Translator(
            self.model,
            self.tokenizer,
            self.cfg,
            self.device,
            decode,
            nbest,
            self.use_cache,
            self.text.warn_truncated,
            self.output,
        )

    def _search(
        self, src: torch.Tensor, limits: torch.Tensor, observe: Observer | None = None
    ) -> list[list[Hypothesis]]:
        self.model.eval()
        d = self.decode
        src = src.to(self.device)
        if d.beam_size == 1 and self.nbest == 1:
            out = greedy(self.model, src, limits, self.use_cache, observe, self.output)
            return [[Hypothesis(tokens, None)] for tokens in out]
        return beam_search(
            self.model, src, limits, d.beam_size, d.alpha, self.nbest, observe, self.output
        )
