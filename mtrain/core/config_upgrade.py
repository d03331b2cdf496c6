"""A run's recorded config in today's schema, with the values that run used, not today's defaults.

A run records its config (its config.yaml, an export's mtrain.yaml) with the schema `VERSION`
it was written in, and its checkpoints name the version too. A key added to the schema later
is absent from an older record; read with today's default, it would change the run (a target
vocabulary of 4,000 pieces for a run that has one of the source's size, a dropout chosen on
resume). `upgrade` is the one place that turns an older record into today's schema: it walks
`MIGRATIONS`, one step per version, and each step fills in the keys declared beside their
field in config.py as added in that version (`Added`). A config file a person writes names no
version and is read with today's defaults.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

VERSION_KEY = "version"
Key = tuple[str, str]  # (section, key)


@dataclass(frozen=True)
class Added:
    """What a run recorded before a key existed did, declared beside the key (config.py)."""

    value: Any  # the value that does what mtrain did before the key existed
    commit: str  # the commit that added the key
    # The schema version it came in; 1: before records named their version, so a record of
    # version 1 may lack it. Records of an earlier version lack it; those of this one hold it.
    version: int = 1
    # The value on CUDA where mtrain did otherwise there (None: `value` on every device); a
    # record that cannot say where its run trained takes `value`.
    cuda: Any = None

    def before(self, trained_on: Callable[[], str | None]) -> Any:
        """The value of a run that lacks the key, given the device type it trained on."""
        if self.cuda is not None and trained_on() == "cuda":
            return self.cuda
        return self.value


@dataclass(frozen=True)
class Migration:
    """One step of the chain: a record of schema `version - 1` read in schema `version`. The
    step also drops the older meaning of the keys declared `redefined=version` and fills in
    those it `adds` where the record lacks them, with the value declared beside each."""

    version: int
    note: str  # what the step changes, in words
    removed: frozenset[Key] = frozenset()  # keys the schema no longer has from this version

    def adds(self, added: Added) -> bool:
        """Whether this step fills in a key declared `added`: those that came in its version,
        and at the first step those of version 1, which a record of version 1 may lack."""
        return added.version == self.version or (added.version == 1 and self is MIGRATIONS[0])


MIGRATIONS = (
    # 1: every record written before records carried a version (416dbc9 to 116cbc2); its keys
    # say which mtrain wrote it, and any key added in those days may be missing.
    Migration(
        2,
        "train.compile compiles per batch shape and train.init_from names a parent; keys "
        "added since the first run directory take what mtrain did before them",
        # decode.batch_size (sentences per batch) became decode.batch_tokens in fe3ae92
        removed=frozenset({("decode", "batch_size")}),
    ),
    Migration(3, "model.variant names the model's variant; every model before was the textbook's"),
)

# The schema of the configs and checkpoints this mtrain writes: the chain's last step.
VERSION = MIGRATIONS[-1].version


class Declared(Protocol):
    """What the upgrade reads of one key's declaration (config.py's `Policy`)."""

    added: Added | None  # None: every run directory records it (416dbc9)
    redefined: int | None  # the version that gave the key its meaning; older values dropped


def upgrade(
    record: dict[str, Any],
    version: int,
    keys: Mapping[Key, Declared],
    trained_on: Callable[[], str | None] = lambda: None,
) -> dict[str, Any]:
    """A run's config record of schema `version` (its `VERSION_KEY` taken out) in today's;
    `keys`: each key's declaration; `trained_on`: the device type its run trained on (asked
    only where a key's older value depends on it; None: unknown)."""
    for step in MIGRATIONS:
        if step.version <= version:
            continue
        record = without(record, step.removed)
        for (section, key), declared in keys.items():
            values = record.setdefault(section, {})
            if not isinstance(values, dict):  # refused, with its key, when the config is built
                continue
            if declared.redefined == step.version:
                values.pop(key, None)
            added = declared.added
            if added is not None and step.adds(added) and key not in values:
                values[key] = copy.deepcopy(added.before(trained_on))
    return record


def removed() -> frozenset[Key]:
    """Every key the schema had and no longer has."""
    return frozenset().union(*(step.removed for step in MIGRATIONS))


def without_removed(raw: dict[str, Any]) -> dict[str, Any]:
    """A config mapping less the keys the schema no longer has; a copy."""
    return without(raw, removed())


def without(raw: dict[str, Any], keys: frozenset[Key]) -> dict[str, Any]:
    """A config mapping less `keys`; a copy."""
    raw = {
        name: dict(values) if isinstance(values, dict) else values for name, values in raw.items()
    }
    for section, key in keys:
        if isinstance(raw.get(section), dict):
            raw[section].pop(key, None)
    return raw
