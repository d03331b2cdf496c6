"""lab.json's shape: each field of a LabRecord checked to be what its readers take, before
the record is built; anything else refused in one line naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtrain.core.errors import OptionError
from mtrain.laboratory.plan import BASELINE, NAME, Budget

REQUIRED = ("asked", "seeds", "variants", "config")
FIELDS = (*REQUIRED, "recipe", "runs", "located")  # LabRecord's
ASKED = ("config_sha256", "budget", "overrides", "probes")
SETTINGS = 'an object of sections\' keys, e.g. {"train": {"lr": 0.001}}'


def not_a_record(path: Path, why: str) -> OptionError:
    return OptionError(f"{path}: not a lab's record ({why}); use another --out")


def shaped(data: Any, path: Path) -> dict[str, Any]:
    """lab.json's fields, each checked to be what its readers take (a budget with both its
    keys); anything else refused in one line naming the key."""

    def need(ok: Any, key: str, expected: str) -> None:
        if not ok:
            raise not_a_record(path, f"{key}: expected {expected}")

    need(isinstance(data, dict), "the file", "a JSON object")
    has_keys(data, FIELDS, REQUIRED, "", path)
    asked = data["asked"]
    need(isinstance(asked, dict), "asked", "an object")
    has_keys(asked, ASKED, ASKED, "asked.", path)
    need(isinstance(asked["config_sha256"], str), "asked.config_sha256", "a string")
    budget = asked["budget"]
    need(
        isinstance(budget, dict)
        and set(budget) <= {"updates", "minutes"}
        and Budget.given(budget.get("updates"), budget.get("minutes")),
        "asked.budget",
        'updates or minutes above 0, e.g. {"updates": 1200, "minutes": null}',
    )
    need(settings(asked["overrides"]), "asked.overrides", SETTINGS)
    need(asked["probes"] and all_of(asked["probes"], str), "asked.probes", "a list of sentences")
    seeds = data["seeds"]
    need(
        seeds and all_of(seeds, int) and min(seeds) >= 0 and len(set(seeds)) == len(seeds),
        "seeds",
        "a list of whole numbers, 0 or more, each once",
    )
    variants = data["variants"]
    need(isinstance(variants, dict), "variants", "an object of variants")
    for name, sets in variants.items():
        need(NAME.fullmatch(name) and name != BASELINE, f"variants {name!r}", "a variant's name")
        need(settings(sets), f"variants {name!r}", SETTINGS)
    need(isinstance(data["config"], str), "config", "a string")
    need(all_of(data.get("recipe", []), str), "recipe", "a list of KEY=VALUE strings")
    runs = data.get("runs", {})
    need(
        isinstance(runs, dict) and all(dict_of(r, str) for r in runs.values()),
        "runs",
        'an object of runs, e.g. {"peek-seed1": {"diverged": "why"}}',
    )
    need(settings(data.get("located", {})), "located", SETTINGS)
    whole = {"updates": budget.get("updates"), "minutes": budget.get("minutes")}
    return {**data, "asked": {**asked, "budget": whole}}


def has_keys(data: dict, known, required, prefix: str, path: Path) -> None:
    for key in data:
        if key not in known:
            raise not_a_record(path, f"an unknown key, {prefix}{key}")
    for key in required:
        if key not in data:
            raise not_a_record(path, f"no {prefix}{key}")


def all_of(values: Any, kind: type) -> bool:
    """A JSON list of `kind` (int: not a bool)."""
    return isinstance(values, list) and all(type(v) is kind for v in values)


def dict_of(values: Any, kind: type) -> bool:
    return isinstance(values, dict) and all(type(v) is kind for v in values.values())


def settings(value: Any) -> bool:
    """What overrides set, as jsonable gives it: sections, each an object of keys."""
    return dict_of(value, dict)
