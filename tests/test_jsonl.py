"""The one reader of a run's JSON-lines logs: torn last lines, damaged lines, trimming."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtrain.core import jsonl
from mtrain.core.jsonl import LogError

records = st.lists(
    st.fixed_dictionaries(
        {
            "event": st.sampled_from(["train", "validation", "average", "验证"]),
            "step": st.integers(0, 10**6),
            "minutes": st.floats(0, 1e4),
            "loss": st.floats(allow_nan=False, allow_infinity=False),
        }
    ),
    max_size=6,
)


def text_of(recs: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode("utf-8")


@settings(max_examples=60, deadline=None)
@given(records, st.data())
def test_a_log_cut_anywhere_reads_as_the_records_written_whole(tmp_path_factory, recs, data):
    """What a crash mid-append leaves: every complete record, never an error."""
    whole = text_of(recs)
    cut = data.draw(st.integers(0, len(whole)))
    path = tmp_path_factory.mktemp("log") / "train.jsonl"
    path.write_bytes(whole[:cut])
    ends = [len(text_of(recs[: i + 1])) - 1 for i in range(len(recs))]  # before each newline
    assert jsonl.read(path) == [r for r, end in zip(recs, ends) if end <= cut]


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"[1, 2, 3]", "expected a JSON object, got [1, 2, 3]"),
        (b'{"minutes": 1.0}', 'no "step"'),
        (b'{"step": 3}', 'no "minutes"'),
        (b'{"step": "3", "minutes": 1}', '"step": expected a number'),
        (b'{"step": 1.5, "minutes": 1}', '"step": expected a whole number'),
        (b'{"step": 3, "minutes": 1, "dev_bleu": true}', '"dev_bleu": expected a number'),
        (b'{"step": 3, "minutes": 1, "event": 7}', '"event": expected a string'),
        (b"\xff\xfe{}", "not UTF-8 text"),
        (b"{not json", "not a JSON record"),
        (b"[" * 100_000, "not a JSON record"),
    ],
)
def test_a_damaged_line_before_the_last_names_file_and_line(tmp_path, line, reason):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(text_of([{"step": 1, "minutes": 0.5}]) + line + b"\n" + text_of([]))
    with pytest.raises(LogError, match=re.escape(f"metrics.jsonl:2: not a log record: {reason}")):
        jsonl.read(path)
    path.write_bytes(text_of([{"step": 1, "minutes": 0.5}]) + line)  # the last, no newline
    assert jsonl.read(path) == [{"step": 1, "minutes": 0.5}]


def test_an_absent_log_has_no_records_and_a_directory_is_an_error(tmp_path):
    assert jsonl.read(tmp_path / "none.jsonl") == []
    with pytest.raises(LogError, match="cannot read"):
        jsonl.read(tmp_path)


def test_trim_keeps_the_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"event": "validation", "step": s, "minutes": s / 10} for s in (2, 4, 6)]
    path.write_bytes(text_of(recs) + b'{"event": "valid')
    jsonl.trim(path, 4)
    assert path.read_bytes() == text_of(recs[:2])
    before = path.stat()
    jsonl.trim(path, 4)  # nothing to cut: the file is not rewritten
    assert path.stat().st_ino == before.st_ino


def test_trim_refuses_a_damaged_line_rather_than_drop_the_records_after_it(tmp_path):
    path = tmp_path / "train.jsonl"
    good = text_of([{"step": 2, "minutes": 0.1}])
    path.write_bytes(good + b"[1, 2, 3]\n" + good)
    with pytest.raises(LogError, match=r"train\.jsonl:2"):
        jsonl.trim(path, 10)
    assert path.read_bytes() == good + b"[1, 2, 3]\n" + good


def test_non_finite_numbers_are_written_as_null_and_old_ones_read_as_null(tmp_path):
    nan = {"event": "validation", "step": 5, "minutes": 0.5, "dev_loss": float("nan")}
    deep = {"step": 6, "minutes": 0.6, "examples": [{"attention": [[float("inf"), 0.5]]}]}
    path = tmp_path / "metrics.jsonl"
    written = jsonl.dumps(nan) + jsonl.dumps(deep)
    json.loads(written.splitlines()[0], parse_constant=pytest.fail)  # JSON, not NaN
    assert "NaN" not in written and "Infinity" not in written
    old = '{"step": 7, "minutes": 0.7, "dev_loss": NaN, "loss": -Infinity}\n'
    path.write_text(written + old, "utf-8")
    read = jsonl.read(path)
    assert read[0]["dev_loss"] is None and read[1]["examples"][0]["attention"] == [[None, 0.5]]
    assert read[2]["dev_loss"] is None and read[2]["loss"] is None
    # what /training serves from them is valid JSON
    json.loads(json.dumps(read, allow_nan=False))
