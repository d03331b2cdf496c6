"""Run directories: resolved config, tokenizer models, checkpoints (state dicts, never modules),
and the one loader of a run (`load_run`), which translating and a new run's parent both use."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from mtrain.core import config as config_mod
from mtrain.core import jsonl
from mtrain.core.config import Config
from mtrain.core.errors import MtrainError
from mtrain.core.files import atomic_open, replace, tmp_path, write_atomic
from mtrain.data.tokenizer import PAD_ID, Tokenizer
from mtrain.model.transformer import Transformer

CONFIG_FILE, LAST, BEST, METRICS = "config.yaml", "last.pt", "best.pt", "metrics.jsonl"
AVERAGED = "averaged.pt"
TRAIN_LOG = "train.jsonl"  # training loss and learning rate every LOG_EVERY steps
EXAMPLES = "examples.jsonl"  # each validation's example translations, with their attention
TENSORBOARD = "tensorboard"  # the directory of TensorBoard's event files (train.tensorboard)
EXPORT_MODEL = "model.bin"  # CTranslate2's weights: what a directory `mtrain export` wrote holds


class CheckpointError(MtrainError, ValueError):
    """A run directory or checkpoint that cannot be used; the message names the file."""


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write a checkpoint atomically: a crash or a full disk leaves the previous file intact."""
    # Serialised in memory first: torch's writer turns a failed write (a full disk) into a
    # RuntimeError that no longer says why; a plain write raises the OSError that does.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(path, buffer.getbuffer())


def save_copy(src: Path, dst: Path) -> None:
    """Make `dst` hold what `src` holds now: a hard link (no copy on disk) where possible."""
    tmp = tmp_path(dst)
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # a file system without hard links
        with src.open("rb") as f, atomic_open(dst) as out:
            shutil.copyfileobj(f, out)
        return
    replace(tmp, dst)  # removes the link if the rename fails


# The entries a checkpoint may hold (`TrainingState.state_dict`, `average_checkpoints`) and the
# type of each: a damaged or foreign file is refused here, not deep inside a resume or an average.
ENTRIES = {
    "format": int,
    "config_version": int,  # the schema of the run's config (config_upgrade.py)
    "model": dict,
    "step": int,
    "tokenizer": str,
    "optimizer": dict,
    "scheduler": dict,
    "scaler": dict,
    "data": dict,
    "rng": list,
    "steps": list,
    "epoch": int,
    "batches_done": int,
    "best_bleu": (int, float),
    "stale": int,
    "skipped": int,
    "minutes": (int, float),
    "finished": dict,
    "parent": dict,  # the run it started from (run/lineage.py)
}


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint as plain tensors and containers; pickled code is refused."""
    try:
        f = path.open("rb")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            why = (
                "it holds Python objects, not only tensors, which mtrain never loads"
                if "Unsupported global" in str(e)
                else "not a PyTorch checkpoint"
            )
            raise CheckpointError(f"{path}: not a loadable mtrain checkpoint ({why})") from None
        except Exception:  # torch's readers fail on cut or damaged bytes in many ways
            raise CheckpointError(
                f"{path}: not a loadable mtrain checkpoint (truncated or corrupt)"
            ) from None
    check_state(path, state)
    return state


def peek_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's entries with its tensors mapped from the file, not read: its step or its
    `finished` mark cost no more than a glance. Refused as `load_checkpoint` refuses it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # absent, damaged, foreign, or too old to map: load_checkpoint says which
        return load_checkpoint(path)
    check_state(path, state)
    return state


def check_state(path: Path, state: Any) -> None:
    """Refuse a loaded object that is not a checkpoint as mtrain writes them."""

    def refuse(why: str) -> None:
        raise CheckpointError(f"{path}: not a loadable mtrain checkpoint ({why})")

    if not isinstance(state, dict) or "model" not in state:
        refuse("no model weights")
    for key, kind in ENTRIES.items():
        value = state.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            refuse(f"{key!r} holds a {type(value).__name__}")
    if "step" not in state:
        refuse("no step")
    model = state["model"]
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        refuse("its model entry holds other things than named tensors")


def resolve(run_dir: Path, name: str) -> Path:
    """The checkpoint file `name` of a run; a path outside the run directory is refused."""
    if not name or Path(name).name != name or name in (".", ".."):
        raise CheckpointError(
            f"--checkpoint {name!r}: expected the name of a checkpoint file in the run directory "
            "(best.pt, last.pt, averaged.pt or step-N.pt), not a path"
        )
    return run_dir / name


def check_tokenizer(path: Path, state: dict[str, Any], fingerprint: str) -> None:
    """Refuse a checkpoint trained with other SentencePiece models than the run now holds."""
    if state.get("tokenizer") != fingerprint:
        raise CheckpointError(
            f"{path}: does not match the run's config and tokenizer "
            "(the SentencePiece models differ from those it was trained with)"
        )


def check_corpora(
    path: Path, state: dict[str, Any], digests: dict[str, str], paths: dict[str, str]
) -> None:
    """Refuse a checkpoint trained on other corpora than those at `paths` now: it holds a hash
    of the training, dev and test files (`data_digests`: the dev and test sources shape the
    training pairs too), compared with `digests`, theirs now. A corpus it holds no hash of
    (written before checkpoints kept them) is not compared."""
    for key, digest in state.get("data", {}).items():
        if digests.get(key) != digest:
            raise CheckpointError(
                f"data.{key}: {paths[key]} is not what {path} was trained on (changed since it "
                "was written, or another corpus): restore the file, or train into another --out"
            )


def step_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def step_checkpoints(run_dir: Path) -> list[Path]:
    """The run's step-N.pt checkpoints, oldest first."""
    return sorted(run_dir.glob("step-*.pt"))


