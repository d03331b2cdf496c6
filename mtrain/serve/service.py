"""The loaded model as the server uses it: translate with given options, explain, describe."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from mtrain import model_map
from mtrain.config import Config
from mtrain.ct2_engine import CT2Translator
from mtrain.data import source_ids
from mtrain.run_dir import build_model
from mtrain.serve import explain
from mtrain.serve.api import SearchOptions
from mtrain.text import normalize
from mtrain.tokenizer import too_long
from mtrain.translator import Translation, Translator


@dataclasses.dataclass
class Source:
    """What the server needs to know of a sentence before decoding it."""

    tokens: int  # source ids the model reads, </s> included
    truncated: bool


class Service:
    """One loaded translator, shared by every request through the batcher's one thread."""

    def __init__(self, translator: Translator, run: Path, engine: str, checkpoint: str):
        self.base, self.run, self.engine, self.checkpoint = translator, run, engine, checkpoint
        self.cfg: Config = translator.cfg
        # The translators of the last few search options: making one copies the output weights.
        self.translator = functools.lru_cache(maxsize=8)(self._translator)

    @property
    def can_explain(self) -> bool:
        return not isinstance(self.base, CT2Translator)  # CTranslate2 shows no steps

    def _translator(self, options: SearchOptions) -> Translator:
        """The base translator with a request's search options."""
        decode = dataclasses.replace(self.base.decode, beam_size=options.beam, alpha=options.alpha)
        b = self.base
        if isinstance(b, CT2Translator):
            return CT2Translator(b.engine, b.tokenizer, b.cfg, decode, options.nbest)
        return Translator(b.model, b.tokenizer, b.cfg, b.device, decode, options.nbest)

    def translate(self, texts: list[str], options: SearchOptions) -> list[list[Translation]]:
        """Up to nbest translations of each text, as `mtrain translate` gives them."""
        return self.translator(options).translate_nbest(texts)

    def explain(self, text: str, options: SearchOptions, top_k: int) -> dict[str, Any]:
        return explain.explain(self.translator(options), text, top_k)

    def sources(self, texts: list[str]) -> list[Source]:
        """Each text's length in source ids, as the translator will cut it."""
        data = self.cfg.data
        normalized = [normalize(t, data.src_lang) for t in texts]
        pieces = iter(self.base.tokenizer.encode_src([t for t in normalized if t]))
        out = []
        for text in normalized:
            ids = next(pieces) if text else []
            length = len(source_ids(ids, data.max_src_len)) if text else 0
            out.append(Source(length, too_long(ids, data.max_src_len)))
        return out

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
