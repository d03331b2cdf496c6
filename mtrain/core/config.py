"""Typed run configuration: the schema as dataclasses, every key checked, `key=value` overrides."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import reprlib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from mtrain.core import config_upgrade, yaml_limits
from mtrain.core.config_upgrade import VERSION, VERSION_KEY, Added, Key
from mtrain.core.errors import MtrainError


class ConfigError(MtrainError, ValueError):
    """A configuration that cannot be used; the message names the file and key."""


DATA_KEYS = ("train", "dev", "test")  # the corpora a config must name to train


# A parallel corpus: a TSV file, or {src: FILE, tgt: FILE}, two files aligned line by line.
Corpus = str | dict[str, str]

# The defaults below are configs/default.yaml's recipe, key for key (a test holds them equal):
# a key a config leaves out gets the value the README's figures were measured with. Why each
# value was chosen is said in default.yaml and docs/recipes.md.
#
# Beside each key, its policy (`key(default, resume, child, ...)`): whether a resume may change
# it, what a run started from another (train.init_from) does with it, and, for a key added after
# the first run directory (416dbc9), what a run recorded before it existed did (`Added`, read by
# config_upgrade.py), and whether it holds a path of this machine (`Location`). Resume, init_from
# (run/lineage.py), the upgrade, a run's start (training/start.py) and `mtrain info` read it
# from here; a key declared without one is refused when this module is imported.


class Resume(Enum):
    """What a resume may do with a key."""

    KEPT = "kept"  # refused unless the run's own value: it changes what is trained
    MAY_CHANGE = "may change"  # a limit, or how the run is computed or watched, not what
    RECORDED = "recorded"  # the run's own value kept, whatever the config says (read at its start)


class Child(Enum):
    """What a run started from another's weights (train.init_from) does with a key."""

    OWN = "own"  # the child's config's value
    INHERITED = "inherited"  # the parent's; a config that names another value is refused
    AGREED = "agreed"  # the child's config's, refused unless it is the parent's


class Location(Enum):
    """A key that holds a path of this machine: made absolute at a run's start, and each
    process's own under torchrun (a resume from another machine may name another)."""

    CORPUS = "corpus"  # a corpus's file or files, which must exist
    DIRECTORY = "directory"  # a directory, made when first written to


@dataclass(frozen=True)
class Policy:
    """A key's rules, declared beside it."""

    resume: Resume
    child: Child
    added: Added | None = None  # None: every run directory records it (416dbc9)
    redefined: int | None = None  # the schema version that gave it its meaning (older dropped)
    location: Location | None = None  # None: not a path of this machine


POLICY = "mtrain.policy"  # the field metadata entry that holds a key's Policy


def key(
    default: Any,
    resume: Resume,
    child: Child,
    added: Added | None = None,
    redefined: int | None = None,
    location: Location | None = None,
) -> Any:
    """A config key (a dataclass field) with its policy; a list default is copied per config."""
    policy = {POLICY: Policy(resume, child, added, redefined, location)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=policy)
    return field(default=default, metadata=policy)


KEPT, MAY_CHANGE, RECORDED = Resume.KEPT, Resume.MAY_CHANGE, Resume.RECORDED
OWN, INHERITED, AGREED = Child.OWN, Child.INHERITED, Child.AGREED
CORPUS, DIRECTORY = Location.CORPUS, Location.DIRECTORY


@dataclass
class DataConfig:
    # One corpus or a list of them.
    train: Corpus | list[Corpus] = key("data/tatoeba/train.tsv", KEPT, OWN, location=CORPUS)
    dev: Corpus = key("data/tatoeba/dev.tsv", KEPT, OWN, location=CORPUS)
    test: Corpus = key("data/tatoeba/test.tsv", KEPT, OWN, location=CORPUS)
    # Where `mtrain prepare` writes the encoded training corpora.
    prepared_dir: str = key(
        "prepared", MAY_CHANGE, OWN, Added("prepared", "da5aa77"), location=DIRECTORY
    )
    src_lang: str = key("zh", KEPT, AGREED)
    tgt_lang: str = key("en", KEPT, AGREED)
    max_src_len: int = key(64, KEPT, OWN)  # tokens, </s> included; longer sentences are truncated
    max_tgt_len: int = key(64, KEPT, OWN)
    # Drop training pairs with 9x the pieces on one side; 0: off (da5aa77: none dropped before).
    max_len_ratio: float = key(9.0, KEPT, OWN, Added(0.0, "da5aa77"))
    # Probability that a training source loses its final punctuation piece (。?!): people
    # often type none, and a model that never saw that translates such input worse.
    drop_final_punct: float = key(0.5, KEPT, OWN, Added(0.0, "da5aa77"))
    # 0: off; else each training batch's sources are cut afresh, drawn from the source model's
    # 16 best segmentations with probability ∝ P^alpha (subword sampling, Kudo 2018).
    src_sampling_alpha: float = key(0.0, KEPT, OWN, Added(0.0, "7e56b24"))
    # true: the files hold target then source (e.g. the zh<TAB>en corpus read for en→zh).
    swap_columns: bool = key(False, KEPT, OWN, Added(False, "683f2a0"))

    def max_positions(self) -> int:
        """Positions the model has: the longest source it reads and the longest output it
        can decode (`<s>` included)."""
        return max(self.max_src_len, self.max_tgt_len)


