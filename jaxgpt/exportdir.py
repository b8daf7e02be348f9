"""Exports that never destroy: a Hugging Face directory or a torch_ref ``state_dict`` file is written beside its
target and renamed into place, and only where nothing of someone else's would be lost.

A target may be written when it does not exist, is an empty directory, or is a previous export of ours: a
directory holding the marker ``jaxgpt_export.json``, or a ``.pt`` file whose zip archive holds that record (which
``torch.load`` ignores). Anything else is refused unless ``overwrite=True``. Some targets are refused even then
(``forbidden``: e.g. the run directory, its ``checkpoints/``, or a directory that contains them). Replacing a
previous export renames the old one aside, renames the new one in, and only then deletes the old one, so an
interrupted export leaves the old export or the new one, never half of either.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

MARKER = "jaxgpt_export.json"


class ExportError(ValueError):
    """The export target would lose data, or cannot be written; the message names it and the fix."""


def marker(kind: str, **source: Any) -> dict[str, Any]:
    return {"format": "jaxgpt-export", "kind": kind, "time": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), **source}


def _is_our_dir(path: Path) -> bool:
    try:
        return json.loads((path / MARKER).read_text()).get("format") == "jaxgpt-export"
    except (OSError, ValueError, AttributeError):
        return False


def _is_our_file(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("/" + MARKER)), None)
            return name is not None and json.loads(z.read(name)).get("format") == "jaxgpt-export"
    except (OSError, ValueError, zipfile.BadZipFile, AttributeError):
        return False


def check_target(target: str | os.PathLike, *, kind: str, overwrite: bool = False,
                 forbidden: Iterable[str | os.PathLike] = (), option: str = "--to-hf") -> Path:
    """The resolved target if writing ``kind`` ("dir" or "file") there loses nothing; else :class:`ExportError`.

    ``forbidden``: paths that must never be replaced or written into (the target may not be one of them, lie
    inside one, or contain one), even with ``overwrite``."""
    path = Path(target).expanduser().absolute()
    real = path.resolve()
    for f in forbidden:
        f = Path(f).expanduser().resolve()
        how = "is" if real == f else "is inside" if f in real.parents else "contains" if real in f.parents else ""
        if how:
            raise ExportError(f"{option} {str(target)!r}: {real} {how} {f}, which an export must never replace "
                              "or write into (not even with --overwrite); choose another path, e.g. "
                              f"{f.parent / 'export-hf'}")
    if not path.exists():
        return path
    if kind == "dir":
        if not path.is_dir():
            raise ExportError(f"{option} {str(target)!r} is a file, not a directory; choose another path"
                              + ("" if not overwrite else " (--overwrite replaces directories, not files)"))
        if overwrite or not any(path.iterdir()) or _is_our_dir(path):
            return path
        raise ExportError(f"{option} {str(target)!r} is a directory with other files in it (not a previous jaxgpt "
                          f"export: no {MARKER}); writing there would replace them. Choose a new or empty "
                          "directory, or pass --overwrite to replace it")
    if path.is_dir():
        raise ExportError(f"{option} {str(target)!r} is a directory; give a file name, e.g. "
                          f"{str(Path(target) / 'model.pt')!r}")
    if overwrite or _is_our_file(path):
        return path
    raise ExportError(f"{option} {str(target)!r} exists and is not a previous jaxgpt export; choose a new file "
                      "name, or pass --overwrite to replace it")


@contextlib.contextmanager
def staged_dir(target: Path, mark: dict[str, Any]) -> Iterator[Path]:
    """Yield a temporary directory beside ``target`` to fill; on success it gets the marker and replaces
    ``target`` (see the module docstring); on any error it is removed and ``target`` is untouched."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        (tmp / MARKER).write_text(json.dumps(mark, indent=2) + "\n")
        _swap_in(tmp, target, remove=lambda p: shutil.rmtree(p, ignore_errors=True))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def staged_file(target: Path, mark: dict[str, Any]) -> Iterator[Path]:
    """Yield a temporary file path beside ``target`` to write a ``torch.save`` archive to; on success the marker
    is added to the archive and the file replaces ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with zipfile.ZipFile(tmp, "a") as z:
            root = z.namelist()[0].split("/")[0]
            z.writestr(f"{root}/{MARKER}", json.dumps(mark))
        _swap_in(tmp, target, remove=lambda p: p.unlink(missing_ok=True))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _swap_in(new: Path, target: Path, *, remove) -> None:
    if not target.exists():
        new.rename(target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        old.rename(target)
        raise
    remove(old)
