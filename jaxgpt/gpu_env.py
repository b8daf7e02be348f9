"""Whether this machine can run CUDA programs, told without importing jax (which must not be imported before
``JAX_PLATFORMS`` is settled: see :mod:`jaxgpt.compile`); and JAX's CUDA plugin on a machine without a GPU (installed
by ``make gpu-compile`` to compile H100 programs here) said in one line, not its start-up traceback."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = ["NO_GPU_LINE", "cuda_driver_present", "quiet_cuda_plugin_without_gpu"]

NO_GPU_LINE = ("jaxgpt: JAX's CUDA plugin is installed but found no GPU ({why}); JAX uses the CPU "
               "(set JAX_PLATFORMS=cpu to skip the plugin's check)")
_XLA_BRIDGE_LOGGER = "jax._src.xla_bridge"  # where jax logs a plugin's failed initialize(), traceback and all


def cuda_driver_present() -> bool:
    """True when an NVIDIA kernel driver and its user-space library are there (a GPU process could start)."""
    if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")):
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _no_gpu_reason(record: logging.LogRecord) -> str | None:
    """Why the CUDA plugin's failed start-up (``record``) means only "no GPU here, the CPU is used"; None for any
    other failure (a GPU machine's real error, or a run that asked for CUDA by ``JAX_PLATFORMS``), which keeps its
    traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    if not (isinstance(exc, RuntimeError) and "cuInit" in str(exc)
            and "jax_plugins.xla_cuda" in record.getMessage()):
        return None
    if _requested_platforms():  # an explicit choice that includes CUDA (with cpu alone the plugin skips its check)
        return None
    if not cuda_driver_present():
        return "no NVIDIA driver on this machine"
    if "CUDA_ERROR_NO_DEVICE" in str(exc) or "error 100" in str(exc):
        return "the NVIDIA driver sees no device"
    return None


def _requested_platforms() -> str | None:
    """JAX's ``jax_platforms`` setting (``JAX_PLATFORMS``): None or "" lets JAX fall back to the CPU."""
    jax = sys.modules.get("jax")
    return jax.config.jax_platforms if jax is not None else os.environ.get("JAX_PLATFORMS")


class _NoGpuFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        why = _no_gpu_reason(record)
        if why is None:
            return True
        print(NO_GPU_LINE.format(why=why), file=sys.stderr)
        return False


def quiet_cuda_plugin_without_gpu() -> None:
    """From now on, JAX's CUDA plugin failing to start for want of a GPU (no NVIDIA driver, or a driver that sees
    no device) prints :data:`NO_GPU_LINE` instead of its traceback, when the backends start (JAX then runs on the
    CPU); every other failure of it is logged as JAX logs it. Idempotent; imports nothing of jax."""
    logger = logging.getLogger(_XLA_BRIDGE_LOGGER)
    if not any(isinstance(f, _NoGpuFilter) for f in logger.filters):
        logger.addFilter(_NoGpuFilter())
