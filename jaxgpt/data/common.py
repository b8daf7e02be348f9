"""What the data modules share: the error type, the log line, the cache and project paths, sha256 helpers and
atomic file writes (a temporary file beside the target, then ``os.replace``)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A user-facing data problem (missing input, bad setting, too little data); the message says what to do."""


def _log(msg: str) -> None:
    print(f"[jaxgpt.data] {msg}", flush=True)


def project_root() -> Path:
    """The repository root: the parent of the ``jaxgpt`` package directory."""
    return Path(__file__).resolve().parents[2]


def default_cache_dir() -> Path:
    """``$JAXGPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxgpt``, else ``~/.cache/jaxgpt``."""
    if os.environ.get("JAXGPT_CACHE_DIR"):
        return Path(os.environ["JAXGPT_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "jaxgpt"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path``, then ``os.replace`` it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:  # unlike mkstemp, honours the umask (0644 files)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
