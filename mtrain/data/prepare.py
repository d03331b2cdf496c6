"""Preparing training corpora once: clean, train the tokenizer on a sample, encode in parallel,
and write flat token arrays that training reads a batch at a time, without holding the corpus."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from mtrain.core.config import Config
from mtrain.core.files import (
    recover_directory,
    remove_path,
    replace_directory,
    tmp_path,
    wait_for_lock,
)
from mtrain.data.corpus import DataError, corpora, fingerprint
from mtrain.data.encode_corpus import drops, encode_corpus
from mtrain.data.prepared import (
    FORMAT,
    MANIFEST,
    DamagedCorpus,
    check_prepared,
    data_digests,
    read_manifest,
    sha256,
    write_manifest,
)
from mtrain.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CGROUP = Path("/sys/fs/cgroup")


def prepared_dir(cfg: Config, tokenizer: Tokenizer | None = None) -> Path:
    """Where the training corpora of `cfg` are prepared: named for everything that shapes the
    prepared bytes, so another tokenizer or cleaning setting never reuses them. `tokenizer`:
    the corpora are encoded with these models (a parent run's), not with ones trained here."""
    stem = Path(corpora(cfg.data.train)[0].path).stem
    return Path(cfg.data.prepared_dir) / f"{stem}-{_key(cfg, tokenizer)}"


def _key(cfg: Config, tokenizer: Tokenizer | None) -> str:
    d, t = cfg.data, cfg.tokenizer
    shaping = {
        "format": FORMAT,
        "train": [list(map(str, c.files)) for c in corpora(d.train, d.swap_columns)],
        "swap": d.swap_columns,
        "heldout": [str(c) for key in ("dev", "test") for c in corpora(getattr(d, key))],
        "langs": [d.src_lang, d.tgt_lang],
        "lengths": [d.max_src_len, d.max_tgt_len, d.max_len_ratio],
        "tokenizer": vars(t) if tokenizer is None else tokenizer.fingerprint(),
    }
    return sha256(json.dumps(shaping, sort_keys=True))[:12]


def file_identity(path: Path, known: dict | None = None, hash_it: bool = True) -> dict:
    """Size, modification time and SHA-256 of a file. The hash (about 1 GB/s) is reused from
    `known` when size and modification time are unchanged, so a fresh check costs a `stat`;
    without `hash_it` it is left out, for a later pass over the file to fill in."""
    stat = path.stat()
    identity = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if known and all(known.get(k) == identity[k] for k in identity):
        return known
    return {**identity, "sha256": fingerprint(path)} if hash_it else identity


def _inputs(cfg: Config, manifest: dict | None = None) -> list[dict]:
    """Every input file's identity; hashed only where a (checked) manifest can be compared
    with it (a first prepare hashes its files as it samples them)."""
    comparable = manifest is not None
    known = {item["path"]: item for item in (manifest or {}).get("inputs", [])}
    return [file_identity(p, known.get(str(p)), comparable) for p in _input_paths(cfg)]


def _input_paths(cfg: Config) -> list[Path]:
    return [
        p
        for key in ("train", "dev", "test")
        for corpus in corpora(getattr(cfg.data, key))
        for p in corpus.files
    ]


def corpus_digests(cfg: Config) -> dict[str, str]:
    """The hashes a checkpoint holds of the corpora (`data_digests`), of the files of `cfg` as
    they are now, without preparing them: a file whose size and time the manifest of its
    corpus prepared with its own tokenizer records keeps the hash recorded there (a `stat`);
    any other (a parent's tokenizer's, a moved clone's) is hashed."""
    try:
        known = {i["path"]: i for i in read_manifest(prepared_dir(cfg))["inputs"]}
    except DamagedCorpus:  # none yet, or damaged: the files are hashed
        known = {}
    inputs = [file_identity(p, known.get(str(p))) for p in _input_paths(cfg)]
    train, dev = (
        sum(len(c.files) for c in corpora(getattr(cfg.data, k))) for k in ("train", "dev")
    )
    return data_digests({"inputs": inputs, "train_files": train, "dev_files": dev})


def is_prepared(directory: Path) -> bool:
    """Whether `directory` is a whole prepared corpus: its manifest is written last."""
    return (directory / MANIFEST).is_file()


def _is_fresh(manifest: dict | None, inputs: list[dict]) -> bool:
    """Whether a prepared corpus's (checked) manifest records these inputs."""
    if manifest is None:
        return False
    return [i.get("sha256") for i in inputs] == [i["sha256"] for i in manifest["inputs"]]


def _manifest_or_none(target: Path) -> dict | None:
    """The checked manifest of `target`; None where there is none yet, or where it is damaged
    (torn, another format, the wrong shape: said once, then prepared again)."""
    try:
        return read_manifest(target)
    except DamagedCorpus as e:
        if (target / MANIFEST).exists():
            log.warning("%s: %s; preparing it again", target, e.reason)
        return None


def prepare(
    cfg: Config,
    workers: int | None = None,
    repair: bool = False,
    progress: bool = True,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Prepare the training corpora of `cfg` unless they already are; return the directory.

    The work happens in a hidden temporary directory renamed into place when complete, under
    a lock, so an interrupted prepare is never taken for a finished one and two processes
    never prepare the same corpus at once. A prepared directory whose files disagree is
    refused, or with `repair` (`mtrain prepare`, which also reads every token file) prepared
    again. `progress`: bars on stderr. `tokenizer`: encode with it rather than train one.
    """
    target = prepared_dir(cfg, tokenizer)
    _make_root(Path(cfg.data.prepared_dir))
    with wait_for_lock(target.with_name(f".{target.name}.lock"), f"a prepare of {target}"):
        recover_directory(target, is_prepared, "prepared corpus")  # what a killed one left
        # The files as they are; a hash is recomputed only for a file whose stat changed.
        manifest = _manifest_or_none(target)
        inputs = _inputs(cfg, manifest)
        if _is_fresh(manifest, inputs):
            try:
                check_prepared(target, manifest, full=repair)
                _record_stat(target, manifest, inputs)
                return target
            except DamagedCorpus as e:
                if not repair:
                    raise
                log.warning("%s: damaged (%s); preparing it again", target, e.reason)
        try:
            manifest = _prepare(cfg, target, inputs, workers, progress, tokenizer)
        except OSError as e:  # a full disk, say: name the directory, not a hidden file in it
            if e.filename is None or f".{target.name}." in str(e.filename):
                raise OSError(e.errno, e.strerror, str(target)) from None
            raise
    log.info(
        "prepared %s in %.0f s (tokenizer %.0f s): %d pairs read, %d kept; %s; "
        "%d bad lines skipped; %d source and %d target tokens",
        target,
        manifest["seconds"]["total"],
        manifest["seconds"]["tokenizer"],
        manifest["pairs_read"],
        manifest["pairs"],
        drops(manifest["dropped"]),
        manifest["bad_lines"],
        manifest["tokens"]["src"],
        manifest["tokens"]["tgt"],
    )
    return target


def _make_root(root: Path) -> None:
    """Create data.prepared_dir, or say what stands in its way."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DataError(
            f"data.prepared_dir: {root} is a file, not a directory for prepared corpora"
        ) from None
    except NotADirectoryError:
        raise DataError(
            f"data.prepared_dir: {root}: a part of the path is a file, not a directory"
        ) from None


def _prepare(
    cfg: Config,
    target: Path,
    inputs: list[dict],
    workers: int | None,
    progress: bool,
    tokenizer: Tokenizer | None,
) -> dict:
    """Prepare into a temporary directory and rename it to `target`; return its manifest."""
    tmp = tmp_path(target)
    remove_path(tmp)
    tmp.mkdir()
    try:
        digests: dict[Path, Any] = {}
        cpus = workers or available_cpus()
        encoded = encode_corpus(cfg, tmp, cpus, progress, digests, tokenizer)
        _check_unchanged(inputs)
        for item in inputs:
            if "sha256" not in item:  # hashed while sampled, or a dev or test file
                digest = digests.get(Path(item["path"]))
                item["sha256"] = digest.hexdigest() if digest else fingerprint(Path(item["path"]))
        manifest = {"format": FORMAT, "inputs": inputs, **encoded}
        write_manifest(tmp, manifest)
        replace_directory(tmp, target)
    finally:
        remove_path(tmp)
    return manifest


def _check_unchanged(inputs: list[dict]) -> None:
    """Refuse a prepare whose input files changed while it read them."""
    for item in inputs:
        stat = Path(item["path"]).stat()
        if (stat.st_size, stat.st_mtime_ns) != (item["size"], item["mtime_ns"]):
            raise DataError(
                f"{item['path']} changed while it was being prepared; prepare again once "
                "nothing writes to it"
            )


def _record_stat(target: Path, manifest: dict, inputs: list[dict]) -> None:
    """Keep the stat of inputs touched but unchanged, so they are not hashed again at every
    start; a read-only prepared corpus keeps its manifest, and hashes them again."""
    if inputs == manifest["inputs"]:
        return
    try:
        write_manifest(target, {**manifest, "inputs": inputs})
    except OSError as e:
        log.debug("%s: cannot record the inputs' new times (%s)", target, e.strerror)


def available_cpus(cgroup: Path = CGROUP) -> int:
    """The CPUs this process may use: its affinity, bounded by a cgroup's CPU quota (a
    container's `--cpus`), which affinity does not show."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_quota(cgroup)
    return max(1, min(cpus or 1, math.ceil(quota))) if quota else cpus or 1


def _cgroup_quota(cgroup: Path) -> float | None:
    """CPUs' worth of time a cgroup allows (v2 `cpu.max`, or v1's quota and period)."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None
