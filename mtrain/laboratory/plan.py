"""What a lab trains: its named variants and presets, and the runs of a lab, in order."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtrain.core.config import LOCATIONS, MODEL_VARIANTS, Override, read_config
from mtrain.core.errors import OptionError
from mtrain.core.files import is_utf8

BASELINE = "baseline"

# Each variant takes one part of the textbook's Transformer out (or changes one choice), as
# `--set` overrides of the baseline's config. They live here, beside the code that reads them,
# rather than in a YAML under configs/: they ship with the package (configs/ does not), and a
# test holds each of them to be a valid config. The model's own variants (model.variant) come
# from their one declaration, core/config.py's MODEL_VARIANTS.
LAB_VARIANTS: dict[str, tuple[str, ...]] = {
    **{name: (f"model.variant={name}",) for name in MODEL_VARIANTS if name != "textbook"},
    "one-head": ("model.n_heads=1",),
    "post-norm": ("model.norm=post",),
    "no-label-smoothing": ("train.label_smoothing=0",),
    "untied": ("model.tie_embeddings=false",),
    "no-dropout": ("model.dropout=0",),
    "deep-encoder": ("model.n_encoder_layers=3", "model.n_decoder_layers=1"),
}

# The variant without positional encodings, found by what it lacks: the report draws its
# cross-attention beside the baseline's.
NO_POSITIONS = next(name for name, v in MODEL_VARIANTS.items() if v.positions == "none")

# 我打他 / 他打我 and 狗咬人 / 人咬狗 hold the same characters in another order. Where both are
# cut into the same pieces (狗咬人 / 人咬狗) only positions tell them apart; 我打他 is `▁我 打 他`
# and 他打我 `▁他 打 我` (SentencePiece marks a word's first piece). The long sentence shows what
# a variant does to length and coverage.
WORD_ORDER = ("我打他", "他打我")  # the pair the report's attention figure shows
PROBES = (
    "我是谁",
    *WORD_ORDER,
    "狗咬人",
    "人咬狗",
    "我昨天在图书馆遇到了一个很多年没有见过的老朋友，我们一起喝了咖啡，聊了很久。",
)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
RUN_NAME = re.compile(r".+-seed\d+")  # a lab's run directory: LabRun.name


@dataclass(frozen=True)
class LabVariant:
    """A name and the config changes that make it from the baseline."""

    name: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Budget:
    """What each run of a lab gets: a number of updates, or minutes of wall-clock time."""

    updates: int | None = None
    minutes: float | None = None

    def __post_init__(self) -> None:
        if (self.updates is None) == (self.minutes is None):
            raise OptionError("give a lab --updates N or --minutes M (one of the two)")
        updates, minutes = self.updates, self.minutes
        if updates is not None and (type(updates) is not int or updates < 1):
            raise OptionError(f"--updates {updates!r}: expected a whole number, at least 1")
        if minutes is not None and not (
            isinstance(minutes, (int, float))
            and not isinstance(minutes, bool)
            and math.isfinite(minutes)
            and minutes > 0
        ):
            raise OptionError(f"--minutes {minutes!r}: expected a number of minutes above 0")

    @classmethod
    def given(cls, updates: Any, minutes: Any) -> Budget | None:
        """The budget these values make (as a record holds them); None where they make none."""
        try:
            return cls(updates, minutes)
        except OptionError:
            return None

    def overrides(self) -> tuple[str, ...]:
        if self.updates is not None:  # the steps, not the machine's speed, end each run
            return (f"train.max_steps={self.updates}", "train.max_minutes=0")
        return (f"train.max_minutes={self.minutes}",)  # the config's max_steps still caps

    def __str__(self) -> str:
        return (
            f"{self.updates} updates" if self.updates is not None else f"{self.minutes:g} minutes"
        )


@dataclass(frozen=True)
class Preset:
    config: Path  # in the clone mtrain is installed from (configs/ is not in the package)
    budget: Budget
    variants: tuple[str, ...]
    seeds: tuple[int, ...] = (1,)
    overrides: tuple[str, ...] = ()  # every run's, before any --set


# the presets' lab size: two validations a run of 1,200 updates, no averaged checkpoint
LAB_SIZE = ("train.eval_every=600", "train.average_last=0")
# quick: a learner's first lab, about 30 minutes on 2 fp32 cores of the AVX2 class, its
# baseline trained far enough to translate (dev BLEU 15 and up needs about 1,000 updates at
# this schedule: docs/lab.md), so three runs: the baseline, and the two parts whose loss shows
# on the probes: positions (the word-order pairs) and the causal mask (peek). On the AVX2-only
# EPYC of docs/results.md (2026-12-04) the default trains about 2.6 updates/s in fp32; a run
# spends ~2 min besides its updates: two validations (eval_every 600, no averaged checkpoint)
# and the lab's own greedy passes over dev and test. 3 x (1,200 / 2.6 + 120) s + 60 s = 1,805 s,
# about 30 minutes (docs/lab.md: 20 measured on a faster EPYC with its kernels held to AVX2).
QUICK = Preset(
    Path("configs/default.yaml"), Budget(updates=1200), ("no-positions", "peek"), overrides=LAB_SIZE
)
# textbook: every part the textbook gives a reason for, two seeds, at the quick preset's size
# and budget (its runs are this preset's first three): 14 runs. Timed alone on the 2-core EPYC
# of docs/lab.md with its kernels held to AVX2 (fp32, the stand-in for a learner's laptop):
# 1 h 38 min 41 s, 6.7 to 7.5 minutes a run, within an afternoon's two hours (the AVX2-only
# EPYC, its updates about 0.75 times as fast, about 2 h 10 min).
TEXTBOOK_PARTS = ("no-positions", "peek", "no-scale", "no-residual", "no-layernorm", "one-head")
TEXTBOOK = Preset(
    Path("configs/default.yaml"), Budget(updates=1200), TEXTBOOK_PARTS, (1, 2), LAB_SIZE
)
# paper: the choices Vaswani et al. (2017) measured in their Table 3 that are not parts the
# textbook explains, at the same size: 12 runs, about 80 minutes there.
PAPER = Preset(
    Path("configs/default.yaml"),
    Budget(updates=1200),
    ("learned-positions", "post-norm", "no-label-smoothing", "untied", "no-dropout"),
    (1, 2),
    LAB_SIZE,
)
# full: every named variant, two seeds: 28 runs of 2,000 updates. Estimated, not measured: at
# ~2.6 updates/s (2 fp32 AVX2 cores) 28 x (2,000 / 2.6 + 150) s = 7.2 hours; ~3.5 at bf16 speed.
FULL = Preset(
    Path("configs/default.yaml"),
    Budget(updates=2000),
    tuple(LAB_VARIANTS),
    (1, 2),
    ("train.eval_every=500", "train.average_last=0"),
)
PRESETS = {"quick": QUICK, "textbook": TEXTBOOK, "paper": PAPER, "full": FULL}
# the keys a lab sets for every run alike: no variant or --set may change them
LAB_KEYS = {
    "train.max_steps": "--updates",
    "train.max_minutes": "--minutes",
    "train.seed": "--seeds",
}
# What every run of a lab is measured on: its corpora, languages and tokenizer. A variant that
# changed one would be another experiment, not one part changed (`--set` changes it for every
# run). These two draw the training batches otherwise from the same corpus, and may vary.
BATCH_DRAWING = ("data.drop_final_punct", "data.src_sampling_alpha")
MEASURED_ON = ("data", "tokenizer")


CLONE = Path(__file__).resolve().parents[2]  # the clone this mtrain runs from, if it is one


def preset_config(preset: Preset) -> tuple[Path, tuple[Override, ...]]:
    """A preset's config in the clone this mtrain runs from, and the overrides that find its
    corpora there (the config names them relative to the clone), whatever the working
    directory."""
    path = CLONE / preset.config
    if not path.is_file():
        raise OptionError(
            f"the presets' config {preset.config} is not beside this mtrain ({path.parent} has "
            "none: installed from a package, not a clone); give a lab --config and --updates"
        )
    data = (read_config(path) or {}).get("data") or {}
    clone_paths = tuple(
        (f"data.{key}", str(CLONE / value))
        for (section, key) in LOCATIONS
        if section == "data"
        and isinstance(value := data.get(key), str)
        and not Path(value).is_absolute()
    )
    return path, clone_paths


def override_key(override: Override) -> str:
    """The key a `--set` string (KEY=VALUE) or a (key, value) pair changes."""
    return (override[0] if isinstance(override, tuple) else override.partition("=")[0]).strip()


def refuse_lab_keys(overrides: tuple[Override, ...], where: str, keys=tuple(LAB_KEYS)) -> None:
    """Refuse a change of the budget or the seed, which every run of a lab has alike."""
    for override in overrides:
        key = override_key(override)
        if key in keys:
            raise OptionError(
                f"{where}: sets {key}, which the lab sets for every run alike (its {LAB_KEYS[key]})"
            )


def refuse_measured_on(overrides: tuple[str, ...], where: str) -> None:
    """Refuse a variant's change of what every run is measured on (MEASURED_ON)."""
    for override in overrides:
        key = override_key(override)
        if key.partition(".")[0] in MEASURED_ON and key not in BATCH_DRAWING:
            raise OptionError(
                f"{where}: sets {key}, which every run of a lab is measured on (its corpora, "
                "languages and tokenizer): a variant changes the model or its training; set it "
                "for every run with --set"
            )


