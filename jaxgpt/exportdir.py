"""Exports that never destroy: a Hugging Face directory or a torch_ref ``state_dict`` file is written beside its
target and renamed into place, and only where nothing of someone else's would be lost.

A target may be written when it does not exist, is an empty directory, or is a previous export of ours: a
directory holding the marker ``jaxgpt_export.json`` and nothing but the files that export wrote (the marker lists
them), or a ``.pt`` file whose zip archive holds that record (which ``torch.load`` ignores). Anything else is
refused unless ``overwrite=True`` (a directory of ours to which someone added files is refused too, naming those
files). Some targets are refused even then:

* the run's ``checkpoints/`` (with ``run_dir``): the target may not be it, lie inside it or contain it;
* the ``run_dir`` itself: the target may not be it or contain it, and inside it only a new path or a previous
  export of ours may be written: the run's own files and folders (``config.yaml``, ``metrics.jsonl``,
  ``summary.json``, the lock, anything else already there) are never replaced, not even with ``overwrite``.

Before anything is read or written, the target's parent must be creatable and writable. Replacing a previous
export renames the old one aside, renames the new one in, and only then deletes the old one, so an interrupted
export leaves the old export or the new one, never half of either. The staging paths beside the target are named
``.<name>.tmp-<host>-<pid>-*`` (and ``.<name>.old-<host>-<pid>``); ones left by a process that was killed (its
pid no longer alive on this host, and older than the current process) are removed by the next export to the
same target. An export gets the permissions the umask gives new files and directories (staging is private, and
some writers create their files 0600). An ``OSError`` while writing (disk full, permissions) is an
:class:`ExportWriteError` (an :class:`ExportError` and an ``OSError``) naming the target, which is left as it was.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import socket
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxgpt import diskspace

MARKER = "jaxgpt_export.json"
CHECKPOINTS = "checkpoints"  # a run directory's checkpoints (jaxgpt.checkpoint.CHECKPOINT_SUBDIR; not imported: orbax)
# what save_hf wrote before the marker listed the files (exports made before this list existed)
_HF_FILES = frozenset({"config.json", "model.safetensors", "generation_config.json", "vocab.json", "merges.txt",
                       "tokenizer_config.json", "special_tokens_map.json"})


class ExportError(ValueError):
    """The export target would lose data, or cannot be written; the message names it and the fix."""


class ExportWriteError(ExportError, OSError):
    """Writing the export failed (disk full, permissions, ...): an :class:`ExportError` with a clear message, and
    still an ``OSError`` for callers that catch those; the target is as it was."""


def marker(kind: str, **source: Any) -> dict[str, Any]:
    return {"format": "jaxgpt-export", "kind": kind, "time": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), **source}


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        m = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == "jaxgpt-export" else None


def export_record(path: str | os.PathLike) -> dict[str, Any]:
    """The marker an export of ours carries (a directory's ``jaxgpt_export.json``, or the record inside a ``.pt``
    archive): the run and step it came from, its tokenizer and, since exports record it, its model config
    (``model``). ``{}`` when there is none (not an export of ours, or unreadable)."""
    path = Path(path)
    if path.is_dir():
        return _read_marker(path) or {}
    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("/" + MARKER)), None)
            m = json.loads(z.read(name)) if name else {}
    except (OSError, ValueError, zipfile.BadZipFile):
        m = {}
    return m if isinstance(m, dict) else {}


def export_tokenizer(path: str | os.PathLike) -> dict[str, Any] | None:
    """The tokenizer record an export of ours carries in its marker (a character model's vocabulary); None:
    GPT-2's BPE (a Hugging Face directory, or an export of a BPE model). A ``.pt`` file: its archive's record."""
    rec = export_record(path).get("tokenizer")
    return rec if isinstance(rec, dict) else None


def _foreign_entries(path: Path) -> list[str] | None:
    """For a directory with our marker: the entries that export did not write (sorted; a subdirectory ends in
    ``/``); None when there is no marker (not ours at all)."""
    m = _read_marker(path)
    if m is None:
        return None
    files = m.get("files")
    ours = set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else set(_HF_FILES)
    ours.add(MARKER)
    return sorted(e.name + ("/" if e.is_dir() and not e.is_symlink() else "") for e in path.iterdir()
                  if e.name not in ours or e.is_symlink() or not e.is_file())


def _is_our_dir(path: Path) -> bool:
    """A previous export of ours: the marker, and nothing but the files that export wrote."""
    try:
        return _foreign_entries(path) == []
    except OSError:
        return False


def _is_our_file(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("/" + MARKER)), None)
            return name is not None and json.loads(z.read(name)).get("format") == "jaxgpt-export"
    except (OSError, ValueError, zipfile.BadZipFile, AttributeError):
        return False


def _listing(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _suggestion(run_dir: Path, kind: str) -> Path:
    return run_dir.parent / (f"{run_dir.name}-hf" if kind == "dir" else f"{run_dir.name}.pt")


def check_target(target: str | os.PathLike, *, kind: str, overwrite: bool = False,
                 run_dir: str | os.PathLike | None = None, option: str = "--to-hf") -> Path:
    """The absolute target if writing ``kind`` ("dir" or "file") there loses nothing and can be done; else
    :class:`ExportError` (see the module docstring for ``run_dir`` and ``overwrite``)."""
    path = Path(target).expanduser().absolute()
    real = path.resolve()
    shown = f"{option} {str(target)!r}"
    run = None if run_dir is None else Path(run_dir).expanduser().resolve()
    if run is not None:
        hint = _suggestion(run, kind)
        ckpts = (run / CHECKPOINTS).resolve()
        how = "is" if real == ckpts else "is inside" if ckpts in real.parents else "contains" if real in ckpts.parents \
            else ""
        if how:
            raise ExportError(f"{shown}: {real} {how} {ckpts}, which an export must never replace or write into "
                              f"(not even with --overwrite); choose another path, e.g. {str(hint)!r}")
        if real == run or real in run.parents:
            raise ExportError(f"{shown}: {real} {'is' if real == run else 'contains'} the run directory {run}, "
                              f"which an export must never replace (not even with --overwrite); choose another "
                              f"path, e.g. {str(hint)!r}")
        if run in real.parents and (path.exists() or path.is_symlink()):
            ours = _is_our_dir(path) if kind == "dir" and path.is_dir() else \
                kind == "file" and path.is_file() and _is_our_file(path)
            if not ours:
                raise ExportError(f"{shown}: {real} is already in the run directory {run} and is not a previous "
                                  "jaxgpt export of this kind; an export never replaces the run's own files or "
                                  "folders (not even with --overwrite). Choose a new path, e.g. "
                                  f"{str(hint)!r}")
    _check_writable(path, shown)
    if not path.exists():
        return path
    if kind == "dir":
        if not path.is_dir():
            raise ExportError(f"{shown} is a file, not a directory; choose another path"
                              + ("" if not overwrite else " (--overwrite replaces directories, not files)"))
        if overwrite or not any(path.iterdir()):
            return path
        foreign = _foreign_entries(path)
        if foreign == []:
            return path
        if foreign is None:
            raise ExportError(f"{shown} is a directory with other files in it (not a previous jaxgpt export: no "
                              f"{MARKER}); writing there would replace them. Choose a new or empty directory, or "
                              "pass --overwrite to replace it")
        raise ExportError(f"{shown} is a previous jaxgpt export to which other files were added ("
                          f"{_listing(foreign)}); writing there would delete them. Move them out, choose another "
                          "directory, or pass --overwrite to replace it with them")
    if path.is_dir():
        raise ExportError(f"{shown} is a directory; give a file name, e.g. {str(Path(target) / 'model.pt')!r}")
    if overwrite or _is_our_file(path):
        return path
    raise ExportError(f"{shown} exists and is not a previous jaxgpt export; choose a new file name, or pass "
                      "--overwrite to replace it")


def _check_writable(path: Path, shown: str) -> None:
    """The target's parent exists as a directory we can create files in, or can be created: probe the nearest
    existing ancestor with a file created and removed at once (permission bits do not tell: root, /sys,
    read-only mounts)."""
    parent = path.parent
    existing = next((p for p in [parent, *parent.parents] if p.exists() or p.is_symlink()), None)
    if existing is None or not existing.is_dir():
        raise ExportError(f"{shown}: {existing} is not a directory, so {parent} cannot be created; choose another "
                          "path")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ExportError(f"{shown}: cannot create files in {existing} ({e.strerror or e}); choose a writable "
                          "location") from e


# ---- staging ----------------------------------------------------------------------------------------------
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _stage_prefix(target: Path, what: str) -> str:
    return f".{target.name}.{what}-{_host()}-{os.getpid()}"


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # (racy with other threads; only where /proc has no Umask line)
    os.umask(mask)
    return mask


def _process_start() -> float:
    """This process's start time (seconds since the epoch, at most one clock tick early): its age from
    /proc/self/stat against the boot clock, subtracted from now (``btime`` in /proc/stat is whole seconds off the
    wall clock); the import time where there is no /proc."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


_IMPORTED = time.time()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def remove_stale_staging(target: Path) -> list[Path]:
    """Remove what killed exports to ``target`` left beside it: ``.<name>.tmp-<host>-<pid>-*`` staging paths (and
    ``.<name>.old-<host>-<pid>`` copies of a replaced export, once ``target`` exists again) of this host whose pid
    is no longer alive and which are older than this process. Returns what was removed."""
    pattern = re.compile(r"^\." + re.escape(target.name) + r"\.(tmp|old)-" + re.escape(_host())
                         + r"-(\d+)(-[A-Za-z0-9_]+)?$")
    started, removed = _process_start(), []
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = pattern.match(p.name)
        if m is None or (m.group(1) == "old" and not target.exists()):
            continue
        try:
            if _alive(int(m.group(2))) or p.lstat().st_mtime >= started:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except OSError:
            continue
    return removed


@contextlib.contextmanager
def staged_dir(target: Path, mark: dict[str, Any], *, need: int | None = None) -> Iterator[Path]:
    """Yield a temporary directory beside ``target`` to fill; on success it gets the marker (listing the files
    written) and replaces ``target`` (see the module docstring); on any error it is removed and ``target`` is
    untouched (an ``OSError`` becomes an :class:`ExportError`)."""
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(target)
        _check_space(target, need)
        tmp = Path(tempfile.mkdtemp(prefix=_stage_prefix(target, "tmp") + "-", dir=target.parent))
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:  # some writers create private files (safetensors: 0600); an export is shared as usual
            if (tmp / name).is_file() and not (tmp / name).is_symlink():
                os.chmod(tmp / name, 0o666 & ~_umask())
        (tmp / MARKER).write_text(json.dumps({**mark, "files": files}, indent=2) + "\n")
        _swap_in(tmp, target, remove=lambda p: shutil.rmtree(p, ignore_errors=True))
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        err = _write_error(e, target, need)
        if err is e:
            raise
        raise err from e


@contextlib.contextmanager
def staged_file(target: Path, mark: dict[str, Any], *, need: int | None = None) -> Iterator[Path]:
    """Yield a temporary file path beside ``target`` to write a ``torch.save`` archive to; on success the marker
    is added to the archive and the file replaces ``target`` (an ``OSError`` becomes an :class:`ExportError`)."""
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(target)
        _check_space(target, need)
        fd, name = tempfile.mkstemp(prefix=_stage_prefix(target, "tmp") + "-", dir=target.parent)
        os.close(fd)
        tmp = Path(name)
        os.chmod(tmp, 0o666 & ~_umask())
        yield tmp
        with zipfile.ZipFile(tmp, "a") as z:
            root = z.namelist()[0].split("/")[0]
            z.writestr(f"{root}/{MARKER}", json.dumps(mark))
        _swap_in(tmp, target, remove=lambda p: p.unlink(missing_ok=True))
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        err = _write_error(e, target, need)
        if err is e:
            raise
        raise err from e


def _check_space(target: Path, need: int | None) -> None:
    """Refuse before writing when the file system of ``target`` has less free space than the export needs."""
    free = diskspace.free_bytes(target.parent)
    if need and free is not None and free < need:
        raise ExportWriteError(f"cannot write {target}: it needs about {diskspace.human(need)} but only "
                               f"{diskspace.human(free)} is free on that file system; nothing was written. Free "
                               "space or choose a target on another disk")


def _write_error(e: BaseException, target: Path, need: int | None) -> BaseException:
    """A failed write as :class:`ExportWriteError` naming the path, the need and the free space: an ``OSError``, or
    a full disk reported as another type (safetensors' ``SafetensorError``, torch's ``RuntimeError``)."""
    if isinstance(e, ExportError):
        return e
    why = diskspace.write_failure(e) if isinstance(e, Exception) else None
    if not isinstance(e, OSError) and why is None:
        return e
    reason = _os_reason(e) if isinstance(e, OSError) else f"{why[1]} ({type(e).__name__})"
    return ExportWriteError(f"cannot write {target}: {reason}; " + diskspace.describe_space(target.parent, need)
                            + "; nothing was changed there (the partial export was removed)")


def _os_reason(e: OSError) -> str:
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return f"{e.strerror}{where}" if e.strerror else str(e)


def _swap_in(new: Path, target: Path, *, remove) -> None:
    if not target.exists():
        new.rename(target)
        return
    old = target.with_name(_stage_prefix(target, "old"))
    target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        old.rename(target)
        raise
    remove(old)
    remove_stale_staging(target)  # an old copy a killed export left while the target was missing
