"""Preemption (jaxgpt.train.preempt, jaxgpt.train.stopping): real SIGTERM / SIGINT sent to real training
processes. The step in hand is saved, the exit status is 128 + signal, and the resumed run repeats the
uninterrupted one bit for bit (the SIGKILL resume test's standard); a second signal lets the save finish, a
third ends the process leaving the earlier checkpoints intact; two processes save the same step. A signal before
the first step of the process has completed (a compilation included) ends the run at once. And Ctrl-C in the other
CLIs (jaxgpt.interrupt): one line, exit 130, no traceback."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

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


def saving(out: Path, *, after: int) -> bool:
    """Has the save of a step after ``after`` begun (orbax's temporary directory, or the committed step)?"""
    d = out / "checkpoints"
    return d.is_dir() and any(int(p.name.split(".")[0]) > after for p in d.iterdir() if p.name.split(".")[0].isdigit())


def steps_done(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out) if r["type"] == "train"] if out.exists() else []


def saved_steps(out: Path) -> list[int]:
    d = out / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def copy_run(src: Path, dst: Path) -> Path:
    from jaxgpt.rundir import LOCK_NAME

    shutil.copytree(src, dst)
    (dst / LOCK_NAME).unlink(missing_ok=True)
    return dst


def read_until(proc: subprocess.Popen, text: str, timeout: float = 180) -> str:
    """The process's output (stdout and stderr together) up to the line holding ``text``."""
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen:
        line = proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {text!r} in the output:\n{seen[-3000:]}{proc.stdout.read()[-3000:]}")
        seen += line
    return seen


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
    wait_for(proc, lambda: saving(out, after=4))  # the save is being written (the hook holds it 1 s before the wait)
    os.kill(proc.pid, signal.SIGTERM)  # a second signal: the save goes on
    log = finish(proc)
    assert proc.returncode == 143, log[-3000:]
    stopped = max(steps_done(out))
    assert f"SIGTERM again: letting the save of step {stopped} finish" in log, log[-3000:]
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
    before = max(saved_steps(out), default=0)
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C
    wait_for(proc, lambda: saving(out, after=before))  # the save is being written (the hook holds it 1.5 s more)
    os.kill(proc.pid, signal.SIGINT)
    log = finish(proc)
    assert proc.returncode == 130, log[-3000:]
    stopped = max(steps_done(out))
    assert f"SIGINT again: letting the save of step {stopped} finish" in log and "Traceback" not in log
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
    read_until(proc, "SIGTERM received")
    time.sleep(1.0)  # the step in hand is done (0.2 s + a step); its checks, then the hook's 4 s before the save
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)
    log = finish(proc)
    assert proc.returncode == 143, log[-3000:]
    stopped = max(steps_done(out))
    assert (f"SIGTERM a third time: exiting now, before the save of step {stopped} began (its checks were "
            f"running): nothing of step {stopped} was written") in log, log[-3000:]
    assert saved_steps(out) == [4] and not saving(out, after=4)  # the earlier checkpoint, intact
    resumed = subprocess.run(cmd(out, "--max_steps=6"), cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0 and "resumed from step 4" in resumed.stdout, resumed.stderr[-3000:]


def test_a_signal_before_the_first_step_ends_the_run_naming_the_checkpoint(tmp_path, env, reference):
    """Resumed from checkpoint 10, SIGINT while the run waits before its first step (a test hook: 5 s): the run
    ends at once, exit 130, naming checkpoint 10 and how to resume; nothing is trained or saved."""
    out = copy_run(reference, tmp_path / "run")
    before = saved_steps(out)
    proc = start(out, env, "--max_steps=12", JAXGPT_DEBUG_STEP_SLEEP="5")
    read_until(proc, "resumed from step 10")
    time.sleep(0.5)  # in the hook's sleep before step 11
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    log = finish(proc)
    took = time.monotonic() - t0
    assert proc.returncode == 130, log[-3000:]
    assert took < 4, f"{took:.1f} s from the signal to the exit"  # not after the hook's sleep and a step
    assert ("jaxgpt.train: interrupted by SIGINT before the first step of this process completed: nothing was "
            f"trained since checkpoint step 10 (in {out / 'checkpoints'}), nothing needed saving. Resume with the "
            "same command") in log, log[-3000:]
    assert "Traceback" not in log and "stopped after step" not in log
    assert saved_steps(out) == before and max(steps_done(out)) == 10


def test_a_sigterm_while_the_first_step_compiles_exits_at_once(tmp_path):
    """The first step's compilation runs in C++ (seconds here, a minute for GPT-2 on a GPU after a restart), where
    Python cannot run a signal handler: the watcher thread ends the run within a second or two, exit 143, instead
    of after the compilation, a step, the check's compilation and a save. (No compilation cache: a real compile.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")
           and k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "run"
    proc = start(out, env, "--eval_interval=0", "--model.n_layer=3")
    read_until(proc, "run dir")
    time.sleep(0.5)  # (announce, then the loop: the first step is traced and compiled)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    log = finish(proc)
    took = time.monotonic() - t0
    assert proc.returncode == 143, log[-3000:]
    assert took < 3, f"{took:.1f} s from the signal to the exit"
    assert ("jaxgpt.train: interrupted by SIGTERM before the first step of this process completed: nothing was "
            "trained, and the run has no checkpoint yet; re-run the same command to start it") in log, log[-3000:]
    assert "Traceback" not in log and steps_done(out) == [] and saved_steps(out) == []


def test_a_diverged_state_at_the_signal_is_not_saved(tmp_path, reference, monkeypatch, capsys):
    """A real SIGTERM after step 11, whose update (lr 1e6) exploded the params: the signal's save checks the state
    first (its loss on the next batch, as for a final state), finds it diverged and saves nothing: exit 3, the
    checkpoints as they were (in-process: the signal is sent from step 11's evaluation, a test hook)."""
    from jaxgpt.train import main
    from jaxgpt.train.evals import InLoopEvals

    out = copy_run(reference, tmp_path / "run")
    before, handler = saved_steps(out), signal.getsignal(signal.SIGTERM)
    real = InLoopEvals.evaluate

    def evaluate(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the first evaluation of this run: step 11's
        return real(self)

    monkeypatch.setattr(InLoopEvals, "evaluate", evaluate)
    code = main([*TINY, f"--out_dir={out}", *ARGS, "--max_steps=20", "--eval_interval=11", "--optim.lr=1e6",
                 "--optim.warmup_steps=0", "--plot=false"])
    err = capsys.readouterr().err
    assert code == 3, err[-3000:]
    assert "SIGTERM received: finishing the step in hand" in err
    assert "the final state, evaluated on the next training batch" in err and "training diverged" in err
    assert "saved checkpoint" not in err and "Traceback" not in err
    assert saved_steps(out) == before and max(steps_done(out)) == 11
    assert signal.getsignal(signal.SIGTERM) == handler and signal.set_wakeup_fd(-1) == -1  # all put back


def test_with_resume_never_the_message_gives_the_command_that_resumes(monkeypatch):
    """`resume: never` refuses a run directory that holds checkpoints, so "the same command" would not resume:
    the message gives that command with --resume=auto instead (and parses back to it)."""
    from jaxgpt.train import parse_args
    from jaxgpt.train.stopping import Stopping

    argv = ["--config", "configs/tiny-test.yaml", "--resume", "never", "--out_dir=runs/a b", "--resume=never",
            "--max_steps=10"]
    monkeypatch.setattr(sys, "argv", [str(REPO / "jaxgpt/train/__main__.py"), *argv])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", SimpleNamespace(name="jaxgpt.train.__main__"))
    run = SimpleNamespace(cfg=SimpleNamespace(resume="never"))
    hint = Stopping.resume_hint(run, 7)
    assert hint.startswith("Resume with `python -m jaxgpt.train ") and "from step 7" in hint, hint
    args = shlex.split(hint.split("`")[1])
    assert args[:3] == ["python", "-m", "jaxgpt.train"] and "never" not in args
    config, overrides, _ = parse_args(args[3:])
    assert config == Path("configs/tiny-test.yaml")
    assert overrides == {"out_dir": "runs/a b", "max_steps": 10, "resume": "auto"}
    run.cfg.resume = "auto"
    assert Stopping.resume_hint(run, 7).startswith("Resume with the same command (resume: auto continues from step 7")


def test_a_third_signal_says_what_it_leaves():
    """The third signal's line, in each phase of the save (the handler's text; the slow test sends real ones)."""
    from jaxgpt.train.preempt import Preemption

    p = Preemption()
    p.start_loop()
    assert "before the step in hand was saved" in p._abandoning()
    p.start_saving(6)
    assert p._abandoning().startswith("exiting now, before the save of step 6 began")
    p.saving_phase("writing", committed=lambda: False)
    assert p._abandoning().startswith("abandoning the save of step 6 now") and "incomplete" in p._abandoning()
    p.saving_phase("writing", committed=lambda: True)  # orbax committed it in the background already
    assert p._abandoning() == "checkpoint step 6 is already committed; exiting now"
    p.saving_phase("committed")
    assert p._abandoning() == "checkpoint step 6 is already committed; exiting now"


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


# ---- Ctrl-C in the other CLIs (jaxgpt.interrupt) ------------------------------------------------------------
def interrupt_cli(args: list[str], env: dict, *, when) -> tuple[subprocess.Popen, str, str, float]:
    """Start ``python ARGS``, send SIGINT once ``when(seen_stdout, seen_stderr)`` holds (the tool is at work),
    and return the process, its output and the seconds from the signal to the exit."""
    import selectors

    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    out = {"stdout": b"", "stderr": b""}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    deadline = time.monotonic() + 180
    try:
        while not when(out["stdout"].decode(errors="replace"), out["stderr"].decode(errors="replace")):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"it ended (exit {proc.returncode}) before the signal:\n{out['stderr'].decode()[-3000:]}"
            for key, _ in sel.select(timeout=0.05):
                out[key.data] += os.read(key.fileobj.fileno(), 65536)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest_out, rest_err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, (out["stdout"] + rest_out).decode(), (out["stderr"] + rest_err).decode(), took


def one_interrupt_line(err: str, prog: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{prog}:")]
    assert len(lines) == 1 and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    return lines[0]


def test_ctrl_c_in_checkpoint_export_says_which_exports_were_completed(tmp_path, env, reference):
    """SIGINT once the Hugging Face export is in place, while the torch_ref one is under way (torch is imported
    only then: seconds): exit 130, one line naming the completed export, the torch file not written."""
    hf, pt = tmp_path / "hf", tmp_path / "sd.pt"
    proc, _, err, _ = interrupt_cli(["-m", "jaxgpt.checkpoint", "export", str(reference), "--to-hf", str(hf),
                                     "--to-torch", str(pt)], env, when=lambda o, e: hf.exists())
    assert proc.returncode == 130, err[-3000:]
    line = one_interrupt_line(err, "jaxgpt.checkpoint")
    assert line == (f"jaxgpt.checkpoint: interrupted (Ctrl-C); the export to --to-hf {hf} was completed; "
                    f"--to-torch {pt} was not written (staged beside its target and removed; anything there before "
                    "is untouched)")
    assert (hf / "model.safetensors").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


WATCHED_TOOL = """
import hashlib, sys
from pathlib import Path
from jaxgpt.interrupt import run_cli

def busy_in_c():  # seconds in C with the GIL released and no signal check, as an XLA compilation
    hashlib.pbkdf2_hmac("sha256", b"key", b"salt", 30_000_000)

def main():
    print("started", flush=True)
    if sys.argv[1] == "swallowed":
        try:
            while True:
                pass  # Python: the Ctrl-C's KeyboardInterrupt is raised here...
        except:  # noqa: E722 (... and swallowed, as by a bare except in JAX's pxla after a compilation)
            pass
    busy_in_c()
    Path(sys.argv[2]).write_text("written")
    return 0

run_cli(main, "jaxgpt.demo", left="nothing was written", watch=True)
"""


@pytest.mark.parametrize("case", ["stuck", "swallowed"])
def test_a_watched_tool_stuck_in_compiled_code_or_whose_ctrl_c_was_swallowed_exits_130_at_once(case, tmp_path,
                                                                                                 env):
    """run_cli(watch=True) (compile, eval, generate, account): a Ctrl-C while the main thread is in C code for
    seconds (an XLA compilation; here a long PBKDF2) or after a library swallowed its KeyboardInterrupt (JAX's
    bare except: seen on CI, where jaxgpt.compile then wrote its report) ends the tool within a few seconds, with
    its one line and exit 130, and nothing is written."""
    out = tmp_path / "out.txt"
    proc, _, err, took = interrupt_cli(["-c", WATCHED_TOOL, case, str(out)], env,
                                       when=lambda o, e: "started" in o and (time.sleep(0.3) or True))
    assert proc.returncode == 130, err[-3000:]
    assert one_interrupt_line(err, "jaxgpt.demo") == "jaxgpt.demo: interrupted (Ctrl-C); nothing was written"
    assert took < 6, f"{took:.1f} s from the signal to the exit"
    assert not out.exists()


@pytest.mark.parametrize("tool", ["eval", "generate", "compile"])
def test_ctrl_c_while_a_cli_compiles_is_one_line_and_exit_130(tool, tmp_path, env, reference):
    """SIGINT while the tool compiles (XLA's threads busy: a normal interpreter shutdown could crash, SIGSEGV):
    exit 130 with one line, no traceback, at once."""
    env = {**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "no-cache")}  # a real compile to interrupt
    if tool == "eval":  # its progress bar appears as the first batch (the compile) starts
        args = ["-m", "jaxgpt.eval", "--task", "val-loss", "--init-from", str(reference), "--data",
                str(REPO / "data_cache" / "shakespeare"), "--json", str(tmp_path / "r.json")]
        started, left = (lambda o, e: "val loss:" in e), "no results were written"
    elif tool == "generate":  # loads the model and compiles for seconds before the first token
        t_start = time.monotonic()
        args = ["-m", "jaxgpt.generate", "--init-from", str(reference), "--max-new-tokens", "2000",
                "--num-samples", "3"]
        started, left = (lambda o, e: time.monotonic() - t_start > 4), "the samples printed so far are complete"
    else:  # its header first, then the train step compiled for an H100 (jaxgpt.account no longer compiles)
        from jaxgpt.compile.targets import plugin_problem

        if plugin_problem():
            pytest.skip(f"compiling for a GPU needs JAX's CUDA plugin: {plugin_problem()}")
        args = ["-m", "jaxgpt.compile", "--config", "configs/tiny-test.yaml", "--no-search", "--json",
                str(tmp_path / "r.json")]
        started, left = (lambda o, e: "compile-only (nothing runs)" in o), "nothing was written"
    proc, out, err, took = interrupt_cli(args, env, when=lambda o, e: started(o, e) and (time.sleep(0.3) or True))
    assert proc.returncode == 130, err[-3000:]
    assert one_interrupt_line(err, f"jaxgpt.{tool}") == f"jaxgpt.{tool}: interrupted (Ctrl-C); {left}"
    assert took < 5, f"{took:.1f} s from the signal to the exit"
    assert not (tmp_path / "r.json").exists()


def run_cli_script(tmp_path: Path, body: str, *, ready: str) -> tuple[subprocess.Popen, str, str]:
    """A tool run through run_cli (its main in ``body``); SIGINT once it writes ``ready`` to stderr."""
    script = tmp_path / "tool.py"
    script.write_text("import os, sys, threading, time\nfrom jaxgpt.interrupt import run_cli\n" + body)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    try:
        while ready not in seen:
            line = proc.stderr.readline()
            assert line, f"it ended before {ready!r}: {seen}"
            seen += line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, seen + err


def test_a_ctrl_c_swallowed_by_a_callback_still_stops_the_tool(tmp_path):
    """The Ctrl-C lands in a __del__ (JAX's garbage-collection callback in the reported case), where Python can
    only print it and carry on: run_cli sends it again, so the tool's own code is interrupted: exit 130, one line."""
    proc, out, err = run_cli_script(tmp_path, """
class Slow:
    def __del__(self):
        sys.stderr.write("in __del__\\n"); sys.stderr.flush()
        time.sleep(5)

def main():
    Slow()
    time.sleep(10)
    print("finished")
    return 0

run_cli(main, "tool", left="nothing was written")
""", ready="in __del__")
    assert proc.returncode == 130 and "finished" not in out, err
    assert one_interrupt_line(err, "tool") == "tool: interrupted (Ctrl-C); nothing was written"


def test_a_ctrl_c_that_a_library_swallowed_is_still_reported(tmp_path):
    """A library's bare ``except:`` (JAX's plugin start-up has one) swallows the KeyboardInterrupt and the tool runs
    to its end: it says so and exits 130, not 0."""
    proc, out, err = run_cli_script(tmp_path, """
def main():
    try:
        sys.stderr.write("working\\n"); sys.stderr.flush()
        time.sleep(10)
    except BaseException:
        pass
    print("finished")
    return 0

run_cli(main, "tool")
""", ready="working")
    assert proc.returncode == 130 and "finished" in out, err
    assert one_interrupt_line(err, "tool") == ("tool: interrupted (Ctrl-C), but the command had already run to its "
                                               "end (its exit status would have been 0)")


@pytest.mark.parametrize("watch", [False, True])
def test_a_ctrl_c_that_jax_s_plugin_start_up_swallowed_and_logged_is_one_line(tmp_path, watch):
    """JAX's plugin start-up swallows the Ctrl-C (bare ``except:``, here while the CUDA plugin loads its libraries:
    seen on CI) and logs it with its traceback: that record is not printed, and the Ctrl-C is delivered again, so
    the tool stops at once with its one line and exit 130 (watched or not)."""
    proc, out, err = run_cli_script(tmp_path, f"""
import logging

def main():
    try:
        sys.stderr.write("loading plugin\\n"); sys.stderr.flush()
        time.sleep(10)
    except:  # noqa: E722 (as jax._src.xla_bridge.discover_pjrt_plugins)
        logging.getLogger("jax._src.xla_bridge").exception("Jax plugin configuration error: Exception when calling "
                                                           "jax_plugins.xla_cuda12.initialize()")
    logging.getLogger("jax._src.xla_bridge").error("a record without a Ctrl-C passes")
    time.sleep(10)
    print("finished")
    return 0

run_cli(main, "tool", watch={watch})
""", ready="loading plugin")
    assert proc.returncode == 130 and "finished" not in out, err
    assert one_interrupt_line(err, "tool") == "tool: interrupted (Ctrl-C); nothing was written"
    assert "a record without a Ctrl-C passes" in err and "Jax plugin configuration error" not in err


def test_a_ctrl_c_during_the_tool_s_imports_is_one_line(tmp_path):
    """run_cli imports the tool ("module:main"); a Ctrl-C during that import waits for it (an interrupted import
    of a compiled extension fails oddly or crashes), then exits 130 with the one line, main never run."""
    (tmp_path / "slowtool.py").write_text("import sys, time\nsys.stderr.write('importing\\n'); sys.stderr.flush()\n"
                                          "time.sleep(1.5)\n\ndef main():\n    print('ran')\n    return 0\n")
    proc, out, err = run_cli_script(tmp_path, 'sys.path.insert(0, os.getcwd())\nrun_cli("slowtool:main", "tool")\n',
                                    ready="importing")
    assert proc.returncode == 130 and "ran" not in out, err
    assert one_interrupt_line(err, "tool") == "tool: interrupted (Ctrl-C); nothing was written"


def test_after_a_ctrl_c_the_process_ends_without_an_interpreter_shutdown(tmp_path):
    """After the line the process ends at once (os._exit): a thread still running (XLA's compiler, here a plain
    thread that never ends) neither delays the exit nor, as at an interpreter shutdown, crashes it."""
    proc, out, err = run_cli_script(tmp_path, """
def main():
    threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: a normal exit would wait for it
    sys.stderr.write("working\\n"); sys.stderr.flush()
    time.sleep(10)
    return 0

run_cli(main, "tool")
""", ready="working")
    assert proc.returncode == 130, err
    assert one_interrupt_line(err, "tool") == "tool: interrupted (Ctrl-C); nothing was written"


@pytest.mark.parametrize("tool", ["train", "checkpoint", "data"])
def test_a_ctrl_c_while_python_imports_the_tool_s_package_is_one_line(tool):
    """`python -m jaxgpt.<tool>` imports the package (its __init__: jax, orbax) before the tool's __main__ and its
    handler run: jaxgpt's __init__ guards that window (held open here by a debug sleep inside it)."""
    env = dict(os.environ, JAXGPT_DEBUG_STARTUP_SLEEP="20", JAX_PLATFORMS="cpu")
    # SIGINT as a terminal's foreground job has it: a suite started in the background of a non-interactive shell
    # (`nohup make test &`) passes SIGINT on ignored, and Python then leaves it ignored (the guard guards nothing)
    proc = subprocess.Popen([sys.executable, "-m", f"jaxgpt.{tool}", "--help"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(2.0)  # Python's start-up and jaxgpt's config import take ~0.1 s: the guard's sleep has begun
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5, err
    assert one_interrupt_line(err, f"jaxgpt.{tool}") == (f"jaxgpt.{tool}: interrupted (Ctrl-C) while starting; "
                                                         "nothing was written")
    assert out == ""
