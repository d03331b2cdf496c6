"""Atomic writes: durable renames, symlinks kept, no temporary file left behind."""

from __future__ import annotations

import fcntl
import io
import os
import socket
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtrain.core import files
from mtrain.core.files import atomic_open, first_bad_line, write_atomic
from mtrain.data.corpus import DataError
from mtrain.data.pairs import decode_lines
from mtrain.run.directory import save_copy


def leftovers(directory) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_the_rename_is_made_durable_by_syncing_the_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        mode = os.fstat(fd).st_mode
        synced.append("directory" if stat.S_ISDIR(mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomic(tmp_path / "a", "new")
    # The file's bytes first, then the directory entry that the rename changed.
    assert synced == ["file", "directory"]


def test_a_symlinked_output_is_written_through_to_its_target(tmp_path):
    target, link = tmp_path / "real.txt", tmp_path / "link.txt"
    target.write_text("old")
    link.symlink_to(target)
    with atomic_open(link, "w") as f:
        f.write("new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"
    assert leftovers(tmp_path) == []


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.txt"
    link.symlink_to(tmp_path / "sub" / ".." / "made.txt")
    write_atomic(link, "made")
    assert link.is_symlink() and (tmp_path / "made.txt").read_text() == "made"


def test_save_copy_removes_its_link_when_the_rename_fails(tmp_path, monkeypatch):
    src, dst = tmp_path / "last.pt", tmp_path / "best.pt"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")

    def fail(a, b):
        raise OSError(28, "No space left on device", str(a), None, str(b))

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError) as e:
        save_copy(src, dst)
    assert e.value.filename == str(dst)  # the file meant, not the temporary one
    assert leftovers(tmp_path) == [] and dst.read_bytes() == b"old"


NOT_UTF8 = [b"\xff", b"\xe4", b"\xe4\xb8", b"\xb8", b"\xed\xa0\x80"]  # bad, cut, surrogate


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from(
            [b"a", b"\n", b"\r\n", "一".encode(), "é".encode(), b"\xef\xbb\xbf", *NOT_UTF8]
        ),
        max_size=30,
    ),
    block=st.integers(1, 9),
)
def test_the_first_bad_line_is_where_reading_line_by_line_fails(tmp_path_factory, parts, block):
    """Whatever the block size, even one that splits characters: 1 to 9 bytes here."""
    data = b"".join(parts)
    path = tmp_path_factory.getbasetemp() / "input.zh"
    path.write_bytes(data)
    try:
        for _ in decode_lines(io.BytesIO(data), "input.zh"):
            pass
        expected = None
    except DataError as e:
        expected = int(str(e).split(":")[1])
    assert first_bad_line(path, block) == expected


def test_replace_directory_keeps_the_earlier_one_on_any_failure(tmp_path, monkeypatch):
    target, new = tmp_path / "out", tmp_path / ".out.1.tmp"
    target.mkdir()
    (target / "f").write_text("earlier")
    new.mkdir()
    (new / "f").write_text("new")
    real = Path.rename

    def fail_the_second(self, to):
        if self == new:
            raise OSError(28, "No space left on device", str(self))
        return real(self, to)

    monkeypatch.setattr(Path, "rename", fail_the_second)
    with pytest.raises(OSError):
        files.replace_directory(new, target)
    assert (target / "f").read_text() == "earlier" and (new / "f").read_text() == "new"
    monkeypatch.undo()
    files.replace_directory(new, target)
    assert (target / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [
        "out"
    ]


@pytest.mark.parametrize("target_there", [False, True])
def test_recover_directory_renames_back_what_a_killed_writer_moved_aside(
    tmp_path, target_there, caplog
):
    dead = 2**22 + 12345  # above any pid_max: no process has it
    target = tmp_path / "out"
    aside, unfinished = tmp_path / f".out.{dead}.old", tmp_path / f".out.{dead}.tmp"
    for directory, text in ((aside, "earlier"), (unfinished, "half")):
        directory.mkdir()
        (directory / "f").write_text(text)
    if target_there:  # the killed writer had put its own in place
        target.mkdir()
        (target / "f").write_text("new")
    files.recover_directory(target, lambda d: (d / "f").is_file(), "thing")
    assert (target / "f").read_text() == ("new" if target_there else "earlier")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    restored = "restored the earlier thing that a killed thing had moved aside"
    assert (restored in caplog.text) == (not target_there)


def test_a_probe_of_the_lock_in_that_instant_does_not_refuse_the_trainer(tmp_path, monkeypatch):
    """`lock_holder` holds a shared lock for an instant: a trainer that starts then takes the
    lock once the probe lets go, rather than refusing with the last holder's name."""
    (tmp_path / files.LOCK_FILE).write_text("pid 1 on a-host-long-gone\n", encoding="utf-8")
    probe = (tmp_path / files.LOCK_FILE).open("rb")
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # as lock_holder holds it
    let_go, gone = threading.Event(), threading.Event()

    def prober():  # lets go when told: after the trainer has been refused once
        let_go.wait()
        probe.close()
        gone.set()

    real = fcntl.flock

    def flock(f, operation):
        real(f, operation)
        if operation == fcntl.LOCK_SH | fcntl.LOCK_NB:  # the trainer saw no exclusive holder
            let_go.set()
            gone.wait()

    thread = threading.Thread(target=prober)
    thread.start()
    monkeypatch.setattr(files.fcntl, "flock", flock)
    try:
        with files.DirectoryLock(tmp_path):
            held = (tmp_path / files.LOCK_FILE).read_text(encoding="utf-8")
            assert held == f"pid {os.getpid()} on {socket.gethostname()}\n"
    finally:
        let_go.set()
        thread.join()
    assert gone.is_set()


def test_a_shared_lock_that_stays_refuses_the_trainer_naming_no_stale_holder(tmp_path, monkeypatch):
    (tmp_path / files.LOCK_FILE).write_text("pid 1 on a-host-long-gone\n", encoding="utf-8")
    monkeypatch.setattr(files, "PROBE_WAIT", 0.0)
    with (tmp_path / files.LOCK_FILE).open("rb") as probe:
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        with pytest.raises(files.DirectoryLocked, match="keeps a shared lock") as refused:
            files.DirectoryLock(tmp_path).__enter__()
    assert "long-gone" not in str(refused.value)
    assert files.lock_holder(tmp_path) is None  # refused, it holds nothing
    with files.DirectoryLock(tmp_path):
        assert files.lock_holder(tmp_path) == f"pid {os.getpid()} on {socket.gethostname()}"


def test_a_lock_beside_a_directory_refuses_a_second_holder_and_goes_with_the_first(tmp_path):
    directory = tmp_path / "out"
    refused = pytest.raises(files.DirectoryLocked, match=f"^{directory}: in use by another")
    with files.lock_beside(directory), refused, files.lock_beside(directory):
        pass
    assert list(tmp_path.iterdir()) == []
    with files.lock_beside(directory):  # free again
        pass
