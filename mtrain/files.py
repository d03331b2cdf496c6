"""Files that must never be left half-written: atomic writes, and the lock on a run directory."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # not POSIX: run directories go unlocked
    fcntl = None

log = logging.getLogger(__name__)
TMP_SUFFIX = ".tmp"
LOCK_FILE = ".lock"


def tmp_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (same directory, same disk).

    Hidden, and tagged with the process id, so it clobbers no file of the user's.
    """
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def write_target(path: Path) -> Path:
    """The file that writing to `path` replaces: a symlink's target, so that the link stays."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def sync_directory(directory: Path) -> None:
    """Flush a directory's entries to disk: until then, a power cut can undo a rename in it."""
    if not hasattr(os, "O_DIRECTORY"):  # Windows: directories cannot be opened or synced
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # a file system that cannot: nothing lost
            raise
    finally:
        os.close(fd)


def _named(e: OSError, tmp: Path, path: Path) -> OSError:
    """`e` naming the file meant, `path`, rather than its temporary file."""
    if e.filename is None or str(e.filename) == str(tmp):
        return OSError(e.errno, e.strerror, str(path))
    return e


def replace(tmp: Path, path: Path) -> None:
    """Rename the complete file `tmp` to `path` durably; on failure, remove `tmp`."""
    try:
        os.replace(tmp, path)
        sync_directory(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _named(e, tmp, path) from None
        raise


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "wb", **kwargs) -> Iterator[IO]:
    """Open a temporary file that replaces `path` only when the block completes.

    If the block fails (a full disk, an error, Ctrl-C), the temporary file is removed and
    `path` keeps what it held before; readers never see a half-written file. A symlink stays
    a symlink: its target is replaced.
    """
    target = write_target(path)
    tmp = tmp_path(target)
    try:
        with tmp.open(mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _named(e, tmp, path) from None
        raise
    replace(tmp, target)


def write_atomic(path: Path, data: bytes | memoryview | str) -> None:
    """Write `data` to `path` atomically (text as UTF-8)."""
    with atomic_open(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


# Temporary files of `tmp_path` (group 1: the writer's pid), and `NAME.pt.tmp` of earlier mtrain
# versions: nothing else.
LEFTOVER = re.compile(r"\..+\.(\d+)\.tmp|.+\.pt\.tmp")


def remove_leftovers(directory: Path) -> list[Path]:
    """Delete the temporary files a killed process left in `directory`; return them. A file
    whose writer still runs (`mtrain translate -o RUN/out.txt`, say) is its own, and stays."""
    leftovers = []
    for path in sorted(directory.iterdir()):
        match = LEFTOVER.fullmatch(path.name)
        if match and not (match[1] and is_running(int(match[1]))):
            leftovers.append(path)
    for path in leftovers:
        path.unlink(missing_ok=True)
    return leftovers


def is_running(pid: int) -> bool:
    """Whether a process `pid`, other than this one, runs on this machine (this process has
    written nothing yet where it looks: a file with its pid is an earlier holder's)."""
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, the pid is only checked
    except PermissionError:  # another user's process
        return True
    except (ProcessLookupError, OverflowError):  # none has it; a number too large to be a pid
        return False
    return True


class DirectoryLocked(RuntimeError):
    """Another process holds the lock on a directory; the message names it."""


class DirectoryLock:
    """An exclusive OS lock on a directory, held while a process writes into it.

    The lock is `flock` on `DIR/.lock`: the kernel releases it when the process ends, however it
    ends, so a crash never leaves a stale lock. The file holds the holder's pid and host, for
    the message another process gets.
    """

    def __init__(self, directory: Path):
        self.path = directory / LOCK_FILE
        self.file: IO[str] | None = None

    def __enter__(self) -> DirectoryLock:
        try:
            f = self.path.open("a+", encoding="utf-8")
        except OSError as e:  # a read-only directory, say: name it, not the lock file
            raise OSError(e.errno, e.strerror, str(self.path.parent)) from None
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                f.close()
                raise DirectoryLocked(
                    f"{self.path.parent}: in use by another mtrain process ({holder}); "
                    "wait for it to finish or use another directory"
                ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self.file = f
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()  # closing releases the lock
            self.file = None


@contextlib.contextmanager
def wait_for_lock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive OS lock on the file `path` for `what` (a prepare of DIR), waiting, and
    saying for whom, while another process holds it. A lock file that cannot be created (a
    read-only disk) leaves the block unlocked: it can only read, which needs no lock."""
    try:
        f = path.open("a+", encoding="utf-8")
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        log.debug("%s: cannot create the lock (%s); reading without it", path, e.strerror)
        yield
        return
    with f:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                log.warning("waiting for %s to finish %s", holder, what)
                fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel however the holder ends
        f.seek(0)
        f.truncate()
        f.write(f"mtrain pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield


@dataclasses.dataclass(frozen=True)
class Stamp:
    """What tells a file changed: a rename into place gives a new inode, a write in place a new
    size or modification time."""

    inode: int
    size: int
    mtime_ns: int


def stamp(path: Path) -> Stamp | None:
    """The file's stamp now; None if it does not exist (or cannot be looked at)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return Stamp(st.st_ino, st.st_size, st.st_mtime_ns)
