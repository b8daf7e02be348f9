"""jaxgpt.ops, each fast kernel against the plain expression it replaces (values and gradients).

fp32 with ``matmul_precision="highest"``: the kernels must agree with the plain autodiff to fp32 rounding.
bf16 operands: they must agree with the plain expression evaluated with the same bf16 operands (the
kernels change *how* XLA runs the matmuls, never which numbers they multiply), to bf16-level tolerance.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import ops
from jaxgpt.kernels import loss as fused_loss
from jaxgpt.precision import Policy

F32, BF16 = jnp.float32, jnp.bfloat16
HIGHEST = jax.lax.Precision.HIGHEST


def _rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.PRNGKey(key), shape, F32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ---- fused lm_head + cross-entropy -------------------------------------------------------------------------
def _plain_ce(h, w, t, vocab_size, dtype, precision):
    logits = jnp.einsum("btc,vc->btv", h.astype(dtype), w.astype(dtype), precision=precision,
                        preferred_element_type=F32)[..., :vocab_size]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, t[..., None], axis=-1))


def _fake_gpus():
    from types import SimpleNamespace

    return [SimpleNamespace(platform="gpu")]


@pytest.mark.parametrize("budget, n_chunks", [(None, 1), (5 * 72, 3), (4 * 72, 4)],
                         ids=["one-chunk", "3-chunks", "4-chunks-padded-rows"])
@pytest.mark.parametrize("dtype, gpu_path", [("float32", False), ("bfloat16", False), ("float32", True)],
                         ids=["fp32", "bf16", "fp32-gpu-path"])
def test_fused_cross_entropy_matches_plain(monkeypatch, budget, n_chunks, dtype, gpu_path):
    """Loss, dh and dw of the chunked fused loss equal the plain logits -> log_softmax -> mean NLL, over a
    padded vocabulary (72 rows, 67 real: the padded columns must take no probability), with one chunk (the
    scan is inlined: the path where XLA would fold the dW transpose into the dot), and with several chunks
    (batch 3 x seq 5 = 15 rows: 3 chunks of 5, or 4 chunks of 4 with one padded row). ``gpu_path``: the same
    on CPU as traced for GPUs (all padded rows kept and masked, max and sum of exp in one online pass)."""
    if budget is not None:
        monkeypatch.setattr(fused_loss, "CE_CHUNK_ELEMENTS_GPU" if gpu_path else "CE_CHUNK_ELEMENTS", budget)
    if gpu_path:
        monkeypatch.setattr(fused_loss, "CE_CHUNK_ELEMENTS_GPU", budget or fused_loss.CE_CHUNK_ELEMENTS)
        with ops.traced_for(_fake_gpus()):
            _check_fused_ce(n_chunks, dtype)
        return
    _check_fused_ce(n_chunks, dtype)


def _check_fused_ce(n_chunks, dtype):
    B, T, C, Vp, V = 3, 5, 16, 72, 67
    assert -(-B * T // fused_loss._chunk_rows(B * T, Vp)) == n_chunks
    h, w = _rand(0, (B, T, C)), _rand(1, (Vp, C), 0.5)
    w = w.at[V:].set(_rand(2, (Vp - V, C), 3.0))  # large padded rows: any leak into the softmax would show
    t = jax.random.randint(jax.random.PRNGKey(3), (B, T), 0, V)
    dt = jnp.dtype(dtype)
    prec = HIGHEST if dtype == "float32" else None
    fused = jax.jit(jax.value_and_grad(
        lambda h, w: fused_loss.lm_head_cross_entropy(h, w, t, vocab_size=V, dtype=dt, precision=prec), argnums=(0, 1)))
    plain = jax.jit(jax.value_and_grad(lambda h, w: _plain_ce(h, w, t, V, dt, prec), argnums=(0, 1)))
    (lf, (dhf, dwf)), (lp, (dhp, dwp)) = fused(h, w), plain(h, w)
    tol = 2e-6 if dtype == "float32" else 2e-2  # bf16: dlogits are rounded to bf16 before the two matmuls
    assert abs(float(lf) - float(lp)) <= 1e-6 * abs(float(lp))  # the forward is fp32 from the same products
    assert _rel(dhf, dhp) <= tol and _rel(dwf, dwp) <= tol, (_rel(dhf, dhp), _rel(dwf, dwp))
    assert not np.asarray(dwf[V:]).any()  # padded rows get exactly no gradient


def test_fused_cross_entropy_gradient_scales_with_the_cotangent():
    h, w = _rand(0, (2, 4, 8)), _rand(1, (16, 8))
    t = jnp.zeros((2, 4), jnp.int32)
    f = lambda h: fused_loss.lm_head_cross_entropy(h, w, t, vocab_size=16, dtype=F32, precision=HIGHEST)  # noqa: E731
    g1 = jax.grad(f)(h)
    g3 = jax.grad(lambda h: 3.0 * f(h))(h)
    np.testing.assert_allclose(np.asarray(g3), 3.0 * np.asarray(g1), rtol=1e-6)


# ---- bf16 matmul with a bf16 backward ---------------------------------------------------------------------
def test_matmul_matches_plain_bf16_dot():
    x, w, g = _rand(0, (3, 7, 24)), _rand(1, (24, 40)), _rand(2, (3, 7, 40))

    def plain(x, w):
        return jnp.einsum("...i,io->...o", x.astype(BF16), w.astype(BF16), preferred_element_type=F32)

    fast = lambda x, w: ops.matmul(x, w, dtype=BF16)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.jit(fast)(x, w)), np.asarray(jax.jit(plain)(x, w)))
    gf = jax.jit(jax.grad(lambda x, w: jnp.sum(fast(x, w) * g), argnums=(0, 1)))(x, w)
    gp = jax.jit(jax.grad(lambda x, w: jnp.sum(plain(x, w) * g), argnums=(0, 1)))(x, w)
    for a, b in zip(gf, gp):  # both round g to bf16 for the backward matmuls; the fp32 sums may differ in order
        assert _rel(a, b) <= 1e-2
        assert a.dtype == F32


def test_matmul_matches_plain_fp32_autodiff():
    """fp32 (the CPU default where bf16 GEMMs are slow): the backward's transposed-operand dots give autodiff's
    gradients to fp32 rounding."""
    x, w, g = _rand(0, (3, 7, 24)), _rand(1, (24, 40)), _rand(2, (3, 7, 40))

    def plain(x, w):
        return jnp.einsum("...i,io->...o", x, w, precision=HIGHEST)

    fast = lambda x, w: ops.matmul(x, w, dtype=F32, precision=HIGHEST)  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.jit(fast)(x, w)), np.asarray(jax.jit(plain)(x, w)), rtol=1e-6, atol=1e-6)
    gf = jax.jit(jax.grad(lambda x, w: jnp.sum(fast(x, w) * g), argnums=(0, 1)))(x, w)
    gp = jax.jit(jax.grad(lambda x, w: jnp.sum(plain(x, w) * g), argnums=(0, 1)))(x, w)
    for a, b in zip(gf, gp):
        assert a.shape == b.shape and a.dtype == F32
        assert _rel(a, b) <= 1e-6


def test_auto_follows_the_default_device(monkeypatch):
    """On a GPU machine, a computation placed on the CPU (``jax.default_device(cpu)``, as the parity tests'
    cpu cases do) gets the CPU's kernels: cuDNN attention has no CPU lowering at all."""
    from jaxgpt.precision import default_compute

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # what a CUDA machine reports
    assert ops.platform() == "gpu"
    assert Policy.bf16().attention_impl() == "cudnn"
    assert default_compute() == "bf16"
    for cpu in (jax.devices("cpu")[0], "cpu"):
        with jax.default_device(cpu):
            assert ops.platform() == "cpu"
            assert Policy.bf16().attention_impl() == "einsum"
            assert Policy.fp32(fast_kernels=False).attention_impl() == "xla"
            assert default_compute() == default_compute("cpu")


