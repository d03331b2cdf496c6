"""Typed run configuration: the schema as dataclasses, every key checked, `key=value` overrides."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import reprlib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mtrain.core import config_upgrade, yaml_limits
from mtrain.core.config_upgrade import VERSION, VERSION_KEY
from mtrain.core.errors import MtrainError


class ConfigError(MtrainError, ValueError):
    """A configuration that cannot be used; the message names the file and key."""


DATA_KEYS = ("train", "dev", "test")  # the corpora a config must name to train


# A parallel corpus: a TSV file, or {src: FILE, tgt: FILE}, two files aligned line by line.
Corpus = str | dict[str, str]

# The defaults below are configs/default.yaml's recipe, key for key (a test holds them equal):
# a key a config leaves out gets the value the README's figures were measured with. Why each
# value was chosen is said in default.yaml and docs/recipes.md.


@dataclass
class DataConfig:
    train: Corpus | list[Corpus] = "data/tatoeba/train.tsv"  # one corpus or a list of them
    dev: Corpus = "data/tatoeba/dev.tsv"
    test: Corpus = "data/tatoeba/test.tsv"
    prepared_dir: str = "prepared"  # where `mtrain prepare` writes the encoded training corpora
    src_lang: str = "zh"
    tgt_lang: str = "en"
    max_src_len: int = 64  # tokens, </s> included; longer sentences are truncated
    max_tgt_len: int = 64
    max_len_ratio: float = 9.0  # drop training pairs with 9x the pieces on one side; 0: off
    # Probability that a training source loses its final punctuation piece (。?!): people
    # often type none, and a model that never saw that translates such input worse.
    drop_final_punct: float = 0.5
    # 0: off; else each training batch's sources are cut afresh, drawn from the source model's
    # 16 best segmentations with probability ∝ P^alpha (subword sampling, Kudo 2018).
    src_sampling_alpha: float = 0.0
    # true: the files hold target then source (e.g. the zh<TAB>en corpus read for en→zh).
    swap_columns: bool = False

    def max_positions(self) -> int:
        """Positions the model has: the longest source it reads and the longest output it
        can decode (`<s>` included)."""
        return max(self.max_src_len, self.max_tgt_len)


@dataclass
class TokenizerConfig:
    joint: bool = False  # one SentencePiece model for both languages, or one each
    vocab_size: int = 8000  # per model (the source's, when tgt_vocab_size is set)
    tgt_vocab_size: int = 4000  # the target model's size; 0: vocab_size; a joint model has one
    model_type: Literal["unigram", "bpe"] = "unigram"
    character_coverage: float = 0.9995
    input_sentence_size: int = 200_000  # sentences sampled to train each model on

    @property
    def tgt_size(self) -> int:
        """The target model's size: its own, or the source's (always, when joint)."""
        return self.vocab_size if self.joint else self.tgt_vocab_size or self.vocab_size


@dataclass
class ModelConfig:
    d_model: int = 256
    n_heads: int = 4
    n_encoder_layers: int = 2
    n_decoder_layers: int = 2
    d_ff: int = 1024
    dropout: float = 0.2
    norm: Literal["pre", "post"] = "pre"  # LayerNorm before each sublayer, or after (the paper)
    # One matrix for the target embedding and the output projection (and the source embedding
    # too when the vocabulary is joint).
    tie_embeddings: bool = True


@dataclass
class TrainConfig:
    seed: int = 1
    batch_tokens: int = 3000  # source + target tokens per batch, padding included
    accumulate: int = 1  # batches whose gradients are summed into one update
    lr: float = 2e-3  # peak learning rate, reached at the end of warmup
    warmup_steps: int = 400
    # After warmup: inverse-square-root decay, or linear decay to 0 at the run's end (the
    # end of the time budget, planned from the measured speed once warmup is over and again
    # at every validation step).
    lr_schedule: Literal["inverse_sqrt", "linear"] = "linear"
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    max_steps: int = 100_000
    max_minutes: float = 29.0  # wall-clock budget, the whole run included; 0 means none
    eval_every: int = 500  # steps between validations
    keep_last: int = 5  # step-N.pt checkpoints kept, besides last.pt and best.pt
    patience: int = 0  # stop after this many validations without a better dev BLEU; 0: never
    average_last: int = 5  # at the end, average the last N step checkpoints into averaged.pt
    # 0: off; else the decay of a moving average of the weights, updated after every update,
    # which validations and the checkpoints' `model` use (0.998: about the last 500 updates).
    ema_decay: float = 0.0
    # A recipe that follows the budget: a run whose linear schedule is first planned to end
    # short of this many updates trains with `short_run_dropout` instead of model.dropout
    # (0.1 learned more at 2,662 fp32 updates, 0.2 at 2,925 and 4,700; docs/recipes.md); 0: off.
    short_run_updates: int = 2800
    short_run_dropout: float = 0.1
    skip_nonfinite: bool = False  # skip a batch whose loss is NaN/inf instead of stopping
    # auto: bf16 autocast where the GPU or CPU has bf16 (fp16 + loss scaling on old GPUs); else fp32
    precision: Literal["auto", "fp32"] = "auto"
    # true: compile a batch's forward and loss once per batch shape (torch.compile); auto: not
    # yet on any device (slower on the CPU as measured, not measured on CUDA)
    compile: Literal["auto", True, False] = "auto"
    # Sentences translated greedily at every validation, to watch the model learn: shown on
    # stderr and kept with their cross-attention in examples.jsonl. The dev sentences are a
    # count, not a list: they come from whichever dev corpus the config names.
    examples: list[str] = field(default_factory=lambda: ["我是谁"])
    dev_examples: int = 3  # short dev sentences added to them, with their references
    tensorboard: bool = False  # also write TensorBoard event files (the tensorboard extra)
    # A run (its best.pt) or RUN/CHECKPOINT whose weights, tokenizers, `model` and `tokenizer`
    # sections this run starts from; "": random weights. The rest is this config's.
    init_from: str = ""


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
    batch_tokens: int = 6000  # source tokens per batch, padding included, shared by the beams
    beam_size: int = 6  # 1 is greedy search
    alpha: float = 1.0  # length penalty exponent of beam search
    max_len_ratio: float = 1.5  # output length limit: ratio × source length + offset tokens
    max_len_offset: int = 10


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        if value not in choices:
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
    """d_model splits into heads, and into sine and cosine pairs."""
    if cfg.model.d_model % cfg.model.n_heads:
        raise ConfigError(
            f"model.d_model: {cfg.model.d_model} is not divisible by "
            f"model.n_heads={cfg.model.n_heads}"
        )
    if cfg.model.d_model % 2:
        raise ConfigError("model.d_model: must be even for sinusoidal positions")


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
    apply_value(raw, key.strip(), parse_yaml(text, f"--set {override!r}: value"))


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
    return raw


def upgraded(raw: dict[str, Any], where: str, version: int) -> dict[str, Any]:
    """A run's recorded config in today's schema; `version`: its schema when it names none."""
    version = raw.pop(VERSION_KEY, version)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ConfigError(f"{where}: {VERSION_KEY}: expected a schema version, got {version!r}")
    if version > VERSION:
        raise ConfigError(
            f"{where}: written by a newer mtrain (config version {version}; this one reads "
            f"up to {VERSION}): upgrade mtrain"
        )
    return config_upgrade.upgrade(raw, version)


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
        raw = upgraded(raw, str(path), VERSION)
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


def load_recorded(path: Path) -> Config:
    """A run's own config (its config.yaml, an export's mtrain.yaml), in today's schema with
    the values the run used; a record that names no version is of schema 1."""
    return from_dict(upgraded(read_mapping(path), str(path), 1), str(path))