def parse_variant(text: str) -> LabVariant:
    """A named variant (`one-head`), or `NAME: KEY=VALUE KEY=VALUE ...`, a variant of one's own."""
    if not isinstance(text, str):
        raise OptionError(f"variant {text!r}: expected a string such as 'one-head'")
    name, colon, rest = text.partition(":")
    name = name.strip()
    if not colon:
        if name not in LAB_VARIANTS:
            raise OptionError(
                f"variant {name!r}: not one of {', '.join(LAB_VARIANTS)}; or give your own as "
                f"'NAME: KEY=VALUE ...'"
            )
        return LabVariant(name, LAB_VARIANTS[name])
    overrides = tuple(rest.split())
    if not NAME.fullmatch(name) or name == BASELINE:
        raise OptionError(
            f"variant {text!r}: its name must be letters, digits, '.', '_', '+' or '-' "
            f"(and not {BASELINE!r})"
        )
    if name in LAB_VARIANTS:
        raise OptionError(
            f"variant {text!r}: {name!r} is a named variant's name; give yours another"
        )
    if not overrides or not all("=" in o for o in overrides):
        raise OptionError(f"variant {text!r}: expected 'NAME: KEY=VALUE ...' after the colon")
    refuse_lab_keys(overrides, f"variant {name!r}")
    refuse_measured_on(overrides, f"variant {name!r}")
    return LabVariant(name, overrides)


