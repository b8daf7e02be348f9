"""Disk space and write failures: one error type for "a write failed" (:class:`WriteFailed`, exit status 2 in
every CLI), the free space of a path, the size of a directory or of a pytree, and the recognition of a write
failure however a library reports it.

Not every library raises ``OSError`` for a full disk: orbax (through TensorStore) raises ``ValueError:
RESOURCE_EXHAUSTED ... No space left on device``, safetensors its own ``SafetensorError``, torch a
``RuntimeError`` from its zip writer. :func:`write_failure` finds the cause in any of them (the exception, its
cause and context chain, or the message) so that callers can say what happened instead of printing a traceback.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

# errno values that mean "this write cannot succeed here" (full disk, quota, read-only, I/O error, too big)
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES, errno.EPERM}
_PATTERNS = (
    (re.compile(r"No space left on device|\bENOSPC\b|not enough space|disk full", re.I),
     errno.ENOSPC),
    (re.compile(r"Disk quota exceeded|EDQUOT", re.I), errno.EDQUOT),
    (re.compile(r"Read-only file system|EROFS", re.I), errno.EROFS),
    (re.compile(r"Input/output error|\bEIO\b", re.I), errno.EIO),
    (re.compile(r"File too large|EFBIG", re.I), errno.EFBIG),
)

_TORCH_WRITER = re.compile(r"PytorchStreamWriter failed writing|inline_container\.cc.*unexpected pos|file write failed",
                           re.I | re.S)


class WriteFailed(Exception):
    """A write failed (a full disk, a quota, a read-only or failing file system); the message names the path, what
    the write needed, the free space and what was kept. Every CLI exits 2 with it, without a traceback."""


def write_failure(exc: BaseException) -> tuple[int, str] | None:
    """``(errno, description)`` if ``exc`` (or anything in its cause / context chain) is a failed write: an
    ``OSError`` with an errno in :data:`WRITE_ERRNOS`, or any exception whose message says so (orbax's
    ``RESOURCE_EXHAUSTED``, safetensors' and torch's own types). None otherwise."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            return e.errno, os.strerror(e.errno)
        text = str(e)
        for pattern, code in _PATTERNS:
            if pattern.search(text):
                return code, os.strerror(code)
        if _TORCH_WRITER.search(text):  # torch's zip writer hides the errno: "unexpected pos 576 vs 534"
            return errno.EIO, f"torch's writer could not write the file ({text.strip()[:120]}; usually a full disk)"
        e = e.__cause__ or e.__context__
    return None


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes (for this user) on the file system holding ``path`` or its nearest existing parent."""
    p = Path(path).absolute()
    for q in (p, *p.parents):
        if q.exists():
            try:
                return shutil.disk_usage(q).free
            except OSError:
                return None
    return None


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist; files vanishing meanwhile are skipped)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                continue
    return total


def tree_nbytes(tree: Any) -> int:
    """Bytes of the arrays of a pytree (global sizes)."""
    import jax

    return sum(int(getattr(x, "nbytes", 0) or 0) for x in jax.tree.leaves(tree))


def human(n: int | float | None) -> str:
    """``1.23 GB`` (decimal units, as ``df -H`` shows them); ``?`` for None."""
    if n is None:
        return "?"
    n = float(n)
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} bytes" if unit == "bytes" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def describe_space(path: str | os.PathLike, need: int | None) -> str:
    """``needed about X; Y free on the file system of PATH``."""
    free = free_bytes(path)
    needed = f"it needed about {human(need)}" if need else "its size is unknown"
    return f"{needed}; {human(free)} free on the file system of {path} now"
