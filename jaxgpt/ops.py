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
* :func:`causal_attention` — ``softmax(q k^T / sqrt(D) + causal mask) v`` as plain einsums with a hand-written
  backward (``Policy.attention = "einsum"``, the CPU default).

What each one saved is measured in ``BENCHMARKS.md`` and in the docstrings below; ``tests/test_ops.py`` checks
each against the plain expression, values and gradients.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int


def materialize_transpose(a: Float[Array, "*batch m n"]) -> Float[Array, "*batch n m"]:
    """``a`` with its last two axes swapped, as a real row-major array. A plain ``.T`` (or a copy of it) is
    folded by XLA into the consumer as a layout change, which makes XLA:CPU upcast a bf16 dot to fp32;
    flattening behind an optimization barrier forces the physical transpose."""
    swapped = jnp.swapaxes(a, -1, -2)
    if jax.default_backend() != "cpu":
        return swapped  # GPU/TPU matmul units take transposed operands at full speed
    return lax.optimization_barrier(swapped.reshape(-1)).reshape(swapped.shape)


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
CE_CHUNK_ELEMENTS = 1 << 25  # fp32 logits per chunk of the fused loss (jaxgpt.account's memory estimate reads it)


def _chunk_rows(n_rows: int, vocab_rows: int, budget: int | None = None) -> int:
    """Rows per chunk so one chunk's fp32 logits stay near ``budget`` elements (128 MiB): 4 chunks of 512 rows
    for 2,048 tokens at GPT-2's vocabulary. Measured on a 2-core CPU: 158-row chunks were 25% slower (the dW
    dot's contraction gets short), one chunk no faster than four (more memory traffic per pass)."""
    budget = CE_CHUNK_ELEMENTS if budget is None else budget
    rows = max(1, min(n_rows, budget // vocab_rows))
    n_chunks = math.ceil(n_rows / rows)
    return math.ceil(n_rows / n_chunks)  # balanced chunks: the padded last chunk wastes < n_chunks rows


_NT = (((1,), (1,)), ((), ()))  # dot_general dims for a @ b^T


def _ce_pass(h, w, targets, vocab_size, dtype, precision, with_grad):
    """Loss sum over all rows, and (with_grad) d(mean)/dh and d(mean)/dw. h (M, C), w (V, C), targets (M,)."""
    M, C = h.shape
    V = w.shape[0]
    rows = _chunk_rows(M, V)
    n_chunks = math.ceil(M / rows)
    pad = n_chunks * rows - M
    hp = jnp.pad(h.astype(dtype), ((0, pad), (0, 0)))
    tp = jnp.pad(targets, (0, pad))
    valid_row = (jnp.arange(n_chunks * rows) < M).reshape(n_chunks, rows)
    hc = hp.reshape(n_chunks, rows, C)
    tc = tp.reshape(n_chunks, rows)
    w_c = w.astype(dtype)
    real_col = jnp.arange(V) < vocab_size  # padded vocabulary columns take no probability

    def chunk(carry, inp):
        dw_t = carry
        h_i, t_i, ok = inp
        # h W^T straight from row-major W: YNNPACK runs this NT dot in bf16 (only *backward*-style transposed
        # operands get upcast), and a materialised W^T copy measured slower.
        logits = lax.dot_general(h_i, w_c, _NT, precision=precision, preferred_element_type=jnp.float32)
        logits = jnp.where(real_col[None, :], logits, -jnp.inf)  # (rows, V) fp32
        # one exp pass: e = exp(logits - max) serves both the loss (through its sum) and the softmax
        # (logsumexp + a second exp(logits - lse) pass measured 2x slower on the 2-core CPU)
        m = jnp.max(logits, axis=-1, keepdims=True)
        e = jnp.exp(logits - m)
        s = jnp.sum(e, axis=-1, keepdims=True)
        lse = (m + jnp.log(s))[:, 0]
        tgt = jnp.take_along_axis(logits, t_i[:, None], axis=-1)[:, 0]
        loss_sum = jnp.sum(jnp.where(ok, lse - tgt, 0.0))
        if not with_grad:
            return dw_t, (loss_sum, jnp.zeros((0,), jnp.float32))
        # d(lse - tgt)/dlogits = softmax - onehot, zero on padded rows (padded columns: e is already 0 there)
        # of the *mean*: the 1/M folds into this pass instead of two more passes over dh and dW
        dlogits = (e * (1.0 / s) - jax.nn.one_hot(t_i, V, dtype=jnp.float32)) * (1.0 / M)
        dlogits = jnp.where(ok[:, None], dlogits, 0.0).astype(dtype)
        dh_i = _dot(dlogits, w_c, dtype, precision)  # (rows, V) @ (V, C)
        dw_t = dw_t + _dot(materialize_transpose(h_i), dlogits, dtype, precision)  # (C, rows) @ (rows, V)
        return dw_t, (loss_sum, dh_i)

    dw_t0 = jnp.zeros((C, V) if with_grad else (0,), jnp.float32)
    dw_t, (loss_sums, dh) = lax.scan(chunk, dw_t0, (hc, tc, valid_row))
    loss_sum = jnp.sum(loss_sums)
    if not with_grad:
        return loss_sum
    # the barrier keeps XLA from folding this transpose into the dW dot (with one chunk the scan is inlined,
    # and a bf16 dot with a transposed operand then has no CPU kernel at all)
    dw = lax.optimization_barrier(dw_t).T if jax.default_backend() == "cpu" else dw_t.T
    return loss_sum, dh.reshape(-1, C)[:M], dw


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused_ce(h, w, targets, vocab_size, dtype, precision):
    return _ce_pass(h, w, targets, vocab_size, dtype, precision, with_grad=False) / h.shape[0]


def _fused_ce_fwd(h, w, targets, vocab_size, dtype, precision):
    loss_sum, dh, dw = _ce_pass(h, w, targets, vocab_size, dtype, precision, with_grad=True)
    return loss_sum / h.shape[0], (dh, dw, targets)


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


# ---- causal self-attention ------------------------------------------------------------------------------------
def _einsum(spec, a, b, dtype, precision):
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=precision,
                      preferred_element_type=jnp.float32)


def _attention_probs(q, k, dtype, precision):
    """softmax(q k^T / sqrt(D) + causal mask), fp32, (B, H, T, S)."""
    T, S = q.shape[1], k.shape[1]
    scores = _einsum("bthd,bshd->bhts", q, k, dtype, precision) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((T, S), dtype=bool))
    return jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _causal_attention(q, k, v, dtype, precision):
    return _einsum("bhts,bshd->bthd", _attention_probs(q, k, dtype, precision), v, dtype, precision)