@dataclass(frozen=True)
class LabRun:
    """One run of a lab: a variant (or the baseline) with one seed."""

    variant: str
    seed: int
    changes: tuple[str, ...]  # the variant's own, from the baseline
    overrides: tuple[Override, ...]  # every change from the config file, the seed's included

    @property
    def name(self) -> str:
        return f"{self.variant}-seed{self.seed}"


@dataclass(frozen=True)
class Lab:
    """A baseline config and its variants, each trained once per seed within a budget."""

    config: Path
    budget: Budget
    variants: tuple[LabVariant, ...] = ()
    seeds: tuple[int, ...] = (1,)
    overrides: tuple[Override, ...] = ()  # every run's, the baseline's too
    probes: tuple[str, ...] = PROBES
    recipe: tuple[str, ...] = ()  # what the budget recipe chose, once for every run
    # a preset config's data paths as found in this clone: every run's too, but not what the
    # lab was asked (a moved clone finds them elsewhere, and its lab goes on)
    clone_paths: tuple[Override, ...] = ()

    def __post_init__(self) -> None:
        names = [v.name for v in self.variants]
        twice = {n for n in names if names.count(n) > 1}
        if twice:
            raise OptionError(f"variant {sorted(twice)[0]!r} named twice")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise OptionError("--seeds: name each seed once")
        if not all(type(s) is int and s >= 0 for s in self.seeds):
            raise OptionError(f"--seeds {self.seeds}: expected whole numbers, 0 or more")
        if not self.probes:
            raise OptionError("a lab needs at least one probe sentence")
        for probe in self.probes:
            if not isinstance(probe, str) or not probe.strip() or "\n" in probe or "\r" in probe:
                raise OptionError(f"--probe {probe!r}: expected a sentence on one line")
            if not is_utf8(probe):  # bytes that are not UTF-8, kept by Python as surrogates
                raise OptionError(f"--probe {probe!r}: not valid UTF-8 text")
        # at equal time, the config's train.max_steps caps each run: --set may change it
        budget_keys = {override_key(o) for o in self.budget.overrides()}
        refuse_lab_keys(self.overrides, "--set", (*budget_keys, "train.seed"))

    def runs(self) -> list[LabRun]:
        """Seed by seed, the baseline first: a lab stopped early has whole comparisons."""
        common = (*self.clone_paths, *self.overrides, *self.budget.overrides(), *self.recipe)
        return [
            LabRun(
                variant.name,
                seed,
                variant.overrides,
                (*common, *variant.overrides, f"train.seed={seed}"),
            )
            for seed in self.seeds
            for variant in (LabVariant(BASELINE, ()), *self.variants)
        ]


