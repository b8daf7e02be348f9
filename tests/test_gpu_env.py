"""JAX's CUDA plugin without a GPU (``make gpu-compile`` on a CPU machine): its failed start-up is one line saying
the CPU is used, while a GPU machine's real failures, and a run that asked for CUDA, keep their traceback."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgpt import gpu_env

REPO = Path(__file__).resolve().parents[1]
CUINIT = ("jaxlib/cuda/versions_helpers.cc:135: operation cuInit(0) failed: Unknown CUDA error 303; "
          "cuGetErrorName failed. This probably means that JAX was unable to load the CUDA libraries.")
NO_DEVICE = "jaxlib/cuda/versions_helpers.cc:135: operation cuInit(0) failed: CUDA_ERROR_NO_DEVICE"


def plugin_record(exc: BaseException, plugin: str = "jax_plugins.xla_cuda12") -> logging.LogRecord:
    """The record jax's discover_pjrt_plugins logs when a plugin's initialize() raises (logger.exception)."""
    try:
        raise exc
    except BaseException:
        return logging.getLogger(gpu_env._XLA_BRIDGE_LOGGER).makeRecord(
            gpu_env._XLA_BRIDGE_LOGGER, logging.ERROR, __file__, 1,
            "Jax plugin configuration error: Exception when calling %s.initialize()", (plugin,), sys.exc_info())


@pytest.mark.parametrize("driver, platforms, exc, said", [
    (False, None, RuntimeError(CUINIT), "no NVIDIA driver on this machine"),  # make gpu-compile, no GPU
    (False, "", RuntimeError(CUINIT), "no NVIDIA driver on this machine"),
    (True, None, RuntimeError(NO_DEVICE), "the NVIDIA driver sees no device"),
    (True, None, RuntimeError(CUINIT), None),  # a GPU machine whose CUDA fails: its traceback stays
    (False, "cuda", RuntimeError(CUINIT), None),  # CUDA asked for: JAX will not fall back to the CPU
    (False, None, RuntimeError("cuDNN version mismatch"), None),  # another start-up failure
    (False, None, ImportError("cuInit"), None),
])
def test_the_plugins_failed_start_without_a_gpu_is_one_line(monkeypatch, capsys, driver, platforms, exc, said):
    monkeypatch.setattr(gpu_env, "cuda_driver_present", lambda: driver)
    monkeypatch.setattr(gpu_env, "_requested_platforms", lambda: platforms)
    record = plugin_record(exc)
    assert gpu_env._NoGpuFilter().filter(record) is (said is None)  # False: the record (and traceback) dropped
    err = capsys.readouterr().err
    assert err == ("" if said is None else gpu_env.NO_GPU_LINE.format(why=said) + "\n")
    if said is not None:
        assert err.count("\n") == 1 and "JAX uses the CPU" in err and "found no GPU" in err
    other = plugin_record(RuntimeError(CUINIT), plugin="jax_plugins.xla_tpu")  # not the CUDA plugin: untouched
    assert gpu_env._NoGpuFilter().filter(other) is True


def test_importing_jaxgpt_installs_the_filter_once():
    import jaxgpt  # noqa: F401

    gpu_env.quiet_cuda_plugin_without_gpu()
    logger = logging.getLogger(gpu_env._XLA_BRIDGE_LOGGER)
    assert sum(isinstance(f, gpu_env._NoGpuFilter) for f in logger.filters) == 1


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None or gpu_env.cuda_driver_present(),
                    reason="needs JAX's CUDA plugin installed (make gpu-compile) on a machine without a GPU")
@pytest.mark.parametrize("code", ["import jaxgpt, jax; jax.devices()", "import jax, jaxgpt; jax.devices()"])
def test_a_jax_command_after_make_gpu_compile_prints_one_line(code):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # (conftest sets it: the user has none)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code + "; print(jax.default_backend())"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "cpu\n", proc.stderr
    assert proc.stderr == gpu_env.NO_GPU_LINE.format(why="no NVIDIA driver on this machine") + "\n"


@pytest.mark.parametrize("driver", [False, True])
def test_malloc_tuning_kept_when_the_cuda_plugin_has_no_gpu(monkeypatch, driver):
    """jaxgpt.train re-executes itself with glibc's malloc tuned for the CPU's host-bound steps; JAX's CUDA plugin
    installed on a machine with no NVIDIA driver (`make gpu-compile` on a CPU box) still trains on the CPU and keeps
    it; only a GPU that can run skips it."""
    import importlib.util

    from jaxgpt.train import cli

    calls = []
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("JAXGPT_NO_MALLOC_TUNING", raising=False)
    monkeypatch.setattr(cli.sys, "platform", "linux")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "jax_cuda12_plugin" else
                        (None if name in ("jax_cuda13_plugin", "libtpu") else real(name, *a)))
    monkeypatch.setattr(cli.gpu_env, "cuda_driver_present", lambda: driver)
    monkeypatch.setattr(cli.os, "execve", lambda *a: calls.append(a))
    cli._maybe_reexec_with_malloc_tuning(["--max_steps=1"])
    assert bool(calls) is (not driver)
    if calls:
        assert calls[0][2]["GLIBC_TUNABLES"] == cli.MALLOC_TUNABLES


def test_the_schedule_warning_is_printed_once_across_the_malloc_reexec(tmp_path):
    """jaxgpt.train re-executes itself for the malloc tuning (above): what it says before that would be said twice,
    so the schedule's warning comes after it (here the run then stops at its missing data, exit 2)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXGPT_NO_MALLOC_TUNING")}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "-m", "jaxgpt.train", "--max_steps=3", f"--data_dir={tmp_path / 'none'}",
                        "--data_source=", f"--out_dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.stderr.count("warning: max_steps 3 ends the run inside the learning-rate warm-up") == 1, r.stderr[-2000:]