@dataclass
class TokenizerConfig:
    joint: bool = key(False, KEPT, INHERITED)  # one SentencePiece model for both languages
    vocab_size: int = key(8000, KEPT, INHERITED)  # per model (the source's, if tgt_vocab_size)
    # The target model's size; 0: vocab_size; a joint model has one (a2a5f5e: the source's
    # size before).
    tgt_vocab_size: int = key(4000, KEPT, INHERITED, Added(0, "a2a5f5e"))
    model_type: Literal["unigram", "bpe"] = key("unigram", KEPT, INHERITED)
    character_coverage: float = key(0.9995, KEPT, INHERITED)
    # Sentences sampled to train each model on (da5aa77: every one before, which 200,000 is for
    # a corpus below that size; a resumed run keeps the tokenizers it has).
    input_sentence_size: int = key(200_000, KEPT, INHERITED, Added(200_000, "da5aa77"))

    @property
    def tgt_size(self) -> int:
        """The target model's size: its own, or the source's (always, when joint)."""
        return self.vocab_size if self.joint else self.tgt_vocab_size or self.vocab_size


@dataclass(frozen=True)
class ModelVariant:
    """A model.variant: the textbook's Transformer, or it with one part swapped out (one change
    at a time, so that a run measures what that part buys). The model builds its parts from
    these fields (model/transformer.py's `variant_parts`); `lacks` says in words what it lacks."""

    lacks: str = ""
    positions: Literal["sinusoidal", "learned", "none"] = "sinusoidal"  # added to the embeddings
    scaled: bool = True  # attention scores divided by √d_head
    residual: bool = True  # each sublayer's output added to its input
    layernorm: bool = True  # LayerNorm in the sublayers and after the stacks
    look_ahead: bool = True  # in training, the decoder's self-attention hides later targets


# The one declaration of the model's variants: the config check, the model and the lab read it.
MODEL_VARIANTS = {
    "textbook": ModelVariant(),
    "no-positions": ModelVariant(
        "the encoder and decoder add no positional encoding", positions="none"
    ),
    "learned-positions": ModelVariant(
        "positions are learned embeddings, not the fixed sinusoids", positions="learned"
    ),
    "peek": ModelVariant(
        "in training the decoder's self-attention has no look-ahead mask (it sees the "
        "targets it must predict); decoding is as usual",
        look_ahead=False,
    ),
    "no-scale": ModelVariant("attention scores are not divided by √d_head", scaled=False),
    "no-residual": ModelVariant("no sublayer has its residual connection", residual=False),
    "no-layernorm": ModelVariant(
        "no LayerNorm, in the sublayers or after the stacks", layernorm=False
    ),
}


@dataclass
class ModelConfig:
    d_model: int = key(256, KEPT, INHERITED)
    n_heads: int = key(4, KEPT, INHERITED)
    n_encoder_layers: int = key(2, KEPT, INHERITED)
    n_decoder_layers: int = key(2, KEPT, INHERITED)
    d_ff: int = key(1024, KEPT, INHERITED)
    dropout: float = key(0.2, KEPT, OWN)  # regularisation is a child run's own
    # LayerNorm before each sublayer, or after (the paper).
    norm: Literal["pre", "post"] = key("pre", KEPT, INHERITED)
    # One matrix for the target embedding and the output projection (and the source embedding
    # too when the vocabulary is joint); ff2b51d: untied before.
    tie_embeddings: bool = key(True, KEPT, INHERITED, Added(False, "ff2b51d"))
    # One of MODEL_VARIANTS: the textbook's model, or it with one part swapped (mtrain lab).
    variant: str = key("textbook", KEPT, INHERITED, Added("textbook", "c4a89ab", version=3))