def preset_lab(name: str, **changes) -> Lab:
    """The lab a preset names, with the given fields (None or empty: the preset's own)."""
    if name not in PRESETS:
        raise OptionError(f"--preset {name!r}: not one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    given = {k: v for k, v in changes.items() if v}
    config, clone_paths = given.pop("config", None), ()
    if config is None:
        config, clone_paths = preset_config(preset)
    given["overrides"] = (*preset.overrides, *given.get("overrides", ()))
    lab = Lab(
        config,
        preset.budget,
        tuple(parse_variant(v) for v in preset.variants),
        preset.seeds,
        clone_paths=clone_paths,
    )
    return dataclasses.replace(lab, **given)


def make_lab(
    config: Path | None,
    variants: list[str],
    updates: int | None = None,
    minutes: float | None = None,
    seeds: tuple[int, ...] = (),
    overrides: tuple[Override, ...] = (),
    probes: tuple[str, ...] | None = None,
    preset: str | None = None,
) -> Lab:
    """A lab from the options of `mtrain lab` (a preset's, where it names one and they do not).
    No variants: the baseline alone, trained once per seed (the seeds' spread)."""
    budget = None if updates is None and minutes is None else Budget(updates, minutes)
    parsed = tuple(parse_variant(v) for v in variants)
    if preset is not None:
        return preset_lab(
            preset,
            config=config,
            variants=parsed,
            budget=budget,
            seeds=tuple(seeds),
            overrides=tuple(overrides),
            probes=tuple(probes or ()),
        )
    if config is None:
        raise OptionError("give a lab --config (the baseline's) or a --preset")
    if budget is None:
        raise OptionError("give a lab --updates N or --minutes M (one of the two)")
    return Lab(
        config,
        budget,
        parsed,
        tuple(seeds) or (1,),
        tuple(overrides),
        PROBES if probes is None else tuple(probes),
    )