def average_checkpoints(paths: list[Path]) -> dict[str, Any]:
    """A checkpoint whose weights are the mean of the given checkpoints' weights.

    The checkpoints must come from one run (same tokenizer, same shapes); the result holds the
    model, the tokenizer fingerprint and the steps averaged, not the optimizer state.
    """
    states = [load_checkpoint(path) for path in paths]
    first = states[0]["model"]
    for path, state in zip(paths[1:], states[1:]):
        check_tokenizer(path, state, states[0].get("tokenizer"))
        # Checked, not left to `+=`: it would broadcast other shapes and skip missing names.
        if state["model"].keys() != first.keys() or any(
            value.shape != first[key].shape for key, value in state["model"].items()
        ):
            raise CheckpointError(
                f"{path}: cannot average with {paths[0].name} (other weight names or shapes)"
            )
    try:
        total = {k: v.double() for k, v in first.items()}
        for state in states[1:]:
            for key, value in state["model"].items():
                total[key] += value
    except RuntimeError as e:  # tensors of a kind that cannot be summed
        raise CheckpointError(f"{paths[0].parent}: cannot average ({e})") from None
    model = {k: (v / len(states)).to(states[0]["model"][k].dtype) for k, v in total.items()}
    steps = [state["step"] for state in states]  # the steps averaged
    return {
        "model": model,
        "tokenizer": states[0].get("tokenizer"),
        "step": steps[-1],
        "steps": steps,
        "parent": states[0].get("parent"),
    }


def write_config(
    run_dir: Path,
    cfg: Config,
    chosen: dict[str, Any] | None = None,
    parent: dict[str, Any] | None = None,
) -> None:
    """The run's config.yaml: its schema version, its config, what the run chose from its plan
    (`chosen`), the run it started from (`parent`, run/lineage.py), and the version of the
    config.yaml it replaces where that was older (a run upgraded by a resume)."""
    since = upgraded_from(run_dir)
    record = config_record(cfg) | ({config_mod.CHOSEN: chosen} if chosen else {})
    record |= {config_mod.PARENT: parent} if parent else {}
    record |= {config_mod.UPGRADED: since} if since else {}
    text = yaml.safe_dump(record, sort_keys=False, allow_unicode=True)
    write_atomic(run_dir / CONFIG_FILE, text)


def config_record(cfg: Config) -> dict[str, Any]:
    """A run's config as its files record it: the schema version first (config_upgrade.py)."""
    return {config_mod.VERSION_KEY: config_mod.VERSION, **cfg.to_dict()}


