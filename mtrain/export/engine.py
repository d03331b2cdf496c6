"""Translate with a directory `mtrain export` wrote: the text side `Translator` uses
(`translator.Sentences`), with CTranslate2 doing the search; and `open_engine`, which chooses
between the two engines (a run, opened by `decoding.loaded`, or an export) for every command,
serve and `mtrain.load`.

CTranslate2's searches are ours (greedy; beam search that ranks 2 × beam candidates and ends
a sentence at `beam` finished hypotheses), but for two things, which this module bridges:
- one output limit per call, where ours is per sentence: beam search's batches are split by
  limit, greedy's outputs are cut;
- the length penalty. CTranslate2 divides by length ** β, we by GNMT's ((5 + length) / 6) **
  alpha. The penalty only ranks finished hypotheses (with β > 0 it does not change which ones
  finish), but CTranslate2 returns only its `beam` best of them: we choose the β that tracks
  GNMT's penalty most closely, so that ours is among them, recover their log-probabilities and
  rank them by ours. Our best is then CTranslate2's on all but rare sentences (on the tests, all);
  with --nbest, lower entries may differ where more than `beam` hypotheses finished.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from mtrain.core import config, runtime
from mtrain.core.config import Config, DecodeConfig
from mtrain.core.errors import OptionError
from mtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from mtrain.decoding.loaded import decode_options, open_run
from mtrain.decoding.search import Hypothesis, Observer, log_length_penalty, normalized
from mtrain.decoding.translator import SearchedText, Sentences, TextTranslator
from mtrain.export.converter import (
    FLOAT16_ON_CPU,
    MTRAIN_CONFIG,
    Quantization,
    is_export,
    read_manifest,
    require_ctranslate2,
)
from mtrain.run.directory import BEST, CONFIG_FILE, CheckpointError

log = logging.getLogger(__name__)

# CTranslate2 stops a beam early when its length penalty is exactly 0; a negligible one keeps
# its search ours (length ** 1e-9 is 1 in float32).
NO_PENALTY = 1e-9


def ranking_exponent(alpha: float, max_len: int) -> float:
    """The β whose length ** β is closest to GNMT's ((5 + length) / 6) ** alpha (least squares
    in logs, lengths 2 to max_len; both are 1 at length 1): CTranslate2's `beam` best by it then
    hold ours. At least NO_PENALTY."""
    lengths = range(2, max(max_len, 2) + 1)
    x = [math.log(n) for n in lengths]
    y = [alpha * math.log((5 + n) / 6) for n in lengths]
    beta = sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x)
    return max(beta, NO_PENALTY)


class CT2Translator(SearchedText):
    """Translates with CTranslate2 on an exported model: our text side (`Sentences`), its search."""

    def __init__(
        self,
        engine,  # a ctranslate2.Translator
        tokenizer: Tokenizer,
        cfg: Config,
        decode: DecodeConfig | None = None,
        nbest: int = 1,
    ):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.decode, self.nbest = decode or cfg.decode, nbest
        self.text = Sentences(tokenizer, cfg, self.decode)
        self.length_exponent = ranking_exponent(self.decode.alpha, cfg.data.max_tgt_len)

    def with_options(self, decode: DecodeConfig, nbest: int) -> CT2Translator:
        """This translator with other search options."""
        return CT2Translator(self.engine, self.tokenizer, self.cfg, decode, nbest)

    def _search(
        self, src: torch.Tensor, limits: torch.Tensor, observe: Observer | None = None
    ) -> list[list[Hypothesis]]:
        """Search a padded (B, S) batch; `observe` sees nothing: CTranslate2 shows no steps."""
        d = self.decode
        limits = limits.tolist()
        # Without the final </s>: the exported config has CTranslate2 add it.
        sources = [[t for t in row if t != PAD_ID][:-1] for row in src.tolist()]
        # Beam search depends on the limit: one call per limit. Greedy does not (its first n
        # tokens are those it outputs with limit n): one call, outputs cut at their limits.
        groups = defaultdict(list)
        for row, limit in enumerate(limits):
            groups[limit if d.beam_size > 1 else 0].append(row)
        found: list[list[Hypothesis]] = [[] for _ in sources]
        for rows in groups.values():
            results = self.engine.translate_batch(
                [self.tokenizer.src.id_to_piece(sources[row]) for row in rows],
                max_decoding_length=max(limits[row] for row in rows),
                **self.options,
            )
            for row, result in zip(rows, results):
                outputs = [pieces[: limits[row]] for pieces in result.hypotheses]
                found[row] = self._hypotheses(outputs, result.scores)
        return found

    @property
    def options(self) -> dict:
        """translate_batch's options for our search: output limits, never <pad> or <s>."""
        beam = self.decode.beam_size
        return {
            "beam_size": beam,
            "num_hypotheses": beam,
            "length_penalty": self.length_exponent if beam > 1 else 0.0,
            "return_scores": beam > 1,
            "return_end_token": True,  # so that a length counts </s>, as ours does
            "min_decoding_length": 0,  # an empty output may be the best one
            "max_input_length": 0,  # sources are cut already, at data.max_src_len
            "suppress_sequences": [[self.tokenizer.tgt.id_to_piece(i)] for i in (PAD_ID, BOS_ID)],
        }

    def _hypotheses(self, outputs: list[list[str]], scores: list[float]) -> list[Hypothesis]:
        """CTranslate2's hypotheses as ours: ids without </s>, ranked by GNMT's penalty."""
        hyps = []
        for i, pieces in enumerate(outputs):
            ids = self.tokenizer.tgt.piece_to_id(pieces)
            body = ids[:-1] if ids and ids[-1] == EOS_ID else ids
            if not scores:  # greedy
                hyps.append(Hypothesis(body, None))
                continue
            length = len(ids)  # the steps taken, </s> included
            # CTranslate2's score times length ** β is the log-probability; in logs throughout
            theirs = -self.length_exponent * math.log(length)
            ours = log_length_penalty(length, self.decode.alpha)
            hyps.append(Hypothesis(body, normalized(scores[i], theirs + ours)))
        return sorted(hyps, key=lambda h: -h.score)[: self.nbest] if scores else hyps


