"""LAB_DIR/lab.json: what a lab was asked (its config's text, budget, common overrides, seeds,
variants and probes), the recipe it chose once for every run, and the runs that diverged. A
rerun that asks for another budget, config or probe list is refused: its runs would mix with
the old ones under a new title; one that adds seeds or variants goes on."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtrain.core import config
from mtrain.core.errors import OptionError
from mtrain.core.files import write_atomic
from mtrain.laboratory.plan import Lab

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
    located: dict[str, Any] = field(default_factory=dict)  # a preset's corpora in this clone

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
            located=jsonable(lab.located),
        )

    @classmethod
    def read(cls, lab_dir: Path) -> LabRecord | None:
        path = lab_dir / LAB_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text("utf-8"))
            return cls(**data)
        except (OSError, ValueError, TypeError) as e:
            raise OptionError(f"{path}: not a lab's record ({e}); use another --out") from None

    def write(self, lab_dir: Path) -> None:
        text = json.dumps(self.__dict__, ensure_ascii=False, indent=1)
        write_atomic(lab_dir / LAB_FILE, text + "\n")

    def merged(self, new: LabRecord, lab_dir: Path) -> LabRecord:
        """This record with the seeds and variants of `new` added; refused in one line where
        `new` asks for another config, budget, common overrides or probes, or changes a
        variant."""
        what = {
            "config_sha256": f"the text of {new.config}",
            "budget": "the budget",
            "overrides": "the common --set",
            "probes": "the probes",
        }
        for key, name in what.items():
            old, now = self.asked.get(key), new.asked.get(key)
            if key == "overrides":  # a record before 2026-12-07 holds them among the asked
                old = without(old, new.located)
            if old != now:
                shown = f": {brief(key, old)}, now {brief(key, now)}"
                shown = "" if key == "config_sha256" else shown
                refuse(lab_dir, f"{name} changed{shown}")
        for name, overrides in new.variants.items():
            if name in self.variants and self.variants[name] != overrides:
                refuse(lab_dir, f"variant {name!r} changed: {self.variants[name]}, now {overrides}")
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


def without(overrides: Any, located: dict[str, Any]) -> Any:
    """`overrides` (lab.json's nested keys) less the keys `located` sets."""
    if not isinstance(overrides, dict):
        return overrides
    kept = {}
    for section, keys in overrides.items():
        inner = located.get(section)
        if isinstance(keys, dict) and isinstance(inner, dict):
            keys = {k: v for k, v in keys.items() if k not in inner}
            if not keys:
                continue
        kept[section] = keys
    return kept


def brief(key: str, value: Any) -> str:
    """A value of lab.json's `asked`, in a few words."""
    if key == "budget" and isinstance(value, dict):
        return " ".join(f"{v:g} {k}" for k, v in value.items() if v is not None) or "none"
    return json.dumps(value, ensure_ascii=False)[:80]


def refuse(lab_dir: Path, change: str) -> None:
    raise OptionError(
        f"{lab_dir} holds a lab asked otherwise ({change}); its runs would mix into another "
        f"lab's report: use another --out"
    )
