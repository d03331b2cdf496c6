"""A trained model to translate with, on either engine: what `mtrain.load` returns, and the one
place the commands and the server open a run directory or an export.

`open_model` reads a run directory (engine "mtrain": its checkpoint on PyTorch, through
`decoding.loaded`) or a directory `mtrain export` wrote (engine "ctranslate2"), and returns a
`TranslationModel`: translation on both engines; scores, traces and attention maps, which need
the model's own forward pass, on mtrain's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtrain.core.config import Config
from mtrain.core.errors import OptionError
from mtrain.decoding.attention import AttentionRecorder
from mtrain.decoding.loaded import decode_options, open_run
from mtrain.decoding.score import TOP_K, Score, score_pairs
from mtrain.decoding.trace import Tracer
from mtrain.decoding.translator import TextTranslator, Translation, Translator
from mtrain.export import engine as ct2_engine
from mtrain.figures.attention import Attention
from mtrain.figures.trace import Trace
from mtrain.run.directory import BEST

ENGINES = ("mtrain", "ctranslate2")


@dataclass
class TranslationModel:
    """A trained model, ready to translate, score, trace and show its attention."""

    path: Path  # the run directory, or the export
    engine: str  # "mtrain" or "ctranslate2"
    translator: TextTranslator
    checkpoint: Path | None = None  # the checkpoint file (engine mtrain)
    step: int | None = None  # the training step it was saved at (engine mtrain)

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
        texts = [text] if isinstance(text, str) else list(text)
        found = self._with(beam, alpha, nbest).translate_nbest(texts)
        if nbest == 1:
            out: list = [t[0].text for t in found]
        else:
            out = [[(t.text, t.score) for t in ts] for ts in found]
        return out[0] if isinstance(text, str) else out

    def translate_nbest(self, texts: list[str]) -> list[list[Translation]]:
        """Each sentence's translations with the model's own options, as the commands use."""
        return self.translator.translate_nbest(texts)

    def _torch(self, what: str) -> Translator:
        if not isinstance(self.translator, Translator):
            raise OptionError(f"{what} needs --engine mtrain")
        return self.translator

    def score(
        self, source: str | list[str], target: str | list[str], k: int = TOP_K
    ) -> Score | list[Score]:
        """How likely the model finds `target` as the translation of `source`, piece by piece
        (teacher forcing); lists of sources and targets give a list of scores."""
        if isinstance(source, str) != isinstance(target, str):
            raise OptionError("score a source with a target, or a list of each")
        sources = [source] if isinstance(source, str) else list(source)
        targets = [target] if isinstance(target, str) else list(target)
        if len(sources) != len(targets):
            raise OptionError(f"{len(sources)} sources but {len(targets)} targets")
        scores = score_pairs(self._torch("scoring"), sources, targets, k)
        return scores[0] if isinstance(source, str) else scores

    def trace(
        self, text: str, k: int = 5, beam: int | None = None, alpha: float | None = None
    ) -> Trace:
        """How `text` is decoded, step by step: what `mtrain translate --trace` prints."""
        translator = self._with(beam, alpha, 1)
        self._torch("--trace")
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
        translator = self._with(beam, alpha, 1)
        model = self._torch("--attention").model
        with AttentionRecorder(model) as recorder:
            result = translator.inspect(text, recorder)
        if not result.src:
            raise OptionError("an empty sentence has no attention to show")
        tokens = result.hypotheses[0].tokens
        maps = recorder.maps(tokens)
        labels = maps.axis_labels(result.src, tokens, translator.tokenizer)
        return Attention.of(maps, labels, f"{text} → {result.translations[0].text}")

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
    nbest: int = 1,
) -> TranslationModel:
    """A run directory (engine "mtrain") or an export (engine "ctranslate2") to translate with."""
    if engine not in ENGINES:
        raise OptionError(f"engine {engine!r}: expected mtrain or ctranslate2")
    if engine == "ctranslate2":
        if checkpoint != BEST:
            raise OptionError("--checkpoint needs --engine mtrain")
        cfg, tokenizer, ct2 = ct2_engine.load(path, device, quantize)
        decode = decode_options(cfg, beam, alpha, nbest)
        translator = ct2_engine.CT2Translator(ct2, tokenizer, cfg, decode, nbest)
        return TranslationModel(path, engine, translator)
    opened = open_run(path, device, checkpoint, quantize, beam, alpha, nbest)
    return TranslationModel(path, engine, opened.translator, opened.checkpoint, opened.step)
