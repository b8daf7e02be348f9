"""Test-session set-up shared by ``tests/`` and ``parity_tests/`` (loaded before any test module imports jax).

With JAX's CUDA plugin installed (``.ci/run`` installs it to compile the H100 program, ``tests/test_compile.py``)
but no NVIDIA driver, every process that imports jax would print the plugin's failed start-up check as a
traceback and drop the plugin, so the compile-only CUDA topology would be missing too. On such a machine the tests
therefore run with ``JAX_PLATFORMS=cpu`` (inherited by the subprocesses they start): the CPU tests see exactly
the CPU backend they see without the plugin, and the plugin stays loaded for compile-only use. Where a driver is
present (a GPU machine) nothing is set, so the CUDA tests get the GPU.
"""

import os

from jaxgpt.gpu_env import cuda_driver_present

# kernels: auto (jaxgpt.tune) reads and writes its choices here: never the user's cache in a test
if not os.environ.get("JAXGPT_CACHE"):
    import tempfile

    os.environ["JAXGPT_CACHE"] = tempfile.mkdtemp(prefix="jaxgpt-test-cache-")

if not cuda_driver_present():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
