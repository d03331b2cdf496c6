"""Runs built on other runs: reading a parent run safely, the sections it passes on, and the
record of where a run came from (config.yaml's `parent`, and every checkpoint's).

A run with `train.init_from: RUN` (or RUN/CHECKPOINT) starts from the parent's weights and
tokenizers and takes the keys declared `Child.INHERITED` beside them in config.py (its `model`
and `tokenizer` sections, but for dropout); the languages must agree (`Child.AGREED`);
everything else (optimizer, schedule, batch order, dropout, data, `train`) is its own. Rank 0
alone reads the parent and sends it to the others, as a resume does: no rank needs another's
disk.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtrain.core import config as config_mod
from mtrain.core.config import POLICIES, Child, Config, ConfigError, effective
from mtrain.core.distributed import Group
from mtrain.core.files import lock_holder
from mtrain.data.tokenizer import Tokenizer, TokenizerError
from mtrain.run.directory import (
    BEST,
    CONFIG_FILE,
    EXPORT_MODEL,
    LAST,
    CheckpointError,
    load_run,
    peek_checkpoint,
    run_config,
    run_record,
)

log = logging.getLogger(__name__)

PARENT = config_mod.PARENT  # config.yaml's section, and the checkpoints' entry


@dataclass
class Parent:
    """What a new run takes from its parent: weights, tokenizer models, config, and the record
    of them that the new run keeps."""

    record: dict[str, Any]  # run, checkpoint, step, weights (SHA-256), parent (its own record)
    weights: dict[str, torch.Tensor]
    protos: tuple[bytes, bytes]  # the source and target SentencePiece models
    config: Config

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_protos(*self.protos)


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """The SHA-256 of a model's weights: names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def describe(record: dict[str, Any]) -> str:
    """One line: which run and checkpoint a run was built on."""
    return f"fine-tuned from {record['run']} {record['checkpoint']} (update {record['step']})"


def read_parent(spec: str) -> Parent:
    """The parent `spec` names (RUN: its best.pt, or RUN/CHECKPOINT), checked as a resume
    checks its checkpoint; every refusal is one line that starts with the key."""
    try:
        return _read(Path(spec))
    except (CheckpointError, TokenizerError, ConfigError) as e:
        raise CheckpointError(f"train.init_from: {e}") from None


def _read(path: Path) -> Parent:
    if path.is_dir():
        run, name = path, BEST
    elif path.exists() or (path.parent / CONFIG_FILE).is_file():  # RUN/CHECKPOINT
        run, name = path.parent, path.name
    else:
        raise CheckpointError(f"{path}: no such run")
    if (run / EXPORT_MODEL).is_file() and not (run / CONFIG_FILE).is_file():
        raise CheckpointError(
            f"{run}: a CTranslate2 export, which translates but does not train; name the run "
            "it was exported from"
        )
    holder = lock_holder(run)
    # One read of a file replaced whole by each save: the checkpoint as it is at this moment.
    loaded = load_run(run, torch.device("cpu"), name)
    step, weights = loaded.step, loaded.model.state_dict()
    if holder is not None:
        log.info(
            "%s is being trained now (%s): starting from %s as it is at this moment (update %d)",
            run,
            holder,
            name,
            step,
        )
    record = {
        "run": str(run.absolute()),
        "checkpoint": name,
        "step": step,
        "weights": weights_digest(weights),
        PARENT: recorded(run),
    }
    return Parent(record, weights, loaded.tokenizer.protos(), loaded.cfg)


def given_keys(config_path: Path, overrides: list[config_mod.Override]) -> set[tuple[str, str]]:
    """The keys a run takes from its parent that a config file and its `--set`s name."""
    raw = config_mod.read_config(config_path) or {}
    for assignment in overrides:
        config_mod.apply_override(raw, assignment)
    return {
        (section, name)
        for (section, name), policy in POLICIES.items()
        if policy.child is Child.INHERITED
        if isinstance(raw.get(section), dict) and name in raw[section]
    }


