"""jaxgpt.rundir: a directory with one writer: clear errors for unusable paths, a lock that names its holder and
never outlives a killed holder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxgpt.rundir import LOCK_NAME, DirError, DirLock, DirLocked, locked_dir, make_dir

REPO = Path(__file__).resolve().parent.parent


def test_second_lock_is_refused_and_names_the_holder(tmp_path):
    with locked_dir(tmp_path / "run", what="run directory") as d:
        holder = json.loads((d / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["host"]
        with pytest.raises(DirLocked) as e:
            DirLock(d, what="run directory").acquire()
        msg = str(e.value)
        assert f"process {os.getpid()}" in msg and "in use" in msg and "another out_dir" in msg
        assert e.value.holder["pid"] == os.getpid()
    with DirLock(tmp_path / "run") as lock:  # released: free again
        assert lock.held
    assert not lock.held


def test_a_killed_holder_never_blocks(tmp_path):
    d = make_dir(tmp_path / "run")
    code = ("import sys, time; from jaxgpt.rundir import DirLock; DirLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(d)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(DirLocked, match=f"process {proc.pid}"):
            DirLock(d).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert json.loads((d / LOCK_NAME).read_text())["pid"] == proc.pid  # the stale file is still there ...
    deadline = time.time() + 10
    with DirLock(d) as lock:  # ... and simply taken over
        assert lock.held and time.time() < deadline
        assert json.loads((d / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_unusable_paths_are_named(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DirError, match="'.*file' is a file, not a directory.*choose another out_dir"):
        make_dir(tmp_path / "file" / "run")
    with pytest.raises(DirError, match="is a file"):
        make_dir(tmp_path / "file")

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(DirError, match="cannot create the shard directory \\(Permission denied\\); choose another --out"):
        make_dir(tmp_path / "new", what="shard directory", option="--out")
    monkeypatch.undo()
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(DirError, match="not writable"):
        make_dir(tmp_path / "new")
