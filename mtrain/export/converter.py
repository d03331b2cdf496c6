"""Export a trained run to a CTranslate2 model directory, built with CTranslate2's own spec API.

The spec is CTranslate2's `TransformerSpec`, filled as its OpenNMT-py and Marian converters fill
it: fused query/key/value matrices, LayerNorms before or after each sublayer, our sinusoidal
table given explicitly (CTranslate2's own table orders sines and cosines differently), tokens
scaled by sqrt(d_model), and vocabularies whose positions are our SentencePiece ids.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import os
from pathlib import Path
from types import ModuleType

import torch
import yaml
from torch import nn

from mtrain.core.config import MODEL_VARIANTS, Config, ModelConfig
from mtrain.core.errors import MtrainError
from mtrain.core.files import (
    lock_beside,
    recover_directory,
    remove_path,
    replace_directory,
    sync_directory,
    tmp_path,
)
from mtrain.data.tokenizer import BOS_ID, EOS_ID, SRC_MODEL, TGT_MODEL, UNK_ID, Tokenizer
from mtrain.model.transformer import PositionalEncoding, Transformer
from mtrain.run.directory import BEST, EXPORT_MODEL, config_record, load_run

log = logging.getLogger(__name__)

MTRAIN_CONFIG = "mtrain.yaml"  # the run's config, beside CTranslate2's own config.json
MODEL_FILE = EXPORT_MODEL
README = "README.md"
# What this export wrote: its files, and the weights' type (read back to warn on a CPU).
MANIFEST = "export.json"
# The files an export holds: CTranslate2's, ours, and the manifest, which lists them too (an
# export written before the manifest is read with this list alone). `--force` replaces a
# directory that holds nothing else.
EXPORT_FILES = frozenset(
    {
        MODEL_FILE,
        "config.json",
        "source_vocabulary.json",
        "target_vocabulary.json",
        "shared_vocabulary.json",
        SRC_MODEL,
        TGT_MODEL,
        MTRAIN_CONFIG,
        README,
        MANIFEST,
    }
)


class Quantization(str, enum.Enum):
    """How an export stores the weights: float32 as trained (none), int8 matrices and the rest
    float32 (int8, or int8_float32: the same file), or float16 (for GPUs)."""

    none = "none"
    int8 = "int8"
    int8_float32 = "int8_float32"
    float16 = "float16"


# Rows of the exported sinusoidal table: CTranslate2's default input limit (1,024 tokens), so
# that longer input than the run was trained on is read, not refused, by a CTranslate2 user.
POSITIONS = 1024
FLOAT16_ON_CPU = (
    "%s: float16 weights are for GPUs; on a CPU CTranslate2 computes in float32 from weights "
    "rounded to float16, so its outputs can differ from the run's (export without --quantize, "
    "or with int8, for a CPU)"
)
INSTALL = "pip install ctranslate2 (in a checkout of mtrain: pip install -e '.[serve]')"

# Each model option and the values CTranslate2 can express; None: any value. An option missing
# here (one added after this exporter) is refused until it is mapped.
EXPRESSIBLE: dict[str, set | None] = {
    "d_model": None,
    "n_heads": None,
    "n_encoder_layers": None,
    "n_decoder_layers": None,
    "d_ff": None,
    "dropout": None,  # training only
    "norm": {"pre", "post"},
    "tie_embeddings": {True, False},  # tied matrices are stored once (CTranslate2 aliases them)
    # CTranslate2 adds a table of positions (zeros: none; a learned one), decodes with the
    # look-ahead mask (peek lacks it in training only), and scales queries by 1/sqrt(d_head)
    # (undone for no-scale by scaling our query projection); every sublayer has its residual
    # connection and LayerNorm.
    "variant": {name for name, v in MODEL_VARIANTS.items() if v.residual and v.layernorm},
}


class ExportError(MtrainError, ValueError):
    """A run that cannot be exported, or an engine that is not installed; one line."""


def require_ctranslate2() -> ModuleType:
    """The ctranslate2 module, or an ExportError that says how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise ExportError(f"CTranslate2 is not installed: {INSTALL}") from None
    return ctranslate2


