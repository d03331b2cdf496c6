"""Opening a run to translate with: the run as `run.directory.load_run` loads it (the one
loader of a run directory, which a new run's parent is read with too), in a Translator.

`mtrain translate`, `eval`, `score`, `plot`, `export`, `serve` (and each checkpoint it reloads,
through `wrap`) and `mtrain.load` all come through here; a CTranslate2 export is opened by
`export.engine`, which chooses between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mtrain.core import config, runtime
from mtrain.core.config import Config, DecodeConfig
from mtrain.core.errors import OptionError
from mtrain.data.tokenizer import Tokenizer
from mtrain.decoding.translator import Translator
from mtrain.model.transformer import Transformer
from mtrain.run.directory import BEST, LoadedRun, load_run, run_config


@dataclass
class OpenedRun:
    """A run's checkpoint, ready to translate with."""

    run: LoadedRun
    translator: Translator


def decode_options(cfg: Config, beam: int | None, alpha: float | None, nbest: int) -> DecodeConfig:
    """The run's decoding options with those asked for (None: the run's own)."""
    asked = {"beam_size": beam, "alpha": alpha}
    raw = cfg.to_dict()
    raw["decode"].update({k: v for k, v in asked.items() if v is not None})
    decode = config.from_dict(raw, "options").decode  # the run's own checks: beam, alpha bounds
    if nbest > decode.beam_size:
        raise OptionError(f"--nbest {nbest} needs --beam {nbest} or more")
    return decode


def wrap(
    model: Transformer,
    tokenizer: Tokenizer,
    cfg: Config,
    device: torch.device,
    decode: DecodeConfig,
    nbest: int = 1,
    quantize: bool = False,
) -> Translator:
    """A loaded model in a Translator; `quantize`: its linear layers computing in int8."""
    if quantize:
        if device.type != "cpu":
            raise OptionError("--quantize int8 runs on the CPU only; add --device cpu")
        model = runtime.quantize_int8(model)
    return Translator(model, tokenizer, cfg, device, decode, nbest)


def open_run(
    run_dir: Path,
    device: str = "auto",
    checkpoint: str = BEST,
    quantize: bool = False,
    beam: int | None = None,
    alpha: float | None = None,
    nbest: int = 1,
) -> OpenedRun:
    """A run directory's checkpoint `checkpoint` on `device` ("auto": CUDA when present)."""
    torch_device = runtime.pick_device(device)
    runtime.configure(torch_device)
    decode = decode_options(run_config(run_dir), beam, alpha, nbest)  # before the weights load
    run = load_run(run_dir, torch_device, checkpoint)
    translator = wrap(run.model, run.tokenizer, run.cfg, torch_device, decode, nbest, quantize)
    return OpenedRun(run, translator)
