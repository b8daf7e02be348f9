"""Fast, exact-in-intent building blocks that the precision policy switches on (``Policy.fast_kernels``).

Each function here computes the same mathematical result as the plain expression named in its docstring;
what changes is how XLA is allowed to run it. The parity tests check them against the plain expressions.

* :func:`matmul` — ``x @ w`` with bf16 operands and fp32 accumulation whose *backward* matmuls also run in
  bf16. XLA:CPU's ``operand-upcaster`` pass turns a bf16 dot into an fp32 dot whenever an operand arrives in
  a transposed (column-major) layout, which autodiff's ``dX = g W^T`` and ``dW = X^T g`` always do; on CPU
  the custom VJP therefore hands XLA real row-major transposed copies (:func:`materialize_transpose`).
* :func:`lm_head_cross_entropy` — ``mean(logsumexp(h W^T) - (h W^T)[target])`` over the real vocabulary,
  computed in row chunks with its gradient formed in the same pass, so the (tokens x 50,304) fp32 logits
  are never materialised whole, and never twice.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int


def materialize_transpose(a: Float[Array, "m n"]) -> Float[Array, "n m"]:
    """``a.T`` as a real row-major array. A plain ``.T`` (or a copy of it) is folded by XLA into the consumer
    as a layout change, which makes XLA:CPU upcast a bf16 dot to fp32; flattening behind an optimization
    barrier forces the physical transpose."""
    if jax.default_backend() != "cpu":
        return a.T  # GPU/TPU matmul units take transposed operands at full speed
    flat = lax.optimization_barrier(a.T.reshape(-1))
    return flat.reshape(a.shape[::-1])


def _dot(a, b, dtype, precision):
    return lax.dot(a.astype(dtype), b.astype(dtype), precision=precision, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul2d(x, w, dtype, precision):
    return _dot(x, w, dtype, precision)


def _matmul2d_fwd(x, w, dtype, precision):
    xc, wc = x.astype(dtype), w.astype(dtype)
    return _dot(xc, wc, dtype, precision), (xc, wc, jnp.zeros((), x.dtype))


def _matmul2d_bwd(dtype, precision, res, g):
    xc, wc, x_like = res
    gc = g.astype(dtype)
    dx = _dot(gc, materialize_transpose(wc), dtype, precision)  # (M, N) @ (N, K)
    dw = _dot(materialize_transpose(xc), gc, dtype, precision)  # (K, M) @ (M, N)
    return dx.astype(x_like.dtype), dw


_matmul2d.defvjp(_matmul2d_fwd, _matmul2d_bwd)


def matmul(x: Float[Array, "... d_in"], w: Float[Array, "d_in d_out"], *, dtype,
           precision=None) -> Float[Array, "... d_out"]:
    """``x @ w``: operands in ``dtype``, fp32 accumulation and result, bf16-friendly backward."""
    lead = x.shape[:-1]
    y = _matmul2d(x.reshape(-1, x.shape[-1]), w, jnp.dtype(dtype), precision)
    return y.reshape(*lead, w.shape[-1])


# ---- fused lm_head + cross-entropy --------------------------------------------------------------------------
def _chunk_rows(n_rows: int, vocab_rows: int, budget: int = 1 << 23) -> int:
    """Rows per chunk so one chunk's fp32 logits stay near ``budget`` elements (32 MiB)."""
    rows = max(1, min(n_rows, budget // vocab_rows))
    n_chunks = math.ceil(n_rows / rows)
    return math.ceil(n_rows / n_chunks)  # balanced chunks: the padded last chunk wastes < n_chunks rows


def _ce_pass(h, w, targets, vocab_size, dtype, precision, with_grad):
    """Loss sum over all rows, and (with_grad) d(sum)/dh and d(sum)/dw. h (M, C), w (V, C), targets (M,)."""
    M, C = h.shape
    V = w.shape[0]
    rows = _chunk_rows(M, V)
    n_chunks = math.ceil(M / rows)
    pad = n_chunks * rows - M
    hp = jnp.pad(h, ((0, pad), (0, 0)))
    tp = jnp.pad(targets, (0, pad))
    valid_row = (jnp.arange(n_chunks * rows) < M).reshape(n_chunks, rows)
    hc = hp.reshape(n_chunks, rows, C)
    tc = tp.reshape(n_chunks, rows)
    w_t = materialize_transpose(w.astype(dtype))  # (C, V), row-major, once per step
    w_c = w.astype(dtype)
    real_col = jnp.arange(V) < vocab_size  # padded vocabulary columns take no probability

    def chunk(carry, inp):
        dw_t = carry
        h_i, t_i, ok = inp
        logits = _dot(h_i, w_t, dtype, precision)  # (rows, V) fp32
        logits = jnp.where(real_col[None, :], logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, t_i[:, None], axis=-1)[:, 0]
        loss_sum = jnp.sum(jnp.where(ok, lse - tgt, 0.0))
        if not with_grad:
            return dw_t, (loss_sum, jnp.zeros((0,), jnp.float32))
        # d(lse - tgt)/dlogits = softmax - onehot, zero on padded rows and padded columns
        probs = jnp.exp(logits - lse[:, None])
        dlogits = probs - jax.nn.one_hot(t_i, V, dtype=jnp.float32)
        dlogits = jnp.where(ok[:, None], dlogits, 0.0).astype(dtype)
        dh_i = _dot(dlogits, w_c, dtype, precision)  # (rows, V) @ (V, C)
        dw_t = dw_t + _dot(materialize_transpose(h_i.astype(dtype)), dlogits, dtype, precision)  # (C, V)
        return dw_t, (loss_sum, dh_i)

    dw_t0 = jnp.zeros((C, V) if with_grad else (0,), jnp.float32)
    dw_t, (loss_sums, dh) = lax.scan(chunk, dw_t0, (hc, tc, valid_row))
    loss_sum = jnp.sum(loss_sums)
    if not with_grad:
        return loss_sum
    return loss_sum, dh.reshape(-1, C)[:M], dw_t.T


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused_ce(h, w, targets, vocab_size, dtype, precision):
    return _ce_pass(h, w, targets, vocab_size, dtype, precision, with_grad=False) / h.shape[0]


def _fused_ce_fwd(h, w, targets, vocab_size, dtype, precision):
    loss_sum, dh, dw = _ce_pass(h, w, targets, vocab_size, dtype, precision, with_grad=True)
    M = h.shape[0]
    return loss_sum / M, (dh / M, dw / M, targets)


def _fused_ce_bwd(vocab_size, dtype, precision, res, g):
    dh, dw, targets = res
    return (g * dh).astype(jnp.float32), (g * dw).astype(jnp.float32), None


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def lm_head_cross_entropy(
    h: Float[Array, "batch seq embed"],
    w: Float[Array, "vocab_rows embed"],
    targets: Int[Array, "batch seq"],
    *,
    vocab_size: int,
    dtype,
    precision=None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy of the tied lm_head ``logits = h @ w^T`` over the first ``vocab_size``
    columns, in fp32; the same value as ``cross_entropy(logits[..., :vocab_size], targets)``."""
    C = h.shape[-1]
    return _fused_ce(h.reshape(-1, C).astype(jnp.float32), w, targets.reshape(-1), vocab_size,
                     jnp.dtype(dtype), precision)
