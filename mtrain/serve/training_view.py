"""The page's training view: a run's curves and example translations, read from logs that may
still be written.

A log is read incrementally: at each look only the bytes appended since are parsed; a file that
shrank, was replaced, or was rewritten in place (the bytes just before where the last look
stopped differ; a resumed run's trim) is read again from its start. A last line without its
newline is a record still being written, not an error: it is left for the next look. A line
longer than the read window is skipped, and said once. Missing files (no validation yet) read as
no records; a line that is not a record leaves the last good reading in place and is reported
once; only regular files are opened (a FIFO would hang the request). An example's attention maps
stay on disk until one is asked for: the view keeps where each validation's line lies in
examples.jsonl, and reads that line again.

Requests read the view from worker threads at once: a log is looked at by one thread at a time,
and each look publishes a whole new `Reading`, so a request works from one reading throughout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mtrain.core import jsonl
from mtrain.core.files import Stamp
from mtrain.run.directory import EXAMPLES, METRICS, TRAIN_LOG

log = logging.getLogger(__name__)

HEAVY = ("attention", "src_pieces", "tgt_pieces")  # an example's keys left on disk until asked
READ_CHUNK = 1 << 24  # bytes parsed per look at most: a huge log is caught up over a few looks
TAIL = 4096  # bytes before where the last look stopped, compared at each look


@dataclass(frozen=True)
class Reading:
    """A log's records as one look left them; a new look makes a new one."""

    records: tuple[dict[str, Any], ...] = ()
    spans: tuple[tuple[int, int], ...] = ()  # each record's (offset, length) in the file
    error: str | None = None  # the line that stopped the reading
    skipped: int = 0  # lines over READ_CHUNK bytes, left out
    version: int = 0  # one more at each change


class LogFile:
    """One JSON-lines log and its records as last read; `light` drops examples' heavy keys."""

    def __init__(self, path: Path, light: bool = False):
        self.path, self.light = path, light
        self.reading = Reading()
        self._lock = threading.Lock()  # one look at a time: two would read the same bytes
        self._inode: int | None = None  # of the file read
        self._stamp: Stamp | None = None  # of the file at the last look; None: look again
        self._offset = 0  # bytes read whole, up to a newline
        self._line = 1  # the number of the line at `_offset`
        self._tail = b""  # the TAIL bytes before `_offset`, as read
        self._skipping = False  # `_offset` is within a line over READ_CHUNK bytes

    @property
    def records(self) -> tuple[dict[str, Any], ...]:
        return self.reading.records

    @property
    def error(self) -> str | None:
        return self.reading.error

    def refresh(self) -> bool:
        """Read what was appended to the log since the last look; True if it changed."""
        with self._lock:
            before = self.reading
            try:
                data = self._read_new()
            except jsonl.LogError as e:  # keep the last good records
                self._fail(str(e))
            else:
                if data is not None:
                    self._take(data)
            return self.reading is not before

    def _read_new(self) -> bytes | None:
        """At most READ_CHUNK bytes from `_offset`, after starting again from the file's start
        if it is not the file read so far; None if it has not changed since the last look."""
        f = _open(self.path)
        if f is None:  # gone (or not written yet)
            self._restart()
            return None
        with f:
            st = os.fstat(f.fileno())
            now = Stamp(st.st_ino, st.st_size, st.st_mtime_ns)
            # replaced, cut back (a resumed run's trim) or rewritten in place: from the start
            if now.inode != self._inode or now.size < self._offset or self._rewritten(f):
                self._restart()
                self._inode = now.inode
            elif now == self._stamp:
                return None
            self._stamp = now
            f.seek(self._offset)
            data = f.read(READ_CHUNK)
        if len(data) == READ_CHUNK:
            self._stamp = None  # more to read at the next look
        return data

    def _rewritten(self, f: BinaryIO) -> bool:
        """Whether the bytes before `_offset` are not those read there."""
        f.seek(self._offset - len(self._tail))
        return f.read(len(self._tail)) != self._tail

    def _take(self, data: bytes) -> None:
        """Parse the whole lines of `data`, the bytes at `_offset`, and publish them."""
        if self._skipping:  # the rest of a line over READ_CHUNK bytes
            end = data.find(b"\n")
            self._advance(data if end < 0 else data[: end + 1], 1 if end >= 0 else 0)
            if end < 0:
                return
            self._skipping, data = False, data[end + 1 :]
        elif len(data) == READ_CHUNK and b"\n" not in data:
            log.warning(
                "mtrain serve: %s:%d: a line over %d bytes: skipped",
                self.path,
                self._line,
                READ_CHUNK,
            )
            self._skipping = True
            self._publish(skipped=self.reading.skipped + 1)
            self._advance(data, 0)
            return
        finished = data[: data.rfind(b"\n") + 1]  # a live writer's last line may be half out
        try:
            found = jsonl.lines(self.path, finished, self._line)
        except jsonl.LogError as e:
            self._fail(str(e))
            return
        starts = [0] + [i + 1 for i, byte in enumerate(finished) if byte == 10]
        spans = [
            (self._offset + starts[x.number - self._line], len(x.text.encode())) for x in found
        ]
        records = [_light(x.record) if self.light else x.record for x in found]
        if found or self.reading.error is not None:
            r = self.reading
            self._publish(
                records=r.records + tuple(records), spans=r.spans + tuple(spans), error=None
            )
        self._advance(finished, finished.count(b"\n"))

    def _advance(self, read: bytes, lines: int) -> None:
        self._offset += len(read)
        self._line += lines
        self._tail = (self._tail + read[-TAIL:])[-TAIL:]

    def _restart(self) -> None:
        self._inode = self._stamp = None
        self._offset, self._line, self._tail, self._skipping = 0, 1, b"", False
        r = self.reading
        if r.records or r.error or r.skipped:
            self.reading = Reading(version=r.version + 1)

    def _fail(self, message: str) -> None:
        if self.reading.error != message:
            log.warning("mtrain serve: %s", message)
            self._publish(error=message)

    def _publish(self, **changes: Any) -> None:
        r = self.reading
        self.reading = dataclasses.replace(r, **changes, version=r.version + 1)

    def record_at(self, span: tuple[int, int]) -> dict[str, Any] | None:
        """The record whole at `span` (offset, length), read again; None if it is unreadable."""
        offset, length = span
        try:
            f = _open(self.path)
        except jsonl.LogError:
            return None
        if f is None:
            return None
        with f:
            f.seek(offset)
            try:
                return jsonl.parse(f.read(length).rstrip(b"\n"))
            except ValueError:
                return None


