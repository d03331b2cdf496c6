"""Preparing training corpora once: clean, train the tokenizer on a sample, encode in parallel,
and write flat token arrays that training reads a batch at a time, without holding the corpus."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from mtrain.config import Config
from mtrain.corpus import corpora, fingerprint
from mtrain.encode_corpus import drops, encode_corpus
from mtrain.files import fcntl, sync_directory, write_atomic

log = logging.getLogger(__name__)

FORMAT = 1  # of the prepared directory; a change makes every prepared corpus stale
MANIFEST = "manifest.json"


def prepared_dir(cfg: Config) -> Path:
    """Where the training corpora of `cfg` are prepared: named for everything that shapes the
    prepared bytes, so another tokenizer or cleaning setting never reuses them."""
    return Path(cfg.data.prepared_dir) / f"{Path(corpora(cfg.data.train)[0].path).stem}-{_key(cfg)}"


def _key(cfg: Config) -> str:
    d, t = cfg.data, cfg.tokenizer
    shaping = {
        "format": FORMAT,
        "train": [list(map(str, c.files)) for c in corpora(d.train, d.swap_columns)],
        "swap": d.swap_columns,
        "heldout": [str(c) for key in ("dev", "test") for c in corpora(getattr(d, key))],
        "langs": [d.src_lang, d.tgt_lang],
        "lengths": [d.max_src_len, d.max_tgt_len, d.max_len_ratio],
        "tokenizer": vars(t),
    }
    return _sha256(json.dumps(shaping, sort_keys=True))[:12]


def file_identity(path: Path, known: dict | None = None) -> dict:
    """Size, modification time and SHA-256 of a file. The hash (about 1 GB/s) is reused from
    `known` when size and modification time are unchanged, so a fresh check costs a `stat`."""
    stat = path.stat()
    identity = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if known and all(known.get(k) == identity[k] for k in identity):
        return known
    return {**identity, "sha256": fingerprint(path)}


def _inputs(cfg: Config, manifest: dict | None = None) -> list[dict]:
    known = {item["path"]: item for item in (manifest or {}).get("inputs", [])}
    paths = [
        p
        for key in ("train", "dev", "test")
        for corpus in corpora(getattr(cfg.data, key))
        for p in corpus.files
    ]
    return [file_identity(p, known.get(str(p))) for p in paths]


def _read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_fresh(manifest: dict | None, inputs: list[dict]) -> bool:
    """Whether a prepared corpus's manifest records these inputs, in this format."""
    if manifest is None or manifest.get("format") != FORMAT:
        return False
    return [i["sha256"] for i in inputs] == [i["sha256"] for i in manifest["inputs"]]


def identity(manifest: dict) -> dict:
    """What makes two prepared corpora the same, on any machine: inputs, tokenizer, output."""
    keys = ("format", "dtype", "pairs", "tokens", "tokenizer")
    return {"inputs": [i["sha256"] for i in manifest["inputs"]]} | {k: manifest[k] for k in keys}


def data_digests(manifest: dict) -> dict[str, str]:
    """A hash of the training files' contents, one of the dev files' and one of the test
    files' (training pairs whose source is a dev or test source are dropped), for checkpoints;
    a single file's is its own SHA-256, as checkpoints recorded before corpora were prepared."""
    n_train, n_dev = manifest["train_files"], manifest["dev_files"]
    digests = {}
    for key, inputs in (
        ("train", manifest["inputs"][:n_train]),
        ("dev", manifest["inputs"][n_train : n_train + n_dev]),
        ("test", manifest["inputs"][n_train + n_dev :]),
    ):
        hashes = [i["sha256"] for i in inputs]
        digests[key] = hashes[0] if len(hashes) == 1 else _sha256("".join(hashes))
    return digests


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def prepare(cfg: Config, workers: int | None = None) -> Path:
    """Prepare the training corpora of `cfg` unless they already are; return the directory.

    The work happens in a hidden temporary directory renamed into place when complete, under
    a lock, so an interrupted prepare is never taken for a finished one and two processes
    never prepare the same corpus at once.
    """
    target = prepared_dir(cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.with_name(f".{target.name}.lock")):
        # The files as they are; a hash is recomputed only for a file whose stat changed.
        manifest = _read_manifest(target)
        inputs = _inputs(cfg, manifest)
        if _is_fresh(manifest, inputs):
            return target
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        for pattern in (f".{target.name}.*.tmp", f".{target.name}.*.old"):
            for stale in target.parent.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)  # left by a killed prepare
        tmp.mkdir()
        try:
            workers = workers or len(os.sched_getaffinity(0))
            manifest = {"format": FORMAT, "inputs": inputs, **encode_corpus(cfg, tmp, workers)}
            write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
            _replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel however the holder ends
        yield


def _replace_dir(new: Path, target: Path) -> None:
    old = target.with_name(f".{target.name}.{os.getpid()}.old")
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)
    sync_directory(target.parent)  # make the renames durable
