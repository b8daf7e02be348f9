"""A name given for a directory (``--init-from``, ``init_from``): whether it reads as a local path rather than a
Hugging Face hub name, and the one line that says a directory does not exist (naming the nearest one that does),
so a typo such as ``runs/shakespeare-char-cpy`` is never taken for a model on the hub. Imports nothing heavy:
configuration checks use it before jax is imported."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

__all__ = ["looks_like_path", "missing_directory", "nearest", "no_such_directory"]


def looks_like_path(name: str) -> bool:
    """True when ``name`` can only be a path: it starts with ``/``, ``.`` or ``~``, ends with a separator, has
    more than one separator (hub names are ``NAME`` or ``OWNER/NAME``), or its first component is a directory
    here (``runs/x`` beside a ``runs/`` directory)."""
    name = str(name)
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    if name.startswith(("/", ".", "~")) or name.endswith(tuple(seps)):
        return True
    parts = Path(name).parts
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def nearest(path: str | Path) -> str | None:
    """The existing directory whose name is closest to ``path``'s among its would-be siblings (a typo's fix), as
    ``path`` spells its parent; None when none is close."""
    path = Path(path).expanduser()
    parent = path.parent
    try:
        siblings = [p.name for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return None
    match = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.75)
    return str(Path(str(path.parent)) / match[0]) if match else None


def missing_directory(name: str) -> str | None:
    """``"no such directory: NAME (did you mean X?)"`` for a ``name`` that reads as a path (:func:`looks_like_path`)
    and names nothing here; None when it exists or may be a hub name."""
    path = Path(str(name)).expanduser()
    if path.exists() or not looks_like_path(str(name)):
        return None
    return no_such_directory(name)


def no_such_directory(name: str) -> str:
    """``"no such directory: NAME"``, with the nearest existing sibling when one is close."""
    close = nearest(name)
    return f"no such directory: {name}" + (f" (did you mean {close}?)" if close else "")
