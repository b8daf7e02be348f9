"""Attention: softmax(q k^T / sqrt(D) + causal mask) v, and its implementations (``Policy.kernels.attention``):
"reference" (the plain einsums below: the oracle, dropout, and decoding against a KV cache), "xla" and "cudnn"
(``jax.nn.dot_product_attention``'s), "einsum" (:func:`causal_attention`: query-blocked einsums with a
hand-written backward, the CPUs' choice), "auto" (:meth:`jaxgpt.precision.Policy.attention_impl`)."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from jaxgpt.ops import dropout, materialize_transpose, platform, transpose_operand
from jaxgpt.precision import Policy


def attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch kv_seq heads head_dim"],
    v: Float[Array, "batch kv_seq heads head_dim"],
    *,
    policy: Policy,
    mask: Float[Array, "batch 1 seq kv_seq"] | None = None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """softmax(q k^T / sqrt(D) + causal mask) v. Without ``mask`` the attention is causal over one sequence;
    with it (incremental decoding), ``mask[b, 0, t, s]`` says whether query t may see key s."""
    impl = policy.attention_impl()
    if dropout_key is not None and dropout_rate > 0.0:
        impl = "reference"  # the fused kernels have no dropout on the probabilities
    if impl == "reference":
        return reference_attention(q, k, v, policy=policy, mask=mask, dropout_rate=dropout_rate,
                                   dropout_key=dropout_key)
    if mask is not None and impl in ("cudnn", "einsum"):
        impl = "xla"  # an explicit mask (the model's own decoding uses cached_attention) takes XLA's path
    if impl == "einsum":  # the output rounded as the policy's GEMM outputs (Policy.gemm_output), as SDPA's
        y = causal_attention(q, k, v, dtype=policy.dtype, precision=policy.lax_precision)
        return y.astype(policy.out_dtype)
    y = jax.nn.dot_product_attention(policy.cast(q), policy.cast(k), policy.cast(v), mask=mask,
                                     is_causal=mask is None, implementation=impl)
    return y.astype(policy.out_dtype)


def reference_attention(q, k, v, *, policy: Policy, mask=None, dropout_rate=0.0, dropout_key=None):
    """The same attention written out as plain einsums (the oracle for the fused path, and dropout)."""
    T, S = q.shape[1], k.shape[1]
    scores = policy.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])  # fp32
    if mask is None:
        mask = jnp.tril(jnp.ones((T, S), dtype=bool))[None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)  # fp32
    probs = dropout(probs, dropout_rate, dropout_key)
    return policy.einsum("bhts,bshd->bthd", probs, v)


def cached_attention(q: Float[Array, "batch seq heads head_dim"], k: Float[Array, "batch heads kv_seq head_dim"],
                     v: Float[Array, "batch heads kv_seq head_dim"], *, policy: Policy,
                     mask: Float[Array, "batch 1 seq kv_seq"], dropout_rate: float = 0.0,
                     dropout_key: jax.Array | None = None) -> Float[Array, "batch seq heads head_dim"]:
    """Incremental decoding: queries against a KV cache held heads-first; ``mask[b, 0, t, s]`` says whether
    query t may see key s. The same einsums as :func:`reference_attention`."""
    scores = policy.einsum("bthd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])  # fp32
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    probs = dropout(probs, dropout_rate, dropout_key)
    return policy.einsum("bhts,bhsd->bthd", probs, v)


# ---- causal self-attention ------------------------------------------------------------------------------------
ATTENTION_QUERY_BLOCKS = 4  # query blocks of the blocked causal attention (fewer when the sequence is shorter)


def _einsum(spec, a, b, dtype, precision):
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=precision,
                      preferred_element_type=jnp.float32)


def query_blocks(seq: int, n_blocks: int | None = None) -> list[tuple[int, int]]:
    """The query rows ``[a, b)`` of each block of :func:`causal_attention`: ``n_blocks`` (default
    :data:`ATTENTION_QUERY_BLOCKS`) near-equal blocks; block ``[a, b)`` sees keys ``[0, b)`` only."""
    n = max(1, min(ATTENTION_QUERY_BLOCKS if n_blocks is None else n_blocks, seq))
    edges = [round(i * seq / n) for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _heads_first(x: Float[Array, "batch seq heads head_dim"]) -> Float[Array, "batch heads seq head_dim"]:
    """(B, T, H, D) -> (B, H, T, D) as a real row-major copy on CPU (see :func:`jaxgpt.ops.materialize_transpose`), so
    each attention matmul below is a plain batched matmul over (B, H)."""
    y = jnp.swapaxes(x, 1, 2)
    if platform() != "cpu":
        return y
    return lax.optimization_barrier(y.reshape(-1)).reshape(y.shape)


def _blocked_forward(qh, kh, vh, dtype, precision):
    """Per query block ``[a, b)``: probs (B, H, b - a, b) fp32 over the keys it can see, and y (B, H, T, D)."""
    T, D = qh.shape[2], qh.shape[3]
    scale = 1.0 / math.sqrt(D)
    kt = transpose_operand(kh)  # (B, H, D, T)
    probs, ys = [], []
    for a, b in query_blocks(T):
        scores = _einsum("bhtd,bhds->bhts", qh[:, :, a:b], kt[..., :b], dtype, precision) * scale
        visible = jnp.arange(b)[None, :] <= jnp.arange(a, b)[:, None]  # causal; only the last a..b columns bite
        p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        probs.append(p)
        ys.append(_einsum("bhts,bhsd->bhtd", p, vh[:, :, :b], dtype, precision))
    return probs, jnp.concatenate(ys, axis=2)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _causal_attention(q, k, v, dtype, precision):
    qh, kh, vh = (_heads_first(x.astype(dtype)) for x in (q, k, v))
    _, y = _blocked_forward(qh, kh, vh, dtype, precision)
    return jnp.swapaxes(y, 1, 2)


def _causal_attention_fwd(q, k, v, dtype, precision):
    qh, kh, vh = (_heads_first(x.astype(dtype)) for x in (q, k, v))
    probs, y = _blocked_forward(qh, kh, vh, dtype, precision)
    return jnp.swapaxes(y, 1, 2), (qh, kh, vh, probs, y, jnp.zeros((), q.dtype))


def _causal_attention_bwd(dtype, precision, res, g):
    qh, kh, vh, probs, y, like = res
    T, D = qh.shape[2], qh.shape[3]
    scale = 1.0 / math.sqrt(D)
    gh = _heads_first(g.astype(jnp.float32))  # (B, H, T, D)
    # softmax backward: dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(g * y) (D wide, not S)
    delta = jnp.sum(gh * y, axis=-1, keepdims=True)  # (B, H, T, 1); a reduction, not a matmul
    vt = transpose_operand(vh)  # (B, H, D, T)
    # dK and dV are built transposed, (B, H, D, T): dV^T += g^T P and dK^T += q^T dS take the small (D, t) row-major
    # copies of g and q as left operands and P, dS as they are, where P^T g and dS^T q needed a transposed copy of
    # every (t, S) block of P and dS (measured at gpt2's T=1024 H=12: the attention's fwd+bwd 1.3-1.4x faster)
    gt, qt = materialize_transpose(gh.astype(dtype)), materialize_transpose(qh)  # (B, H, D, T)
    dq, dkt, dvt = [], jnp.zeros(gt.shape, jnp.float32), jnp.zeros(gt.shape, jnp.float32)
    for (a, b), p in zip(query_blocks(T), probs):
        dvt = _add_to_first_columns(dvt, _einsum("bhdt,bhts->bhds", gt[..., a:b], p, dtype, precision))  # (P^T g)^T
        dp = _einsum("bhtd,bhds->bhts", gh[:, :, a:b], vt[..., :b], dtype, precision)  # g V^T
        ds = p * (dp - delta[:, :, a:b]) * scale
        dq.append(_einsum("bhts,bhsd->bhtd", ds, kh[:, :, :b], dtype, precision))
        dkt = _add_to_first_columns(dkt, _einsum("bhdt,bhts->bhds", qt[..., a:b], ds, dtype, precision))  # (dS^T q)^T
    dq = jnp.swapaxes(jnp.concatenate(dq, axis=2), 1, 2)  # (B, T, H, D)
    dk, dv = (jnp.transpose(d, (0, 3, 1, 2)) for d in (dkt, dvt))  # (B, H, D, T) -> (B, T, H, D)
    return tuple(d.astype(like.dtype) for d in (dq, dk, dv))


def _add_to_first_columns(acc: jax.Array, update: jax.Array) -> jax.Array:
    """``acc[..., :b] += update`` for ``b = update.shape[-1]``. Over the whole last axis it is a plain add: as a
    scatter its index is an empty constant, which jax 0.11 passes into a shard_map as an operand and Shardy's
    canonicalizer (ManualComputationUnusedInputsPattern) then crashed XLA's compiler with (SIGSEGV)."""
    if update.shape[-1] == acc.shape[-1]:
        return acc + update
    return acc.at[..., : update.shape[-1]].add(update)


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
    fp32: the same forward as :func:`reference_attention` without a mask, with a hand-written backward.

    Blocked by queries (:func:`query_blocks`): block ``[a, b)`` multiplies only against keys ``[0, b)``, so the
    fully masked upper triangle is mostly never computed (4 blocks: 62.5% of the dense work), and every matmul
    is a plain batched matmul over heads-first, row-major copies of q, k and v. The softmax backward uses
    ``rowsum(dP * P) = rowsum(g * y)``. Measured on a 2-core AMD EPYC Zen 4, forward+backward against the dense
    einsum version this replaced: 9-10 ms vs 18-21 ms at B=8 T=256 H=4, 43-50 ms vs 67-72 ms at gpt2's T=1024 H=12
    (which itself was 1.5-2x faster than ``jax.nn.dot_product_attention(implementation="xla")``). The backward
    builds dK and dV transposed, so no (t, S) block of P or dS is ever transposed: on a 2-core AVX2-only AMD EPYC,
    fwd+bwd at T=1024 H=12 went from 99-115 to 78-81 ms (best of 15, alternating in one process; torch's fused
    CPU SDPA: 66 ms), at B=8 T=256 H=4 from 24 to 20 ms."""
    return _causal_attention(q, k, v, jnp.dtype(dtype), precision)
