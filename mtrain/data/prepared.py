"""The prepared-corpus format, owned here alone: its file names and dtypes, the manifest (read and
checked by `read_manifest`), what the writer (`prepare.py`, `encode_corpus.py`) writes and the
checks the reader (`token_corpus.TokenCorpus`) relies on.
No torch here: `mtrain prepare` stays light.

A prepared directory holds, per side (`src`, `tgt`): `SIDE.bin`, every pair's token ids one
after another; `SIDE_len.npy`, each pair's length (uint16); `SIDE_offsets.npy`, where each pair
starts (int64, one more than the pairs). The source side ends each pair with </s>. Beside them:
the tokenizer's models and `manifest.json`, which records the inputs, counts, dtype, checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from mtrain.core.files import write_atomic
from mtrain.data.corpus import DataError, fingerprint

FORMAT = 1  # of the prepared directory; a change makes every prepared corpus stale
MANIFEST = "manifest.json"
SIDES = ("src", "tgt")
LENGTH_DTYPE = np.dtype(np.uint16)  # of each pair's length, a side's tokens
OFFSET_DTYPE = np.dtype(np.int64)  # of where each pair starts in its token file


def lengths_name(side: str) -> str:
    """The file of one side's pair lengths."""
    return f"{side}_len.npy"


def offsets_name(side: str) -> str:
    """The file of where each of one side's pairs starts in its token file."""
    return f"{side}_offsets.npy"


TOKEN_FILES = tuple(
    name for side in SIDES for name in (f"{side}.bin", lengths_name(side), offsets_name(side))
)
UINT16_IDS = 1 << 16  # vocabularies up to this size store their ids as uint16, larger as int32
# Every key a manifest of this format holds, and its type; "vocab" and "files" are optional
# (corpora prepared before they were recorded).
MANIFEST_KEYS: dict[str, type] = {
    "format": int,
    "inputs": list,
    "train_files": int,
    "dev_files": int,
    "dtype": str,
    "pairs": int,
    "tokens": dict,
    "tokenizer": str,
}
INPUT_KEYS: dict[str, type] = {"path": str, "size": int, "mtime_ns": int, "sha256": str}


class DamagedCorpus(DataError):
    """A prepared directory whose files disagree with each other; the message names it once,
    says why once, and what to do once."""

    def __init__(self, directory: Path, reason: str):
        super().__init__(
            f"{directory}: damaged prepared corpus: {reason}; `mtrain prepare` prepares it again"
        )
        self.reason = reason


# The manifest.


