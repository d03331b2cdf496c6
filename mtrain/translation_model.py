"""`TranslationModel`, what `mtrain.load` returns: a trained model to translate with, on either
engine, and to score, trace and show the attention of (which need mtrain's own engine).

A face of the package, beside `mtrain/__init__.py`: it opens the model through
`export.engine.open_engine`, as the commands and the server do, and checks each argument a
caller passes, so that a wrong one ends in one `MtrainError` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtrain.core.config import MAX_BEAM, Config
from mtrain.core.errors import OptionError
from mtrain.decoding.loaded import decode_options
from mtrain.decoding.score import TOP_K, Score, score_pairs
from mtrain.decoding.trace import Tracer
from mtrain.decoding.translator import TextTranslator, Translation, Translator
from mtrain.export.engine import Opened, open_engine
from mtrain.figures.attention import Attention
from mtrain.figures.trace import Trace
from mtrain.run.directory import BEST


def whole(value: Any, name: str, low: int = 1, high: int | None = None) -> int:
    """`value` as a whole number in [low, high], or one line naming the argument."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise OptionError(f"{name}: expected a whole number, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise OptionError(f"{name} {value}: expected {bound}")
    return value


def text_of(text: Any, name: str) -> str:
    """A sentence: a string that UTF-8 can write; anything else refused in one line."""
    if not isinstance(text, str):
        raise OptionError(f"{name}: expected a string, got {text!r:.80}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # "\ud800": a str, but no text (no encoding writes it)
        raise OptionError(
            f"{name}: a lone surrogate {text[e.start]!r} at character {e.start} is not text"
        ) from None
    return text


def texts_of(text: Any, name: str) -> list[str]:
    """A sentence or a list of them, as a list; anything else refused in one line."""
    if isinstance(text, str):
        return [text_of(text, name)]
    if not isinstance(text, (list, tuple)) or not all(isinstance(t, str) for t in text):
        raise OptionError(f"{name}: expected a string or a list of strings, got {text!r:.80}")
    return [text_of(t, f"{name} {i}") for i, t in enumerate(text)]


def search(beam: Any, alpha: Any) -> None:
    """Refuse search options of the wrong type (their ranges are the config's to check)."""
    if beam is not None:
        whole(beam, "beam", 1, MAX_BEAM)
    if alpha is not None and (not isinstance(alpha, (int, float)) or isinstance(alpha, bool)):
        raise OptionError(f"alpha: expected a number, got {alpha!r}")


@dataclass
class TranslationModel(Opened):
    """A trained model, ready to translate, score, trace and show its attention: an opened
    engine (its path, engine, translator, checkpoint and step) with the API's methods."""

    @property
    def cfg(self) -> Config:
        return self.translator.cfg

    @property
    def direction(self) -> str:
        return f"{self.cfg.data.src_lang}→{self.cfg.data.tgt_lang}"

    def __repr__(self) -> str:
        m = self.cfg.model
        size = ""
        if isinstance(self.translator, Translator):
            n = sum(p.numel() for p in self.translator.model.parameters())
            size = f", {n / 1e6:.1f}M parameters"
        layers = (
            f"{m.n_encoder_layers}+{m.n_decoder_layers} layers, d_model {m.d_model}, "
            f"{m.n_heads} heads" + ("" if m.variant == "textbook" else f", {m.variant}")
        )
        where = f"{self.checkpoint} (step {self.step})" if self.checkpoint else str(self.path)
        return f"<TranslationModel {self.direction}{size}, {layers}; {self.engine}: {where}>"

    def _with(self, beam: int | None, alpha: float | None, nbest: int) -> TextTranslator:
        """The translator with these search options (None: the model's own)."""
        search(beam, alpha)
        whole(nbest, "nbest", 1, MAX_BEAM)
        t = self.translator
        if beam is None and alpha is None and nbest == t.nbest:
            return t
        beam = t.decode.beam_size if beam is None else beam
        alpha = t.decode.alpha if alpha is None else alpha
        return t.with_options(decode_options(self.cfg, beam, alpha, nbest), nbest)

    def translate(
        self,
        text: str | list[str],
        beam: int | None = None,
        alpha: float | None = None,
        nbest: int = 1,
    ) -> str | list[str] | list[tuple[str, float | None]] | list[list[tuple[str, float | None]]]:
        """Translate a sentence (a string back) or a list of them (a list back, in order).

        `beam` 1 is greedy; None: the run's. With `nbest` > 1 each sentence gives a list of
        (translation, score) pairs, best first.
        """
        texts = texts_of(text, "text")
        found = self._with(beam, alpha, nbest).translate_nbest(texts)
        if nbest == 1:
            out: list = [t[0].text for t in found]
        else:
            out = [[(t.text, t.score) for t in ts] for ts in found]
        return out[0] if isinstance(text, str) else out

    def translate_nbest(self, texts: list[str]) -> list[list[Translation]]:
        """Each sentence's translations with the model's own options, as the commands use."""
        return self.translator.translate_nbest(texts_of(texts, "texts"))

    def _torch(self, what: str) -> Translator:
        if not isinstance(self.translator, Translator):
            raise OptionError(f"{what} needs --engine mtrain")
        return self.translator

    def score(
        self, source: str | list[str], target: str | list[str], k: int = TOP_K
    ) -> Score | list[Score]:
        """How likely the model finds `target` as the translation of `source`, piece by piece
        (teacher forcing); lists of sources and targets give a list of scores. `k`: how many of
        the model's likeliest pieces each piece shows."""
        if isinstance(source, str) != isinstance(target, str):
            raise OptionError("score a source with a target, or a list of each")
        sources, targets = texts_of(source, "source"), texts_of(target, "target")
        if len(sources) != len(targets):
            raise OptionError(f"{len(sources)} sources but {len(targets)} targets")
        translator = self._torch("scoring")
        whole(k, "k", 1, translator.tokenizer.tgt_vocab_size)
        scores = score_pairs(translator, sources, targets, k)
        return scores[0] if isinstance(source, str) else scores

    def trace(
        self, text: str, k: int = 5, beam: int | None = None, alpha: float | None = None
    ) -> Trace:
        """How `text` is decoded, step by step: what `mtrain translate --trace` prints."""
        text_of(text, "text")
        translator = self._with(beam, alpha, 1)
        whole(k, "k", 1, self._torch("--trace").tokenizer.tgt_vocab_size)
        tracer = Tracer(k)
        result = translator.inspect(text, tracer)
        best = result.translations[0]
        return Trace.of(
            text,
            result.src,
            tracer.steps.get(0, []),
            self.translator.tokenizer,
            best.text,
            best.score,
        )

    def attention(
        self, text: str, beam: int | None = None, alpha: float | None = None
    ) -> Attention:
        """The attention weights of `text`'s translation: what `--attention` draws."""
        text_of(text, "text")
        self._torch("--attention")
        return Attention.of_translation(self._with(beam, alpha, 1), text)

    def curves(self):
        """The run's training curves (loss, learning rate, dev BLEU) as a matplotlib Figure."""
        from mtrain.figures.curves import draw_curves

        self._torch("curves")
        return draw_curves([self.path])


def open_model(
    path: Path,
    engine: str = "mtrain",
    device: str = "auto",
    checkpoint: str = BEST,
    quantize: bool = False,
    beam: int | None = None,
    alpha: float | None = None,
) -> TranslationModel:
    """A run directory (engine "mtrain") or an export (engine "ctranslate2") to translate with."""
    for name, value in (("engine", engine), ("device", device), ("checkpoint", checkpoint)):
        if not isinstance(value, str):
            raise OptionError(f"{name}: expected a string, got {value!r}")
    if not isinstance(quantize, bool):
        raise OptionError(f"quantize: expected True or False, got {quantize!r}")
    search(beam, alpha)
    opened = open_engine(path, engine, device, checkpoint, quantize, beam, alpha)
    return TranslationModel(**vars(opened))