# Rules that join keys of two sections, declared beside them. Each is read where a run is built
# on another's weights (train.init_from: run/lineage.py's `inherit`, before anything is
# written) and says in one line why the child cannot take them, or None.
def learned_positions_kept(child: Config, parent: Config, where: str) -> str | None:
    """A learned-positions model's table has a row per position, as many as the longer of
    data.max_src_len and data.max_tgt_len (`max_positions`): a child keeps that number."""
    mine, theirs = child.data, parent.data
    rows = theirs.max_positions()
    if MODEL_VARIANTS[parent.model.variant].positions != "learned" or mine.max_positions() == rows:
        return None
    return (
        f"model.variant='learned-positions' in {where} has a table of {rows} positions "
        f"(data.max_src_len={theirs.max_src_len}, data.max_tgt_len={theirs.max_tgt_len}); "
        f"data.max_src_len={mine.max_src_len} and data.max_tgt_len={mine.max_tgt_len} here "
        f"make {mine.max_positions()}: the longer of them must be {rows}"
    )


JOINED = (learned_positions_kept,)


@dataclass
class TrainConfig:
    seed: int = key(1, KEPT, OWN)
    batch_tokens: int = key(3000, KEPT, OWN)  # source + target tokens per batch, padding included
    # Batches whose gradients are summed into one update.
    accumulate: int = key(1, KEPT, OWN, Added(1, "ff2b51d"))
    lr: float = key(2e-3, KEPT, OWN)  # peak learning rate, reached at the end of warmup
    warmup_steps: int = key(400, KEPT, OWN)
    # After warmup: inverse-square-root decay, or linear decay to 0 at the run's end (the
    # end of the time budget, planned from the measured speed once warmup is over and again
    # at every validation step).
    lr_schedule: Literal["inverse_sqrt", "linear"] = key(
        "linear", KEPT, OWN, Added("inverse_sqrt", "da5aa77")
    )
    label_smoothing: float = key(0.1, KEPT, OWN)
    clip_norm: float = key(1.0, KEPT, OWN)
    max_steps: int = key(100_000, MAY_CHANGE, OWN)
    max_minutes: float = key(29.0, MAY_CHANGE, OWN)  # wall-clock budget, all of the run; 0: none
    eval_every: int = key(500, KEPT, OWN)  # steps between validations
    # step-N.pt checkpoints kept, besides last.pt and best.pt (c8b9337: none before).
    keep_last: int = key(5, KEPT, OWN, Added(0, "c8b9337"))
    # Stop after this many validations without a better dev BLEU; 0: never.
    patience: int = key(0, MAY_CHANGE, OWN, Added(0, "ff2b51d"))
    # At the end, average the last N step checkpoints into averaged.pt.
    average_last: int = key(5, KEPT, OWN, Added(0, "ff2b51d"))
    # 0: off; else the decay of a moving average of the weights, updated after every update,
    # which validations and the checkpoints' `model` use (0.998: about the last 500 updates).
    ema_decay: float = key(0.0, KEPT, OWN, Added(0.0, "a2a5f5e"))
    # A recipe that follows the budget: a run whose linear schedule is first planned to end
    # short of this many updates trains with `short_run_dropout` instead of model.dropout
    # (0.1 learned more at 2,662 fp32 updates, 0.2 at 2,925 and 4,700; docs/recipes.md); 0: off.
    short_run_updates: int = key(2800, KEPT, OWN, Added(0, "6028b16"))
    short_run_dropout: float = key(0.1, KEPT, OWN, Added(0.1, "6028b16"))  # unused while off
    # Skip a batch whose loss is NaN/inf instead of stopping (c8b9337: stopped before).
    skip_nonfinite: bool = key(False, KEPT, OWN, Added(False, "c8b9337"))
    # auto: bf16 autocast where the GPU or CPU has bf16 (fp16 + loss scaling on old GPUs); else
    # fp32. May change on a resume: "auto" may already differ from machine to machine. Before
    # ff2b51d mtrain autocast on CUDA as "auto" does there, and computed in fp32 on the CPU.
    precision: Literal["auto", "fp32"] = key(
        "auto", MAY_CHANGE, OWN, Added("fp32", "ff2b51d", cuda="auto")
    )
    # true: compile a batch's forward and loss once per batch shape (torch.compile); auto: not
    # yet on any device (slower on the CPU as measured, not measured on CUDA). How the updates
    # are computed, not what: a resume may change it. ff2b51d's train.compile compiled the whole
    # model (gone in e91f4b9): version 2 gave the key its meaning.
    compile: Literal["auto", True, False] = key(
        "auto", MAY_CHANGE, OWN, Added(False, "5ab2130", version=2), redefined=2
    )
    # Sentences translated greedily at every validation, to watch the model learn: shown on
    # stderr and kept with their cross-attention in examples.jsonl. The dev sentences are a
    # count, not a list: they come from whichever dev corpus the config names.
    # What a run shows, not what it trains (greedy, no random draw): a resume may change them.
    examples: list[str] = key(["我是谁"], MAY_CHANGE, OWN, Added([], "dc6eecf"))
    # Short dev sentences added to them, with their references.
    dev_examples: int = key(3, MAY_CHANGE, OWN, Added(0, "dc6eecf"))
    # Also write TensorBoard event files (the tensorboard extra): what is logged, not trained.
    tensorboard: bool = key(False, MAY_CHANGE, OWN, Added(False, "dc6eecf"))
    # A run (its best.pt) or RUN/CHECKPOINT whose weights, tokenizers, `model` and `tokenizer`
    # sections this run starts from; "": random weights. The rest is this config's. Read when
    # the run begins, never on a resume, which keeps the run's own.
    init_from: str = key("", RECORDED, OWN, Added("", "f4e8780", version=2))


