"""A directory that one process writes: created with errors that name the problem, then locked against a second
writer.

``jaxgpt.train`` locks its ``out_dir`` (process 0 of a multi-process run) and ``jaxgpt.data`` its ``--out``
before they write anything. The lock is ``flock(2)`` on ``<dir>/.jaxgpt.lock``, whose content names the holder
(host, PID, start time, command). The kernel drops the lock when the holding process ends, however it ends, so a
lock left by a killed process never blocks the restart; the stale file is simply taken over.

    with locked_dir("runs/x", what="run directory", option="out_dir"):
        ...  # this process is the directory's only writer

A caller that should queue behind the holder rather than fail (training preparing a shared ``data_dir``) passes
``wait_s``: it waits for the lock, then finds whatever the holder left.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

LOCK_NAME = ".jaxgpt.lock"


class DirError(ValueError):
    """The directory cannot be used: it cannot be created or written, or another process holds it."""


class DirLocked(DirError):
    """Another live process holds the directory's lock."""

    def __init__(self, message: str, holder: dict[str, Any]):
        super().__init__(message)
        self.holder = holder


def make_dir(path: str | os.PathLike, *, what: str = "directory", option: str = "out_dir") -> Path:
    """Create ``path`` (and its parents) if needed and check it is a writable directory; ``DirError`` names the
    problem (a regular file on the way, no permission, a read-only file system) and the ``option`` to change."""
    path = Path(path)
    fix = f"choose another {option}"
    blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise DirError(f"{option} {str(path)!r}: {str(blocker)!r} is a file, not a directory, so the {what} cannot "
                       f"be created there; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DirError(f"{option} {str(path)!r}: cannot create the {what} ({e.strerror or e}); {fix}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise DirError(f"{option} {str(path)!r}: the {what} is not writable by this user; {fix} or fix its "
                       "permissions")
    return path


class DirLock:
    """An exclusive lock on a directory (see the module docstring). :meth:`acquire` raises :class:`DirLocked`
    naming the holder when another process has it."""

    def __init__(self, directory: str | os.PathLike, *, what: str = "directory", option: str = "out_dir"):
        self.directory, self.what, self.option = Path(directory), what, option
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, *, wait_s: float = 0, on_wait: Callable[[dict[str, Any]], None] | None = None,
                poll_s: float = 0.2) -> "DirLock":
        """Take the lock. ``wait_s=0``: refuse at once (:class:`DirLocked`) when another process holds it; otherwise
        wait up to ``wait_s`` seconds (``None``: no limit) for the holder to finish, calling ``on_wait(holder)``
        once when the wait begins, and raise :class:`DirLocked` (saying how long it waited) if it never does.

        The lock file may be removed by its holder (as ``jaxgpt.data`` does when it leaves no directory behind):
        a lock taken on a file that is no longer at :attr:`path` is dropped and taken again on the new one, and a
        directory removed while this process waited is created again."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        waited = again = False
        while True:
            fd = self._open(recreate=again)
            again = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise DirError(f"{self.option} {str(self.directory)!r}: cannot lock {self.path} "
                                   f"({e.strerror or e})") from e
                if deadline is not None and time.monotonic() >= deadline:
                    raise DirLocked(self._locked_message(holder, waited_s=wait_s if waited else 0), holder) from None
                if not waited and on_wait is not None:
                    on_wait(holder)
                waited = True
                time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))
                continue
            if not _same_file(fd, self.path):  # its holder removed it before letting go: lock the current one
                os.close(fd)
                continue
            break
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(_me(), indent=1) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as e:  # a full disk (or quota): leave no empty lock file behind
            try:
                if _same_file(fd, self.path):
                    self.path.unlink()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            raise DirError(f"{self.option} {str(self.directory)!r}: cannot write the lock file {self.path} "
                           f"({e.strerror or e}); free space on that disk (or choose another {self.option})") from e
        self._fd = fd
        return self

    def _open(self, recreate: bool) -> int:
        flags = os.O_RDWR | os.O_CREAT
        try:
            try:
                return os.open(self.path, flags, 0o644)
            except FileNotFoundError:
                if not recreate or self.directory.exists():
                    raise
                self.directory.mkdir(parents=True, exist_ok=True)  # removed by the holder this process waited for
                return os.open(self.path, flags, 0o644)
        except OSError as e:
            raise DirError(f"{self.option} {str(self.directory)!r}: cannot create the lock file {self.path} "
                           f"({e.strerror or e}); choose another {self.option}") from e

    def remove_file(self) -> None:
        """Delete the lock file while still holding the lock (a waiter then locks a new one); call
        :meth:`release` after. For a holder that leaves nothing behind in the directory."""
        if self._fd is not None and _same_file(self._fd, self.path):
            self.path.unlink(missing_ok=True)

    def _locked_message(self, holder: dict[str, Any], waited_s: float | None = 0) -> str:
        waited = f" (still, after waiting {waited_s:g} s)" if waited_s else ""
        return (f"{self.option} {str(self.directory)!r}: the {self.what} is in use by {describe_holder(holder)}"
                f"{waited}. Two writers would mix their files. Wait for it to finish or stop it, or choose another "
                f"{self.option}. (The lock is {self.path}; it is released when that process ends, however it ends.)")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # no holder named once released
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "DirLock":
        return self if self.held else self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


@contextlib.contextmanager
def locked_dir(path: str | os.PathLike, *, what: str = "directory", option: str = "out_dir", wait_s: float = 0,
               on_wait: Callable[[dict[str, Any]], None] | None = None) -> Iterator[Path]:
    """:func:`make_dir`, then hold its :class:`DirLock` for the ``with`` block (waiting for it as
    :meth:`DirLock.acquire` does with ``wait_s`` > 0)."""
    path = make_dir(path, what=what, option=option)
    with DirLock(path, what=what, option=option).acquire(wait_s=wait_s, on_wait=on_wait):
        yield path


def describe_holder(holder: dict[str, Any]) -> str:
    """``process PID on HOST (started T: COMMAND)`` from a lock file's content, or ``another process``."""
    if not holder:
        return "another process"
    return (f"process {holder.get('pid', '?')} on {holder.get('host', '?')} (started {holder.get('started', '?')}"
            + (f": {holder['command']}" if holder.get("command") else "") + ")")


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(getattr(sys, "orig_argv", sys.argv))[:500]}


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}
