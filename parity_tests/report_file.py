"""The parity report file named by $JAXGPT_PARITY_REPORT: each pytest process merges its measured numbers into it at
the end of its session. Several processes can end at once (pytest-xdist's workers, or two runs side by side), so a
merge holds an exclusive lock on a companion ``.lock`` file while it reads, merges and replaces the report: no
process's numbers are lost, and a reader never sees a half-written file."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path


def merge_into(path: str | os.PathLike, numbers: dict[str, dict[str, float]]) -> None:
    """Add ``numbers`` (key -> measured name -> value) to the JSON report at ``path``; a key already there is
    replaced by the new one."""
    path = Path(path)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        old = json.loads(path.read_text()) if path.is_file() else {}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**old, **numbers}, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
