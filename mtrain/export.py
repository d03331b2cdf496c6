"""Export a trained run to a CTranslate2 model directory, built with CTranslate2's own spec API.

The spec is CTranslate2's `TransformerSpec`, filled as its OpenNMT-py and Marian converters fill
it: fused query/key/value matrices, LayerNorms before or after each sublayer, our sinusoidal
table given explicitly (CTranslate2's own table orders sines and cosines differently), tokens
scaled by sqrt(d_model), and vocabularies whose positions are our SentencePiece ids.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch
import yaml
from torch import nn

from mtrain.config import Config
from mtrain.files import tmp_path
from mtrain.model import PositionalEncoding, Transformer
from mtrain.run_dir import BEST, load_run
from mtrain.tokenizer import BOS_ID, EOS_ID, SRC_MODEL, TGT_MODEL, UNK_ID, Tokenizer

MTRAIN_CONFIG = "mtrain.yaml"  # the run's config, beside CTranslate2's own config.json
MODEL_FILE = "model.bin"
QUANTIZATIONS = ("int8", "int8_float32", "float16")
# Rows of the exported sinusoidal table: CTranslate2's default input limit (1,024 tokens), so
# that longer input than the run was trained on is read, not refused, by a CTranslate2 user.
POSITIONS = 1024
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
}


class ExportError(ValueError):
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

    def attention(self, spec, scope: str, self_attention: bool) -> None:
        """Our q_proj and kv_proj (keys then values) as CTranslate2's fused projections."""
        q, kv = self(f"{scope}.q_proj.weight"), self(f"{scope}.kv_proj.weight")
        qb, kvb = self(f"{scope}.q_proj.bias"), self(f"{scope}.kv_proj.bias")
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
    table = PositionalEncoding(m.d_model, max(POSITIONS, model.src_embed.positions.pe.size(0)))
    for side, stack in (("src", spec.encoder), ("tgt", spec.decoder)):
        embeddings = stack.embeddings[0] if side == "src" else stack.embeddings
        embeddings.weight = w(f"{side}_embed.tokens.weight").numpy()
        stack.scale_embeddings = True  # tokens × sqrt(d_model), then + position
        stack.position_encodings.encodings = table.pe.numpy()  # (positions, d_model)
        if pre_norm:  # the final LayerNorm of a pre-norm stack
            w.norm(stack.layer_norm, "encoder.norm" if side == "src" else "decoder.norm")
    for i, layer in enumerate(spec.encoder.layer):
        scope = f"encoder.layers.{i}"
        w.attention(layer.self_attention, f"{scope}.self_attn", self_attention=True)
        w.norm(layer.self_attention.layer_norm, f"{scope}.residuals.0.norm")
        w.linear(layer.ffn.linear_0, f"{scope}.feed_forward.linear1")
        w.linear(layer.ffn.linear_1, f"{scope}.feed_forward.linear2")
        w.norm(layer.ffn.layer_norm, f"{scope}.residuals.1.norm")
    for i, layer in enumerate(spec.decoder.layer):
        scope = f"decoder.layers.{i}"
        w.attention(layer.self_attention, f"{scope}.self_attn", self_attention=True)
        w.norm(layer.self_attention.layer_norm, f"{scope}.residuals.0.norm")
        w.attention(layer.attention, f"{scope}.cross_attn", self_attention=False)
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
| `model.bin`, `config.json`, `*_vocabulary.json` | the model, for `ctranslate2.Translator` |
| `{SRC_MODEL}`, `{TGT_MODEL}` | SentencePiece: text to source pieces, target pieces to text |
| `{MTRAIN_CONFIG}` | the run's config, for `mtrain translate --engine ctranslate2` |

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
- it cuts sources at {data.max_src_len} pieces, and outputs at {d.max_len_ratio} × source pieces \
+ {d.max_len_offset} (at most {data.max_tgt_len});
- it never outputs `<pad>` or `<s>`;
- beam search ranks finished hypotheses by GNMT's length penalty, log-probability /
  ((5 + length) / 6) ** {d.alpha}, where CTranslate2's `length_penalty` divides by
  length ** alpha.
"""


def write_directory(spec, out: Path, tokenizer: Tokenizer, cfg: Config, text: str) -> None:
    """Save the spec, tokenizer, config and README into a fresh directory `out`."""
    spec.save(str(out))
    (out / SRC_MODEL).write_bytes(tokenizer.src.serialized_model_proto())
    (out / TGT_MODEL).write_bytes(tokenizer.tgt.serialized_model_proto())
    config_text = yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True)
    (out / MTRAIN_CONFIG).write_text(config_text, encoding="utf-8")
    (out / "README.md").write_text(text, encoding="utf-8")
    for path in out.iterdir():  # on disk before the directory is renamed into place
        with path.open("rb") as f:
            os.fsync(f.fileno())


def is_export(path: Path) -> bool:
    """Whether `path` is a directory that `export_run` wrote."""
    return (path / MODEL_FILE).is_file() and (path / MTRAIN_CONFIG).is_file()


def check_destination(out: Path, run_dir: Path, force: bool) -> None:
    """Refuse to write where a user's files would be lost."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"-o {out}: is a file, not a directory")
    if out.resolve() == run_dir.resolve() or out.resolve() in run_dir.resolve().parents:
        raise ExportError(f"-o {out}: would replace the run {run_dir}; choose another directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"-o {out}: exists and is not empty; add --force to replace it")
        if not is_export(out):
            raise ExportError(
                f"-o {out}: --force replaces only an earlier export (it has no {MODEL_FILE} "
                f"and {MTRAIN_CONFIG}); choose another directory"
            )


def export_run(
    run_dir: Path,
    out: Path,
    which: str = BEST,
    quantize: str | None = None,
    force: bool = False,
) -> Path:
    """Write a run's checkpoint as a CTranslate2 model directory `out`; return `out`.

    The directory is written under a temporary name and renamed when complete: an interrupted
    export leaves no half-written model, and a replaced one is removed only after that.
    """
    require_ctranslate2()
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ExportError(f"--quantize {quantize}: expected one of {', '.join(QUANTIZATIONS)}")
    check_destination(out, run_dir, force)
    cfg, tokenizer, model = load_run(run_dir, torch.device("cpu"), which)
    spec = build_spec(cfg, tokenizer, model)
    spec.validate()
    spec.optimize(quantization=quantize)
    tmp, old = tmp_path(out), out.with_name(f"{tmp_path(out).name}.old")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        write_directory(spec, tmp, tokenizer, cfg, readme(run_dir, out, which, quantize, cfg))
        if out.exists():
            out.rename(old)  # an empty directory, or an earlier export (see check_destination)
        try:
            tmp.rename(out)
        except BaseException:
            if old.exists():
                old.rename(out)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out
