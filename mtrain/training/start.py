"""A run's start: where it goes, its config checked against the run it resumes or the parent
it begins from, its directory opened and locked, and the training that follows. `mtrain train`,
`mtrain.train` and `mtrain.lab` all start a run here; each way it stops early is an
MtrainError, which the command turns into one line and an exit status."""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from mtrain.core import config, runtime
from mtrain.core.config import Config, ConfigError, Resume, effective
from mtrain.core.errors import MtrainError, OptionError
from mtrain.core.files import LOCK_FILE, DirectoryLock, refuse_held, remove_leftovers
from mtrain.data import corpus
from mtrain.data.prepare import corpus_digests
from mtrain.run.directory import (
    BEST,
    CONFIG_FILE,
    LAST,
    CheckpointError,
    check_corpora,
    peek_checkpoint,
    recorded_version,
    run_config,
    step_checkpoints,
    write_config,
)

if TYPE_CHECKING:
    import torch

    from mtrain.core.distributed import Group
    from mtrain.run.lineage import Parent

RUNS_ROOT = Path("runs")  # where runs go, and where the latest is looked for

log = logging.getLogger(__name__)


class Stopped(MtrainError):
    """Training stopped by a second Ctrl-C (or one before it began), without a new checkpoint;
    the message says what the run directory keeps."""


def train_run(
    config_path: Path,
    overrides: list[config.Override],
    out: Path | None,
    device: str = "auto",
    peer_timeout: float = 5.0,
) -> tuple[Path | None, float]:
    """Train as `mtrain train` does; return the run directory (None on ranks other than 0)
    and the best dev BLEU. Ctrl-C raises `Interrupted` once a checkpoint is saved, `Stopped`
    where none could be."""
    from mtrain.core import distributed  # imported here: keeps `translate` light

    group = distributed.from_env()
    run_dir = out or RUNS_ROOT / f"{config_path.stem}-{datetime.now():%Y%m%d-%H%M%S}"
    cfg = start_config(config_path, overrides, run_dir)
    torch_device = runtime.pick_device(device, group.local_rank)
    parent = None
    if cfg.train.init_from and group.is_main:  # checked before anything is written
        from mtrain.run import lineage

        parent = lineage.start(cfg, run_dir, config_path, overrides)
    if group.is_main:
        make_run_dir(run_dir)
    distributed.start(group, torch_device, peer_timeout)
    try:
        best = run_training(cfg, run_dir, torch_device, group, parent)
    finally:
        distributed.stop(group)
    return (run_dir if group.is_main else None), best


def start_config(config_path: Path, overrides: list[config.Override], run_dir: Path) -> Config:
    """The config a run in `run_dir` starts with (a resumed run's own values where the file
    names none), checked, its data paths made absolute and its parent's path too."""
    from mtrain.training import tensorboard_log

    cfg = config.load(config_path, overrides, require_data=True, run=resumed(run_dir))
    tensorboard_log.require(cfg.train)
    resolve_data(cfg, config_path)
    if cfg.train.init_from:
        cfg.train.init_from = os.path.abspath(cfg.train.init_from)
    return cfg


def check_start(config_path: Path, overrides: list, run_dir: Path) -> tuple:
    """What `mtrain train` checks at a run's start, writing nothing: the run's config as it
    would train, and the tokenizer its corpus is encoded with where not its own (a parent's)."""
    from mtrain.data.tokenizer import Tokenizer
    from mtrain.run import lineage

    cfg = start_config(config_path, overrides, run_dir)
    parent = None
    if cfg.train.init_from:
        parent = lineage.start(cfg, run_dir, config_path, overrides)
    resumes = check_run_dir(run_dir, cfg)
    if resumes and cfg.train.init_from:  # its tokenizer is its own once it began
        return cfg, Tokenizer.load(run_dir)
    return cfg, parent and parent.tokenizer()


def check_run_dir(run_dir: Path, cfg: Config) -> bool:
    """Refuse, writing nothing, a run directory that a run of `cfg` cannot start in: what
    `train_run` refuses before it makes it (`refuse_out`), as it locks it and as it opens it
    (`check_checkpoints`); return whether the run resumes."""
    refuse_out(run_dir)
    refuse_held(run_dir)
    return check_checkpoints(run_dir, cfg)


def run_training(
    cfg: Config,
    run_dir: Path,
    device: torch.device,
    group: Group,
    parent: Parent | None = None,
) -> float:
    """Train into `run_dir` as this process of `group` (from `parent`'s weights, if given);
    return the best dev BLEU. Each way a run stops early is an MtrainError (Ctrl-C:
    `Interrupted` or `Stopped`), but for a bug, which keeps its traceback."""
    from mtrain.core import distributed
    from mtrain.training.build import build_trainer

    try:
        # Rank 0 alone owns the run directory; the others get what they need from it.
        with DirectoryLock(run_dir) if group.is_main else contextlib.nullcontext():
            resume = group.is_main and open_run_dir(run_dir, cfg)
            cfg = rank_0s_config(cfg, group)
            trainer = build_trainer(cfg, run_dir, device, resume, group, parent=parent)
            # a start that does nothing (a finished run) writes nothing
            if group.is_main and not trainer.progress.done(cfg.train):
                chosen = trainer.choice and trainer.choice.to_dict()
                say_upgraded(run_dir)
                # once the run is known to be resumable
                write_config(run_dir, cfg, chosen, trainer.state.parent)
            return trainer.run()
    except KeyboardInterrupt:
        last = run_dir / LAST
        kept = f"{last} is intact" if last.exists() else "no checkpoint had been written"
        raise Stopped(f"stopped; {kept}") from None
    except RuntimeError as e:
        if not (group.active and distributed.is_peer_loss(e)):
            raise  # a bug: its traceback says where
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise distributed.DistributedError(
            f"rank {group.rank}: lost the other training processes ({first_line[:200]})"
        ) from None


