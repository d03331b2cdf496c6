"""What a lab trains: its named variants and presets, and the runs of a lab, in order."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from mtrain.core.config import VARIANTS as MODEL_VARIANTS
from mtrain.core.errors import OptionError

BASELINE = "baseline"

# Each variant takes one part of the textbook's Transformer out (or changes one choice), as
# `--set` overrides of the baseline's config. They live here, beside the code that reads them,
# rather than in a YAML under configs/: they ship with the package (configs/ does not), and a
# test holds each of them to be a valid config. The model's own variants (model.variant) come
# from their one declaration, core/config.py's VARIANTS.
VARIANTS: dict[str, tuple[str, ...]] = {
    **{name: (f"model.variant={name}",) for name in MODEL_VARIANTS if name != "textbook"},
    "one-head": ("model.n_heads=1",),
    "post-norm": ("model.norm=post",),
    "no-label-smoothing": ("train.label_smoothing=0",),
    "untied": ("model.tie_embeddings=false",),
    "deep-encoder": ("model.n_encoder_layers=3", "model.n_decoder_layers=1"),
}

# 我打他 / 他打我 and 狗咬人 / 人咬狗 hold the same characters in another order: only positions
# tell them apart. The long sentence shows what a variant does to length and coverage.
PROBES = (
    "我是谁",
    "我打他",
    "他打我",
    "狗咬人",
    "人咬狗",
    "我昨天在图书馆遇到了一个很多年没有见过的老朋友，我们一起喝了咖啡，聊了很久。",
)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


@dataclass(frozen=True)
class Variant:
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
        if (self.updates or 1) < 1 or (self.minutes or 1) <= 0:
            raise OptionError("--updates and --minutes must be positive")

    def overrides(self) -> tuple[str, ...]:
        if self.updates is not None:  # the steps, not the machine's speed, end each run
            return (f"train.max_steps={self.updates}", "train.max_minutes=0")
        return (f"train.max_minutes={self.minutes}",)  # the config's max_steps still caps

    def __str__(self) -> str:
        return f"{self.updates} updates" if self.updates else f"{self.minutes:g} minutes"


@dataclass(frozen=True)
class Preset:
    config: Path
    budget: Budget
    variants: tuple[str, ...]
    seeds: tuple[int, ...] = (1,)


# quick: the baseline and 6 variants, one seed: 7 runs in about 30 minutes on two CPU cores.
# configs/default.yaml trains about 3.7 updates/s there (bf16). Besides its updates, a run spends
# (estimated, not measured) ~5 s starting and ~25 s per greedy pass over the 2,245 dev sentences,
# of which it makes four: the validations at 500 updates and at the end, the averaged
# checkpoints', the lab's own; ~105 s. The first run also trains the tokenizers (~60 s).
# 60 s + 7 x (105 s + 550 / 3.7 s) = 1,838 s, 31 minutes: 550 updates a run.
PRESETS = {
    "quick": Preset(
        Path("configs/default.yaml"),
        Budget(updates=550),
        ("no-positions", "peek", "no-scale", "no-residual", "no-layernorm", "one-head"),
    ),
}


def parse_variant(text: str) -> Variant:
    """A named variant (`one-head`), or `NAME: KEY=VALUE KEY=VALUE ...`, a variant of one's own."""
    name, colon, rest = text.partition(":")
    name = name.strip()
    if not colon:
        if name not in VARIANTS:
            raise OptionError(
                f"variant {name!r}: not one of {', '.join(VARIANTS)}; or give your own as "
                f"'NAME: KEY=VALUE ...'"
            )
        return Variant(name, VARIANTS[name])
    overrides = tuple(rest.split())
    if not NAME.fullmatch(name) or name == BASELINE:
        raise OptionError(
            f"variant {text!r}: its name must be letters, digits, '.', '_', '+' or '-' "
            f"(and not {BASELINE!r})"
        )
    if not overrides or not all("=" in o for o in overrides):
        raise OptionError(f"variant {text!r}: expected 'NAME: KEY=VALUE ...' after the colon")
    return Variant(name, overrides)


@dataclass(frozen=True)
class LabRun:
    """One run of a lab: a variant (or the baseline) with one seed."""

    variant: str
    seed: int
    changes: tuple[str, ...]  # the variant's own, from the baseline
    overrides: tuple[str, ...]  # every change from the config file, the seed's included

    @property
    def name(self) -> str:
        return f"{self.variant}-seed{self.seed}"


@dataclass(frozen=True)
class Lab:
    """A baseline config and its variants, each trained once per seed within a budget."""

    config: Path
    variants: tuple[Variant, ...]
    budget: Budget
    seeds: tuple[int, ...] = (1,)
    overrides: tuple[str, ...] = ()  # every run's, the baseline's too
    probes: tuple[str, ...] = PROBES

    def __post_init__(self) -> None:
        names = [v.name for v in self.variants]
        twice = {n for n in names if names.count(n) > 1}
        if twice:
            raise OptionError(f"variant {sorted(twice)[0]!r} named twice")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise OptionError("--seeds: name each seed once")
        if not self.probes:
            raise OptionError("a lab needs at least one probe sentence")

    def runs(self) -> list[LabRun]:
        """Seed by seed, the baseline first: a lab stopped early has whole comparisons."""
        common = (*self.overrides, *self.budget.overrides())
        return [
            LabRun(
                variant.name,
                seed,
                variant.overrides,
                (*common, *variant.overrides, f"train.seed={seed}"),
            )
            for seed in self.seeds
            for variant in (Variant(BASELINE, ()), *self.variants)
        ]


def preset_lab(name: str, **changes) -> Lab:
    """The lab a preset names, with the given fields (None: the preset's own) changed."""
    if name not in PRESETS:
        raise OptionError(f"--preset {name!r}: not one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    lab = Lab(
        preset.config,
        tuple(parse_variant(v) for v in preset.variants),
        preset.budget,
        preset.seeds,
    )
    return dataclasses.replace(lab, **{k: v for k, v in changes.items() if v})


def make_lab(
    config: Path | None,
    variants: list[str],
    updates: int | None = None,
    minutes: float | None = None,
    seeds: tuple[int, ...] = (),
    overrides: tuple[str, ...] = (),
    probes: tuple[str, ...] = (),
    preset: str | None = None,
) -> Lab:
    """A lab from the options of `mtrain lab` (a preset's, where it names one and they do not)."""
    budget = None if updates is None and minutes is None else Budget(updates, minutes)
    parsed = tuple(parse_variant(v) for v in variants)
    changes = dict(
        config=config,
        variants=parsed,
        budget=budget,
        seeds=tuple(seeds),
        overrides=tuple(overrides),
        probes=tuple(probes),
    )
    if preset is not None:
        return preset_lab(preset, **changes)
    if config is None:
        raise OptionError("give a lab --config (the baseline's) or a --preset")
    if budget is None:
        raise OptionError("give a lab --updates N or --minutes M (one of the two)")
    return Lab(**{k: v for k, v in changes.items() if v})
