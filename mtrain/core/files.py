"""Files that must never be left half-written: atomic writes, the one rule for writing a path
the user names, directory replacement, locks, and the checks on the user's own files."""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import enum
import errno
import logging
import os
import re
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from mtrain.core.errors import MtrainError

try:
    import fcntl
except ImportError:  # not POSIX: run directories go unlocked
    fcntl = None

log = logging.getLogger(__name__)
TMP_SUFFIX = ".tmp"
LOCK_FILE = ".lock"
# `lock_holder` holds a shared lock on a run's lock file for an instant: a DirectoryLock that
# meets only such a lock tries again, up to PROBE_TRIES times PROBE_WAIT seconds.
PROBE_TRIES, PROBE_WAIT = 100, 0.01


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


class FileRefused(MtrainError, ValueError):
    """A file the user named that cannot be used: an input that is not UTF-8, an output that is
    a directory, a socket or the input itself; the message names it, in one line."""


class OutputKind(enum.Enum):
    """How a path the user named is written."""

    FILE = "file"  # a regular file, or a new path: a temporary file renamed over it
    STREAM = "stream"  # a device, a FIFO, a descriptor (/dev/stdout): written in place


# What a path that is neither a file nor a stream is, for the message that refuses it.
OTHER_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))
# The directories whose entries are this process's open descriptors (/dev/stdout links here).
DESCRIPTORS = re.compile(r"/dev/fd|/proc/(self|thread-self|\d+)/fd")


def output_kind(path: Path) -> OutputKind:
    """How writing to `path` goes: a rename replaces a file, never what is not one.

    A device, a FIFO and a descriptor are written in place, as `cat > path` would (a rename
    would put a regular file where a device was, or leave a reader waiting on its FIFO); a
    descriptor (/dev/stdout, /dev/fd/N) is written in place whatever it is open on, as it names
    what the shell opened. Every other kind is refused with FileRefused.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:  # a new path, or a symlink to one: created by the rename
        return OutputKind.FILE
    for is_kind, kind in OTHER_KINDS:
        if is_kind(mode):
            raise FileRefused(f"{path}: is {kind}, not a file to write")
    if stat.S_ISREG(mode) and not names_descriptor(path):
        return OutputKind.FILE
    if stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
        return OutputKind.STREAM
    raise FileRefused(f"{path}: is not a file, a device or a pipe; not written")


def names_descriptor(path: Path, hops: int = 40) -> bool:
    """Whether `path`, or a symlink on its way, is an entry of a descriptor directory."""
    path = Path(os.path.abspath(path))
    for _ in range(hops):
        if DESCRIPTORS.fullmatch(str(path.parent)):
            return True
        if not path.is_symlink():
            return False
        path = Path(os.path.abspath(path.parent / os.readlink(path)))
    return False


@contextlib.contextmanager
def open_output(path: Path, mode: str = "wb", **kwargs) -> Iterator[IO]:
    """Open a path the user named (`-o`) for writing, by the rule of `output_kind`: a file is
    replaced atomically when the block completes; a device, FIFO or descriptor is written in
    place (no rename, no fsync: a pipe cannot be synced)."""
    if output_kind(path) is OutputKind.STREAM:
        with open(path, mode, **kwargs) as f:
            yield f
    else:
        with atomic_open(path, mode, **kwargs) as f:
            yield f


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


def remove_path(path: Path) -> None:
    """Remove a file or a whole directory (not what a symlink points to); gone already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def old_path(path: Path) -> Path:
    """Where `replace_directory` moves what was at `path` until its replacement is in place."""
    return path.with_name(f".{path.name}.{os.getpid()}.old")


def replace_directory(new: Path, target: Path) -> None:
    """Put the complete directory `new` in `target`'s place, durably.

    What was at `target` is moved aside first and removed last. On any failure `target` keeps
    what it held (moved back if it was moved aside), and `new` is left for the caller to
    remove. A process killed between the two renames leaves the earlier directory whole
    beside `target`, as `.NAME.<pid>.old`, which `recover_directory` renames back.
    """
    old = old_path(target)
    if os.path.lexists(target):
        target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        if os.path.lexists(old):
            old.rename(target)
        raise
    sync_directory(target.parent)
    remove_path(old)