def build_model(cfg: Config, tokenizer: Tokenizer | None = None) -> Transformer:
    """The model a config and tokenizer describe, freshly initialised; without a tokenizer
    (none trained yet), of the vocabulary size the config asks for."""
    if tokenizer is None:
        vocab = (cfg.tokenizer.vocab_size, cfg.tokenizer.tgt_size)
    else:
        vocab = (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    return Transformer(
        cfg.model, *vocab, cfg.data.max_positions(), PAD_ID, joint_vocab=cfg.tokenizer.joint
    )


def run_record(run_dir: Path) -> dict[str, Any]:
    """A run's config.yaml as written, sections and all; {} where it cannot be read."""
    try:
        record = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return record if isinstance(record, dict) else {}


def run_choices(run_dir: Path) -> dict[str, Any] | None:
    """What a run chose from its plan, as its config.yaml records it; None: nothing yet."""
    chosen = run_record(run_dir).get(config_mod.CHOSEN)
    return chosen if isinstance(chosen, dict) else None


def recorded_version(run_dir: Path) -> int | None:
    """The schema version of a run's config.yaml as written: its own, else its checkpoints',
    else 1; None: no readable config.yaml."""
    record = run_record(run_dir)
    if not record:
        return None
    version = record.get(config_mod.VERSION_KEY) or checkpoint_version(run_dir) or 1
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def upgraded_from(run_dir: Path) -> int | None:
    """The schema version a run was begun in, where older than this mtrain's: its config.yaml's,
    or what the resume that upgraded it recorded; None: begun in this version."""
    since = run_record(run_dir).get(config_mod.UPGRADED)
    if isinstance(since, int) and not isinstance(since, bool):
        return since
    version = recorded_version(run_dir)
    return version if version is not None and version < config_mod.VERSION else None


def checkpoint_version(run_dir: Path) -> int | None:
    """The config schema a run's checkpoints record (last.pt's, else best.pt's): 1 for those
    written before they recorded one; None: no readable checkpoint."""
    for name in (LAST, BEST):
        try:
            return peek_checkpoint(run_dir / name).get("config_version", 1)
        except CheckpointError:
            continue
    return None


def trained_on(run_dir: Path) -> str | None:
    """The device type ("cuda", "cpu") a run's last.pt (else best.pt) was saved from: a
    checkpoint's tensors keep the device they were on; None: no readable checkpoint."""
    where: set[str] = set()

    def note(storage: Any, location: str) -> Any:
        where.add(location.split(":")[0])
        return storage

    for name in (LAST, BEST):
        try:
            torch.load(run_dir / name, map_location=note, weights_only=True, mmap=True)
        except Exception:  # absent, damaged or foreign: the next one, or unknown
            continue
        return "cuda" if "cuda" in where else "cpu"
    return None


def run_config(run_dir: Path) -> Config:
    """A run directory's config, in today's schema with the values the run used (its
    checkpoints say its schema where its config.yaml lost the line, and the device it trained
    on where a key's older value depends on it); refused where there is none."""
    path = run_dir / CONFIG_FILE
    if not path.is_file() and (run_dir / EXPORT_MODEL).is_file():
        raise CheckpointError(
            f"{run_dir}: a CTranslate2 export (written by mtrain export), not a run directory: "
            "translate it with --engine ctranslate2 (in Python: "
            'mtrain.load(path, engine="ctranslate2"))'
        )
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: not a run directory (no {CONFIG_FILE})")
    return config_mod.load_recorded(
        path, lambda: checkpoint_version(run_dir), lambda: trained_on(run_dir)
    )


def load_model(
    path: Path, cfg: Config, tokenizer: Tokenizer, device: torch.device
) -> tuple[Transformer, int]:
    """The model of checkpoint `path` (in eval mode) and the step it was saved at."""
    state = load_checkpoint(path)
    check_tokenizer(path, state, tokenizer.fingerprint())
    model = build_model(cfg, tokenizer)
    try:
        model.load_state_dict(state["model"])
    except (KeyError, RuntimeError) as e:
        reason = " ".join(str(e).split())[:200]
        raise CheckpointError(
            f"{path}: does not match the run's config and tokenizer ({reason})"
        ) from None
    return model.to(device).eval(), state["step"]


@dataclass
class LoadedRun:
    """A run's config, tokenizer and the model of one of its checkpoints (in eval mode)."""

    run_dir: Path
    cfg: Config
    tokenizer: Tokenizer
    model: Transformer
    checkpoint: Path
    step: int  # the training step the checkpoint was saved at


def load_run(run_dir: Path, device: torch.device, checkpoint: str = BEST) -> LoadedRun:
    """A run directory's config, tokenizer and checkpoint `checkpoint`'s model on `device`."""
    cfg = run_config(run_dir)
    tokenizer = Tokenizer.load(run_dir)
    path = resolve(run_dir, checkpoint)
    model, step = load_model(path, cfg, tokenizer, device)
    return LoadedRun(run_dir, cfg, tokenizer, model, path, step)


def latest_run(runs_root: Path) -> Path:
    """The run directory under `runs_root` whose best checkpoint was written last."""
    candidates = sorted(runs_root.glob(f"*/{BEST}"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise CheckpointError(f"no trained run under {runs_root}/; train one or pass --run DIR")
    return candidates[-1].parent


def training_summary(run_dir: Path) -> dict[str, Any]:
    """Steps, minutes and best dev BLEU from a run's logs, and the checkpoints it holds."""
    records = jsonl.read(run_dir / METRICS) + jsonl.read(run_dir / TRAIN_LOG)
    scored = [r for r in records if r.get("dev_bleu") is not None]
    best = max(scored, key=lambda r: r["dev_bleu"], default=None)
    logged = max((r["step"] for r in records), default=0)
    return {
        "steps": checkpoint_step(run_dir / LAST, logged),
        "minutes": max((r["minutes"] for r in records), default=0.0),
        "validations": sum(r.get("event", "validation") == "validation" for r in scored),
        "best_dev_bleu": None if best is None else best["dev_bleu"],
        "best_is_average": best is not None and best.get("event") == "average",
        "checkpoints": {p.name: p.stat().st_size for p in sorted(run_dir.glob("*.pt"))},
        "finished": finished_record(run_dir / LAST),
        "chosen": run_choices(run_dir),
    }


def checkpoint_step(path: Path, otherwise: int) -> int:
    """The step a checkpoint holds (read without its tensors); `otherwise` where it cannot
    be read (none yet, or damaged)."""
    try:
        return peek_checkpoint(path)["step"]
    except CheckpointError:
        return otherwise


def finished_record(path: Path) -> dict[str, Any] | None:
    """Why the run of last.pt `path` ended, and its learning rate then; None while it goes on
    (or unknown: no readable last.pt). Its tensors are not read."""
    try:
        finished = peek_checkpoint(path).get("finished")
    except CheckpointError:  # none yet, or damaged: `load_checkpoint` says why where it matters
        return None
    if finished is None:
        return None
    return {key: finished.get(key) for key in ("reason", "limit", "lr")}
