"""Whether this machine can run CUDA programs, told without importing jax (which must not be imported before
``JAX_PLATFORMS`` is settled: see :mod:`jaxgpt.compile`)."""

from __future__ import annotations

import ctypes
import os


def cuda_driver_present() -> bool:
    """True when an NVIDIA kernel driver and its user-space library are there (a GPU process could start)."""
    if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")):
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True
