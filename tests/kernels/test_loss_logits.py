"""The fused lm_head cross-entropy's logits (jaxgpt.kernels.loss._head_logits): written once, in one dtype.

* fp32 logits (the default): the GPU path's GEMM output goes through an optimization barrier straight into the
  two passes that read it (no epilogue the GPU would run as a pass of its own);
* bf16 logits (``logits_dtype=bfloat16``, torch.autocast's bf16 lm_head output): the loss and its gradient are
  those of the plain expression on the bf16-rounded logits, and differ from the fp32 loss by no more than the
  bound the rounding allows (derived in :func:`_bf16_bounds`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import ops
from jaxgpt.kernels import loss as fused_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parity_tests"))
from tolerances import BF16_UNIT_ROUNDOFF, bf16_logits_grad_bounds  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
U = BF16_UNIT_ROUNDOFF  # bf16's unit roundoff, 2^-8 (round to nearest even, 8 significant bits: tolerances.py)
B, T, C, VP, V = 3, 5, 16, 72, 67  # 15 rows; 72 head rows of which 67 are the real vocabulary


def _gpus():
    return [SimpleNamespace(platform="gpu")]


def _inputs():
    h = jax.random.normal(jax.random.PRNGKey(0), (B, T, C), F32)
    w = 0.5 * jax.random.normal(jax.random.PRNGKey(1), (VP, C), F32)
    w = w.at[V:].set(3.0 * jax.random.normal(jax.random.PRNGKey(2), (VP - V, C), F32))  # padded rows: must not leak
    t = jax.random.randint(jax.random.PRNGKey(3), (B, T), 0, V)
    return h, w, t


def _logits(h, w):
    """The fp32 logits of the bf16 operands (fp32 accumulation), real columns only."""
    return jnp.einsum("btc,vc->btv", h.astype(BF16), w.astype(BF16), preferred_element_type=F32)[..., :V]


def _plain_ce(h, w, t, logits_dtype):
    logits = _logits(h, w).astype(logits_dtype).astype(F32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, t[..., None], axis=-1))


def _fused(h, w, t, logits_dtype, budget, gpu, monkeypatch):
    monkeypatch.setattr(fused_loss, "CE_CHUNK_ELEMENTS_GPU" if gpu else "CE_CHUNK_ELEMENTS",
                        budget or fused_loss.CE_CHUNK_ELEMENTS)
    f = jax.jit(jax.value_and_grad(lambda h, w: fused_loss.lm_head_cross_entropy(
        h, w, t, vocab_size=V, dtype=BF16, logits_dtype=logits_dtype), argnums=(0, 1)))
    if gpu:
        with ops.traced_for(_gpus()):
            return f(h, w)
    return f(h, w)


CHUNKS = pytest.mark.parametrize("budget, n_chunks", [(None, 1), (5 * VP, 3), (4 * VP, 4)],
                                 ids=["one-chunk", "3-chunks", "4-chunks-padded-rows"])
PATHS = pytest.mark.parametrize("gpu", [False, True], ids=["cpu-path", "gpu-path"])


@CHUNKS
@PATHS
def test_bf16_logits_are_the_plain_loss_of_the_rounded_logits(monkeypatch, budget, n_chunks, gpu):
    """logits_dtype=bfloat16: loss, dh and dW of the plain log_softmax NLL of bf16-rounded logits (the padded
    vocabulary masked, padded rows of an uneven last chunk dropped)."""
    h, w, t = _inputs()
    assert -(-B * T // fused_loss._chunk_rows(B * T, VP, budget or fused_loss.CE_CHUNK_ELEMENTS)) == n_chunks
    lf, (dhf, dwf) = _fused(h, w, t, BF16, budget, gpu, monkeypatch)
    lp, (dhp, dwp) = jax.jit(jax.value_and_grad(lambda h, w: _plain_ce(h, w, t, BF16), argnums=(0, 1)))(h, w)
    assert abs(float(lf) - float(lp)) <= 1e-6 * abs(float(lp))  # the same bf16 logits, the rest in fp32
    # both round dlogits to bf16 (the fused path before its two GEMMs, the plain one in the einsum's transpose): an
    # element's rounding may differ by one bf16 ulp, 2u relative, of sum_i |dlogits_i| |w_i| <= 2 max|w| / M
    M = B * T
    for fused, plain, scale in ((dhf, dhp, float(jnp.abs(w[:V]).max())), (dwf[:V], dwp[:V], float(jnp.abs(h).max()))):
        err = float(jnp.abs(fused - plain).max())
        assert err <= 2 * U * 2 * scale / M * 1.01, (err, 4 * U * scale / M)
    assert not np.asarray(dwf[V:]).any()  # padded head rows get exactly no gradient


def _bf16_bounds(h, w, t):
    """Elementwise bounds on |bf16-logits result - fp32-logits result| (loss, dh, dW), from the rounding alone
    (derived in parity_tests/tolerances.py, bf16 logits): |dloss| <= 2 u L (L: the largest |logit|), dh and dW
    through the softmax's change and both paths' bf16 rounding of dlogits."""
    lf = np.asarray(_logits(h, w), np.float64).reshape(-1, V)
    return (2 * U * np.abs(lf).max(), *bf16_logits_grad_bounds(lf, t, np.asarray(h).reshape(-1, C), w[:V]))


@CHUNKS
@PATHS
def test_bf16_logits_stay_within_the_rounding_bound_of_the_fp32_loss(monkeypatch, budget, n_chunks, gpu):
    h, w, t = _inputs()
    l32, (dh32, dw32) = _fused(h, w, t, F32, budget, gpu, monkeypatch)
    l16, (dh16, dw16) = _fused(h, w, t, BF16, budget, gpu, monkeypatch)
    b_loss, b_dh, b_dw = _bf16_bounds(h, w, t)
    slack = 1e-6  # fp32 sums in a different order
    assert abs(float(l16) - float(l32)) <= b_loss + slack * abs(float(l32))
    assert float(l16) != float(l32)  # the option does change the numbers: the bound is not met trivially
    assert np.all(np.abs(np.asarray(dh16 - dh32)).reshape(-1, C) <= b_dh * 1.01 + 1e-9)
    assert np.all(np.abs(np.asarray(dw16 - dw32))[:V] <= b_dw * 1.01 + 1e-9)


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_eval_losses_with_bf16_logits(dt):
    """token_cross_entropy takes the same option: per-token losses of the (rounded) logits, and the greedy flag."""
    h, w, t = _inputs()
    losses, greedy = jax.jit(lambda h, w: fused_loss.token_cross_entropy(h, w, t, vocab_size=V, dtype=BF16,
                                                                   logits_dtype=dt))(h, w)
    logits = _logits(h, w).astype(dt).astype(F32)
    want = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, t[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(losses), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(jnp.take_along_axis(logits, t[..., None], -1)[..., 0]
                                                                 >= logits.max(-1)))


def _eqns(jaxpr):
    """Every equation of a closed jaxpr, sub-jaxprs (scan bodies, custom_vjp rules) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_gpu_path_ends_the_logits_gemm_at_its_output(dt):
    """Traced for GPUs, the logits GEMM writes ``logits_dtype`` and its only user is an optimization barrier, so
    XLA cannot fuse the padded-vocabulary mask or a convert into it as an epilogue (a cuBLAS GEMM has none: the
    2026-11-26 H100 step ran that mask as its own pass over the fp32 logits, 8.7 ms per b64 micro-step)."""
    h, w, t = _inputs()
    f = jax.value_and_grad(lambda h, w: fused_loss.lm_head_cross_entropy(h, w, t, vocab_size=V, dtype=BF16,
                                                                   logits_dtype=dt), argnums=(0, 1))
    with ops.traced_for(_gpus()):
        jaxpr = jax.make_jaxpr(f)(h, w)
    eqns = list(_eqns(jaxpr.jaxpr))
    heads = [e for e in eqns if e.primitive.name == "dot_general"  # h_i @ W^T: (rows, C) x (VP, C) -> (rows, VP)
             and e.invars[1].aval.shape == (VP, C) and e.outvars[0].aval.shape[-1] == VP]
    assert heads and all(e.outvars[0].aval.dtype == jnp.dtype(dt) for e in heads)
    for head in heads:
        users = [e for e in eqns if any(v is head.outvars[0] for v in e.invars)]
        assert [u.primitive.name for u in users] == ["optimization_barrier"], users


def test_logits_dtype_is_checked():
    h, w, t = _inputs()
    with pytest.raises(ValueError, match="logits_dtype = 'float16'.*float32, bfloat16"):
        fused_loss.lm_head_cross_entropy(h, w, t, vocab_size=V, dtype=BF16, logits_dtype="float16")
