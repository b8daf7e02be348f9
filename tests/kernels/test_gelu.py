"""jaxgpt.kernels.gelu (Policy.gelu = "pallas"): the one-kernel GELU backward in Pallas' interpreter against the XLA
expression, the c_fc + GELU custom VJP against autodiff of the plain MLP path, a tiny GPT under the policy, the
policy field, and the compiled tiny H100 step holding the Pallas Triton kernel.

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

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import ops
from jaxgpt.kernels import gelu
from jaxgpt.config import ConfigError
from jaxgpt.precision import Policy
from tests.tiny_training import tiny_adamw_losses

U = 2.0 ** -24
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@pytest.mark.parametrize("rows, cols", [(512, 512), (300, 128), (40, 96), (256, 3072 // 8)],
                         ids=["blocks", "ragged-rows", "small-ragged", "one-row-block"])
def test_kernel_matches_the_xla_expression(rows, cols):
    """The Pallas kernel (interpreted) against the plain path's autodiff expression: bf16 dh within one bf16 ulp
    (plus the fp32 bound where cancellation leaves dh tiny),
    the bias gradient (the partial sums' sum) within the derived fp32 bound of the fp64 truth, as is XLA's; rows
    and columns that are not multiples of the 256 x 256 block (padded) included."""
    g, h = _inputs(rows, cols)
    dh_k, sums_k = gelu.gelu_backward(g, h, interpret=True)
    dh_x, sums_x = gelu.gelu_backward_xla(g, h)
    br, _ = gelu.blocks(rows, cols)
    assert dh_k.dtype == jnp.bfloat16 and dh_k.shape == (rows, cols)
    assert sums_k.dtype == jnp.float32 and sums_k.shape == (-(-rows // br), cols)
    truth, s = _truth(g, h)
    _check("bf16 dh", dh_k, dh_x, _bf16_ulp(dh_k, dh_x) + 32 * U * s)
    bound = 16 * U * s.sum(0) + _gamma(rows) * np.abs(truth).sum(0)
    _check("kernel d(bias)", sums_k.sum(0), truth.sum(0), bound + _gamma(sums_k.shape[0]) * np.abs(truth).sum(0))
    _check("xla d(bias)", sums_x.sum(0), truth.sum(0), bound)
    dh32, _ = gelu.gelu_backward(g, h, out_dtype=jnp.float32, interpret=True)  # fp32 dh: the derived fp32 bound
    _check("fp32 dh", dh32, truth, 16 * U * s)


def test_kernel_refuses_what_it_cannot_take():
    with pytest.raises(gelu.GeluKernelError, match=r"one \(rows, features\) shape.*reshape"):
        gelu.gelu_backward(jnp.ones((2, 4, 8)), jnp.ones((2, 4, 8)), interpret=True)
    with pytest.raises(gelu.GeluKernelError, match=r"\(4, 8\) and \(4, 16\)"):
        gelu.gelu_backward(jnp.ones((4, 8)), jnp.ones((4, 16)), interpret=True)
    with pytest.raises(gelu.GeluKernelError, match="float32 g and h.*bfloat16"):
        gelu.gelu_backward(jnp.ones((4, 8), jnp.bfloat16), jnp.ones((4, 8)), interpret=True)
    with pytest.raises(gelu.GeluKernelError, match="backward = 'triton'"):
        gelu.fc_gelu(jnp.ones((4, 8)), jnp.ones((8, 16)), None, dtype=jnp.bfloat16, backward="triton")


def _plain(x, w, b, dtype):
    """The plain MLP path of jaxgpt.model (Linear under the policy, then jax.nn.gelu in fp32)."""
    h = ops.matmul(x, w, dtype=dtype)
    return jax.nn.gelu(h + b if b is not None else h, approximate=True)


def _grads(f, x, w, b, dy):
    @jax.jit
    def run(x, w, b, dy):
        def loss(x, w, b):
            y = f(x, w, b)
            return jnp.sum(y * dy), y
        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, b)
        return y, *grads
    return run(x, w, b, dy)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_custom_vjp_against_autodiff_of_the_plain_mlp(dtype, with_bias):
    """fc_gelu's value and gradients (dx, dW, d(bias)) against autodiff of the plain path, (2, 24, 32) x (32, 128):
    with the XLA expression (the CPU's backward) y, dx and dW bit for bit (the same dh, the same GEMMs) and d(bias)
    within gamma_R sum |dh| (a sum in another order); with the kernel (interpreted) dh differs by up to one bf16 ulp,
    so dx and dW lie within sum |ulp(dh)| |operand| plus twice the GEMMs' fp32 accumulation bound."""
    r = np.random.default_rng(1)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(r.standard_normal((2, 24, 32)), jnp.float32)
    w = jnp.asarray(0.3 * r.standard_normal((32, 128)), jnp.float32)
    b = jnp.asarray(0.5 * r.standard_normal(128), jnp.float32) if with_bias else None
    dy = jnp.asarray(r.standard_normal((2, 24, 128)), jnp.float32)
    y_p, dx_p, dw_p, db_p = _grads(lambda x, w, b: _plain(x, w, b, dt), x, w, b, dy)
    y_x, dx_x, dw_x, db_x = _grads(lambda x, w, b: gelu.fc_gelu(x, w, b, dtype=dt, backward="xla"), x, w, b, dy)
    np.testing.assert_array_equal(np.asarray(y_x), np.asarray(y_p))
    np.testing.assert_array_equal(np.asarray(dx_x), np.asarray(dx_p))
    np.testing.assert_array_equal(np.asarray(dw_x), np.asarray(dw_p))
    h = np.asarray(ops.matmul(x, w, dtype=dt), np.float64) + (0.0 if b is None else np.asarray(b, np.float64))
    dh, s = _truth(np.asarray(dy).reshape(-1, 128), h.reshape(-1, 128))
    rows = dh.shape[0]
    if with_bias:
        _check("xla d(bias)", db_x, db_p, 2 * _gamma(rows) * np.abs(dh).sum(0) + 32 * U * s.sum(0))
    else:
        assert db_x is None and db_p is None
    _, dx_k, dw_k, db_k = _grads(lambda x, w, b: gelu.fc_gelu(x, w, b, dtype=dt, backward="interpret"), x, w, b, dy)
    xc, wc = (np.abs(np.asarray(a.astype(dt), np.float64)) for a in (x.reshape(-1, 32), w))
    ulp = _bf16_ulp(dh, dh) * 2 if dt == jnp.bfloat16 else 32 * U * s  # either side of a bf16 rounding boundary
    _check("kernel dx", np.asarray(dx_k).reshape(-1, 32), np.asarray(dx_p).reshape(-1, 32),
           ulp @ wc.T + 2 * _gamma(128) * np.abs(dh) @ wc.T + 1e-30)
    _check("kernel dW", dw_k, dw_p, xc.T @ ulp + 2 * _gamma(rows) * xc.T @ np.abs(dh) + 1e-30)
    if with_bias:
        _check("kernel d(bias)", db_k, db_p, 2 * _gamma(rows) * np.abs(dh).sum(0) + 32 * U * s.sum(0))


def _train(policy: Policy, backward: str, monkeypatch, steps: int = 4) -> list[float]:
    """tests.tiny_training's AdamW losses with jaxgpt.kernels.gelu's backward forced to ``backward``."""
    monkeypatch.setattr(gelu, "_resolve", lambda b: backward)
    return tiny_adamw_losses(policy, steps)


def test_tiny_gpt_trains_to_the_plain_policys_losses(monkeypatch):
    """A tiny GPT (2 layers, n_embd 32: 128-wide MLPs of 32 rows) under Policy(kernels={"mlp": 'pallas'}), bf16 compute, with the
    GELU backward the GPU's (the kernel, interpreted: dh within a bf16 ulp of the plain one), takes 4 AdamW steps to
    the plain policy's losses within 1e-4 relative, and the losses fall. (The CPU's own backward under the policy is
    the plain expression: test_custom_vjp_against_autodiff_of_the_plain_mlp has its gradients bit for bit.)"""
    plain = _train(Policy.bf16(), "xla", monkeypatch)
    assert plain[-1] < plain[0] - 0.05, plain
    np.testing.assert_allclose(_train(Policy.bf16(kernels={"mlp": "pallas"}), "interpret", monkeypatch), plain, rtol=1e-4)


def test_policy_field_and_train_config():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    assert Policy().gelu == "plain" and TrainConfig.load(None, {}).gelu == "plain"  # the default is unchanged
    cfg = TrainConfig.load(None, {"gelu": "pallas", "precision": "auto"})
    assert resolve_policy(cfg, "gpu") == Policy.bf16(kernels={"mlp": "pallas"})
    with pytest.raises(ConfigError, match="Policy.gelu = 'triton'.*'plain', 'pallas'"):
        Policy(kernels={"mlp": "triton"})
    with pytest.raises(ConfigError, match="gelu"):
        TrainConfig.load(None, {"gelu": "fast"})
    for kw in ({"gemm_output": "bfloat16"}, {"fp8": "mlp"}, {"fast_kernels": False}):
        with pytest.raises(ConfigError, match="Policy.gelu = 'pallas' replaces.*gelu: plain"):
            Policy(compute_dtype="bfloat16", **kw, kernels={"mlp": "pallas"})
    with pytest.raises(ConfigError, match="gemm_output 'bfloat16'"):
        resolve_policy(TrainConfig.load(None, {"gelu": "pallas", "precision": "bf16-autocast"}), "gpu")
    assert Policy.fp8_policy("lm_head", kernels={"mlp": "pallas"}).gelu == "pallas"  # the MLP's GEMMs stay bf16 there


def test_tiny_h100_step_runs_the_pallas_kernel_once_per_layer_and_micro_step():
    """The tiny step compiled for the H100 under gelu=pallas: one Pallas Triton custom call per layer in the
    backward (in gelu's scope, priced as a fusion at the least efficient measured fusion rate), nothing else in
    gelu's backward but the small reduction of its partial sums, and every GEMM of a class the calibration measured
    (the gpt2 b64 program's GEMM classes were checked equal to the default program's when it was written)."""
    from tests.test_compile import PLUGIN_PROBLEM, TINY_BF16, _compiled

    if PLUGIN_PROBLEM is not None:
        pytest.skip(f"compile-only GPU tests need JAX's CUDA plugin: {PLUGIN_PROBLEM}")
    from jaxgpt.compile import calibrated, hlo

    cs, data = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1] + ("gelu=pallas",))
    assert cs.policy.gelu == "pallas"
    ks, _ = hlo.kernels(cs.hlo_text())
    triton = [k for k in ks if k.opcode == "__gpu$xla.gpu.triton"]
    assert len(triton) == 2 and all(k.count == cs.micro_steps for k in triton), [(k.name, k.count) for k in triton]
    assert all(k.category == "GELU" and "transpose(" in k.op_name for k in triton)
    # beside the kernels, gelu's backward holds only the reduction of their partial sums (one fp32 row per block)
    others = [k for k in ks if k.category == "GELU" and "transpose(" in k.op_name and k not in triton]
    assert all(k.opcode == "kInput" and k.bytes < 0.02 * triton[0].bytes for k in others), others
    assert set(data["structure"]["gemms"]) == {"bf16 x bf16 -> f32"}, data["structure"]["gemms"]
    cal = calibrated.for_target("h100-sxm")
    # every GEMM (dx and dW of c_fc included) is of a class the calibration measured: the bwd as _matmul2d_bwd lays it
    assert all(cal.rate(k)[1] for k in ks if k.gemm), sorted({k.gemm for k in ks if k.gemm and not cal.rate(k)[1]})
    rate, known = cal.rate(triton[0])
    worst = min((r for r in cal.rates.values() if r.kind == "fusion" and r.efficiency() > 0),
                key=calibrated.Rate.efficiency)
    assert not known and rate == worst