def load(
    directory: Path, device: str = "auto", int8: bool = False
) -> tuple[Config, Tokenizer, object]:
    """An exported directory's config, tokenizer and ctranslate2.Translator.

    `int8` computes in int8 whatever the stored weights; the threads are PyTorch's, so that
    the two engines are compared on equal terms.
    """
    ct2 = require_ctranslate2()
    if not is_export(directory):
        hint = (
            f"; export it first: mtrain export {directory} -o DIR"
            if (directory / CONFIG_FILE).is_file()
            else ""
        )
        raise CheckpointError(
            f"{directory}: not a directory written by mtrain export (no {MTRAIN_CONFIG}){hint}"
        )
    try:
        cfg = config.load_recorded(directory / MTRAIN_CONFIG)
        tokenizer = Tokenizer.load(directory)
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{directory}: {e}") from None
    torch_device = runtime.pick_device(device)
    float16 = read_manifest(directory).get("quantize") == Quantization.float16
    if float16 and torch_device.type == "cpu" and not int8:
        log.warning(FLOAT16_ON_CPU, directory)
    try:
        engine = ct2.Translator(
            str(directory),
            device=torch_device.type,
            device_index=torch_device.index or 0,  # cuda:N is GPU N, not GPU 0
            compute_type="int8" if int8 else "default",
            intra_threads=torch.get_num_threads(),
        )
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{directory}: CTranslate2 cannot load it ({e})") from None
    return cfg, tokenizer, engine


ENGINES = ("mtrain", "ctranslate2")


@dataclass
class Opened:
    """A model opened on one engine, ready to translate."""

    path: Path  # the run directory, or the export
    engine: str  # "mtrain" or "ctranslate2"
    translator: TextTranslator
    checkpoint: Path | None = None  # the checkpoint file (engine mtrain)
    step: int | None = None  # the training step it was saved at (engine mtrain)


def open_engine(
    path: Path,
    engine: str = "mtrain",
    device: str = "auto",
    checkpoint: str = BEST,
    quantize: bool = False,
    beam: int | None = None,
    alpha: float | None = None,
    nbest: int = 1,
) -> Opened:
    """A run directory (engine "mtrain") or an export (engine "ctranslate2") to translate with."""
    if engine not in ENGINES:
        raise OptionError(f"engine {engine!r}: expected mtrain or ctranslate2")
    if engine == "ctranslate2":
        if checkpoint != BEST:
            raise OptionError("--checkpoint needs --engine mtrain")
        cfg, tokenizer, ct2 = load(path, device, quantize)
        decode = decode_options(cfg, beam, alpha, nbest)
        return Opened(path, engine, CT2Translator(ct2, tokenizer, cfg, decode, nbest))
    opened = open_run(path, device, checkpoint, quantize, beam, alpha, nbest)
    return Opened(path, engine, opened.translator, opened.run.checkpoint, opened.run.step)