def check_expressible(cfg: Config) -> None:
    """Refuse, naming the option, a model that CTranslate2's Transformer cannot express."""
    for field in dataclasses.fields(cfg.model):
        value = getattr(cfg.model, field.name)
        if field.name not in EXPRESSIBLE:
            raise ExportError(
                f"model.{field.name}: mtrain export cannot express this option in CTranslate2"
            )
        allowed = EXPRESSIBLE[field.name]
        if allowed is not None and value not in allowed:
            raise ExportError(
                f"model.{field.name}: {value!r} cannot be expressed in CTranslate2 "
                f"(it can: {', '.join(map(str, sorted(allowed, key=str)))})"
            )


def vocabulary(sp) -> list[str]:
    """A SentencePiece model's pieces, position = our id; CTranslate2 maps them back by name."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if len(set(pieces)) != len(pieces):
        raise ExportError("the SentencePiece model has duplicate pieces; ids would not survive")
    return pieces


class _Weights:
    """The model's state dict, handed out once per name; what is never asked for is an error."""

    def __init__(self, model: Transformer):
        self.tensors = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        self.unused = set(self.tensors)

    def __call__(self, name: str) -> torch.Tensor:
        self.unused.discard(name)
        return self.tensors[name]

    def linear(self, spec, scope: str) -> None:
        spec.weight, spec.bias = self(f"{scope}.weight").numpy(), self(f"{scope}.bias").numpy()

    def norm(self, spec, scope: str) -> None:
        spec.gamma, spec.beta = self(f"{scope}.weight").numpy(), self(f"{scope}.bias").numpy()

    def attention(self, spec, scope: str, self_attention: bool, q_scale: float = 1.0) -> None:
        """Our q_proj and kv_proj (keys then values) as CTranslate2's fused projections; the
        queries times `q_scale`."""
        q, kv = self(f"{scope}.q_proj.weight") * q_scale, self(f"{scope}.kv_proj.weight")
        qb, kvb = self(f"{scope}.q_proj.bias") * q_scale, self(f"{scope}.kv_proj.bias")
        if self_attention:  # one (3 d_model, d_model) matrix: queries, keys, values
            spec.linear[0].weight = torch.cat([q, kv]).numpy()
            spec.linear[0].bias = torch.cat([qb, kvb]).numpy()
        else:  # queries from the decoder; keys and values, fused, from the encoder output
            spec.linear[0].weight, spec.linear[0].bias = q.numpy(), qb.numpy()
            spec.linear[1].weight, spec.linear[1].bias = kv.numpy(), kvb.numpy()
        self.linear(spec.linear[-1], f"{scope}.out_proj")


def _layer_norm_epsilon(model: Transformer) -> float:
    eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
    if len(eps) != 1:
        raise ExportError(f"LayerNorms with several epsilons {sorted(eps)}; CTranslate2 has one")
    return eps.pop()


def _positions(m: ModelConfig, model: Transformer, side: str, w: _Weights) -> torch.Tensor:
    """(positions, d_model): the table added to one side's embeddings. The sinusoids for
    POSITIONS at least; a learned table has the run's rows; no-positions, zeros."""
    positions = MODEL_VARIANTS[m.variant].positions
    if positions == "learned":
        return w(f"{side}_embed.positions.table.weight")
    table = PositionalEncoding(m.d_model, max(POSITIONS, model.max_len)).pe
    return torch.zeros_like(table) if positions == "none" else table


