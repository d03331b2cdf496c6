"""LAB_DIR/lab.json: what a lab was asked (its config's text, budget, common overrides, seeds,
variants and probes), the recipe it chose once for every run, and the runs that diverged. A
rerun that asks for another budget, config or probe list is refused: its runs would mix with
the old ones under a new title; one that adds seeds or variants goes on, and the lab holds
them all. Its shape is checked as it is read (record_shape.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mtrain.core import config
from mtrain.core.errors import OptionError
from mtrain.core.files import is_utf8, write_atomic
from mtrain.laboratory.plan import LAB_VARIANTS, RUN_NAME, Budget, Lab, LabVariant
from mtrain.laboratory.record_shape import not_a_record, shaped
from mtrain.run.directory import run_record

LAB_FILE = "lab.json"


def config_digest(path: Path) -> str:
    """The SHA-256 of a config file's text."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise OptionError(f"--config {path}: {e.strerror}") from None


def jsonable(overrides) -> dict[str, Any]:
    """What overrides set, as JSON holds it: {"train": {"lr": 0.001}}, whether given as `--set`
    strings (YAML values) or as (key, value) pairs (the Python API's)."""
    raw: dict[str, Any] = {}
    for override in overrides:
        config.apply_override(raw, override)
    return json.loads(json.dumps(raw, default=str))


@dataclass
class LabRecord:
    """What LAB_DIR/lab.json holds."""

    asked: dict[str, Any]  # compared at a rerun: config_sha256, budget, overrides, probes
    seeds: list[int]
    variants: dict[str, dict]  # name: what its overrides set
    config: str  # the path it was given, for people to read
    recipe: list[str] = field(default_factory=list)
    runs: dict[str, dict[str, str]] = field(default_factory=dict)  # name: {"diverged": why}
    located: dict[str, Any] = field(default_factory=dict)  # what the lab's clone_paths set

    @classmethod
    def of(cls, lab: Lab) -> LabRecord:
        asked = {
            "config_sha256": config_digest(lab.config),
            "budget": {"updates": lab.budget.updates, "minutes": lab.budget.minutes},
            "overrides": jsonable(lab.overrides),
            "probes": list(lab.probes),
        }
        variants = {v.name: jsonable(v.overrides) for v in lab.variants}
        return cls(
            asked,
            list(lab.seeds),
            variants,
            str(lab.config),
            list(lab.recipe),
            located=jsonable(lab.clone_paths),
        )

    @classmethod
    def read(cls, lab_dir: Path) -> LabRecord | None:
        path = lab_dir / LAB_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text("utf-8"))
        except RecursionError:
            raise not_a_record(path, "nested too deeply") from None
        except (OSError, ValueError) as e:
            raise not_a_record(path, str(e)) from None
        return cls(**shaped(data, path))

    def write(self, lab_dir: Path) -> None:
        """lab.json written whole (a path of bytes that are not UTF-8 as JSON's escapes), its
        directory made first where there is none."""
        text = json.dumps(self.__dict__, ensure_ascii=False, indent=1)
        if not is_utf8(text):
            text = json.dumps(self.__dict__, indent=1)
        lab_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(lab_dir / LAB_FILE, text + "\n")

    def merged(self, new: LabRecord, lab_dir: Path) -> LabRecord:
        """This record with the seeds and variants of `new` added; refused in one line where
        `new` asks for another config, budget, common overrides or probes, or changes a
        variant, naming what differs."""
        if self.asked["config_sha256"] != new.asked["config_sha256"]:
            refuse(lab_dir, f"the text of {new.config} changed")
        old, now = (Budget(**r.asked["budget"]) for r in (self, new))
        if old != now:
            refuse(lab_dir, f"the budget changed: {budget_change(old, now)}")
        old_sets = self.asked["overrides"]
        if not self.located:  # a record without it holds the clone's paths among its asked
            old_sets = less_clone_paths(old_sets, new.located, new.asked["overrides"])
        if old_sets != new.asked["overrides"]:
            change = difference(old_sets, new.asked["overrides"])
            refuse(lab_dir, f"the common --set changed: {change}")
        if self.asked["probes"] != new.asked["probes"]:
            change = probes_change(self.asked["probes"], new.asked["probes"])
            refuse(lab_dir, f"the probes changed: {change}")
        for name, overrides in new.variants.items():
            if name in self.variants and self.variants[name] != overrides:
                change = difference(self.variants[name], overrides)
                refuse(lab_dir, f"variant {name!r} changed: {change}")
        seeds = self.seeds + [s for s in new.seeds if s not in self.seeds]
        return LabRecord(
            {**self.asked, "overrides": new.asked["overrides"]},
            seeds,
            {**self.variants, **new.variants},
            new.config,
            self.recipe,
            self.runs,
            new.located,
        )

    def lab(self, lab: Lab) -> Lab:
        """`lab` as this record holds it: every seed and variant it was ever given (those not
        given now as their runs were trained), and the recipe it chose."""
        given = {v.name: v for v in lab.variants}
        variants = tuple(
            given.get(name) or recorded_variant(name, sets) for name, sets in self.variants.items()
        )
        return dataclasses.replace(
            lab, variants=variants, seeds=tuple(self.seeds), recipe=tuple(self.recipe)
        )


