"""The page's training view: a run's curves and example translations, read from logs that may
still be written.

Each log is parsed again only when its stamp changes, so the page may poll every few seconds. A
last line without its newline is a record still being written, not an error: it is left for the
next look. Missing files (no validation yet) read as no records; a line that is not a record
leaves the last good reading in place and is reported once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtrain.core import jsonl
from mtrain.core.files import Stamp, stamp
from mtrain.run.directory import EXAMPLES, METRICS, TRAIN_LOG

log = logging.getLogger(__name__)


@dataclass
class LogFile:
    """One JSON-lines log and its records as last read."""

    path: Path
    stamp: Stamp | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def refresh(self) -> bool:
        """Read the log again if it changed; True if it did."""
        now = stamp(self.path)
        if now == self.stamp:
            return False
        self.stamp = now
        try:
            data = jsonl.read_bytes(self.path) or b""
            finished = data[: data.rfind(b"\n") + 1]  # a live writer's last line may be half out
            self.records = [line.record for line in jsonl.lines(self.path, finished)]
            self.error = None
        except jsonl.LogError as e:  # keep the last good records
            if self.error != str(e):
                log.warning("mtrain serve: %s", e)
            self.error = str(e)
        return True


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
        self.examples = LogFile(run_dir / EXAMPLES)
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
        for ex in _items(records[validation]):
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