def test_bf16_train_grads_have_no_fp32_dots():
    """In the *compiled* bf16 gradient (what XLA:CPU runs after its operand upcaster), every dot takes bf16
    operands: the fast kernels exist to keep autodiff's transposed backward dots from being run in fp32.
    Compiled for the CPU on any machine (on a GPU, attention would be one cuDNN call, without dots)."""
    with jax.default_device(jax.devices("cpu")[0]):
        _check_bf16_train_grads_have_no_fp32_dots()


def _check_bf16_train_grads_have_no_fp32_dots():
    from flax import nnx

    from benchmarks.profile_step import parse_dots
    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT

    cfg = GPTConfig.preset("tiny")
    m = GPT(cfg, policy=Policy.bf16(), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    x = jnp.zeros((2, 16), jnp.int32)

    def loss(params):
        return nnx.merge(graphdef, params, rest).loss(x, x)

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    dots = parse_dots(hlo)
    assert len(dots) >= 6 * 3 * cfg.n_layer  # 6 matmuls per layer, forward + 2 backward each
    fp32 = [d for d in dots if "f32" in d["operand_dtypes"]]
    assert not fp32, fp32[:3]


def test_online_max_and_sum_exp_against_float64():
    """The one-pass (max, sum exp) of the GPU loss path: rows with masked (-inf) columns and large logits."""
    x = np.array(_rand(7, (9, 300), 20.0))
    x[:, 250:] = -np.inf  # padded vocabulary columns
    x[0, :250] = np.linspace(-80.0, 80.0, 250)
    m, s = jax.jit(fused_loss._max_and_sum_exp)(jnp.asarray(x))
    x64 = x.astype(np.float64)
    m64 = x64.max(axis=1, keepdims=True)
    s64 = np.exp(x64 - m64).sum(axis=1, keepdims=True)
    assert np.array_equal(np.asarray(m), m64.astype(np.float32))
    assert np.abs(np.asarray(s, np.float64) / s64 - 1).max() < 250 * 2**-24  # a 250-term fp32 sum's bound
