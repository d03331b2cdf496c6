"""Parallel corpora on disk: TSV files or line-aligned pairs of files, plain or compressed.

A corpus in a config is a TSV file (`src<TAB>tgt`, or Tatoeba's `id<TAB>src<TAB>id<TAB>tgt`), or
a mapping `{src: FILE, tgt: FILE}` of two files with one sentence a line. Files ending in `.gz`
or `.xz` are decompressed as they are read.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import logging
import lzma
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from mtrain.core.errors import MtrainError
from mtrain.data.text import normalize

log = logging.getLogger(__name__)
OPENERS = {".gz": gzip.open, ".xz": lzma.open}


class DataError(MtrainError, ValueError):
    """A corpus that cannot be read; the message names the file and line."""


class BadLine(ValueError):
    """One line that cannot be read as a sentence pair; the message says why."""


@dataclass(frozen=True)
class Corpus:
    """One parallel corpus: a TSV file, or a source and a target file aligned line by line."""

    path: Path  # the TSV file, or the source file of a pair
    tgt_path: Path | None = None  # the target file of a pair
    swap: bool = False  # a TSV holding target<TAB>source

    @property
    def files(self) -> tuple[Path, ...]:
        return (self.path,) if self.tgt_path is None else (self.path, self.tgt_path)

    def __str__(self) -> str:
        return " + ".join(map(str, self.files))


def corpora(spec: Any, swap: bool = False) -> list[Corpus]:
    """The corpora a validated config value names: one corpus or a list of them."""
    items = spec if isinstance(spec, list) else [spec]
    return [
        Corpus(Path(item), swap=swap)
        if isinstance(item, str)
        else Corpus(Path(item["src"]), Path(item["tgt"]))
        for item in items
    ]


def resolve(spec: Any) -> Any:
    """The same config value with every file path made absolute (a run works from anywhere)."""
    if isinstance(spec, list):
        return [resolve(item) for item in spec]
    if isinstance(spec, dict):
        return {side: str(Path(path).resolve()) for side, path in spec.items()}
    return str(Path(spec).resolve())


# What a path that is not a regular file is, for the message that refuses it.
FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_files(spec: Any, key: str) -> None:
    """Raise DataError naming `key` unless every file of the corpora is a readable file: a
    corpus is read more than once, so a pipe or a device cannot be one."""
    for corpus in corpora(spec):
        for path in corpus.files:
            try:
                mode = path.stat().st_mode
            except OSError:
                raise DataError(f"{key}: no such file {path}") from None
            for is_kind, kind in FILE_KINDS:
                if is_kind(mode):
                    raise DataError(f"{key}: {path} is {kind}, not a corpus file")


class _Hashing(io.RawIOBase):
    """A file's bytes as stored, passed on and hashed as they are read."""

    def __init__(self, f: IO[bytes], digest: Any):
        self.f, self.digest = f, digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.f.readinto(buffer)
        self.digest.update(memoryview(buffer)[:n])
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


def open_binary(path: Path) -> IO[bytes]:
    """Open a corpus file for reading bytes, decompressing `.gz` and `.xz` files."""
    try:
        return OPENERS.get(path.suffix, open)(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def _lines(path: Path, digests: dict[Path, Any] | None = None) -> Iterator[bytes]:
    """The lines of a file; `digests` gains the SHA-256 of its stored bytes, read on the way."""
    if digests is None:
        stored = contextlib.nullcontext()
        text = open_binary(path)
    else:
        digest = digests.setdefault(path, hashlib.sha256())
        try:
            stored = io.BufferedReader(_Hashing(path.open("rb", buffering=0), digest), 1 << 20)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror})") from None
        opener = OPENERS.get(path.suffix)
        text = opener(stored, "rb") if opener else stored
    with stored, text:
        try:
            yield from text
            if digests is not None:  # bytes past the last compressed member count too
                while stored.read(1 << 20):
                    pass
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:  # a damaged archive
            raise DataError(f"{path}: cannot read ({e})") from None


