"""The tiny step compiled for the H100 (compile-only) under an opt-in setting beside the same step without it: what
the Pallas kernels' tests (tests/kernels/test_mlp.py, tests/kernels/test_gemm.py, tests/kernels/test_loss_kernel.py) read the kernels
of, and the calibration's least efficient measured rates their new kernels are priced at."""

from __future__ import annotations

import pytest


def kernels_beside_plain(sets: tuple[str, ...], base: tuple[str, ...] = ()):
    """``(compiled, kernels, plain_kernels)`` of the tiny bf16 step with ``base + sets`` and with ``base`` alone
    (skipped without JAX's CUDA plugin)."""
    from tests.test_compile import PLUGIN_PROBLEM, TINY_BF16, _compiled

    if PLUGIN_PROBLEM is not None:
        pytest.skip(f"compile-only GPU tests need JAX's CUDA plugin: {PLUGIN_PROBLEM}")
    from jaxgpt.compile import hlo

    cs, _ = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1] + base + sets)
    plain, _ = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1] + base)
    return cs, hlo.kernels(cs.hlo_text())[0], hlo.kernels(plain.hlo_text())[0]


def gemm_flops(kernels) -> float:
    """FLOPs per step of every kernel with a GEMM in it (XLA's GEMM fusions count what they fuse besides)."""
    return sum(k.flops * k.count for k in kernels if k.matmul_dtype)


def slowest(kind: str):
    """The H100 calibration and its least efficient measured rate of ``kind`` ("gemm", "fusion")."""
    from jaxgpt.compile import calibrated

    cal = calibrated.for_target("h100-sxm")
    return cal, min((r for r in cal.rates.values() if r.kind == kind and r.efficiency() > 0),
                    key=calibrated.Rate.efficiency)
