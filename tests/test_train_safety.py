"""jaxgpt.train's run safety: divergence (non-finite and spiking losses) never costs the healthy checkpoints,
rollback-and-skip, --resume_step / --skip_batches applied exactly once, one writer per run directory.

The runs are in-process (``main([...])``) on the tiny config; the last test starts a real second process.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxgpt.checkpoint import Checkpoints
from jaxgpt.rundir import LOCK_NAME
from jaxgpt.train import main, read_metrics

REPO = Path(__file__).resolve().parent.parent
BASE = ["--config", str(REPO / "configs/tiny-test.yaml"), f"--data_dir={REPO / 'data_cache' / 'shakespeare'}",
        "--eval_interval=0", "--plot=false"]
EXPLODE = ["--optim.lr=1e6", "--optim.warmup_steps=0"]


def run(out: Path, *args: str) -> int:
    return main([*BASE, f"--out_dir={out}", *args])


def saved_steps(out: Path) -> list[int]:
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


def meta(out: Path, step: int) -> dict:
    with Checkpoints(out, read_only=True) as c:
        return c.saved_meta(step)


def max_abs_params(out: Path, step: int) -> float:
    from jaxgpt.checkpoint import load_model
    from flax import nnx
    import jax

    params = nnx.state(load_model(out, step=step), nnx.Param)
    return max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(params))


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    """4 healthy steps, a checkpoint after each (keep 2: steps 3 and 4)."""
    out = tmp_path_factory.mktemp("healthy") / "run"
    assert run(out, "--max_steps=4", "--checkpoint_interval=1", "--keep_checkpoints=2") == 0
    return out


def copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    (dst / LOCK_NAME).unlink(missing_ok=True)
    return dst


def test_an_explosion_never_costs_the_healthy_checkpoints(healthy, tmp_path, capsys):
    """The issue's scenario: with lr 1e6 and a checkpoint every step (keep 2), a finite explosion. Step 5
    (from the healthy state 4) passes; its update explodes the params, so step 6's loss is a spike: the held
    checkpoint of state 5 is dropped, keep-K rotates nothing out, the error names the healthy step and
    checkpoint 4, and resuming from it with a sane lr trains on."""
    out = copy_run(healthy, tmp_path / "run")
    capsys.readouterr()
    assert run(out, "--max_steps=10", "--checkpoint_interval=1", "--keep_checkpoints=2", *EXPLODE) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "step 6: loss " in err and "the median" in err and "spike factor 3" in err
    assert "The newest healthy state is step 4" in err and "the last good checkpoint is step 4" in err
    assert "--resume_step=4 --skip_batches=2" in err
    assert saved_steps(out) == [3, 4]
    for s in (3, 4):
        assert max_abs_params(out, s) < 10  # healthy weights (an exploded state reaches 1e5 and more)
        assert meta(out, s)["extra"]["checked"] is True
    div = [r for r in read_metrics(out) if r["type"] == "divergence"]
    assert [r["step"] for r in div] == [6] and div[0]["loss"] > 1e3

    assert run(out, "--max_steps=8", "--checkpoint_interval=1", "--keep_checkpoints=2") == 0
    train = [r for r in read_metrics(out) if r["type"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) and r["loss"] < 11 for r in train)
    assert saved_steps(out) == [7, 8]


def test_rollback_restores_skips_exactly_and_is_bounded(healthy, tmp_path, capsys):
    """on_divergence: rollback goes back to checkpoint 4 and skips the 2 batches of steps 5-6; the lr still
    explodes the params, so it diverges again; the second rollback to checkpoint 4 skips those 2 batches and the
    2 the first attempt trained on (4 in all: no attempt repeats another), diverges again and stops, naming
    the skip that would come next. The step after the first rollback computes the same loss, bit for bit, as a
    manual --resume_step=4 --skip_batches=2."""
    out = copy_run(healthy, tmp_path / "auto")
    assert run(out, "--max_steps=10", "--checkpoint_interval=1", *EXPLODE, "--on_divergence=rollback",
               "--max_rollbacks=2") == 3
    err = capsys.readouterr().err
    assert "2 rollback(s) done" in err and "Traceback" not in err
    assert "--resume_step=4 --skip_batches=6" in err and "on_divergence: rollback" not in err
    records = read_metrics(out)
    kinds = [(r["type"], r["step"]) for r in records if r["type"] in ("divergence", "rollback")]
    assert kinds == [("divergence", 6), ("rollback", 6), ("divergence", 6), ("rollback", 6), ("divergence", 6)]
    rollbacks = [r for r in records if r["type"] == "rollback"]
    assert [(r["to_step"], r["skip_batches"]) for r in rollbacks] == [(4, 2), (4, 4)]
    step5 = [r for r in records if r["type"] == "train" and r["step"] == 5]
    assert len({r["loss"] for r in step5}) == len(step5) == 3  # the first try and two rollbacks: other data each
    assert saved_steps(out) == [3, 4]

    manual = copy_run(healthy, tmp_path / "manual")
    assert run(manual, "--max_steps=5", "--checkpoint_interval=1", "--resume_step=4", "--skip_batches=2") == 0
    manual5 = next(r for r in read_metrics(manual) if r["type"] == "train" and r["step"] == 5)
    assert manual5["loss"] == step5[1]["loss"]
    assert meta(manual, 5)["loader_state"]["step"] == 4 + 2 + 1  # batches drawn: 4 trained, 2 skipped, 1


@pytest.mark.slow  # 24 s on 2 cores; the per-step checks: the explosion and rollback tests above
def test_an_exploded_final_state_is_never_saved(healthy, tmp_path, capsys):
    """No training step evaluates the final state, so the run checks it on the batch the next step would take:
    a final update that explodes the params (step 5 from checkpoint 4 at lr 1e6) is caught there, nothing of
    it is saved, keep-K rotates nothing out, and the error names checkpoint 4 as the last good one."""
    out = copy_run(healthy, tmp_path / "run")
    position = meta(out, 4)["loader_state"]
    assert run(out, "--max_steps=5", "--checkpoint_interval=1", "--keep_checkpoints=2", *EXPLODE) == 3
    err = capsys.readouterr().err
    assert "the final state, evaluated on the next training batch: loss " in err and "Traceback" not in err
    assert "The newest healthy state is step 4" in err and "the last good checkpoint is step 4" in err
    assert saved_steps(out) == [3, 4] and meta(out, 4)["loader_state"] == position
    assert [r["step"] for r in read_metrics(out) if r["type"] == "divergence"] == [6]

    assert run(out, "--max_steps=6", "--checkpoint_interval=1", "--keep_checkpoints=2") == 0  # a sane lr: on
    assert saved_steps(out) == [5, 6] and max_abs_params(out, 6) < 10


@pytest.mark.slow  # 38 s on 2 cores
def test_resume_step_sets_newer_aside_and_a_rerun_continues(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(out, "--max_steps=8", "--checkpoint_interval=2", "--keep_checkpoints=4") == 0
    assert saved_steps(out) == [2, 4, 6, 8]
    before = read_metrics(out)

    assert run(out, "--max_steps=10", "--checkpoint_interval=2", "--keep_checkpoints=4", "--resume_step=4",
               "--skip_batches=3") == 0
    assert "resumed from step 4 by resume_step, skipping 3 batch(es)" in capsys.readouterr().out
    assert saved_steps(out) == [4, 6, 8, 10]
    aside = sorted(p.name.split("-")[0] for p in (out / "checkpoints" / "superseded").iterdir())
    assert aside == ["6", "8"]  # the abandoned branch, moved aside, not deleted
    superseded = [json.loads(line) for line in (out / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded == [r for r in before if r["step"] > 4]
    m = meta(out, 10)
    assert m["loader_state"]["step"] == 10 + 3
    assert [(e["resumed_from"], e["skip_batches"]) for e in m["extra"]["lineage"]] == [(4, 3)]
    assert [r for r in read_metrics(out) if r["type"] == "resume"][0]["skip_batches"] == 3

    # the same command again (say, a requeued job): it continues from 10, not from 4 a second time
    assert run(out, "--max_steps=12", "--checkpoint_interval=2", "--keep_checkpoints=4", "--resume_step=4",
               "--skip_batches=3") == 0
    assert "was applied by an earlier run of this command; continuing from its newest checkpoint, step 10" \
        in capsys.readouterr().out
    assert saved_steps(out) == [6, 8, 10, 12] and meta(out, 12)["loader_state"]["step"] == 12 + 3
    assert sorted(p.name.split("-")[0] for p in (out / "checkpoints" / "superseded").iterdir()) == ["6", "8"]

    assert run(out, "--max_steps=12", "--resume_step=5") == 2
    assert "resume_step = 5: " in capsys.readouterr().err
    assert run(tmp_path / "other", "--skip_batches=2") == 2
    assert "skip_batches = 2: needs resume_step" in capsys.readouterr().err


@pytest.mark.slow  # 20 s on 2 cores; the lock itself: tests/test_rundir.py
def test_a_second_writer_is_refused_before_writing(tmp_path, capsys):
    """While another holder has the run directory's lock, a run is refused, naming the holder, before it writes
    anything; once the lock is free the run proceeds. (The lock itself, and that a killed holder never blocks:
    tests/test_rundir.py; two real training processes: the slow test below.)"""
    from jaxgpt.rundir import DirLock

    out = tmp_path / "run"
    assert run(out, "--max_steps=2", "--checkpoint_interval=2") == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK_NAME}
    with DirLock(out):
        assert run(out, "--max_steps=4") == 2
        err = capsys.readouterr().err
        assert f"the run directory is in use by process {os.getpid()} on " in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK_NAME} == before
    assert run(out, "--max_steps=4", "--checkpoint_interval=2") == 0
    assert "resumed from step 2" in capsys.readouterr().out


@pytest.mark.slow
def test_two_training_processes_one_run_directory(tmp_path, capsys):
    """A real second `jaxgpt.train` on a directory another one is training in exits 2 naming it; once the first
    is killed (SIGKILL: no clean-up at all) the directory is free again and the run resumes."""
    out = tmp_path / "run"
    env = {**os.environ, "JAXGPT_DEBUG_STEP_SLEEP": "0.3", "JAX_PLATFORMS": "cpu"}
    first = subprocess.Popen([sys.executable, "-m", "jaxgpt.train", *BASE, f"--out_dir={out}", "--max_steps=200",
                              "--checkpoint_interval=2"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "checkpoints" / "2").is_dir():
            assert first.poll() is None, first.stderr.read()[-2000:]
            time.sleep(0.1)
        before = (out / "metrics.jsonl").read_text()
        assert run(out, "--max_steps=4") == 2
        err = capsys.readouterr().err
        assert f"the run directory is in use by process {first.pid} on " in err and "Traceback" not in err
        assert (out / "metrics.jsonl").read_text().startswith(before)  # the second run wrote nothing
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert run(out, "--max_steps=4", "--checkpoint_interval=2") == 0  # the killed holder's lock is gone
    assert "resumed from step" in capsys.readouterr().out


def test_unusable_out_dir_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert run(tmp_path / "file" / "run", "--max_steps=2") == 2
    err = capsys.readouterr().err
    assert "is a file, not a directory" in err and "choose another out_dir" in err and "Traceback" not in err


def test_resume_falls_back_past_a_damaged_step_and_says_what_changed(healthy, tmp_path, capsys):
    """The newest checkpoint has a flipped bit: the run resumes from the one before, moving the damaged one to
    checkpoints/damaged/ (not deleting it). A changed lr is printed and recorded; a changed seed is refused
    with the fix, before anything is written."""
    out = copy_run(healthy, tmp_path / "run")
    (data,) = sorted((out / "checkpoints" / "4" / "params" / "ocdbt.process_0" / "d").iterdir(),
                     key=lambda p: -p.stat().st_size)[:1]
    b = bytearray(data.read_bytes())
    b[len(b) // 2] ^= 0x10
    data.write_bytes(bytes(b))

    before = (out / "metrics.jsonl").read_text()
    assert run(out, "--max_steps=6", "--checkpoint_interval=1", "--keep_checkpoints=2", "--seed=7") == 2
    err = capsys.readouterr().err
    assert "seed: 1337 -> 7" in err and "use --seed=1337" in err and "another out_dir" in err
    assert (out / "metrics.jsonl").read_text() == before and (out / "checkpoints" / "4").is_dir()  # untouched

    assert run(out, "--max_steps=6", "--checkpoint_interval=1", "--keep_checkpoints=2", "--optim.lr=5e-4") == 0
    printed = capsys.readouterr().out
    assert "checkpoint step 4 is damaged" in printed and "resumed from step 3" in printed
    assert "resuming step 3 with changed settings: max_steps: 4 -> 6; optim.lr: 0.001 -> 0.0005" in printed
    (moved,) = (out / "checkpoints" / "damaged").iterdir()
    assert moved.name.startswith("4-") and "digest" in (moved / "reason.txt").read_text()
    records = read_metrics(out)
    assert [r for r in records if r["type"] == "config_change"] == [
        {"type": "config_change", "step": 3, "changes": {"max_steps": [4, 6], "optim.lr": [0.001, 0.0005]}}]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert saved_steps(out) == [5, 6]


def test_resume_refusals_touch_nothing(healthy, tmp_path, capsys):
    """Two resumes refused with exit 2 and no traceback, nothing moved or written: a setting that reshapes the
    optimizer state (clipping switched off: every checkpoint would fail to fit, and must not be called
    damaged), and --resume_step naming a damaged step (a garbage meta item)."""
    out = copy_run(healthy, tmp_path / "run")
    files = lambda: {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK_NAME}  # noqa: E731
    before = files()
    capsys.readouterr()
    assert run(out, "--max_steps=6", "--optim.grad_clip=0") == 2
    err = capsys.readouterr().err
    assert "optim.grad_clip: 1.0 -> 0.0" in err and "use --optim.grad_clip=1.0" in err
    assert "damaged" not in err and "Traceback" not in err
    assert files() == before

    (out / "checkpoints" / "4" / "meta" / "metadata").write_bytes(b"\xc5\x00 not json")
    before = files()
    assert run(out, "--max_steps=6", "--resume_step=4") == 2
    err = capsys.readouterr().err
    assert "step 4" in err and "meta" in err and "Traceback" not in err
    assert files() == before


def test_a_failed_set_up_leaves_no_run_directory(tmp_path, capsys):
    """A setting found wrong after the lock was taken (here a missing HellaSwag file) leaves no trace of a run
    directory that did not exist before."""
    out = tmp_path / "new-run"
    assert run(out, "--max_steps=2", "--hellaswag_interval=1", f"--hellaswag_file={tmp_path / 'missing.jsonl'}") == 2
    assert "hellaswag" in capsys.readouterr().err.lower()
    assert not out.exists()