# The largest length penalty exponent, for config, command line and API alike: GNMT's values are
# below 1, and a larger one has long outputs win whatever their words.
MAX_ALPHA = 10.0
# The largest beam, for config, command line, Python API and serve alike. Quality falls past a
# beam of ten or so (Koehn & Knowles 2017) and the search's memory grows with it: at 64, a
# 256-piece sentence on a 6-layer, d_model 512 decoder keeps under 1 GB of key/value cache,
# where an unbounded beam (10**6) grew a process to 23 GB before the kernel killed it. 64 still
# gives an n-best list of 50 for reranking.
MAX_BEAM = 64


@dataclass
class DecodeConfig:
    # Source tokens per batch, padding included, shared by the beams (fe3ae92: beam search; a
    # greedy search in batches of sentences before).
    batch_tokens: int = key(6000, KEPT, OWN, Added(6000, "fe3ae92"))
    beam_size: int = key(6, KEPT, OWN, Added(1, "fe3ae92"))  # 1 is greedy search
    # Length penalty exponent of beam search (unused by the greedy search before fe3ae92).
    alpha: float = key(1.0, KEPT, OWN, Added(0.6, "fe3ae92"))
    # Output length limit: ratio × source length + offset tokens.
    max_len_ratio: float = key(1.5, KEPT, OWN)
    max_len_offset: int = key(10, KEPT, OWN, Added(10, "fe3ae92"))


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def policies(cls: type = Config) -> dict[Key, Policy]:
    """Every key's policy by (section, key); a key declared without one (not with `key`) is
    refused, naming it."""
    found = {}
    for section in dataclasses.fields(cls):
        for item in dataclasses.fields(section.default_factory):
            policy = item.metadata.get(POLICY)
            if not isinstance(policy, Policy):
                raise TypeError(
                    f"config key {section.name}.{item.name}: declared without its policy; "
                    "declare it with config.key(default, resume, child, ...)"
                )
            found[section.name, item.name] = policy
    return found


POLICIES = policies()  # each key's rules, as declared beside it
# The keys that hold a path of this machine, and what each names.
LOCATIONS = {key: p.location for key, p in POLICIES.items() if p.location is not None}


def effective(section: Any, name: str) -> Any:
    """The value of key `name` in a config section that counts: the target vocabulary's
    size, not the 0 that means "the source's"."""
    if isinstance(section, TokenizerConfig) and name == "tgt_vocab_size":
        return section.tgt_size
    return getattr(section, name)


