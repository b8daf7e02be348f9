"""Full disks and write errors (jaxgpt.diskspace and its callers): a clear exit-2 error naming the path, the
need and the free space, with nothing lost and nothing half-written taken for complete.

Real full file systems where the machine allows it: a small tmpfs mounted for the test (needs root; skipped
with a message otherwise). The same logic is also tested everywhere by fault injection (a write that raises
what the library raises on a full disk)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxgpt import diskspace, exportdir, rundir

REPO = Path(__file__).resolve().parent.parent
TINY = ["--config", str(REPO / "configs/tiny-test.yaml")]


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of the size asked for, unmounted after the test; skipped where mounting is not permitted."""
    mounted = []

    def make(size_mb: float) -> Path:
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size_mb * 1024)}k", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            why = f"cannot mount a tmpfs here ({(r.stderr or r.stdout).strip() or r.returncode})"
            if os.geteuid() != 0:  # a developer's machine: the fault-injection tests cover the same logic
                pytest.skip(f"{why}: a real full disk needs root")
            pytest.fail(f"{why}, as root (CI runs as root: this test must run there)")
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill(d: Path) -> None:
    """Fill the file system of ``d`` to the last byte."""
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


# ---- recognising a failed write, whatever the library ---------------------------------------------------
def test_write_failure_recognises_each_library_s_full_disk():
    class SafetensorError(Exception):
        pass

    assert diskspace.write_failure(OSError(errno.ENOSPC, "No space left on device"))[0] == errno.ENOSPC
    assert diskspace.write_failure(OSError(errno.EDQUOT, "Disk quota exceeded"))[0] == errno.EDQUOT
    orbax = ValueError('RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database: Failed to write 3065557 bytes '
                       "to file 5: No space left on device [os_error_code='28']")
    assert diskspace.write_failure(orbax) == (errno.ENOSPC, os.strerror(errno.ENOSPC))
    st = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert diskspace.write_failure(st)[0] == errno.ENOSPC
    torch_err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert "usually a full disk" in diskspace.write_failure(torch_err)[1]
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert diskspace.write_failure(wrapped)[0] == errno.ENOSPC
    assert diskspace.write_failure(ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 1 GB")) is None
    assert diskspace.write_failure(KeyError("x")) is None
    assert diskspace.human(1234567) == "1.23 MB" and diskspace.human(None) == "?"


# ---- the run directory's lock -----------------------------------------------------------------------------
def test_a_lock_that_cannot_be_written_leaves_no_lock_file(tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "pwrite", full)
    with pytest.raises(rundir.DirError, match=r"cannot write the lock file .* \(No space left on device\)"):
        rundir.DirLock(tmp_path, what="run directory").acquire()
    assert not (tmp_path / rundir.LOCK_NAME).exists()


def test_a_full_disk_at_start_is_an_error_and_leaves_no_lock(small_fs, capsys):
    d = small_fs(0.5)
    fill(d)
    with pytest.raises(rundir.DirError, match="cannot (write|create) the lock file"):
        rundir.DirLock(d, what="run directory").acquire()
    assert not (d / rundir.LOCK_NAME).exists()
    from jaxgpt.train import main

    out = d / "run"
    code = main(TINY + [f"--out_dir={out}", f"--data_dir={REPO / 'data_cache' / 'shakespeare'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "No space left on device" in err or "cannot create" in err
    assert not out.exists()  # the run directory it created is removed again


# ---- exports ----------------------------------------------------------------------------------------------
def test_export_write_errors_of_every_type_are_export_write_errors(tmp_path, monkeypatch):
    class SafetensorError(Exception):
        pass

    target = tmp_path / "hf"
    for exc in (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
                OSError(errno.ENOSPC, "No space left on device")):
        with pytest.raises(exportdir.ExportWriteError, match=f"cannot write {target}: .*nothing was changed"):
            with exportdir.staged_dir(target, {"kind": "hf"}, need=1000) as tmp:
                (tmp / "part").write_bytes(b"x" * 100)
                raise exc
        assert not target.exists() and list(tmp_path.iterdir()) == []  # the staging directory is gone too
    with pytest.raises(KeyError):  # not a write failure: passed on as it is
        with exportdir.staged_dir(target, {"kind": "hf"}):
            raise KeyError("x")
    monkeypatch.setattr(diskspace, "free_bytes", lambda p: 10)
    with pytest.raises(exportdir.ExportWriteError, match="needs about 1.00 kB but only 10 bytes is free"):
        with exportdir.staged_file(tmp_path / "sd.pt", {"kind": "t"}, need=1000):
            pytest.fail("the pre-check should refuse before anything is written")


def test_exports_into_a_full_tmpfs_exit_cleanly(small_fs, monkeypatch):
    import torch
    from safetensors.numpy import save_file

    d = small_fs(1)
    monkeypatch.setattr(exportdir, "_check_space", lambda target, need: None)  # reach the real write failure
    with pytest.raises(exportdir.ExportWriteError, match="No space left on device .*SafetensorError"):
        with exportdir.staged_dir(d / "hf", {"kind": "hf"}, need=4 << 20) as tmp:
            save_file({"a": np.ones(1 << 20, np.float32)}, str(tmp / "model.safetensors"))
    with pytest.raises(exportdir.ExportWriteError, match="torch's writer could not write"):
        with exportdir.staged_file(d / "sd.pt", {"kind": "t"}, need=4 << 20) as tmp:
            torch.save({"a": torch.ones(1 << 20)}, tmp)
    assert sorted(p.name for p in d.iterdir()) == []  # nothing left behind


# ---- data preparation -------------------------------------------------------------------------------------
def corpus(tmp_path: Path, mb: float) -> Path:
    rng = np.random.default_rng(0)
    words = ["the", "king", "and", "queen", "of", "a", "castle", "river", "stone", "light", "night", "day"]
    f = tmp_path / "corpus.txt"
    f.write_text(" ".join(rng.choice(words, size=int(mb * 1e6 / 5))))
    return f


def test_data_preparation_that_fills_the_disk_exits_2_and_leaves_nothing(small_fs, tmp_path, capsys):
    from jaxgpt.data.cli import main

    d = small_fs(0.5)
    out = d / "shards"
    code = main(["--input", str(corpus(tmp_path, 2)), "--out", str(out), "--quiet", "--shard-size", "100000"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "writing the shards failed" in err and "No space left on device" in err and "tokens" in err
    assert "free on that file system" in err
    assert not out.exists()  # created by this run: removed, lock and staging directory included


def test_data_preparation_write_error_by_fault_injection(tmp_path, monkeypatch, capsys):
    import importlib

    prepare_mod = importlib.import_module("jaxgpt.data.prepare")
    from jaxgpt.data.cli import main

    calls = {"n": 0}
    real = prepare_mod.ShardWriter._flush

    def flaky(self, n):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.out_dir / "x.bin"))
        return real(self, n)

    monkeypatch.setattr(prepare_mod.ShardWriter, "_flush", flaky)
    out = tmp_path / "shards"
    code = main(["--input", str(corpus(tmp_path, 0.3)), "--out", str(out), "--quiet", "--shard-size", "20000"])
    err = capsys.readouterr().err
    assert code == 2 and "No space left on device" in err and "nothing was moved into" in err
    assert not out.exists()


# ---- training ---------------------------------------------------------------------------------------------
def _train(out: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jaxgpt.train", *TINY, f"--out_dir={out}", "--max_steps=30", "--eval_interval=0",
           "--checkpoint_interval=3", "--sample_interval=-1", f"--data_dir={REPO / 'data_cache' / 'shakespeare'}",
           *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_checkpoint_save_that_fills_the_disk_stops_the_run_at_the_next_step(small_fs, tmp_path_factory):
    """tiny's checkpoints take ~20 MB: on a 32 MB disk the step-3 one fits and the step-6 one cannot. The
    pre-flight check refuses the run first; with --allow-low-disk it trains, and the failed save stops it with
    exit 2 within a step or two; step 3 stays restorable, the failed save shows as incomplete, the log is whole."""
    d = small_fs(32)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXGPT_DEBUG_STEP_SLEEP": "0.2",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "xla_cache_tiny"),  # (test_preempt's)
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    out = d / "run"
    refused = _train(out, env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "only" in refused.stderr and "is free on that file system" in refused.stderr
    assert "--allow_low_disk=true" in refused.stderr and "Traceback" not in refused.stderr
    assert not (out / rundir.LOCK_NAME).exists() or (out / rundir.LOCK_NAME).read_text() == ""

    ran = _train(out, env, "--allow-low-disk")
    err = ran.stderr
    assert ran.returncode == 2, err[-3000:]
    assert "Traceback" not in err and len(err.splitlines()) < 40, err[-3000:]
    assert "saving checkpoint step 6 into" in err and "No space left on device" in err
    assert "The newest intact checkpoint is step 3" in err and "free on the file system" in err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # every line whole
    last = max(r["step"] for r in records if r["type"] == "train")
    assert 6 <= last < 9  # noticed within the steps that follow, not at the end (30)
    listing = subprocess.run([sys.executable, "-m", "jaxgpt.checkpoint", "list", str(out)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    rows = {ln.split()[0]: ln for ln in listing.stdout.splitlines() if ln.strip()[:1].isdigit()}
    assert "ok" in rows["3"] and "incomplete" in rows["6"], listing.stdout


def test_the_sibling_writes_of_a_failed_save_are_not_logged_as_unretrieved(caplog):
    """A save that hits a full disk fails in several of orbax's write tasks at once; the first failure is reported
    (the run's one-line error), and asyncio's "Task exception was never retrieved" for the others (with their
    tracebacks: seen intermittently under the real full-disk test above) is dropped; other asyncio errors are not."""
    import logging

    from jaxgpt.checkpoint.integrity import quiet_abandoned_reads

    def async_serialize_from_host():  # the name of orbax's write coroutine
        raise ValueError("RESOURCE_EXHAUSTED: Error writing ... No space left on device")

    def write_fragment():  # its inner coroutine, gathered: the only frame of a failed _GatheringFuture (CI)
        raise ValueError("RESOURCE_EXHAUSTED: Error writing ... No space left on device")

    def something_else():
        raise ValueError("a real asyncio problem")

    quiet_abandoned_reads()
    caught = {}
    for name, fn in (("write", async_serialize_from_host), ("fragment", write_fragment), ("other", something_else)):
        try:
            fn()
        except ValueError as e:
            caught[name] = e
    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for e in caught.values():
            log.error("Task exception was never retrieved", exc_info=(type(e), e, e.__traceback__))
            log.error("_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished "
                      "exception=%r>", e, exc_info=(type(e), e, e.__traceback__))
    assert [r.exc_info[1] for r in caplog.records] == [caught["other"]] * 2


# ---- metrics.jsonl and loss.png ------------------------------------------------------------------------------
def _record(step: int) -> dict:
    return {"type": "train", "step": step, "loss": 10.5 - step / 100, "lr": 1e-3, "grad_norm": 1.25}


def _whole_records(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"a torn last line: {text[-200:]!r}"
    return [json.loads(line) for line in text.splitlines()]  # (a torn line would not parse)


def test_a_metrics_write_that_fails_mid_record_leaves_only_whole_records(tmp_path, monkeypatch):
    """Fault injection: the write of step 3's record takes 40 bytes and then hits ENOSPC. WriteFailed names the
    file and the step; the log holds steps 1-2 only, after close() too (nothing buffered is flushed later)."""
    from jaxgpt.train.metrics import MetricsLog

    log = MetricsLog(tmp_path, tensorboard=False, truncate_after=None)
    log.write(_record(1))
    log.write(_record(2))
    real_write, calls = os.write, {"n": 0}

    def full_after_40_bytes(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data[:40]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_after_40_bytes)
    with pytest.raises(diskspace.WriteFailed, match=r"metrics.jsonl: cannot append a record \(No space left on "
                       r"device\).*every record up to step 3 \(excluded\)"):
        log.write(_record(3))
    assert calls["n"] == 2 and log.failed
    assert _whole_records(tmp_path / "metrics.jsonl") == [_record(1), _record(2)]
    monkeypatch.setattr(os, "write", real_write)
    log.close()
    assert _whole_records(tmp_path / "metrics.jsonl") == [_record(1), _record(2)]


def test_a_metrics_write_into_a_full_tmpfs_leaves_only_whole_records(small_fs):
    """A real full disk: the record that straddles the last free page is written in part, then ENOSPC. The log is
    cut back to its whole records, and close() neither fails nor appends the rest of the record."""
    from jaxgpt.train.metrics import MetricsLog

    d = small_fs(1)
    log = MetricsLog(d, tensorboard=False, truncate_after=None)
    step, size = 1, len(json.dumps(_record(1))) + 1
    while (os.path.getsize(d / "metrics.jsonl") % 4096) < 4096 - size + 20:  # the next record crosses a page
        log.write(_record(step))
        step += 1
    fill(d)  # (the metrics file's last page still has room for the record's head)
    with pytest.raises(diskspace.WriteFailed, match="No space left on device"):
        log.write(_record(step))
    log.close()
    assert _whole_records(d / "metrics.jsonl") == [_record(s) for s in range(1, step)]


def test_a_full_disk_at_a_metrics_write_stops_training_with_exit_2(tmp_path, monkeypatch, capsys):
    """The run's own path (fault injection at step 3's record): one error line, exit 2, no traceback, a whole
    log, and no loss.png drawn onto the full disk."""
    from jaxgpt.train import main

    real_write, armed = os.write, {"on": True}

    def write(fd, data):
        if armed["on"] and os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl") and b'"step": 3,' in data:
            armed["on"] = False
            real_write(fd, bytes(data[:25]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    out = tmp_path / "run"
    code = main(TINY + [f"--out_dir={out}", f"--data_dir={REPO / 'data_cache' / 'shakespeare'}", "--max_steps=6",
                        "--eval_interval=0", "--checkpoint_interval=0", "--sample_interval=-1"])
    err = capsys.readouterr().err
    assert not armed["on"], "the fault was never injected"
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"error: {out / 'metrics.jsonl'}: cannot append a record (No "
                                                   "space left on device)")
    assert [r["step"] for r in _whole_records(out / "metrics.jsonl") if r["type"] == "train"] == [1, 2]
    assert not (out / "loss.png").exists()


def test_plotting_leaves_matplotlib_s_backend_alone(tmp_path):
    """loss.png is drawn without pyplot: a notebook that trains keeps its own backend (plt.show() still works)."""
    import matplotlib

    from jaxgpt.train.metrics import plot_losses

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(_record(s)) + "\n" for s in (1, 2, 3)))
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # stands for a notebook's backend: anything but Agg
    try:
        assert plot_losses(tmp_path) == tmp_path / "loss.png"
        assert matplotlib.get_backend() == "svg"
        assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        matplotlib.use(before)


# ---- an interrupted save in the listing -------------------------------------------------------------------
def test_checkpoint_list_shows_a_real_interrupted_save_as_incomplete(tmp_path):
    """A process saves step 1, then starts saving step 2 (64 MB) and is SIGKILLed while orbax writes it."""
    run = tmp_path / "run"
    script = f"""
import os, signal, jax, jax.numpy as jnp
from jaxgpt.checkpoint import Checkpoints
ck = Checkpoints({str(run)!r}, keep=3)
small = {{"w": jnp.ones((4,))}}
ck.save(1, params=small, opt_state=small, config={{"model": {{}}}})
ck.wait()
big = {{"w": jax.random.normal(jax.random.key(0), (4096, 4096))}}
ck.save(2, params=big, opt_state=big, config={{"model": {{}}}})
import time
t = time.monotonic()  # orbax creates the temporary directory in its background thread: wait for it (while the
while time.monotonic() - t < 10 and not any(n.startswith("2.") for n in os.listdir(ck.directory)):  # arrays are
    time.sleep(0.001)  # still being written), then kill
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr[-2000:]
    names = os.listdir(run / "checkpoints")
    assert "1" in names and "2" not in names and any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names
    listing = subprocess.run([sys.executable, "-m", "jaxgpt.checkpoint", "list", str(run)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    rows = {ln.split()[0]: ln for ln in listing.stdout.splitlines() if ln.strip()[:1].isdigit()}
    assert "incomplete" in rows["2"] and "ok" in rows["1"], listing.stdout


# ---- the shards' tokenizer records ------------------------------------------------------------------------
def test_a_shard_whose_header_names_another_tokenizer_is_refused(tmp_path):
    from jaxgpt.data import DataError, check_shards_for_model, prepare
    from jaxgpt.data.shards import _read_json

    out = prepare([str(corpus(tmp_path, 0.05))], tmp_path / "shards", shard_size=5000, verbose=False)
    check_shards_for_model(out, 50304)
    header_path = sorted(out.glob("*_train_*.json"))[1]
    header = _read_json(header_path)
    header.update(tokenizer="cl100k_base", vocab_size=100277, eot_token=100257)
    header_path.write_text(json.dumps(header))
    with pytest.raises(DataError) as e:
        check_shards_for_model(out, 50304)
    msg = str(e.value)
    assert str(header_path.with_suffix(".bin")) in msg and "'cl100k_base'" in msg and "'gpt2'" in msg
    assert "manifest" in msg and "--force" in msg
    (out / "manifest.json").unlink()  # without a manifest: compared with the model's tokenizer
    with pytest.raises(DataError, match="jaxgpt's tokenizer"):
        check_shards_for_model(out, 50304)


def test_ctrl_c_in_data_preparation_exits_130_with_one_line_and_leaves_nothing(tmp_path):
    """A real SIGINT to `python -m jaxgpt.data` while it tokenizes: one line, exit 130, no traceback, no shards."""
    import time

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "shards"
    p = subprocess.Popen([sys.executable, "-m", "jaxgpt.data", "--input", str(corpus(tmp_path, 12)), "--out",
                          str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = b""
        while b"tokenizing" not in seen and p.poll() is None:  # its progress bar: it is tokenizing
            seen += os.read(p.stderr.fileno(), 4096)
        assert p.poll() is None, seen.decode()[-2000:]
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, rest = p.communicate(timeout=60)
        err = (seen + rest).decode()
    finally:
        p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("jaxgpt.data: interrupted"), err[-2000:]
    assert err.count("jaxgpt.data:") == 1  # one line (besides the progress bar)
    assert "jaxgpt.data: interrupted (Ctrl-C); no shards were committed" in err
    assert not out.exists()


@pytest.mark.parametrize("module, tool", [("jaxgpt.data.__main__", "jaxgpt.data.cli"),
                                          ("jaxgpt.checkpoint.__main__", "jaxgpt.checkpoint.cli"),
                                          ("jaxgpt.eval.__main__", "jaxgpt.eval.cli"),
                                          ("jaxgpt.train.__main__", "jaxgpt.train.cli"),
                                          ("jaxgpt.generate.__main__", "jaxgpt.generate.cli"),
                                          ("jaxgpt.account.__main__", "jaxgpt.account.cli")])
def test_every_cli_runs_through_the_interrupt_handler(module, tool, capsys):
    """Each entry point imports jaxgpt.interrupt before anything else and hands run_cli the tool to import, so a
    Ctrl-C during the tool's imports is one line too; a full disk is exit 2 with one line. (Real Ctrl-Cs:
    tests/test_preempt.py.)"""
    import ast
    import importlib.util

    from jaxgpt.interrupt import run_cli

    prog = module.removesuffix(".__main__")
    body = ast.parse(Path(importlib.util.find_spec(module).origin).read_text()).body
    body = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))  # docstring
            and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    first = body[0]  # the first statement: the interrupt handler's import (in the `__main__` guard for a module)
    imports = [n for n in ast.walk(first) if isinstance(n, ast.ImportFrom)]
    assert imports and imports[0].module == "jaxgpt.interrupt", ast.dump(first)[:300]
    calls = [n for n in ast.walk(ast.Module(body=body, type_ignores=[])) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "run_cli"]
    assert len(calls) == 1 and [a.value for a in calls[0].args] == [f"{tool}:main", prog]

    def full() -> int:
        raise diskspace.WriteFailed("x: no space")

    handler, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    try:
        with pytest.raises(SystemExit) as e:
            run_cli(full, prog)
    finally:  # (run_cli keeps its own for the rest of a process's life)
        signal.signal(signal.SIGINT, handler)
        sys.unraisablehook = hook
    assert e.value.code == 2 and capsys.readouterr().err == f"{prog}: error: x: no space\n"


# ---- the same logic by fault injection (runs everywhere, no mount needed) ------------------------------------
def test_a_failed_background_save_is_reported_by_the_next_check(tmp_path, monkeypatch):
    """orbax reports a full disk from its background thread as ``ValueError: RESOURCE_EXHAUSTED ... No space left
    on device`` at the next wait: ``check()`` (once per training step) surfaces it as CheckpointWriteFailed naming
    the step, its size, the free space and the newest intact step; the intact step stays restorable."""
    import time

    import jax.numpy as jnp

    from jaxgpt.checkpoint import Checkpoints
    from jaxgpt.checkpoint.manager import CheckpointWriteFailed

    ck = Checkpoints(tmp_path / "run", keep=3)
    tree = {"w": jnp.arange(1000, dtype=jnp.float32)}
    ck.save(1, params=tree, opt_state=tree, config={"model": {}})
    ck.check()
    ck.wait()
    failing = {"armed": False}
    real_wait = ck.manager.wait_until_finished

    def wait_until_finished():
        real_wait()
        if failing.pop("armed", False):  # what a failed save leaves: orbax's temporary directory, not the step
            (ck.directory / "2").rename(ck.directory / "2.orbax-checkpoint-tmp-1234")
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database: Failed to write 4000 '
                             "bytes to file 5: No space left on device [os_error_code='28']")

    monkeypatch.setattr(ck.manager, "wait_until_finished", wait_until_finished)
    ck.save(2, params=tree, opt_state=tree, config={"model": {}})
    failing["armed"] = True
    with pytest.raises(CheckpointWriteFailed) as e:
        for _ in range(400):  # (the save ends in the background; check() waits for nothing meanwhile)
            ck.check()
            time.sleep(0.05)
    msg = str(e.value)
    assert f"saving checkpoint step 2 into {ck.directory} failed: No space left on device" in msg
    assert "it needed about 8.00 kB" in msg and "free on the file system" in msg
    assert e.value.step == 2 and e.value.latest == 1 and "The newest intact checkpoint is step 1" in msg
    assert "re-run the same command" in msg and ck.all_steps() == [1]
    ck.check()  # reported once
    ck.close()


def test_the_pre_flight_check_refuses_a_small_disk(tmp_path, monkeypatch, capsys):
    from jaxgpt.train import main

    monkeypatch.setattr(diskspace, "free_bytes", lambda p: 5_000_000)  # 5 MB: less than one tiny checkpoint
    args = TINY + [f"--out_dir={tmp_path / 'run'}", f"--data_dir={REPO / 'data_cache' / 'shakespeare'}",
                   "--max_steps=2", "--eval_interval=0", "--sample_interval=-1", "--plot=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the run will keep up to 1 checkpoint of" in err and "only 5.00 MB is free" in err
    assert "--allow_low_disk=true" in err and "Traceback" not in err
    assert not list((tmp_path / "run" / "checkpoints").glob("[0-9]*"))  # (--allow-low-disk: the tmpfs test)