def build_spec(cfg: Config, tokenizer: Tokenizer, model: Transformer):
    """CTranslate2's TransformerSpec holding the model's weights, vocabularies and tokens."""
    require_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    check_expressible(cfg)
    m = cfg.model
    pre_norm = m.norm == "pre"
    spec = transformer_spec.TransformerSpec.from_config(
        (m.n_encoder_layers, m.n_decoder_layers),
        m.n_heads,
        pre_norm=pre_norm,
        activation=common_spec.Activation.RELU,
    )
    w = _Weights(model)
    for side, stack in (("src", spec.encoder), ("tgt", spec.decoder)):
        embeddings = stack.embeddings[0] if side == "src" else stack.embeddings
        embeddings.weight = w(f"{side}_embed.tokens.weight").numpy()
        stack.scale_embeddings = True  # tokens × sqrt(d_model), then + position
        stack.position_encodings.encodings = _positions(m, model, side, w).numpy()
        if pre_norm:  # the final LayerNorm of a pre-norm stack
            w.norm(stack.layer_norm, "encoder.norm" if side == "src" else "decoder.norm")
    # CTranslate2's scores are divided by sqrt(d_head): no-scale's queries are that much larger.
    q_scale = math.sqrt(m.d_model // m.n_heads) if not MODEL_VARIANTS[m.variant].scaled else 1.0
    for i, layer in enumerate(spec.encoder.layer):
        scope = f"encoder.layers.{i}"
        w.attention(layer.self_attention, f"{scope}.self_attn", True, q_scale)
        w.norm(layer.self_attention.layer_norm, f"{scope}.residuals.0.norm")
        w.linear(layer.ffn.linear_0, f"{scope}.feed_forward.linear1")
        w.linear(layer.ffn.linear_1, f"{scope}.feed_forward.linear2")
        w.norm(layer.ffn.layer_norm, f"{scope}.residuals.1.norm")
    for i, layer in enumerate(spec.decoder.layer):
        scope = f"decoder.layers.{i}"
        w.attention(layer.self_attention, f"{scope}.self_attn", True, q_scale)
        w.norm(layer.self_attention.layer_norm, f"{scope}.residuals.0.norm")
        w.attention(layer.attention, f"{scope}.cross_attn", False, q_scale)
        w.norm(layer.attention.layer_norm, f"{scope}.residuals.1.norm")
        w.linear(layer.ffn.linear_0, f"{scope}.feed_forward.linear1")
        w.linear(layer.ffn.linear_1, f"{scope}.feed_forward.linear2")
        w.norm(layer.ffn.layer_norm, f"{scope}.residuals.2.norm")
    w.linear(spec.decoder.projection, "output_projection")
    if w.unused:
        raise ExportError(f"weights with no place in CTranslate2's Transformer: {sorted(w.unused)}")

    spec.register_source_vocabulary(vocabulary(tokenizer.src))
    spec.register_target_vocabulary(vocabulary(tokenizer.tgt))
    piece = tokenizer.tgt.id_to_piece
    for i in (UNK_ID, BOS_ID, EOS_ID):  # CTranslate2 names one of each for both vocabularies
        if tokenizer.src.id_to_piece(i) != piece(i):
            raise ExportError(
                f"id {i} is {tokenizer.src.id_to_piece(i)!r} in the source "
                f"vocabulary but {piece(i)!r} in the target one"
            )
    spec.config.unk_token, spec.config.bos_token = piece(UNK_ID), piece(BOS_ID)
    spec.config.eos_token, spec.config.decoder_start_token = piece(EOS_ID), piece(BOS_ID)
    spec.config.add_source_eos = True  # our sources end with </s>
    spec.config.layer_norm_epsilon = _layer_norm_epsilon(model)
    return spec


def reach(cfg: Config) -> str:
    """How long a sentence the README's lines read and write, in the README's words."""
    rows = cfg.data.max_positions()
    if cfg.model.variant == "learned-positions":  # the run's table, no row past it
        return (
            f"these lines read and write up to {rows} pieces, the rows of the learned position "
            "table (CTranslate2 refuses a longer sentence)"
        )
    return (
        "these lines read up to 1,024 source pieces and write up to 256\n  (CTranslate2's "
        f"`max_input_length` and `max_decoding_length`), past the {rows} positions\n  the model "
        "was trained on: what it makes of the others is untested"
    )


def readme(run_dir: Path, out: Path, which: str, quantize: str | None, cfg: Config) -> str:
    """The README.md of an exported directory: what it holds and how to use it."""
    data, d = cfg.data, cfg.decode
    example = "我是谁" if data.src_lang == "zh" else "Who am I?"
    beam = d.beam_size
    lang = f"{data.src_lang}→{data.tgt_lang}"
    weights = quantize or "float32"
    zh = " and converts traditional Chinese to simplified" if data.src_lang == "zh" else ""
    return f"""# {run_dir.name}: a {lang} translation model for CTranslate2

Exported by `mtrain export` from `{run_dir}` (checkpoint `{which}`), weights in {weights}.

| file | holds |
|---|---|
| `{MODEL_FILE}`, `config.json`, `*_vocabulary.json` | the model, for `ctranslate2.Translator` |
| `{SRC_MODEL}`, `{TGT_MODEL}` | SentencePiece: text to source pieces, target pieces to text |
| `{MTRAIN_CONFIG}` | the run's config, for `mtrain translate --engine ctranslate2` |
| `{MANIFEST}` | the files `mtrain export` wrote here, and the weights' type |

With mtrain, with the input handling and output of `mtrain translate`:

    mtrain translate --engine ctranslate2 --run {out} "{example}"

Without it, with only `pip install ctranslate2 sentencepiece`:

```python
import ctranslate2, sentencepiece as spm

src, tgt = (spm.SentencePieceProcessor(model_file=f"{out}/spm.{{s}}.model") for s in ("src", "tgt"))
translator = ctranslate2.Translator("{out}")
result = translator.translate_batch([src.encode("{example}", out_type=str)], beam_size={beam})
print(tgt.decode(result[0].hypotheses[0]))
```

What `mtrain translate` does that these lines do not:
- it collapses whitespace{zh};
- it cuts sources at {data.max_src_len} pieces, and outputs at {d.max_len_ratio} × source pieces +
  {d.max_len_offset} (at most {data.max_tgt_len}); {reach(cfg)};
- it outputs an empty line where the model ends a sentence at once; CTranslate2's
  `min_decoding_length` is 1, so these lines always output at least one piece;
- it never outputs `<pad>` or `<s>`;
- beam search ranks finished hypotheses by GNMT's length penalty, log-probability /
  ((5 + length) / 6) ** {d.alpha}, where CTranslate2's `length_penalty` divides by
  length ** length_penalty (1 by default). `mtrain translate --engine ctranslate2` bridges
  the two, with one gap: CTranslate2 returns only its `beam_size` best finished hypotheses by
  its own penalty, so where more than `beam_size` have finished when a search ends (several
  at the same step, or a sentence at its output limit after some finished), the best by
  GNMT's penalty may not be among them, and the engine outputs another.
"""


def write_directory(
    spec, out: Path, tokenizer: Tokenizer, cfg: Config, text: str, quantize: str | None
) -> None:
    """Save the spec, tokenizer, config, README and manifest into a fresh directory `out`."""
    spec.save(str(out))
    (out / SRC_MODEL).write_bytes(tokenizer.src.serialized_model_proto())
    (out / TGT_MODEL).write_bytes(tokenizer.tgt.serialized_model_proto())
    config_text = yaml.safe_dump(config_record(cfg), sort_keys=False, allow_unicode=True)
    (out / MTRAIN_CONFIG).write_text(config_text, encoding="utf-8")
    (out / README).write_text(text, encoding="utf-8")
    files = sorted({p.name for p in out.iterdir()} | {MANIFEST})
    manifest = {"files": files, "quantize": quantize or "float32"}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    for path in out.iterdir():  # on disk before the directory is renamed into place
        with path.open("rb") as f:
            os.fsync(f.fileno())
    sync_directory(out)


def is_export(path: Path) -> bool:
    """Whether `path` is a directory that `export_run` wrote."""
    return (path / MODEL_FILE).is_file() and (path / MTRAIN_CONFIG).is_file()


def read_manifest(directory: Path) -> dict:
    """An export's manifest; empty where there is none or it cannot be read."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def foreign_files(directory: Path) -> list[str]:
    """The entries of an export directory that `mtrain export` did not write."""
    listed = read_manifest(directory).get("files")
    ours = EXPORT_FILES | set(listed if isinstance(listed, list) else [])
    return sorted(p.name for p in directory.iterdir() if p.name not in ours)


def destination(out: Path) -> Path:
    """The directory that `-o out` names, absolute: a symlink's target, so the link stays."""
    path = Path(os.path.abspath(out))  # `.` and `..` have no name to put a temporary beside
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check_destination(out: Path, target: Path, run_dir: Path, force: bool) -> None:
    """Refuse to write where a user's files would be lost; `target` is `destination(out)`."""
    if target.exists() and not target.is_dir():
        raise ExportError(f"-o {out}: is a file, not a directory")
    resolved, run = target.resolve(), run_dir.resolve()
    if resolved == run or resolved in run.parents:
        raise ExportError(f"-o {out}: would replace the run {run_dir}; choose another directory")
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        where = "the current directory" if resolved == cwd else "a parent of the current directory"
        raise ExportError(
            f"-o {out}: is {where}, which an export would replace; choose a new directory "
            "(-o model, say)"
        )
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not is_export(target):
        raise ExportError(
            f"-o {out}: is not empty and not an earlier export (it has no {MODEL_FILE} and "
            f"{MTRAIN_CONFIG}); --force replaces only an earlier export: choose another directory"
        )
    foreign = foreign_files(target)
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise ExportError(
            f"-o {out}: holds files that mtrain export did not write ({shown}); --force replaces "
            "only an export's own files: move them, or choose another directory"
        )
    if not force:
        raise ExportError(f"-o {out}: exists and is not empty; add --force to replace it")


def _named(e: OSError, tmp: Path, target: Path) -> OSError:
    """`e` naming what the user named: the destination, not its temporary directory."""
    if e.filename is None:  # a failed write (a full disk) names no file
        return OSError(e.errno, e.strerror, str(target))
    path = Path(os.fsdecode(e.filename))
    if path == tmp:  # the temporary directory could not be made: its parent is at fault
        return OSError(e.errno, e.strerror, str(target.parent))
    if tmp in path.parents:
        return OSError(e.errno, e.strerror, str(target / path.relative_to(tmp)))
    return e


def export_run(
    run_dir: Path,
    out: Path,
    which: str = BEST,
    quantize: Quantization = Quantization.none,
    force: bool = False,
) -> Path:
    """Write a run's checkpoint as a CTranslate2 model directory `out`; return `out`.

    The directory is written under a temporary name and put in place when complete
    (`files.replace_directory`): an interrupted export leaves no half-written model, and a
    replaced one is removed only after that. Two exports to one directory at once: the second
    is refused (`files.lock_beside`).
    """
    ct2 = require_ctranslate2()
    try:
        quantize = Quantization(quantize)  # a plain string, from a script, is checked here
    except ValueError:
        choices = ", ".join(q.value for q in Quantization)
        raise ExportError(f"--quantize {quantize}: expected one of {choices}") from None
    level = None if quantize is Quantization.none else quantize.value
    target = destination(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    with lock_beside(target):  # two exports to one directory: the second is refused
        recover_directory(target, is_export, "export")
        check_destination(out, target, run_dir, force)
        run = load_run(run_dir, torch.device("cpu"), which)
        spec = build_spec(run.cfg, run.tokenizer, run.model)
        spec.validate()
        spec.optimize(quantization=level)
        if quantize is Quantization.float16 and not ct2.get_cuda_device_count():
            log.warning(FLOAT16_ON_CPU, out)
        tmp = tmp_path(target)
        try:
            tmp.mkdir()
            text = readme(run_dir, out, which, level, run.cfg)
            write_directory(spec, tmp, run.tokenizer, run.cfg, text, level)
            replace_directory(tmp, target)
        except OSError as e:
            raise _named(e, tmp, target) from None
        finally:
            remove_path(tmp)
    return out
