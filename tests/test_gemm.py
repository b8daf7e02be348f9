"""jaxgpt.gemm (Policy.qkv = "pallas"): the GEMM with a bias + bf16 epilogue in Pallas' interpreter against the fp64
truth and XLA's expression, linear_cast's custom VJP against autodiff of the plain path, a tiny GPT under the policy,
the policy field, and the compiled tiny H100 step holding the kernels, read as GEMMs.

Bounds (derived, not fitted; u = 2^-24): the bf16 x bf16 products are exact in fp32, so the fp32 accumulator plus the
bias lies within gamma_{K+1} (sum |x| |w| + |b|) of the exact value in any summation order; rounded to bf16, two such
values differ by at most one bf16 ulp of the larger plus twice that bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import gemm, model, ops
from jaxgpt.config import ConfigError
from jaxgpt.precision import Policy
from tests.test_gelu_gemm import BF16, SMALL, _f64, _fwd_inputs
from tests.test_gelu_kernel import _bf16_ulp, _check, _gamma
from tests.tiny_training import tiny_adamw_losses


@pytest.mark.parametrize("m, k, n, block", [(96, 64, 256, SMALL), (100, 48, 200, SMALL), (256, 128, 256, None)],
                         ids=["tiles", "ragged", "default-blocks"])
def test_bias_cast_kernel_against_the_truth_and_xla(m, k, n, block):
    x, w, b = _fwd_inputs(m, k, n)
    y = gemm.gemm_bias_cast(x, w, b, interpret=True, block=block)
    assert (y.dtype, y.shape) == (BF16, (m, n))
    absw = np.abs(_f64(x)) @ np.abs(_f64(w)) + np.abs(_f64(b))
    y_x = (ops._dot(x, w, BF16, None) + b).astype(BF16)
    _check("kernel y vs xla", y, y_x, _bf16_ulp(y, y_x) + 2 * _gamma(k + 1) * absw + 1e-30)
    truth = _f64(x) @ _f64(w) + _f64(b)
    _check("kernel y vs truth", y, truth, _bf16_ulp(y, truth) + _gamma(k + 1) * absw + 1e-30)
    y32 = gemm.gemm_bias_cast(x, w, None, out_dtype=jnp.float32, interpret=True, block=block)  # no bias, fp32 out
    _check("fp32 y", y32, _f64(x) @ _f64(w), _gamma(k) * (absw - np.abs(_f64(b))) + 1e-30)


def test_kernel_and_linear_cast_refuse_what_they_cannot_take():
    x, w, b = _fwd_inputs(8, 16, 32)
    with pytest.raises(gemm.GemmKernelError, match=r"x must be \(rows, d_in\).*reshape"):
        gemm.gemm_bias_cast(x[None], w, b, interpret=True)
    with pytest.raises(gemm.GemmKernelError, match="w must be bfloat16, got float32"):
        gemm.gemm_bias_cast(x, w.astype(jnp.float32), b, interpret=True)
    with pytest.raises(gemm.GemmKernelError, match=r"do not chain.*\(d_out,\)"):
        gemm.gemm_bias_cast(x, w, b[:8], interpret=True)
    with pytest.raises(gemm.GemmKernelError, match="impl = 'cuda'.*'plain'"):
        gemm.linear_cast(x, w, b, dtype=BF16, impl="cuda")


def _grads(f, x, w, b, dy):
    @jax.jit
    def run(x, w, b, dy):
        def loss(x, w, b):
            y = f(x, w, b)
            return jnp.sum(y.astype(jnp.float32) * dy), y
        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, b)
        return y, *grads
    return run(x, w, b, dy)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_linear_cast_vjp_against_autodiff_of_the_plain_path(with_bias):
    """linear_cast against autodiff of the plain path as attention sees it ((x @ w + b) rounded to bf16), (2, 24, 32)
    -> 96: with XLA's expression ("xla") value, dx and dW bit for bit and d(bias) within a sum-order bound; with the
    kernel (interpreted) y within one bf16 ulp plus the GEMM bound and the gradients (the same backward GEMMs, the
    same cotangent) bit for bit; "plain" (what "auto" is on CPUs) is Linear's fp32 path itself."""
    r = np.random.default_rng(3)
    x = jnp.asarray(r.standard_normal((2, 24, 32)), jnp.float32)
    w = jnp.asarray(0.3 * r.standard_normal((32, 96)), jnp.float32)
    b = jnp.asarray(0.5 * r.standard_normal(96), jnp.float32) if with_bias else None
    dy = jnp.asarray(r.standard_normal((2, 24, 96)), jnp.float32)

    def plain(x, w, b):
        y = ops.matmul(x, w, dtype=BF16)
        return (y + b if b is not None else y).astype(BF16)

    y_p, dx_p, dw_p, db_p = _grads(plain, x, w, b, dy)
    y_x, dx_x, dw_x, db_x = _grads(functools.partial(gemm.linear_cast, dtype=BF16, impl="xla"), x, w, b, dy)
    for name, got, want in (("y", y_x, y_p), ("dx", dx_x, dx_p), ("dW", dw_x, dw_p)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)
    gabs = np.abs(_f64(dy.astype(BF16))).reshape(-1, 96).sum(0)
    if with_bias:
        _check("xla d(bias)", db_x, db_p, 2 * _gamma(48) * gabs + 1e-30)
    else:
        assert db_x is None and db_p is None
    y_k, dx_k, dw_k, db_k = _grads(functools.partial(gemm.linear_cast, dtype=BF16, impl="interpret"), x, w, b, dy)
    absw = np.abs(_f64(x.astype(BF16))).reshape(-1, 32) @ np.abs(_f64(w.astype(BF16))) + (
        0.0 if b is None else np.abs(_f64(b)))
    _check("kernel y", np.asarray(y_k, np.float32).reshape(-1, 96), np.asarray(y_p, np.float32).reshape(-1, 96),
           _bf16_ulp(y_k, y_p).reshape(-1, 96) + 2 * _gamma(33) * absw + 1e-30)
    for name, got, want in (("dx", dx_k, dx_p), ("dW", dw_k, dw_p)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    if with_bias:
        _check("kernel d(bias)", db_k, db_p, 2 * _gamma(48) * gabs + 1e-30)
    y_plain = gemm.linear_cast(x, w, b, dtype=BF16)  # "auto" on the CPU: the plain fp32 path
    lin = ops.matmul(x, w, dtype=BF16)
    np.testing.assert_array_equal(np.asarray(y_plain), np.asarray(lin + b if b is not None else lin))


def test_tiny_gpt_trains_to_the_plain_policys_losses(monkeypatch):
    """A tiny GPT under Policy(qkv='pallas'), bf16, with the GPU's three q, k, v GEMMs (CausalSelfAttention.gemms
    forced to 3): with the CPU's own path its 3 AdamW losses are the plain policy's bit for bit; with the kernel
    (interpreted: q, k and v in bf16 before attention, whose CPU backward then rounds dq, dk, dv to bf16 as cuDNN's
    does on GPUs) within 1e-4 relative."""
    monkeypatch.setattr(model.CausalSelfAttention, "gemms", property(lambda self: 3))
    plain = tiny_adamw_losses(Policy.bf16(), 3)
    assert plain[-1] < plain[0] - 0.05, plain
    assert tiny_adamw_losses(Policy.bf16(qkv="pallas"), 3) == plain
    monkeypatch.setattr(gemm, "linear_cast", functools.partial(gemm.linear_cast, impl="interpret"))
    np.testing.assert_allclose(tiny_adamw_losses(Policy.bf16(qkv="pallas"), 3), plain, rtol=1e-4)


def test_policy_field_and_train_config():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    assert Policy().qkv == "plain" and TrainConfig.load(None, {}).qkv == "plain"  # the default is unchanged
    cfg = TrainConfig.load(None, {"qkv": "pallas", "precision": "auto"})
    assert resolve_policy(cfg, "gpu") == Policy.bf16(qkv="pallas")
    with pytest.raises(ConfigError, match="Policy.qkv = 'triton'.*'plain', 'pallas'"):
        Policy(qkv="triton")
    with pytest.raises(ConfigError, match="qkv"):
        TrainConfig.load(None, {"qkv": "fast"})
    for kw in ({"gemm_output": "bfloat16"}, {"fp8": "all"}, {"attention": "einsum"}):
        with pytest.raises(ConfigError, match="Policy.qkv = 'pallas' rounds.*qkv: plain"):
            Policy(compute_dtype="bfloat16", qkv="pallas", **kw)
    assert Policy.fp8_policy("mlp+lm_head", qkv="pallas").qkv == "pallas"  # the attention's GEMMs stay bf16 there


def test_tiny_h100_step_reads_the_kernels_as_gemms_and_drops_attentions_converts():
    """The tiny step compiled for the H100 under qkv=pallas: three Pallas GEMMs per layer (q, k, v), each read as a
    GEMM at the least efficient measured GEMM rate with the FLOPs of the plain program's GEMM it replaces; the convert
    passes in attention's scope (bias add + bf16) are gone."""
    from tests.test_compile import PLUGIN_PROBLEM, TINY_BF16, _compiled

    if PLUGIN_PROBLEM is not None:
        pytest.skip(f"compile-only GPU tests need JAX's CUDA plugin: {PLUGIN_PROBLEM}")
    from jaxgpt.compile import calibrated, hlo

    cs, _ = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1] + ("qkv=pallas",))
    plain, _ = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1])
    ks, _ = hlo.kernels(cs.hlo_text())
    kp, _ = hlo.kernels(plain.hlo_text())
    pallas = [k for k in ks if k.gemm.startswith("pallas")]
    assert [k.gemm for k in pallas] == ["pallas bf16->bf16 NN"] * 3 * cs.cfg.model.n_layer
    assert {k.category for k in pallas} == {"matmuls fwd"}
    gemm_flops = lambda kernels: sum(k.flops * k.count for k in kernels if k.matmul_dtype)
    assert gemm_flops(ks) == pytest.approx(gemm_flops(kp), rel=1e-4)  # but XLA's fused elementwise ops
    assert [k for k in kp if k.category == "attention: casts, layout"]
    assert not [k for k in ks if k.category == "attention: casts, layout"]
    cal = calibrated.for_target("h100-sxm")
    worst = min((r for r in cal.rates.values() if r.kind == "gemm" and r.efficiency() > 0),
                key=calibrated.Rate.efficiency)
    assert all(cal.rate(k) == (worst, False) for k in pallas)