def _check_corpus(key: str, value: Any, many: bool) -> Any:
    """A corpus (file name or {src, tgt} mapping), or with `many` a non-empty list of them."""
    if many and isinstance(value, list):
        if not value:
            raise ConfigError(f"{key}: expected at least one corpus")
        return [_check_corpus(f"{key}[{i}]", item, False) for i, item in enumerate(value)]
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, dict)
        and set(value) == {"src", "tgt"}
        and all(isinstance(path, str) and path for path in value.values())
    ):
        return value
    expected = "a file name, a {src: FILE, tgt: FILE} mapping" + (" or a list" if many else "")
    raise ConfigError(f"{key}: expected {expected}, got {value!r}")


def _check_value(key: str, value: Any, kind: Any) -> Any:
    """Return `value` as type `kind`, or raise ConfigError naming `key`."""
    if kind == list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise ConfigError(f"{key}: expected a list of sentences, got {reprlib.repr(value)}")
        return value
    if kind in (Corpus, Corpus | list[Corpus]):
        return _check_corpus(key, value, many=kind is not Corpus)
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        # of the same type too: 1 == True, and `compile: 1` is not `compile: true`
        if not any(value == c and type(value) is type(c) for c in choices):
            expected = ", ".join(map(str, choices))
            raise ConfigError(f"{key}: expected one of {expected}, got {reprlib.repr(value)}")
        return value
    if kind is float and not isinstance(value, bool):
        # YAML 1.1 reads 3e-4 (no dot) as a string; people write it that way.
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected float, got {reprlib.repr(value)}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return number
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {reprlib.repr(value)}")
    return value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(f"{where}: expected a mapping, got {reprlib.repr(raw)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            raise ConfigError(f"unknown key '{prefix}{reprlib.repr(str(key))[1:-1]}'")
    values = {}
    for name, value in raw.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = _build(kind, value, f"{prefix}{name}.")
        else:
            values[name] = _check_value(prefix + name, value, kind)
    return cls(**values)


def validate(cfg: Config, source: str) -> None:
    """Check again the rules that relate a built config's values (changed since it was built,
    as a child run's by its parent's sections); errors are prefixed with `source`."""
    try:
        _validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _validate(cfg: Config) -> None:
    """Check the rules that relate values to each other or bound them."""
    _check_positive(cfg)
    _check_model(cfg)
    _check_ranges(cfg)
    _check_train(cfg)
    _check_tokenizer_and_lengths(cfg)


def _check_positive(cfg: Config) -> None:
    """Sizes, lengths, counts and rates that must be above zero."""
    positive = {
        "data.max_src_len": cfg.data.max_src_len,
        "data.max_tgt_len": cfg.data.max_tgt_len,
        "tokenizer.vocab_size": cfg.tokenizer.vocab_size,
        "tokenizer.input_sentence_size": cfg.tokenizer.input_sentence_size,
        "model.d_model": cfg.model.d_model,
        "model.n_heads": cfg.model.n_heads,
        "model.n_encoder_layers": cfg.model.n_encoder_layers,
        "model.n_decoder_layers": cfg.model.n_decoder_layers,
        "model.d_ff": cfg.model.d_ff,
        "train.batch_tokens": cfg.train.batch_tokens,
        "train.accumulate": cfg.train.accumulate,
        "train.lr": cfg.train.lr,
        "train.max_steps": cfg.train.max_steps,
        "train.eval_every": cfg.train.eval_every,
        "train.clip_norm": cfg.train.clip_norm,
        "decode.batch_tokens": cfg.decode.batch_tokens,
        "decode.beam_size": cfg.decode.beam_size,
        "decode.max_len_ratio": cfg.decode.max_len_ratio,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")
    for key in ("max_src_len", "max_tgt_len"):  # prepared corpora store lengths as uint16
        if getattr(cfg.data, key) > 65535:
            raise ConfigError(f"data.{key}: at most 65535, got {getattr(cfg.data, key)}")


def _check_model(cfg: Config) -> None:
    """d_model splits into heads, and into sine and cosine pairs; a known variant."""
    if cfg.model.d_model % cfg.model.n_heads:
        raise ConfigError(
            f"model.d_model: {cfg.model.d_model} is not divisible by "
            f"model.n_heads={cfg.model.n_heads}"
        )
    if cfg.model.d_model % 2:
        raise ConfigError("model.d_model: must be even for sinusoidal positions")
    if cfg.model.variant not in MODEL_VARIANTS:
        raise ConfigError(
            f"model.variant: expected one of {', '.join(MODEL_VARIANTS)}, "
            f"got {reprlib.repr(cfg.model.variant)}"
        )


def _check_ranges(cfg: Config) -> None:
    """Probabilities, ratios and decoding options within their bounds."""
    if not 0 <= cfg.data.drop_final_punct <= 1:
        raise ConfigError(
            f"data.drop_final_punct: must be in [0, 1], got {cfg.data.drop_final_punct}"
        )
    if cfg.data.src_sampling_alpha < 0:
        raise ConfigError(
            f"data.src_sampling_alpha: must not be negative, got {cfg.data.src_sampling_alpha}"
        )
    if cfg.data.src_sampling_alpha and cfg.tokenizer.model_type != "unigram":
        raise ConfigError(
            "data.src_sampling_alpha: needs tokenizer.model_type unigram (a BPE model has no "
            "n best segmentations)"
        )
    rates = {
        "model.dropout": cfg.model.dropout,
        "train.short_run_dropout": cfg.train.short_run_dropout,
    }
    for key, rate in rates.items():
        if not 0 <= rate < 1:
            raise ConfigError(f"{key}: must be in [0, 1), got {rate}")
    if not 0 <= cfg.train.label_smoothing < 1:
        raise ConfigError(
            f"train.label_smoothing: must be in [0, 1), got {cfg.train.label_smoothing}"
        )
    if not 0 <= cfg.train.ema_decay < 1:
        raise ConfigError(f"train.ema_decay: must be in [0, 1), got {cfg.train.ema_decay}")
    if cfg.data.max_len_ratio and cfg.data.max_len_ratio < 1:
        raise ConfigError(
            f"data.max_len_ratio: must be 0 (off) or at least 1, got {cfg.data.max_len_ratio}"
        )
    if cfg.decode.beam_size > MAX_BEAM:
        raise ConfigError(f"decode.beam_size: at most {MAX_BEAM}, got {cfg.decode.beam_size}")
    if not 0 <= cfg.decode.alpha <= MAX_ALPHA:
        raise ConfigError(f"decode.alpha: must be in [0, {MAX_ALPHA:g}], got {cfg.decode.alpha}")
    if cfg.decode.max_len_offset < 0:
        raise ConfigError("decode.max_len_offset must not be negative")


# The section of a run's config.yaml where the run records what it chose from its plan
# (budget_recipe.py); not config: loading a run's config.yaml as a config skips it.
CHOSEN = "chosen"
# The section where a run started from another's weights records that parent (run/lineage.py).
PARENT = "parent"
# The section where a run upgraded by a resume records the schema version it came from.
UPGRADED = "upgraded_from"
SEEDS = 1 << 64  # the seeds every generator takes
# Example sentences per validation, of each kind (train.examples, train.dev_examples): 64 greedy
# translations at most, against the 13,470 hypotheses of a default validation (2,245 dev
# sentences, beam 6), keep their cost under 0.5% of it, and their lines in examples.jsonl
# (about 7 KB each with its attention) and on stderr few enough to read.
MAX_EXAMPLES = 32


def _check_train(cfg: Config) -> None:
    """Counts that may be 0 but not negative, a seed every generator takes; checkpoint
    averaging within the kept checkpoints."""
    counts = ("warmup_steps", "max_minutes", "keep_last", "patience", "average_last")
    for key in (*counts, "short_run_updates", "dev_examples"):
        if getattr(cfg.train, key) < 0:
            raise ConfigError(f"train.{key}: must not be negative")
    for key, count in (
        ("examples", len(cfg.train.examples)),
        ("dev_examples", cfg.train.dev_examples),
    ):
        if count > MAX_EXAMPLES:
            raise ConfigError(
                f"train.{key}: at most {MAX_EXAMPLES} sentences shown at each validation, "
                f"got {count}"
            )
    if not 0 <= cfg.train.seed < SEEDS:  # numpy refuses a negative seed, torch one of 2**64
        raise ConfigError(f"train.seed: must be in [0, 2**64 - 1], got {cfg.train.seed}")
    if cfg.train.average_last == 1:
        raise ConfigError("train.average_last: must be 0 (no averaging) or at least 2")
    if cfg.train.average_last > cfg.train.keep_last:
        raise ConfigError(
            f"train.average_last: {cfg.train.average_last} needs train.keep_last to be at "
            f"least as large, got {cfg.train.keep_last}"
        )


def _check_tokenizer_and_lengths(cfg: Config) -> None:
    """SentencePiece's bounds, two languages, and a batch that holds the longest pair."""
    if not 0.9 <= cfg.tokenizer.character_coverage <= 1:
        raise ConfigError("tokenizer.character_coverage: must be in [0.9, 1]")
    for key in ("vocab_size", "tgt_vocab_size"):
        size = getattr(cfg.tokenizer, key)
        if size < 300 and (size or key == "vocab_size"):
            raise ConfigError(f"tokenizer.{key}: must be at least 300 (256 byte pieces + others)")
    if cfg.data.src_lang == cfg.data.tgt_lang:
        raise ConfigError("data.src_lang and data.tgt_lang must differ")
    longest = cfg.data.max_positions()
    if cfg.train.batch_tokens < 2 * longest:
        raise ConfigError(
            f"train.batch_tokens: {cfg.train.batch_tokens} cannot hold one pair of "
            f"maximum length ({longest} + {longest} tokens)"
        )


# An override: "section.key=value" (`--set`: the value is YAML), or ("section.key", value) (the
# Python API: the value is set as given, and checked as the config's own values are).
Override = str | tuple[str, Any]


def apply_override(raw: dict[str, Any], override: Override) -> None:
    """Apply one override to a raw config mapping."""
    if not isinstance(override, str):
        apply_value(raw, *override)
        return
    key, sep, text = override.partition("=")
    if not sep or not _is_key(key.strip()):
        raise ConfigError(f"--set {override!r}: expected section.key=value")
    # Nothing after `=` is the empty string (what a shell leaves of `key=""`).
    value = parse_yaml(text, f"--set {override!r}: value") if text.strip() else ""
    if (comment := dropped_comment(text, value)) is not None:
        quoted = "'" + text.strip().replace("'", "''") + "'"
        raise ConfigError(
            f"--set {override!r}: YAML reads {comment!r} as a comment and drops it; to keep it, "
            f'quote the value: --set "{key.strip()}={quoted}"'
        )
    apply_value(raw, key.strip(), value)


def dropped_comment(text: str, value: Any) -> str | None:
    """The part of a YAML value's `text` that YAML read as a comment (a `#` after a space, or
    first) and dropped to give `value`; None where it dropped nothing."""
    for match in re.finditer(r"(?:^|\s)#", text):
        head = text[: match.start()]
        try:
            same = (parse_yaml(head, "") if head.strip() else None) == value
        except ConfigError:  # the # is inside a quoted string or a flow collection
            continue
        if same:
            return text[match.start() :].strip()
    return None


def _is_key(key: Any) -> bool:
    parts = key.split(".") if isinstance(key, str) else []
    return len(parts) == 2 and all(parts)


def apply_value(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` ("section.key") of a raw config mapping to `value`, a Python value taken as it
    is (a path as its string), never read again as YAML: "corpus #2.tsv" and "no" stay strings."""
    if not _is_key(key):
        raise ConfigError(f"override {key!r}: expected a key as section.key")
    section, name = key.split(".")
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    inner = raw.setdefault(section, {})
    if not isinstance(inner, dict):
        raise ConfigError(f"{section}: expected a mapping")
    inner[name] = copy.deepcopy(value)  # the caller's list or mapping stays theirs


def from_dict(raw: Any, source: str = "config") -> Config:
    """Build and validate a Config; errors are prefixed with `source`."""
    try:
        cfg = _build(Config, raw if raw is not None else {}, "")
        _validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def parse_yaml(text: str, where: str) -> Any:
    """Parse one YAML document of plain data, in bounded time and memory."""
    try:
        return yaml_limits.parse(text, where)
    except yaml_limits.YAMLRefused as e:
        raise ConfigError(str(e)) from None


def read_config(path: Path) -> Any:
    """The YAML document of a config file, or None for an empty one."""
    try:
        return yaml_limits.read(path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
    except yaml_limits.YAMLRefused as e:
        raise ConfigError(str(e)) from None


def check_names_data(raw: dict[str, Any], path: Path) -> None:
    """Refuse a config that leaves its corpora to the defaults.

    The defaults are the bundled data/tatoeba files, found relative to the current directory:
    an empty or incomplete config would silently train on them.
    """
    data = raw.get("data")
    named = data if isinstance(data, dict) else {}
    missing = [f"data.{key}" for key in DATA_KEYS if key not in named]
    if not raw:
        raise ConfigError(f"{path}: empty config; start from configs/default.yaml")
    if missing:
        raise ConfigError(
            f"{path}: names no {', '.join(missing)}; a run needs its corpora named "
            "(see configs/default.yaml)"
        )


def read_mapping(path: Path) -> dict[str, Any]:
    """A config file's sections, less what a run recorded of its own choices (CHOSEN)."""
    raw = read_config(path)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    raw.pop(CHOSEN, None)  # a run's record of its own choices: a new run makes its own
    raw.pop(PARENT, None)  # and of the run it started from
    raw.pop(UPGRADED, None)  # and of the version it was begun in
    return raw


Unknown = Callable[[], Any]  # a fact about a run asked only where needed; None: unknown


def upgraded(
    raw: dict[str, Any],
    where: str,
    version: Unknown = lambda: None,
    trained_on: Unknown = lambda: None,
) -> dict[str, Any]:
    """A run's recorded config in today's schema. `version`: its schema, asked when it names
    none (None: unknown, so 1 unless it holds keys no record of version 1 has); `trained_on`:
    the device type its run trained on, asked where a key's older value depends on it."""
    version = recorded_version(raw, where, version)
    raw.pop(VERSION_KEY, None)
    return config_upgrade.upgrade(raw, version, POLICIES, trained_on)


def recorded_version(raw: dict[str, Any], where: str, version: Unknown = lambda: None) -> int:
    """The schema version of a run's record: its own, else `version()`, else 1; one it cannot
    be (named wrongly, newer than this mtrain, its line lost, or older than a key it holds) is
    refused in one line."""
    if VERSION_KEY in raw:
        version = raw[VERSION_KEY]
    elif (version := version()) is None:
        later = [key for key, _ in keys_after(raw, 1)]
        if later:
            raise ConfigError(
                f"{where}: names no {VERSION_KEY} but holds {', '.join(later)}, which no record "
                f"of version 1 has: its '{VERSION_KEY}:' line was lost (add the version of the "
                "mtrain that wrote it)"
            )
        version = 1
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ConfigError(f"{where}: {VERSION_KEY}: expected a schema version, got {version!r}")
    if version > VERSION:
        raise ConfigError(
            f"{where}: written by a newer mtrain (config version {version}; this one reads "
            f"up to {VERSION}): upgrade mtrain"
        )
    for key, added in keys_after(raw, version):  # taken at face value, it would change the run
        raise ConfigError(
            f"{where}: {key} came in config version {added}, but this record is of version "
            f"{version}, which has no such key: remove {key}, or name the version that wrote it"
        )
    return version


def keys_after(raw: dict[str, Any], version: int) -> list[tuple[str, int]]:
    """The keys of a record (section.key) that came in a schema version after `version`, each
    with that version: no record of `version` holds them."""
    return sorted(
        (f"{section}.{name}", policy.added.version)
        for (section, name), policy in POLICIES.items()
        if policy.added and policy.added.version > version and policy.redefined is None
        if isinstance(raw.get(section), dict) and name in raw[section]
    )


def load(
    path: Path,
    overrides: list[Override] = (),
    require_data: bool = False,
    run: Config | None = None,
) -> Config:
    """Load a YAML config file, apply `key=value` overrides and validate the result.

    With `require_data`, as for training, the config must name its corpora. `run`: the config
    of the run this one resumes, whose values the keys the file and overrides do not name keep
    (a file written before a key existed does not change it), and keys since removed are
    ignored. A file that names its version
    is a run's record, upgraded as such; one without is read with today's defaults.
    """
    raw = read_mapping(path)
    if VERSION_KEY in raw:
        raw = upgraded(raw, str(path))
    for override in overrides:
        try:
            apply_override(raw, override)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    named = raw
    if run is not None:  # a file written before a key went may still name it
        named = config_upgrade.without_removed(named)
        raw = run.to_dict()
        for section, values in named.items():
            inner = isinstance(values, dict) and isinstance(raw.get(section), dict)
            raw[section] = {**raw[section], **values} if inner else values
    cfg = from_dict(raw, str(path))
    if require_data:
        check_names_data(named, path)
    return cfg


def load_recorded(
    path: Path, version: Unknown = lambda: None, trained_on: Unknown = lambda: None
) -> Config:
    """A run's own config (its config.yaml, an export's mtrain.yaml), in today's schema with
    the values the run used. `version`: its schema where it names none (its checkpoints';
    None: unknown); `trained_on`: the device type its run trained on (None: unknown)."""
    raw = upgraded(read_mapping(path), str(path), version, trained_on)
    return from_dict(raw, str(path))