def recover_directory(target: Path, complete: Callable[[Path], bool], what: str) -> None:
    """Undo what a killed `replace_directory` of `target` (a `what`) left beside it.

    Its temporary directory (`.NAME.<pid>.tmp`) is removed. An earlier directory it had moved
    aside (`.NAME.<pid>.old`) is renamed back when nothing took its place, removed when a
    `complete` one did, and otherwise named, not removed. A writer that still runs keeps its
    own. (`.NAME.<pid>.tmp.old` is the name earlier versions of `mtrain export` moved aside to.)
    """
    if not target.parent.is_dir():
        return
    name = re.compile(rf"\.{re.escape(target.name)}\.(\d+)(\.tmp|\.old|\.tmp\.old)")
    for path in sorted(target.parent.iterdir()):
        match = name.fullmatch(path.name)
        if not match or is_running(int(match[1])):
            continue  # not a leftover, or one whose writer still works
        if match[2] == TMP_SUFFIX:
            remove_path(path)
        elif not os.path.lexists(target) and complete(path):
            path.rename(target)
            sync_directory(target.parent)
            log.warning(
                "%s: restored the earlier %s that a killed %s had moved aside", target, what, what
            )
        elif complete(target):
            remove_path(path)  # the killed writer had put its own in place
        else:
            log.warning(
                "%s: an earlier %s moved aside by a killed %s is in %s", target, what, what, path
            )


class DirectoryLocked(MtrainError, RuntimeError):
    """Another process holds the lock on a directory; the message names it."""


class DirectoryLock:
    """An exclusive OS lock on a directory, held while a process writes into it.

    The lock is `flock` on `DIR/.lock`: the kernel releases it when the process ends, however it
    ends, so a crash never leaves a stale lock. The file holds the holder's pid and host, for
    the message another process gets. A directory replaced whole (an export) is locked by a
    file beside it instead, `.DIR.lock` (`lock_beside`), removed as the lock is released.
    """

    def __init__(self, directory: Path, path: Path | None = None):
        self.directory = directory
        self.path = path or directory / LOCK_FILE
        self.beside = path is not None
        self.file: IO[str] | None = None

    def __enter__(self) -> DirectoryLock:
        while True:
            f = self._lock()
            if not self.beside or _is_at(f, self.path):
                break
            f.close()  # its holder removed it as it let go: lock the file there now
        _claim(f, "pid")  # the holder, for messages
        self.file = f
        return self

    def _lock(self) -> IO[str]:
        try:
            f = self.path.open("a+", encoding="utf-8")
        except OSError as e:  # a read-only directory, say: name it, not the lock file
            raise OSError(e.errno, e.strerror, str(self.path.parent)) from None
        holder = _lock_exclusive(f) if fcntl is not None else None
        if holder is not None:
            f.close()
            raise in_use(self.directory, holder)
        return f

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            if self.beside:  # removed while held: a process that opened it sees it is gone
                self.path.unlink(missing_ok=True)
            self.file.close()  # closing releases the lock
            self.file = None


def in_use(directory: Path, holder: str) -> DirectoryLocked:
    """The refusal of a directory whose lock `holder` holds."""
    return DirectoryLocked(
        f"{directory}: in use by another mtrain process ({holder}); "
        "wait for it to finish or use another directory"
    )


def refuse_held(directory: Path) -> None:
    """Refuse, as its DirectoryLock would, a directory whose lock another process holds now,
    without taking the lock."""
    holder = lock_holder(directory)
    if holder is not None:
        raise in_use(directory, holder)


def lock_holder(directory: Path) -> str | None:
    """Who holds the lock on `directory` now, as its lock file names them ("pid 12 on host");
    None if no process holds it. The OS lock is asked, not the pid: a pid outlives its process
    and may name another one since."""
    try:  # non-blocking: a FIFO named .lock must not hang the caller
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if fcntl is None or not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:  # a shared lock is refused only while a holder has the exclusive one
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _holder(f) or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None