def inherit(cfg: Config, source: Config, where: str, given: set[tuple[str, str]] | None) -> None:
    """Give `cfg` the keys a run takes from `source` (the parent's config, or the run's own on
    a resume); a key that `given` holds (None: every key) and whose value differs from
    `source`'s, or a key that must agree and does not, is refused, naming it and both values,
    as is a rule that joins keys (config.JOINED). The config is checked again with what it took."""
    for (section, name), policy in POLICIES.items():
        if policy.child is Child.OWN:
            continue
        mine, theirs = getattr(cfg, section), getattr(source, section)
        new, old = getattr(mine, name), getattr(theirs, name)
        if effective(mine, name) == effective(theirs, name):
            setattr(mine, name, old)  # the same, perhaps said otherwise (tgt_vocab_size 0)
        elif policy.child is Child.INHERITED and given is not None and (section, name) not in given:
            setattr(mine, name, old)
        else:
            refuse((section, name), new, old, where)
    for rule in config_mod.JOINED:  # rules that join keys of two sections
        if (why := rule(cfg, source, where)) is not None:
            raise ConfigError(f"train.init_from: {why}")
    config_mod.validate(cfg, f"train.init_from: with the model and tokenizer of {where}")


def refuse(key: tuple[str, str], new: Any, old: Any, where: str) -> None:
    raise ConfigError(
        f"train.init_from: {'.'.join(key)} is {new!r} here and {old!r} in {where}; a run built "
        "on another keeps its model, tokenizer and languages (leave the key out)"
    )


def parent_of(cfg: Config, config_path: Path, overrides: list[config_mod.Override]) -> Parent:
    """Read the parent of `cfg` and give `cfg` its sections (those the config leaves out)."""
    parent = read_parent(cfg.train.init_from)
    inherit(cfg, parent.config, parent.record["run"], given_keys(config_path, overrides))
    return parent


def start(
    cfg: Config, run_dir: Path, config_path: Path, overrides: list[config_mod.Override]
) -> Parent | None:
    """Before anything is written: the parent a new run starts from, its sections given to
    `cfg`; on a resume (run_dir holds last.pt), the run's own sections, and no parent read:
    the parent may have moved or gone since."""
    if (run_dir / LAST).exists():
        inherit(cfg, run_config(run_dir), str(run_dir), given_keys(config_path, overrides))
        return None
    return parent_of(cfg, config_path, overrides)


def share(cfg: Config, parent: Parent | None, resume: bool, group: Group) -> Parent | None:
    """The parent a new run starts from (None on a resume, or for a run of its own), and the
    inherited sections in `cfg`, on every rank as rank 0 read them. Rank 0 reads the parent
    here where no one did before (the Python API), holding the config to all of its keys."""
    if not cfg.train.init_from:
        return None
    if group.is_main and not resume and parent is None:
        parent = read_parent(cfg.train.init_from)
        inherit(cfg, parent.config, parent.record["run"], None)
    sent = (cfg.model, cfg.tokenizer, None if resume else parent) if group.is_main else None
    cfg.model, cfg.tokenizer, parent = group.broadcast(sent, startup=True)
    if parent is not None and group.is_main:
        record = parent.record
        log.info(
            "starting from %s %s (update %d, weights %s): a new optimizer, schedule and batch "
            "order",
            record["run"],
            record["checkpoint"],
            record["step"],
            record["weights"][:12],
        )
    return parent


def recorded(run_dir: Path) -> dict[str, Any] | None:
    """The parent a run records (its config.yaml's, else its checkpoints': a run whose
    config.yaml was lost or replaced still says where it came from); None: its own weights."""
    parent = run_record(run_dir).get(PARENT)
    if is_record(parent):
        return parent
    for name in (LAST, BEST):
        try:
            parent = peek_checkpoint(run_dir / name).get(PARENT)
        except CheckpointError:
            continue
        return parent if is_record(parent) else None
    return None


def is_record(parent: Any) -> bool:
    """Whether `parent` is a record as `read_parent` makes them (not one a hand damaged)."""
    kinds = {"run": str, "checkpoint": str, "step": int, "weights": str}
    return isinstance(parent, dict) and all(isinstance(parent.get(k), t) for k, t in kinds.items())
