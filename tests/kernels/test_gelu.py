"""jaxgpt.kernels.gelu: GELU's derivative (what the MLP's kernels compute in their epilogues) and the reference backward
against the fp64 truth, within the derived bounds below (shared with tests/kernels/test_mlp.py and test_gemm.py).

Bounds (derived, not fitted; u = 2^-24, fp32). dh = g * gelu'(h) with gelu'(h) = c + h * c' (c = 0.5 (1 + t),
t = tanh(a), a = K (h + C3 h^3), c' = 0.5 (1 - t^2) K (1 + 3 C3 h^2)) is a dozen fp32 roundings, each relative to
the magnitude of what it rounds, not of the result: 1 + t and 1 - t^2 cancel (to ~1e-5 at h = -5), so their errors
are u-sized against |t| and t^2, not against the difference. a's rounding moves t by (1 - t^2) |a| u, tanh's own
error is a few ulps of |t|, and t^2 carries both twice. So each implementation's fp32 dh lies within 16 u S of the
fp64 truth with S = |g| (0.5 (1 + |t|) + 0.5 (1 - t^2) |a| + |h| K (1 + 3 C3 h^2) (0.5 (1 + t^2) + t^2 + (1 - t^2)
|a|)). Rounded to bf16, two values within 32 u S of each other differ by at most one bf16 ulp of the larger plus that
(where the cancellation leaves dh far below S, the fp32 difference itself can exceed its bf16 ulp). The bias
gradient sums R rows of fp32 dh: within sum 16 u S plus gamma_R sum |dh| of the truth, for each implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.kernels import gelu

U = 2.0 ** -24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _inputs(rows: int, cols: int, seed: int = 0):
    """g ~ N(0, 1) and h ~ 3 N(0, 1): the GEMM output's spread covers GELU's curved part and both tails."""
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.standard_normal((rows, cols)), jnp.float32),
            jnp.asarray(3.0 * r.standard_normal((rows, cols)), jnp.float32))


def _truth(g, h):
    """fp64: dh and the sum of absolute terms S of its fp32 error bound (module docstring)."""
    g, h = np.asarray(g, np.float64), np.asarray(h, np.float64)
    a = gelu.K * (h + gelu.C3 * h ** 3)
    t = np.tanh(a)
    dc = 0.5 * (1 - t * t) * gelu.K * (1 + 3 * gelu.C3 * h * h)
    dh = g * (0.5 * (1 + t) + h * dc)
    s = np.abs(g) * (0.5 * (1 + np.abs(t)) + 0.5 * (1 - t * t) * np.abs(a) + np.abs(h) * gelu.K
                     * (1 + 3 * gelu.C3 * h * h) * (0.5 * (1 + t * t) + t * t + (1 - t * t) * np.abs(a)))
    return dh, s


def _bf16_ulp(a, b):
    m = np.maximum(np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64)))
    return 2.0 ** (np.floor(np.log2(np.maximum(m, 1e-30))) - 7)  # bf16: 8 significant bits


def _check(name, got, want, bound):
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{name}: error up to {worst:.3g}x its derived bound (max abs error {err.max():.3g})"


@pytest.mark.parametrize("rows, cols", [(512, 512), (40, 96)], ids=["blocks", "small"])
def test_reference_backward_and_gelu_grad_against_the_fp64_truth(rows, cols):
    """gelu_backward_xla's fp32 dh (autodiff of jax.nn.gelu) and g * gelu_grad(h) (the kernels' expression) within the
    derived fp32 bound 16 u S of the fp64 truth, and within one bf16 ulp of each other once rounded; the bias
    gradient (the column sum) within 16 u sum S + gamma_R sum |dh|."""
    g, h = _inputs(rows, cols)
    truth, s = _truth(g, h)
    dh32, sums = gelu.gelu_backward_xla(g, h, out_dtype=jnp.float32)
    _check("xla dh", dh32, truth, 16 * U * s)
    _check("gelu_grad dh", g * gelu.gelu_grad(h), truth, 16 * U * s)
    assert sums.shape == (1, cols)
    _check("xla d(bias)", sums[0], truth.sum(0), 16 * U * s.sum(0) + _gamma(rows) * np.abs(truth).sum(0))
    dh16, _ = gelu.gelu_backward_xla(g, h)
    assert dh16.dtype == jnp.bfloat16
    _check("bf16 dh", dh16, (g * gelu.gelu_grad(h)).astype(jnp.bfloat16), _bf16_ulp(dh16, truth) + 32 * U * s)