def _open(path: Path) -> BinaryIO | None:
    """The log open for reading; None if it is absent; LogError if it is no regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise jsonl.LogError(f"{path}: cannot read ({e.strerror})") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise jsonl.LogError(f"{path}: not a regular file")
    return f


def _light(record: dict[str, Any]) -> dict[str, Any]:
    """A validation line's record without its examples' attention and pieces."""
    items = record.get("examples")
    if not isinstance(items, list):
        return record
    kept = [
        {k: v for k, v in ex.items() if k not in HEAVY} if isinstance(ex, dict) else ex
        for ex in items
    ]
    return {**record, "examples": kept}


@dataclass(frozen=True)
class Snapshot:
    """What /training answers: the JSON body and its version."""

    body: bytes
    etag: str
    versions: tuple[int, ...] = ()  # of the logs' readings it was made from


class TrainingView:
    """A run directory's logs as the page draws them."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.train = LogFile(run_dir / TRAIN_LOG)
        self.metrics = LogFile(run_dir / METRICS)
        self.examples = LogFile(run_dir / EXAMPLES, light=True)
        self.snapshot: Snapshot | None = None
        self._lock = threading.Lock()  # one snapshot made at a time, never an older one after

    def read(self) -> Snapshot:
        """The curves and example translations now; built again only when a log changed."""
        logs = (self.train, self.metrics, self.examples)
        for f in logs:
            f.refresh()
        with self._lock:
            readings = tuple(f.reading for f in logs)
            versions = tuple(r.version for r in readings)
            if self.snapshot is None or self.snapshot.versions != versions:
                body = json.dumps(self._view(*readings), ensure_ascii=False, separators=(",", ":"))
                data = body.encode("utf-8")
                etag = '"' + hashlib.sha1(data).hexdigest()[:16] + '"'
                self.snapshot = Snapshot(data, etag, versions)
            return self.snapshot

    def _view(self, train: Reading, metrics: Reading, examples: Reading) -> dict[str, Any]:
        steps = [r for r in train.records if r.get("event", "train") == "train"]
        validations = [
            {k: r.get(k) for k in ("event", "step", "minutes", "dev_loss", "dev_bleu", "dev_chrf")}
            for r in metrics.records
            if r.get("event", "validation") in ("validation", "average") and "dev_bleu" in r
        ]
        errors = [r.error for r in (train, metrics, examples) if r.error]
        for f, r in zip((self.train, self.metrics, self.examples), (train, metrics, examples)):
            if r.skipped:
                lines = "line" if r.skipped == 1 else "lines"
                errors.append(f"{f.path}: {r.skipped} {lines} over {READ_CHUNK} bytes skipped")
        return {
            "run": str(self.run_dir),
            "train": {k: [r.get(k) for r in steps] for k in ("step", "minutes", "loss", "lr")},
            "validations": validations,
            "examples": _examples(examples.records),
            "errors": errors,
        }

    def attention(self, validation: int, source: str) -> dict[str, Any] | None:
        """One example's pieces and cross-attention at the `validation`-th line; None if absent."""
        self.examples.refresh()
        reading = self.examples.reading
        if not 0 <= validation < len(reading.records):
            return None
        step = reading.records[validation]["step"]
        whole = self.examples.record_at(reading.spans[validation]) or {}
        if whole.get("step") != step:  # the file changed since this reading
            return None
        for ex in _items(whole):
            if ex["source"] == source:
                return {
                    "step": step,
                    "source": source,
                    "translation": ex.get("translation"),
                    "src_pieces": ex.get("src_pieces") or [],
                    "tgt_pieces": ex.get("tgt_pieces") or [],
                    "attention": ex.get("attention") or [],  # [layer][head][tgt][src]
                }
        return None


def _examples(records: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """Each example (by source, in order of first appearance) and its translation at each
    validation; attention is fetched one map at a time."""
    sources: dict[str, str | None] = {}  # source -> reference
    for record in records:
        for ex in _items(record):
            sources.setdefault(ex["source"], ex.get("reference"))
    order = {s: i for i, s in enumerate(sources)}
    rows = []
    for record in records:
        texts: list[str | None] = [None] * len(order)
        for ex in _items(record):
            texts[order[ex["source"]]] = ex.get("translation")
        rows.append(
            {
                "step": record["step"],
                "minutes": record["minutes"],
                "event": record.get("event", "validation"),
                "translations": texts,
            }
        )
    return {"sources": list(sources), "references": list(sources.values()), "validations": rows}


def _items(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A validation line's examples, those without a source string left out."""
    items = record.get("examples")
    if not isinstance(items, list):
        return []
    return [ex for ex in items if isinstance(ex, dict) and isinstance(ex.get("source"), str)]
