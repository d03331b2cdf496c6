"""The JSON-lines logs of a run (metrics.jsonl, train.jsonl): one reader for every command.

A record is a JSON object with a whole-number "step" and a number of "minutes". A killed trainer
can leave the last line torn (no newline, cut mid-record): it is skipped with a warning. Any
other line that is not a record is an error that names the file and line.

A value that is not finite (a NaN dev loss) is written as null, which JSON has, not as NaN,
which it has not; one written by an older mtrain is read as null too.
"""

from __future__ import annotations

import json
import logging
import math
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtrain.core.errors import MtrainError
from mtrain.core.files import write_atomic

log = logging.getLogger(__name__)

REQUIRED = ("step", "minutes")
# When present: a number, or null for one that was not finite.
NUMBERS = ("loss", "lr", "dev_loss", "dev_bleu", "dev_chrf")


class LogError(MtrainError, ValueError):
    """A log line that is not a record; the message names the file and line."""


@dataclass
class Line:
    number: int
    text: str  # as written, newline included
    record: dict[str, Any]


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def dumps(record: dict[str, Any], ensure_ascii: bool = True) -> str:
    """One log line, newline included: JSON whose non-finite numbers are null."""
    try:
        text = json.dumps(record, ensure_ascii=ensure_ascii, allow_nan=False)
    except ValueError:  # rare: a diverged run; only then is the record walked
        text = json.dumps(_finite(record), ensure_ascii=ensure_ascii, allow_nan=False)
    return text + "\n"


def _finite(value: Any) -> Any:
    """`value` with every NaN and infinity, however deep, made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _no_constant(name: str) -> None:
    """NaN, Infinity and -Infinity, which older mtrain wrote: read as null."""
    return None


def parse(raw: bytes) -> dict[str, Any]:
    """The record one line holds; ValueError says why it holds none."""
    try:
        record = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except (ValueError, RecursionError):  # RecursionError: nested arrays thousands deep
        raise ValueError("not a JSON record") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {reprlib.repr(record)}")
    for key in REQUIRED:
        if key not in record:
            raise ValueError(f'no "{key}"')
    for key in REQUIRED:
        if not is_number(record[key]):
            raise ValueError(f'"{key}": expected a number, got {reprlib.repr(record[key])}')
    for key in NUMBERS:
        if record.get(key) is not None and not is_number(record[key]):
            raise ValueError(f'"{key}": expected a number, got {reprlib.repr(record[key])}')
    if not isinstance(record["step"], int) or record["step"] < 0:
        raise ValueError(f'"step": expected a whole number >= 0, got {record["step"]!r}')
    if not isinstance(record.get("event", ""), str):
        raise ValueError(f'"event": expected a string, got {reprlib.repr(record["event"])}')
    return record


def lines(path: Path, data: bytes, first: int = 1) -> list[Line]:
    """The records of a log's bytes `data` (its line `first` on), with their lines."""
    parts = data.split(b"\n")
    found = []
    for number, raw in enumerate(parts, first):
        if not raw.strip():
            continue
        try:
            record = parse(raw)
        except ValueError as e:
            if number == first + len(parts) - 1:  # no newline after it: a write cut short
                log.warning("%s:%d: skipped a torn last line (%s)", path, number, e)
                continue
            raise LogError(f"{path}:{number}: not a log record: {e}") from None
        found.append(Line(number, raw.decode("utf-8") + "\n", record))
    return found


def read_bytes(path: Path) -> bytes | None:
    """A log's bytes; None if it does not exist."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LogError(f"{path}: cannot read ({e.strerror})") from None


def read(path: Path) -> list[dict[str, Any]]:
    """The records of a log; none if it is absent."""
    data = read_bytes(path)
    return [] if data is None else [line.record for line in lines(path, data)]


def trim(path: Path, step: int) -> None:
    """Cut a log back to the records of steps up to `step`, where a resumed run goes on.

    Records written after the checkpoint it resumes from would be written again, and a torn
    last line would have the next record appended to it.
    """
    data = read_bytes(path)
    if data is None:
        return
    kept = "".join(line.text for line in lines(path, data) if line.record["step"] <= step)
    if kept.encode("utf-8") != data:
        write_atomic(path, kept)
