"""The page's training view: a run's curves and example translations, read from logs that may
still be written.

A log is read incrementally: at each look only the bytes appended since are parsed (a file that
shrank or was replaced, as a resumed run trims it, is read again from its start). A last line
without its newline is a record still being written, not an error: it is left for the next
look. Missing files (no validation yet) read as no records; a line that is not a record leaves
the last good reading in place and is reported once; only regular files are opened (a FIFO
would hang the request). An example's attention maps stay on disk until one is asked for: the
view keeps where each validation's line lies in examples.jsonl, and reads that line again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtrain.core import jsonl
from mtrain.core.files import Stamp, stamp
from mtrain.run.directory import EXAMPLES, METRICS, TRAIN_LOG

log = logging.getLogger(__name__)

HEAVY = ("attention", "src_pieces", "tgt_pieces")  # an example's keys left on disk until asked
READ_CHUNK = 1 << 24  # bytes parsed per look at most: a huge log is caught up over a few looks


@dataclass
class LogFile:
    """One JSON-lines log and its records as last read; `light` drops examples' heavy keys."""

    path: Path
    light: bool = False
    stamp: Stamp | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # each record's (offset, length)
    error: str | None = None
    offset: int = 0  # bytes read whole, up to a newline
    line: int = 1  # the number of the line at `offset`
    inode: int | None = None  # of the file read

    def refresh(self) -> bool:
        """Read what was appended to the log since the last look; True if it changed."""
        now = stamp(self.path)
        if now == self.stamp:
            return False
        # gone, replaced, or cut back (a resumed run's trim): read it again from its start
        if now is None or now.inode != self.inode or now.size < self.offset:
            self._restart()
            self.inode = now and now.inode
        self.stamp = now
        try:
            data = self._read_from(self.offset)
            finished = data[: data.rfind(b"\n") + 1]  # a live writer's last line may be half out
            found = jsonl.lines(self.path, finished, self.line)
        except jsonl.LogError as e:  # keep the last good records
            if self.error != str(e):
                log.warning("mtrain serve: %s", e)
            self.error = str(e)
            return True
        starts = [0] + [i + 1 for i, byte in enumerate(finished) if byte == 10]
        for line in found:
            start = starts[line.number - self.line]
            self.spans.append((self.offset + start, len(line.text.encode("utf-8"))))
            self.records.append(_light(line.record) if self.light else line.record)
        self.offset += len(finished)
        self.line += finished.count(b"\n")
        self.error = None
        if len(data) == READ_CHUNK:
            self.stamp = None  # more to read at the next look
        return True

    def _restart(self) -> None:
        self.records, self.spans, self.offset, self.line, self.error = [], [], 0, 1, None

    def _read_from(self, offset: int) -> bytes:
        """At most READ_CHUNK bytes of the log from `offset`; none if it is absent."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return b""
        except OSError as e:
            raise jsonl.LogError(f"{self.path}: cannot read ({e.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise jsonl.LogError(f"{self.path}: not a regular file")
            f.seek(offset)
            return f.read(READ_CHUNK)

    def record_at(self, index: int) -> dict[str, Any] | None:
        """The `index`-th record whole, read again from disk; None if it is gone or changed."""
        offset, length = self.spans[index]
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            f.seek(offset)
            try:
                return jsonl.parse(f.read(length).rstrip(b"\n"))
            except ValueError:
                return None


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


@dataclass
class Snapshot:
    """What /training answers: the JSON body and its version."""

    body: bytes
    etag: str


class TrainingView:
    """A run directory's logs as the page draws them."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.train = LogFile(run_dir / TRAIN_LOG)
        self.metrics = LogFile(run_dir / METRICS)
        self.examples = LogFile(run_dir / EXAMPLES, light=True)
        self.snapshot: Snapshot | None = None

    def read(self) -> Snapshot:
        """The curves and example translations now; built again only when a log changed."""
        changed = [f.refresh() for f in (self.train, self.metrics, self.examples)]
        if self.snapshot is None or any(changed):
            body = json.dumps(self._view(), ensure_ascii=False, separators=(",", ":"))
            data = body.encode("utf-8")
            self.snapshot = Snapshot(data, '"' + hashlib.sha1(data).hexdigest()[:16] + '"')
        return self.snapshot

    def _view(self) -> dict[str, Any]:
        train = [r for r in self.train.records if r.get("event", "train") == "train"]
        validations = [
            {k: r.get(k) for k in ("event", "step", "minutes", "dev_loss", "dev_bleu", "dev_chrf")}
            for r in self.metrics.records
            if r.get("event", "validation") in ("validation", "average") and "dev_bleu" in r
        ]
        return {
            "run": str(self.run_dir),
            "train": {k: [r.get(k) for r in train] for k in ("step", "minutes", "loss", "lr")},
            "validations": validations,
            "examples": self._examples(),
            "errors": [f.error for f in (self.train, self.metrics, self.examples) if f.error],
        }

    def _examples(self) -> dict[str, Any]:
        """Each example (by source, in order of first appearance) and its translation at each
        validation; attention is fetched one map at a time."""
        sources: dict[str, str | None] = {}  # source -> reference
        for record in self.examples.records:
            for ex in _items(record):
                sources.setdefault(ex["source"], ex.get("reference"))
        order = {s: i for i, s in enumerate(sources)}
        rows = []
        for record in self.examples.records:
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
        return {
            "sources": list(sources),
            "references": list(sources.values()),
            "validations": rows,
        }

    def attention(self, validation: int, source: str) -> dict[str, Any] | None:
        """One example's pieces and cross-attention at the `validation`-th line; None if absent."""
        self.examples.refresh()
        records = self.examples.records
        if not 0 <= validation < len(records):
            return None
        whole = self.examples.record_at(validation)
        for ex in _items(whole or {}):
            if ex["source"] == source:
                return {
                    "step": records[validation]["step"],
                    "source": source,
                    "translation": ex.get("translation"),
                    "src_pieces": ex.get("src_pieces") or [],
                    "tgt_pieces": ex.get("tgt_pieces") or [],
                    "attention": ex.get("attention") or [],  # [layer][head][tgt][src]
                }
        return None


def _items(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A validation line's examples, those without a source string left out."""
    items = record.get("examples")
    if not isinstance(items, list):
        return []
    return [ex for ex in items if isinstance(ex, dict) and isinstance(ex.get("source"), str)]
