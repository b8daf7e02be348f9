"""Where ``kernels: auto``'s choices live: one JSON file per (device kind, jax/jaxlib version, model shape,
micro-batch, precision) key, looked up first among the committed files (``jaxgpt/kernels/tuned/``, measured on a
device we had), then in the user's cache directory (``$JAXGPT_CACHE/tune``, else ``$XDG_CACHE_HOME/jaxgpt/tune``,
else ``~/.cache/jaxgpt/tune``). A file's name is readable (device, model, batch, precision) plus a hash of the full
key; its ``key`` field is compared in full on reading, so a file for another key is never used."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

COMMITTED_DIR = Path(__file__).resolve().parents[1] / "kernels" / "tuned"
FORMAT = 1  # bumped when a file's fields change: older files are then ignored (measured again)


def cache_dir() -> Path:
    """The user's cache directory for choices (created on writing)."""
    if os.environ.get("JAXGPT_CACHE"):
        return Path(os.environ["JAXGPT_CACHE"]) / "tune"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxgpt" / "tune"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def file_name(key: dict[str, Any]) -> str:
    """``<device>_<layers>L<embed>C_b<batch>x<seq>_<precision>_<hash>.json``: readable, and unique per key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    m, p = key["model"], key["precision"]
    return (f"{_slug(key['device_kind'])}_{m['n_layer']}L{m['n_embd']}C_b{key['batch_size']}x{key['seq_len']}_"
            f"{_slug(p['compute_dtype'])}_{digest}.json")


def _read(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # unreadable or half-written: measured again (and rewritten)
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
        return None
    return data


def lookup(key: dict[str, Any], *, committed_only: bool = False) -> tuple[dict[str, Any], Path] | None:
    """The committed choice for ``key``, else the cached one, with its path (None: neither)."""
    name = file_name(key)
    for path in (COMMITTED_DIR / name,) + (() if committed_only else (cache_dir() / name,)):
        data = _read(path, key)
        if data is not None:
            return data, path
    return None


def store(key: dict[str, Any], record: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``record`` (the search's result) for ``key`` into ``directory`` (default: the user's cache), atomically."""
    directory = Path(directory) if directory is not None else cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(key)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"format": FORMAT, "key": key, **record}, indent=2) + "\n")
    os.replace(tmp, path)
    return path
