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


def test_a_waiting_lock_times_out_naming_the_holder(tmp_path):
    d = make_dir(tmp_path / "shards")
    waits = []
    with DirLock(d, what="shard directory", option="data_dir"):
        t0 = time.monotonic()
        with pytest.raises(DirLocked) as e:
            DirLock(d, what="shard directory", option="data_dir").acquire(wait_s=0.5, on_wait=waits.append, poll_s=0.05)
        assert time.monotonic() - t0 >= 0.5
    assert len(waits) == 1 and waits[0]["pid"] == os.getpid()  # told once, with the holder
    msg = str(e.value)
    assert f"in use by process {os.getpid()}" in msg and "(still, after waiting 0.5 s)" in msg
    assert "choose another data_dir" in msg


def _holder(d: Path, then: str) -> subprocess.Popen:
    code = ("import os, sys, time; from jaxgpt.rundir import DirLock; lock = DirLock(sys.argv[1]).acquire(); "
            f"print('locked', flush=True); time.sleep(1.0); {then}; lock.release()")
    return subprocess.Popen([sys.executable, "-c", code, str(d)], cwd=REPO, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("then", ["pass", "lock.remove_file()", "lock.remove_file(); os.rmdir(sys.argv[1])"])
def test_a_waiter_gets_the_lock_when_the_holder_lets_go(tmp_path, then):
    """Also when the holder removed the lock file (and its directory) first, as a failed `jaxgpt.data` into a new
    directory does: the waiter then holds the lock file that is at the path, not an unlinked one."""
    d = make_dir(tmp_path / "shards")
    proc = _holder(d, then)
    try:
        assert proc.stdout.readline().strip() == "locked"
        waits = []
        with DirLock(d).acquire(wait_s=60, on_wait=waits.append, poll_s=0.05) as lock:
            assert [w["pid"] for w in waits] == [proc.pid]
            held, there = os.fstat(lock._fd), os.stat(lock.path)
            assert (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)
            assert json.loads(lock.path.read_text())["pid"] == os.getpid()
            with pytest.raises(DirLocked):  # and it excludes the next one
                DirLock(d).acquire()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_lock_on_a_removed_lock_file_is_taken_again(tmp_path, monkeypatch):
    """The holder removes the lock file and lets go between this process's open() and its flock(): the flock
    succeeds on the unlinked file, which excludes nobody; acquire must see that and lock the file at the path."""
    import fcntl

    d = make_dir(tmp_path / "shards")
    holder = DirLock(d).acquire()
    real_flock = fcntl.flock
    calls = []

    def flock(fd, op):
        if op & fcntl.LOCK_EX and holder.held:  # the waiter's first try: the holder finishes just before it
            calls.append(os.fstat(fd).st_ino)
            holder.remove_file()
            holder.release()
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with DirLock(d).acquire() as lock:
        monkeypatch.undo()
        held, there = os.fstat(lock._fd), os.stat(lock.path)
        assert len(calls) == 1  # the holder let go exactly once, between open and flock
        assert (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)
        with pytest.raises(DirLocked):
            DirLock(d).acquire()