def recorded(lab: Lab, lab_dir: Path) -> tuple[LabRecord, Lab]:
    """The record of `lab` in `lab_dir` (a new one, or the one there with this lab's seeds and
    variants added, refused where it was asked otherwise), and the lab it holds."""
    record = LabRecord.of(lab)
    earlier = LabRecord.read(lab_dir)
    if earlier is None:
        refuse_unrecorded_budget(lab_dir, lab.budget)
        return record, lab
    record = earlier.merged(record, lab_dir)
    return record, record.lab(lab)


def recorded_variant(name: str, sets: dict[str, dict]) -> LabVariant:
    """A variant lab.json holds and this rerun does not name: its overrides as `--set`
    strings (a named variant's own, where they still set the same)."""
    if name in LAB_VARIANTS and jsonable(LAB_VARIANTS[name]) == sets:
        return LabVariant(name, LAB_VARIANTS[name])
    overrides = tuple(f"{key}={yaml_text(value)}" for key, value in flat(sets).items())
    if jsonable(overrides) != sets:  # a value YAML would read back as another
        raise OptionError(f"{LAB_FILE}: variant {name!r}: its keys cannot be written as --set")
    return LabVariant(name, overrides)


def yaml_text(value: Any) -> str:
    """A JSON value as a `--set` value that YAML reads back as it: 1.0e-05, 'no', [1, 2]."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=math.inf)
    return text.strip().removesuffix("\n...").strip()


def refuse_unrecorded_budget(lab_dir: Path, budget: Budget) -> None:
    """Refuse a lab directory without lab.json whose runs were trained to another budget, as
    each run's config.yaml says: they would mix into this lab's report under its title."""
    if not lab_dir.is_dir():
        return
    for run_dir in sorted(lab_dir.iterdir()):
        train = run_record(run_dir).get("train") if RUN_NAME.fullmatch(run_dir.name) else None
        if not isinstance(train, dict):  # not a lab's run, or no config.yaml: its check says
            continue
        trained = trained_budget(train)
        if trained != budget:
            raise OptionError(
                f"--out {lab_dir}: its run {run_dir.name} was trained to "
                f"{trained or 'no budget of a lab'} (its config.yaml), not this lab's {budget}; "
                f"with no {LAB_FILE} to hold the lab's budget, give it that one or another --out"
            )


def trained_budget(train: dict[str, Any]) -> Budget | None:
    """The budget a lab's run was given, from its config.yaml's train section; None: none."""
    steps, minutes = train.get("max_steps"), train.get("max_minutes")
    return Budget.given(None, minutes) if minutes else Budget.given(steps, None)


def less_clone_paths(overrides: dict, clone_paths: dict[str, Any], kept: dict[str, Any]) -> dict:
    """`overrides` (lab.json's nested keys) less the keys `clone_paths` sets, but for those
    `kept` sets too (a user's own --set of a preset's data.prepared_dir)."""
    dropped = {
        section: {k for k in keys if k not in kept.get(section, {})}
        for section, keys in clone_paths.items()
    }
    trimmed = {
        section: {k: v for k, v in keys.items() if k not in dropped.get(section, ())}
        for section, keys in overrides.items()
    }
    return {section: keys for section, keys in trimmed.items() if keys}


def flat(sets: dict[str, dict]) -> dict[str, Any]:
    """{"train": {"lr": 0.001}} as {"train.lr": 0.001}."""
    return {f"{section}.{k}": v for section, keys in sets.items() for k, v in keys.items()}


def difference(old: dict[str, dict], new: dict[str, dict]) -> str:
    """The keys two sets of overrides set otherwise: `train.lr 0.001 → 0.002, data.dev (not set)
    → "dev.tsv"`."""
    before, after = flat(old), flat(new)
    unset = object()
    keys = [k for k in {**before, **after} if before.get(k, unset) != after.get(k, unset)]

    def shown(values: dict[str, Any], key: str) -> str:
        if key not in values:
            return "(not set)"
        return json.dumps(values[key], ensure_ascii=False)

    return ", ".join(f"{k} {shown(before, k)} → {shown(after, k)}" for k in keys)


def budget_change(old: Budget, new: Budget) -> str:
    """Two budgets, in words that tell them apart: `10 updates → 20 updates`."""
    if str(old) == str(new):  # minutes that differ beyond :g's six digits
        return f"{old.minutes!r} minutes → {new.minutes!r} minutes"
    return f"{old} → {new}"


def probes_change(old: list[str], new: list[str]) -> str:
    """What another probe list drops and adds: `dropped "我打他"; added "他打我"`."""
    said = [
        f"{what} {', '.join(json.dumps(p, ensure_ascii=False) for p in probes)}"
        for what, probes in (
            ("dropped", [p for p in old if p not in new]),
            ("added", [p for p in new if p not in old]),
        )
        if probes
    ]
    return "; ".join(said) or "the same sentences in another order or number"


def refuse(lab_dir: Path, change: str) -> None:
    raise OptionError(
        f"{lab_dir} holds a lab asked otherwise ({change}); its runs would mix into another "
        f"lab's report: use another --out"
    )
