"""Helpers for tests that kill a training run mid-way (SIGKILL resume tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from jaxgpt.train import read_metrics


def trained_steps(out: Path) -> list[int]:
    """The train steps metrics.jsonl in run directory ``out`` holds so far ([] before it exists)."""
    return [r["step"] for r in read_metrics(out) if r["type"] == "train"] if out.exists() else []


def saved_steps(out: Path) -> list[int]:
    """The checkpoint steps committed in ``out/checkpoints`` so far."""
    ckpts = out / "checkpoints"
    return [int(p.name) for p in ckpts.glob("[0-9]*") if p.name.isdigit()] if ckpts.exists() else []


def sigkill_when(proc: subprocess.Popen, ready: Callable[[], bool], *, timeout: float = 180.0) -> None:
    """SIGKILL ``proc`` (a training run) as soon as ``ready()`` is true, polling every 50 ms; fails the test if the
    run ended first. The process is gone when this returns."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if ready():
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def checkpoint_then_two_steps(out: Path) -> Callable[[], bool]:
    """``ready`` for :func:`sigkill_when`: a checkpoint exists and the run trained two steps past it."""

    def ready() -> bool:
        done, saved = trained_steps(out), saved_steps(out)
        return bool(saved and done and max(done) >= min(saved) + 2)

    return ready
