"""Preemption (jaxgpt.train.preempt, jaxgpt.train.stopping): real SIGTERM / SIGINT sent to real training
processes. The step in hand is saved, the exit status is 128 + signal, and the resumed run repeats the
uninterrupted one bit for bit (the SIGKILL resume test's standard); a second signal lets the save finish, a
third abandons it leaving the earlier checkpoints intact; two processes save the same step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxgpt.train import read_metrics

REPO = Path(__file__).resolve().parent.parent
TINY = ["--config", str(REPO / "configs/tiny-test.yaml")]
ARGS = ["--max_steps=10", "--checkpoint_interval=4", "--eval_interval=3", "--sample_interval=0",
        f"--data_dir={REPO / 'data_cache' / 'shakespeare'}"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "xla_cache_tiny"  # shared with test_disk's tiny runs
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def cmd(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "jaxgpt.train", *TINY, f"--out_dir={out}", *ARGS, *args]


def losses(run_dir: Path) -> list[tuple[str, int, float]]:
    return [(r["type"], r["step"], r["loss"] if r["type"] == "train" else r["val_loss"])
            for r in read_metrics(run_dir) if r["type"] in ("train", "eval")]


def steps_done(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out) if r["type"] == "train"] if out.exists() else []


def saved_steps(out: Path) -> list[int]:
    d = out / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def start(out: Path, env: dict, *args: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(cmd(out, *args), cwd=REPO, env={**env, **extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(proc: subprocess.Popen, ready, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not ready():
        time.sleep(0.05)
    if proc.poll() is not None:
        raise AssertionError(f"the run ended (exit {proc.returncode}) before the signal:\n{proc.stdout.read()[-3000:]}")
    assert ready(), "timed out waiting for the run"


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    out = tmp_path_factory.mktemp("reference")
    proc = subprocess.run(cmd(out), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_sigterm_saves_the_step_in_hand_and_resumes_bit_for_bit(tmp_path, env, reference):
    """SIGTERM after step 5 or later, then a second SIGTERM during the save: the step in hand is saved (not the
    step-4 interval checkpoint), exit 143, and the resumed run's losses equal the reference run's bit for bit."""
    out = tmp_path / "run"
    proc = start(out, env, JAXGPT_DEBUG_STEP_SLEEP="0.3", JAXGPT_DEBUG_SAVE_SLEEP="1")
    wait_for(proc, lambda: len(steps_done(out)) >= 5)  # past the step-4 checkpoint: steps 5.. are at stake
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(1.0)  # most likely inside the save (the test hook holds it open for 2 s)
    os.kill(proc.pid, signal.SIGTERM)  # a second signal: the save goes on
    log = finish(proc)
    assert proc.returncode == 143, log[-3000:]
    assert ("SIGTERM again: letting the save of step" in log
            or "SIGTERM again: the step in hand is being finished and saved" in log), log[-3000:]
    stopped = max(steps_done(out))
    assert 5 <= stopped < 10
    assert saved_steps(out)[-1] == stopped  # the step in hand, not the last interval checkpoint (4)
    assert f"SIGTERM: stopped after step {stopped}; saved checkpoint step {stopped}" in log
    assert "Resume with the same command" in log and "Traceback" not in log
    assert not (out / "summary.json").exists() and not (out / "loss.png").exists()

    resumed = subprocess.run(cmd(out), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {stopped}" in resumed.stdout
    assert losses(out) == losses(reference)  # every train and val loss, bit-identical


@pytest.mark.slow  # (the default suite's SIGTERM test sends a second signal too)
def test_sigint_and_a_second_signal_during_the_save_let_it_finish(tmp_path, env):
    out = tmp_path / "run"
    proc = start(out, env, JAXGPT_DEBUG_STEP_SLEEP="0.2", JAXGPT_DEBUG_SAVE_SLEEP="1.5")
    wait_for(proc, lambda: len(steps_done(out)) >= 2)
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C
    time.sleep(1.0)  # inside the save (the test hook holds it open for 3 s)
    os.kill(proc.pid, signal.SIGINT)
    log = finish(proc)
    assert proc.returncode == 130, log[-3000:]
    assert "SIGINT again: letting the save of step" in log and "Traceback" not in log
    stopped = max(steps_done(out))
    assert saved_steps(out)[-1] == stopped and f"saved checkpoint step {stopped}" in log
    listing = subprocess.run([sys.executable, "-m", "jaxgpt.checkpoint", "list", str(out)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and f"{stopped}" in listing.stdout and "incomplete" not in listing.stdout


@pytest.mark.slow
def test_a_third_signal_abandons_the_save_and_keeps_the_earlier_checkpoints(tmp_path, env):
    out = tmp_path / "run"
    proc = start(out, env, JAXGPT_DEBUG_STEP_SLEEP="0.2", JAXGPT_DEBUG_SAVE_SLEEP="4")
    wait_for(proc, lambda: len(steps_done(out)) >= 6)  # the step-4 checkpoint is written
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)
    log = finish(proc)
    assert proc.returncode == 143, log[-3000:]
    assert "SIGTERM a third time: abandoning the save of step" in log
    assert saved_steps(out) == [4]  # the earlier checkpoint, intact
    resumed = subprocess.run(cmd(out, "--max_steps=6"), cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0 and "resumed from step 4" in resumed.stdout, resumed.stderr[-3000:]


def test_a_signal_before_the_first_step_ends_the_run_with_nothing_to_save(tmp_path, env):
    out = tmp_path / "run"
    proc = start(out, env)
    wait_for(proc, lambda: (out / "metrics.jsonl").exists() or False, timeout=180)  # set up, before the loop
    os.kill(proc.pid, signal.SIGTERM)
    log = finish(proc)
    if proc.returncode == 143 and "stopped after step" in log:  # the loop had already begun: a save, as above
        assert saved_steps(out)
        return
    assert proc.returncode == 143, log[-3000:]
    assert "interrupted by SIGTERM before the first step: nothing was trained" in log and "Traceback" not in log
    assert saved_steps(out) == []


@pytest.mark.slow  # three 2-process runs: ~2-4 min on 2 shared cores
def test_two_processes_agree_on_the_step_to_save_and_resume_bit_for_bit(tmp_path):
    """SIGTERM to process 1 only: it posts a notice, process 0 sees it at its next step, both save the same step
    (the largest either had reached) and exit 143. Resumed as 2 processes, the run repeats an uninterrupted
    2-process run bit for bit."""
    from tests.test_multihost import _env, _train_cmd, free_port

    cache = tmp_path / "xla_cache"
    env = _env(2, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    args = ("--batch_size=2", "--mesh=data=2,fsdp=2", "--max_steps=10", "--checkpoint_interval=4")

    def two(out: Path, **extra: str) -> list[subprocess.Popen]:
        port = free_port()
        return [subprocess.Popen(_train_cmd(out, *args), cwd=REPO, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT,
                                 env={**env, **extra, "JAXGPT_COORDINATOR": f"127.0.0.1:{port}",
                                      "JAXGPT_NUM_PROCESSES": "2", "JAXGPT_PROCESS_ID": str(i)}) for i in (0, 1)]

    def wait_all(procs: list[subprocess.Popen]) -> list[str]:
        try:
            return [p.communicate(timeout=400)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()

    ref = two(tmp_path / "ref")
    logs = wait_all(ref)
    assert all(p.returncode == 0 for p in ref), logs[0][-3000:] + logs[1][-3000:]

    out = tmp_path / "run"
    procs = two(out, JAXGPT_DEBUG_STEP_SLEEP="0.3")
    wait_for(procs[0], lambda: len(steps_done(out)) >= 5, timeout=400)
    os.kill(procs[1].pid, signal.SIGTERM)
    logs = wait_all(procs)
    assert [p.returncode for p in procs] == [143, 143], logs[0][-3000:] + logs[1][-3000:]
    assert "another process (process 1) received SIGTERM" in logs[0]
    stopped = [int(log.split("stopped after step ")[1].split(";")[0]) for log in logs]
    assert stopped[0] == stopped[1] == saved_steps(out)[-1] == max(steps_done(out)), (stopped, saved_steps(out))

    resumed = two(out)
    logs = wait_all(resumed)
    assert all(p.returncode == 0 for p in resumed), logs[0][-3000:] + logs[1][-3000:]
    assert f"resumed from step {stopped[0]}" in logs[0]
    assert losses(out) == losses(tmp_path / "ref")
