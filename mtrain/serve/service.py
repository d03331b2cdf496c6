"""The loaded model as the server uses it: translate with given options, explain, describe."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from mtrain.core.config import Config
from mtrain.decoding.translator import Source, TextTranslator, Translation, Translator
from mtrain.model import parameter_map
from mtrain.run.directory import build_model
from mtrain.serve import explain
from mtrain.serve.api import SearchOptions
from mtrain.serve.reload import Loaded


@dataclasses.dataclass
class Decoded:
    """One sentence's translations and the checkpoint step of the model that made them."""

    nbest: list[Translation]
    step: int | None


class Service:
    """One loaded translator, shared by every request through the batcher's one thread."""

    def __init__(
        self,
        translator: TextTranslator,
        run: Path,
        engine: str,
        checkpoint: str,
        step: int | None = None,  # the checkpoint's training step, where known
    ):
        self.base, self.run, self.engine, self.checkpoint = translator, run, engine, checkpoint
        self.step = step
        self.cfg: Config = translator.cfg
        # The translators of the last few search options.
        self.translator = functools.lru_cache(maxsize=8)(self._translator)

    @property
    def can_explain(self) -> bool:
        return isinstance(self.base, Translator)  # CTranslate2 shows no steps

    def _translator(self, options: SearchOptions) -> TextTranslator:
        """The base translator with a request's search options."""
        decode = dataclasses.replace(self.base.decode, beam_size=options.beam, alpha=options.alpha)
        return self.base.with_options(decode, options.nbest)

    def adopt(self, loaded: Loaded) -> None:
        """Serve a newly loaded model; on the worker thread, between batches."""
        self.base, self.step = loaded.translator, loaded.step
        self.translator.cache_clear()

    def sources(self, texts: list[str]) -> list[Source]:
        """Each text as the translator reads it: encoded once, here, off the event loop."""
        return self.base.sources(texts)

    def translate(self, sources: list[Source], options: SearchOptions) -> list[Decoded]:
        """Up to nbest translations of each source, as `mtrain translate` gives them."""
        nbests = self.translator(options).translate_sources(sources)
        return [Decoded(nbest, self.step) for nbest in nbests]

    def explain(self, text: str, source: Source, options: SearchOptions, top_k: int) -> dict:
        answer = explain.explain(self.translator(options), text, source, top_k)
        answer["checkpoint_step"] = self.step
        return answer

    def describe(self) -> dict[str, Any]:
        """The model: languages, size, checkpoint, engine, default search."""
        cfg, tokenizer = self.cfg, self.base.tokenizer
        parts = parameter_map.parts(build_model(cfg, tokenizer))
        m = cfg.model
        return {
            "run": str(self.run),
            "engine": self.engine,
            "checkpoint": self.checkpoint,
            "direction": f"{cfg.data.src_lang}-{cfg.data.tgt_lang}",
            "src_lang": cfg.data.src_lang,
            "tgt_lang": cfg.data.tgt_lang,
            "parameters": parameter_map.total(parts),
            "model": {
                "d_model": m.d_model,
                "n_heads": m.n_heads,
                "n_encoder_layers": m.n_encoder_layers,
                "n_decoder_layers": m.n_decoder_layers,
                "d_ff": m.d_ff,
                "variant": m.variant,
            },
            "vocab": tokenizer.vocab_sizes(),
            "max_src_len": cfg.data.max_src_len,
            "decode": {"beam": self.base.decode.beam_size, "alpha": self.base.decode.alpha},
            "explain": self.can_explain,
        }