def read_manifest(directory: Path) -> dict:
    """The manifest of a prepared corpus, checked: a JSON object of this format with every key,
    each of its type. Anything else (missing, torn, another format, `[]`, a key missing or of
    the wrong type) is a DamagedCorpus, which `mtrain prepare` prepares again."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DamagedCorpus(directory, f"{MANIFEST} cannot be read ({_reason(e)})") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise DamagedCorpus(directory, f"{MANIFEST} {problem}")
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    """What is wrong with a parsed manifest, or None."""
    if not isinstance(manifest, dict):
        return f"holds {type(manifest).__name__}, not an object"
    if manifest.get("format") != FORMAT:
        return f"is of format {manifest.get('format')!r}; this mtrain reads format {FORMAT}"
    for key, kind in MANIFEST_KEYS.items():
        if not _is(manifest.get(key), kind):
            return f"has no {key} of type {kind.__name__}"
    for item in manifest["inputs"]:
        if not (isinstance(item, dict) and all(_is(item.get(k), t) for k, t in INPUT_KEYS.items())):
            return "has an input that is not {path, size, mtime_ns, sha256}"
    for key in ("tokens", "vocab"):
        counts = manifest.get(key, {"src": 0, "tgt": 0})
        if not isinstance(counts, dict) or not all(_is(counts.get(s), int) for s in SIDES):
            return f"has no {key} of each side"
    if not isinstance(manifest.get("files", {}), dict):
        return "has no files checksums"
    try:
        if np.dtype(manifest["dtype"]).kind not in "iu":
            return f"names dtype {manifest['dtype']}, not an integer type"
    except TypeError:
        return f"names dtype {manifest['dtype']!r}, which numpy does not know"
    return None


def _is(value: Any, kind: type) -> bool:
    """isinstance, but a bool is no int (JSON's true is not a count)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def write_manifest(directory: Path, manifest: dict) -> None:
    """Write a prepared corpus's manifest atomically."""
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def vocab_sizes(directory: Path, manifest: dict) -> dict[str, int]:
    """Each side's vocabulary size: the manifest's, or its tokenizer's where it records none."""
    if "vocab" in manifest:
        return manifest["vocab"]
    from mtrain.data.tokenizer import Tokenizer  # light: SentencePiece, no torch

    return Tokenizer.load(directory).vocab_sizes()


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
        digests[key] = hashes[0] if len(hashes) == 1 else sha256("".join(hashes))
    return digests


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# The writer.


def token_dtype(vocab: dict[str, int]) -> np.dtype:
    """The dtype of the token files of a tokenizer with these vocabulary sizes."""
    return np.dtype(np.int32 if max(vocab.values()) > UINT16_IDS else np.uint16)


def token_file(directory: Path, side: str) -> Path:
    """The file of one side's token ids, pair after pair."""
    return directory / f"{side}.bin"


def compact(out: Path, lengths: np.ndarray, keep: np.ndarray, dtype: Any) -> None:
    """Rewrite the token files without the pairs `keep` drops, a bounded slice at a time."""
    for side, column in (("src", 0), ("tgt", 1)):
        tokens = np.memmap(token_file(out, side), dtype=dtype, mode="r")
        ends = np.cumsum(lengths[:, column], dtype=np.int64)
        with (out / f"{side}.new").open("wb") as f:
            step = 1 << 20
            for first in range(0, len(lengths), step):
                last = min(first + step, len(lengths))
                begin = ends[first - 1] if first else 0
                part_keep = np.repeat(keep[first:last], lengths[first:last, column])
                f.write(np.asarray(tokens[begin : ends[last - 1]])[part_keep].tobytes())
        del tokens
        os.replace(out / f"{side}.new", token_file(out, side))


def write_lengths(out: Path, lengths: np.ndarray) -> dict[str, str]:
    """Each side's lengths and offsets into its token file, then every file made durable;
    return the token files' SHA-256 by name, which `mtrain prepare` verifies."""
    for side, column in (("src", 0), ("tgt", 1)):
        np.save(out / lengths_name(side), lengths[:, column].astype(LENGTH_DTYPE))
        offsets = np.zeros(len(lengths) + 1, OFFSET_DTYPE)
        np.cumsum(lengths[:, column], out=offsets[1:])
        np.save(out / offsets_name(side), offsets)
    checksums = {}
    for name in TOKEN_FILES:
        with (out / name).open("rb+") as f:
            os.fsync(f.fileno())
        checksums[name] = fingerprint(out / name)
    return checksums


# The checks.


def check_prepared(
    directory: Path, manifest: dict, lengths: dict[str, np.ndarray] | None = None, full=False
) -> None:
    """Raise DamagedCorpus unless the token files agree with each other and with the manifest:
    lengths, offsets, token file sizes and counts; `full` also reads every token file to check
    its checksum and that every id is within the vocabulary. `lengths`: those already loaded."""
    try:
        _check_files(directory, manifest, lengths or {})
        if full:
            _check_contents(directory, manifest)
    except DamagedCorpus:
        raise
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise DamagedCorpus(directory, f"cannot read it ({_reason(e)})") from None


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename:
        return f"{Path(e.filename).name}: {e.strerror}"
    return " ".join(str(e).split())[:200] or type(e).__name__


def load_array(directory: Path, name: str, mmap: bool = False) -> np.ndarray:
    """One array file of a prepared corpus; DamagedCorpus if it cannot be read whole."""
    try:
        return np.load(directory / name, mmap_mode="r" if mmap else None)
    except (OSError, ValueError, EOFError) as e:  # truncated: numpy's header, mmap, or reshape
        raise DamagedCorpus(
            directory, f"{name} is truncated or unreadable ({_reason(e)})"
        ) from None


def load_lengths(directory: Path, side: str, mmap: bool = False) -> np.ndarray:
    """(N,) one side's pair lengths (the source's with </s>)."""
    return load_array(directory, lengths_name(side), mmap=mmap)


def load_offsets(directory: Path, side: str) -> np.ndarray:
    """(N + 1,) where each of one side's pairs starts, mapped; DamagedCorpus unless int64."""
    offsets = load_array(directory, offsets_name(side), mmap=True)
    if offsets.dtype != OFFSET_DTYPE:
        why = f"{offsets_name(side)} holds {offsets.dtype}, not {OFFSET_DTYPE} offsets"
        raise DamagedCorpus(directory, why)
    return offsets


def _check_files(directory: Path, manifest: dict, lengths: dict) -> None:
    dtype = np.dtype(manifest["dtype"])
    n = manifest["pairs"]
    for side in SIDES:
        length = lengths.get(side)
        if length is None:
            length = load_lengths(directory, side, mmap=True)
        if length.shape != (n,) or length.dtype != LENGTH_DTYPE:
            held = f"{length.shape} {length.dtype}, not ({n},) {LENGTH_DTYPE}"
            raise DamagedCorpus(directory, f"{lengths_name(side)} holds {held}")
        tokens = manifest["tokens"][side]
        if int(length.sum(dtype=np.int64)) != tokens:
            raise DamagedCorpus(directory, f"{lengths_name(side)} does not sum to {tokens} tokens")
        size = token_file(directory, side).stat().st_size
        if size != tokens * dtype.itemsize:
            expected = tokens * dtype.itemsize
            raise DamagedCorpus(directory, f"{side}.bin has {size} bytes, not {expected}")
        offsets = load_offsets(directory, side)
        if offsets.shape != (n + 1,):
            raise DamagedCorpus(directory, f"{offsets_name(side)} holds {offsets.shape} offsets")
        # A slice at a time: the whole of a large corpus's offsets would stay resident.
        start, step = 0, 1 << 20
        for first in range(0, n + 1, step):
            part = np.asarray(offsets[first : first + step])  # offsets[first] is `start`
            ends = np.cumsum(length[first : first + len(part) - 1], dtype=np.int64) + start
            if part[0] != start or not np.array_equal(part[1:], ends):
                why = f"{offsets_name(side)} disagrees with {lengths_name(side)}"
                raise DamagedCorpus(directory, why)
            start = int(ends[-1]) if len(ends) else start
            if first + len(part) - 1 < n:  # the next slice starts after this one's last pair
                start += int(length[first + len(part) - 1])
        del offsets


def _check_contents(directory: Path, manifest: dict) -> None:
    """Every token file's checksum, and every token id within its vocabulary."""
    dtype = np.dtype(manifest["dtype"])
    for name, checksum in manifest.get("files", {}).items():
        if fingerprint(directory / name) != checksum:
            raise DamagedCorpus(directory, f"{name} does not match its checksum")
    vocab = vocab_sizes(directory, manifest)
    for side in SIDES:
        with token_file(directory, side).open("rb") as f:
            while chunk := f.read(1 << 24):
                ids = np.frombuffer(chunk, dtype)
                if len(ids) and int(ids.max()) >= vocab[side]:
                    raise DamagedCorpus(
                        directory, f"{side}.bin holds ids past its vocabulary of {vocab[side]}"
                    )
