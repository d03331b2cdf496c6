"""The loaded model as the server uses it: translate with given options, explain, describe."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from mtrain import model_map
from mtrain.config import Config
from mtrain.run_dir import build_model
from mtrain.serve import explain
from mtrain.serve.api import SearchOptions
from mtrain.translator import Source, TextTranslator, Translation, Translator


class Service:
    """One loaded translator, shared by every request through the batcher's one thread."""

    def __init__(self, translator: TextTranslator, run: Path, engine: str, checkpoint: str):
        self.base, self.run, self.engine, self.checkpoint = translator, run, engine, checkpoint
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

    def sources(self, texts: list[str]) -> list[Source]:
        """Each text as the translator reads it: encoded once, here, off the event loop."""
        return self.base.sources(texts)

    def translate(self, sources: list[Source], options: SearchOptions) -> list[list[Translation]]:
        """Up to nbest translations of each source, as `mtrain translate` gives them."""
        return self.translator(options).translate_sources(sources)

    def explain(self, text: str, source: Source, options: SearchOptions, top_k: int) -> dict:
        return explain.explain(self.translator(options), text, source, top_k)

    def describe(self) -> dict[str, Any]:
        """The model: languages, size, checkpoint, engine, default search."""
        cfg, tokenizer = self.cfg, self.base.tokenizer
        parts = model_map.parts(build_model(cfg, tokenizer))
        m = cfg.model
        return {
            "run": str(self.run),
            "engine": self.engine,
            "checkpoint": self.checkpoint,
            "direction": f"{cfg.data.src_lang}-{cfg.data.tgt_lang}",
            "src_lang": cfg.data.src_lang,
            "tgt_lang": cfg.data.tgt_lang,
            "parameters": model_map.total(parts),
            "model": {
                "d_model": m.d_model,
                "n_heads": m.n_heads,
                "n_encoder_layers": m.n_encoder_layers,
                "n_decoder_layers": m.n_decoder_layers,
                "d_ff": m.d_ff,
            },
            "vocab": {"src": tokenizer.src_vocab_size, "tgt": tokenizer.tgt_vocab_size},
            "max_src_len": cfg.data.max_src_len,
            "decode": {"beam": self.base.decode.beam_size, "alpha": self.base.decode.alpha},
            "explain": self.can_explain,
        }