def _lock_exclusive(f: IO[str]) -> str | None:
    """Take the exclusive lock on `f` without waiting for a holder: None once taken, else who
    holds it. A refusal may come from `lock_holder`'s brief shared lock, not a holder: a shared
    lock granted here says that no process holds the exclusive one, so it is tried again."""
    for _ in range(PROBE_TRIES):
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except OSError:
            pass
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # refused only while a process holds the exclusive lock
            return _holder(f) or "unknown"
        fcntl.flock(f, fcntl.LOCK_UN)
        time.sleep(PROBE_WAIT)  # for the probe to let go
    return "a process that keeps a shared lock on it, as a check that it is in use does"


def lock_beside(directory: Path) -> DirectoryLock:
    """The lock of a directory that is replaced whole: a file beside it, removed when done."""
    return DirectoryLock(directory, directory.with_name(f".{directory.name}.lock"))


def _claim(f: IO[str], label: str) -> None:
    """Write who holds the lock on `f` into it: "LABEL 12 on host", what `_holder` reads."""
    f.seek(0)
    f.truncate()
    f.write(f"{label} {os.getpid()} on {socket.gethostname()}\n")
    f.flush()


def _holder(f: IO) -> str:
    """Who a lock file says holds it (its first 200 characters), or "" where it says nothing."""
    f.seek(0)
    text = f.read(200)
    return (text.decode("utf-8", "replace") if isinstance(text, bytes) else text).strip()


def _is_at(f: IO, path: Path) -> bool:
    """Whether the open file `f` is still the file at `path` (not removed or replaced since)."""
    try:
        return os.path.samestat(os.fstat(f.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


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
                holder = _holder(f) or "another process"
                log.warning("waiting for %s to finish %s", holder, what)
                fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel however the holder ends
        _claim(f, "mtrain pid")
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


# The user's own files: checked before a line is read or a byte written.


def is_utf8(text: str) -> bool:
    """False for text that came from bytes that are not UTF-8 (Python keeps them as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_arguments(texts: list[str]) -> None:
    """Refuse a sentence given as an argument that is not valid UTF-8, naming it."""
    for number, text in enumerate(texts, 1):
        if not is_utf8(text):
            raise FileRefused(f"argument {number}: not valid UTF-8")


def first_bad_line(path: Path, block: int = 1 << 20) -> int | None:
    """The number of the first line of a file that is not valid UTF-8, or None; read in blocks
    of `block` bytes, in bounded memory whatever the lines' length."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    newlines = 0  # in the blocks decoded so far
    with path.open("rb") as f:
        try:
            while data := f.read(block):
                decoder.decode(data)
                newlines += data.count(b"\n")
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            # e.object is the decoder's few held bytes of a split character, then the block:
            # the held bytes hold no newline.
            return newlines + e.object.count(b"\n", 0, e.start) + 1
    return None


def check_input_encoding(path: Path) -> None:
    """Refuse an input file that is not all UTF-8 before a line of it is used.

    Only a regular file is read ahead: a pipe or a device is read once, and checked as it is.
    """
    if path.is_file() and (line := first_bad_line(path)) is not None:
        raise FileRefused(f"{path}:{line}: not valid UTF-8")


def check_output(
    output: Path,
    inputs: list[Path],
    keep: Path,
    from_stdin: bool,
    option: str = "--output",
    what: str = "the translations",
) -> None:
    """Refuse an output path (given as `option`) that cannot be written, or that would overwrite
    what is being read: an input (a file, or a file redirected to stdin), or a file directly in
    the directory `keep` (a run's model, tokenizer, config)."""
    try:
        output_kind(output)
    except FileRefused as e:
        raise FileRefused(f"{option} {e}") from None
    if not output.parent.is_dir():
        raise FileRefused(f"{option} {output}: no such directory {output.parent}")
    if not output.exists():
        return
    stdin = stdin_stat() if from_stdin else None
    if any(output.samefile(p) for p in inputs) or (
        stdin and os.path.samestat(stdin, output.stat())
    ):
        raise FileRefused(f"{option} {output}: is the input file; write {what} elsewhere")
    if any(output.samefile(path) for path in keep.iterdir() if path.is_file()):
        raise FileRefused(f"{option} {output}: is a file of the run {keep}; write {what} elsewhere")


def stdin_stat() -> os.stat_result | None:
    """What standard input is (a file redirected to it has its device and inode), if open."""
    try:
        return os.fstat(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):  # no stdin at all, or closed
        return None