def open_run_dir(run_dir: Path, cfg: Config) -> bool:
    """Clean a locked run directory of what a killed run left; return whether to resume."""
    for leftover in remove_leftovers(run_dir):
        log.info("removed %s, left by an interrupted write", leftover)
    resume = check_checkpoints(run_dir, cfg)
    log.info("run directory %s", run_dir)
    return resume


def check_checkpoints(run_dir: Path, cfg: Config) -> bool:
    """Whether a run of `cfg` resumes the run `run_dir` holds; refused where it holds
    checkpoints but no last.pt, or its run cannot resume as `cfg` (`check_resumable`)."""
    resume = (run_dir / LAST).exists()
    kept = (run_dir / BEST).exists() or step_checkpoints(run_dir)
    if kept and not resume:  # last.pt deleted, or lost
        raise CheckpointError(
            f"{run_dir}: holds checkpoints but no {LAST} to resume from; training "
            "afresh would replace them: use another --out"
        )
    if resume:
        check_resumable(run_dir, cfg)
    return resume


def check_resumable(run_dir: Path, cfg: Config) -> None:
    """Refuse to resume (or, in a lab, to report) a run with a config other than its own, but
    for the keys declared to change on a resume (config.Resume); those it records keep the
    run's own value. A corpus whose contents the checkpoint holds a hash of is compared by them,
    not by its path (a moved clone's corpora resume), before anything is prepared; a damaged
    checkpoint is refused first, as nothing can resume from it."""
    saved = run_config(run_dir)
    state = peek_checkpoint(run_dir / LAST)
    hashed = set(state.get("data", {}))
    for (section, name), policy in config.POLICIES.items():
        if policy.location is config.Location.CORPUS and section == "data" and name in hashed:
            continue
        mine, theirs = getattr(cfg, section), getattr(saved, section)
        old, new = getattr(theirs, name), getattr(mine, name)
        if policy.resume is Resume.RECORDED:
            if new and not old:
                raise ConfigError(
                    f"{run_dir} began from its own weights, not {section}.{name}={new!r}: a "
                    "resume never reads a parent; leave it out or use another --out"
                )
            setattr(mine, name, old)  # where it began: a resume reads no parent
        elif policy.resume is Resume.KEPT and effective(mine, name) != effective(theirs, name):
            raise ConfigError(
                f"{run_dir} was trained with {section}.{name}={old!r}, not {new!r}; use the "
                "run's own config or another --out"
            )
    if hashed:
        paths = {key: getattr(cfg.data, key) for key in hashed}
        check_corpora(run_dir / LAST, state, corpus_digests(cfg), paths)


def resumed(run_dir: Path) -> Config | None:
    """The config of the run `run_dir` holds, in today's schema, if training would resume it:
    the keys a config file does not name keep its values."""
    if (run_dir / LAST).is_file() and (run_dir / CONFIG_FILE).is_file():
        return run_config(run_dir)
    return None


def is_run_dir(path: Path) -> bool:
    """A directory that mtrain trained into (or began to)."""
    return (path / CONFIG_FILE).is_file() or (path / LOCK_FILE).is_file()


def make_run_dir(run_dir: Path) -> None:
    """Make the run directory, refusing one that holds anything but a run."""
    refuse_out(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


def refuse_out(run_dir: Path) -> None:
    """Refuse a run directory that is a file, or holds other files and no run."""
    if run_dir.exists() and not run_dir.is_dir():
        raise OptionError(f"--out {run_dir}: exists and is not a directory")
    if run_dir.is_dir() and not is_run_dir(run_dir) and any(run_dir.iterdir()):
        raise OptionError(
            f"--out {run_dir}: holds other files and no run; use a new or empty directory"
        )


def rank_0s_config(cfg: Config, group: Group) -> Config:
    """Rank 0's config on every rank (rank 0 alone reads the run's own, whose values a resumed
    run keeps for the keys the config file does not name), with this rank's own paths."""
    theirs = group.broadcast(cfg, startup=True)
    if group.is_main:
        return cfg
    for section, name in config.LOCATIONS:  # `theirs` is this rank's copy, received
        setattr(getattr(theirs, section), name, getattr(getattr(cfg, section), name))
    return theirs


def say_upgraded(run_dir: Path) -> None:
    """One line on stderr where this start rewrites an older mtrain's config.yaml."""
    version = recorded_version(run_dir)
    if version is not None and version < config.VERSION:
        log.warning(
            "%s: upgraded from config version %d to %d (keys added since keep what the run did "
            "before them); an mtrain older than this one can no longer resume it",
            run_dir / CONFIG_FILE,
            version,
            config.VERSION,
        )


def resolve_data(cfg: Config, config_path: Path) -> None:
    """Check that the config's corpora exist, and make every path of this machine absolute
    (config.LOCATIONS): the run works from any directory."""
    for (section, name), location in config.LOCATIONS.items():
        value = getattr(getattr(cfg, section), name)
        if location is config.Location.CORPUS:
            try:
                corpus.check_files(value, f"{section}.{name}")
            except corpus.DataError as e:
                raise corpus.DataError(f"{config_path}: {e}") from None
            value = corpus.resolve(value)
        else:
            value = str(Path(value).resolve())
        setattr(getattr(cfg, section), name, value)