def _causal_attention_fwd(q, k, v, dtype, precision):
    qc, kc, vc = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    probs = _attention_probs(qc, kc, dtype, precision)
    y = _einsum("bhts,bshd->bthd", probs, vc, dtype, precision)
    return y, (qc, kc, vc, probs, y)


def _causal_attention_bwd(dtype, precision, res, g):
    qc, kc, vc, probs, y = res
    dv = _einsum("bhts,bthd->bshd", probs, g, dtype, precision)  # P^T g
    dp = _einsum("bthd,bshd->bhts", g, vc, dtype, precision)  # g V^T
    # softmax backward: dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(g * y) (cheaper: D, not S)
    delta = jnp.swapaxes(jnp.sum(g * y, axis=-1), 1, 2)[..., None]  # (B, H, T, 1); a reduction, not a matmul
    ds = probs * (dp - delta) / math.sqrt(qc.shape[-1])
    dq = _einsum("bhts,bshd->bthd", ds, kc, dtype, precision)
    dk = _einsum("bhts,bthd->bshd", ds, qc, dtype, precision)
    return dq, dk, dv


_causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


def causal_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
    *,
    dtype,
    precision=None,
) -> Float[Array, "batch seq heads head_dim"]:
    """``softmax(q k^T / sqrt(D) + causal mask) v``, matmuls in ``dtype`` with fp32 accumulation, softmax in
    fp32: the same forward as ``model.reference_attention`` without a mask, with a hand-written backward.
    On the 2-core CPU it measured 1.5-2x faster (fwd+bwd) than both the plain einsums' autodiff and
    ``jax.nn.dot_product_attention(implementation="xla")``, at T=256 and T=1024: the softmax backward uses
    ``rowsum(dP * P) = rowsum(g * y)`` and no fp32 copy of the bf16 operands is saved. (Cutting long
    sequences into query blocks that skip the fully masked key blocks measured no faster at T=1024.)"""
    return _causal_attention(q, k, v, jnp.dtype(dtype), precision)
