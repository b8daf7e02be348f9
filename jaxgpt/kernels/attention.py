"""Attention: softmax(q k^T / sqrt(D) + causal mask) v, and its implementations (``Policy.kernels.attention``):
"reference" (the plain einsums below: the oracle, dropout, and decoding against a KV cache), "xla" and "cudnn"
(``jax.nn.dot_product_attention``'s), "einsum" (:func:`jaxgpt.ops.causal_attention`: query-blocked einsums with a
hand-written backward, the CPUs' choice), "auto" (:meth:`jaxgpt.precision.Policy.attention_impl`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxgpt import ops
from jaxgpt.ops import dropout
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
        y = ops.causal_attention(q, k, v, dtype=policy.dtype, precision=policy.lax_precision)
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