def raw_lines(
    corpus: Corpus, digests: dict[Path, Any] | None = None
) -> Iterator[tuple[int, bytes, bytes | None]]:
    """Yield (line number, line, target line or None) as bytes; a pair of files must have as
    many lines as each other. `digests` gains each file's SHA-256 of its stored bytes."""
    if corpus.tgt_path is None:
        for number, line in enumerate(_lines(corpus.path, digests), 1):
            yield number, line, None
        return
    src, tgt = _lines(corpus.path, digests), _lines(corpus.tgt_path, digests)
    number = 0
    for number, src_line in enumerate(src, 1):
        tgt_line = next(tgt, None)
        if tgt_line is None:
            src_count = number + sum(1 for _ in src)
            raise DataError(
                f"{corpus.path} has {src_count} lines but {corpus.tgt_path} has {number - 1}: "
                "a source and a target file must have one line each per sentence pair"
            )
        yield number, src_line, tgt_line
    extra = sum(1 for _ in tgt)
    if extra:
        raise DataError(
            f"{corpus.path} has {number} lines but {corpus.tgt_path} has {number + extra}: "
            "a source and a target file must have one line each per sentence pair"
        )


def decode_line(raw: bytes, first: bool) -> str:
    """One line of a UTF-8 file without its line end; a BOM on the first line is dropped."""
    try:
        return raw.decode("utf-8-sig" if first else "utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise BadLine("not valid UTF-8") from None


def parse(number: int, line: bytes, tgt_line: bytes | None, swap: bool) -> tuple[str, str]:
    """The (source, target) text of one raw line or line pair; raises BadLine."""
    if tgt_line is not None:
        return decode_line(line, number == 1), decode_line(tgt_line, number == 1)
    fields = decode_line(line, number == 1).split("\t")
    if len(fields) not in (2, 4):
        raise BadLine(f"expected 2 or 4 tab-separated columns, got {len(fields)}")
    src, tgt = (fields[0], fields[1]) if len(fields) == 2 else (fields[1], fields[3])
    return (tgt, src) if swap else (src, tgt)


def read_line(
    number: int, line: bytes, tgt_line: bytes | None, swap: bool, src_lang: str, tgt_lang: str
) -> tuple[str, str] | None:
    """The text pipeline every corpus reader shares: one raw line (or line pair) parsed and
    normalised into (source, target); None for a blank line of a TSV. Raises BadLine. A pair
    with an empty side is returned as it is: each reader decides with `usable`."""
    if tgt_line is None and not line.strip():
        return None
    src, tgt = parse(number, line, tgt_line, swap)
    return normalize(src, src_lang), normalize(tgt, tgt_lang)


def usable(src: str, tgt: str) -> bool:
    """Whether a normalised pair can be trained on: neither side is empty."""
    return bool(src and tgt)


def read_pairs(
    corpus: Corpus, src_lang: str, tgt_lang: str, scored: bool = False
) -> list[tuple[str, str]]:
    """Read a whole (small: dev or test) corpus into normalised pairs; blank lines are skipped
    and any bad line is an error naming the file and line. A corpus to be `scored` warns of
    its pairs with an empty side, naming the first: they are scored as they are, an empty
    reference included."""
    pairs, empty = [], []
    for number, line, tgt_line in raw_lines(corpus):
        try:
            pair = read_line(number, line, tgt_line, corpus.swap, src_lang, tgt_lang)
        except BadLine as e:
            raise DataError(f"{corpus.path}:{number}: {e}") from None
        if pair is None:  # a blank line of a TSV
            continue
        if not usable(*pair):
            empty.append(number)
        pairs.append(pair)
    if scored and empty:
        log.warning(
            "%s:%d: a sentence pair with an empty side (%d in the file); scored as it is",
            corpus.path,
            empty[0],
            len(empty),
        )
    return pairs


def fingerprint(path: Path) -> str:
    """SHA-256 of a file's bytes as stored (compressed files are not decompressed)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
