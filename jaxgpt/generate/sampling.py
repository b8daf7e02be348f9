"""One token per row from next-token logits, nanoGPT's way: :func:`sample_logits` (temperature, top-k, then a
categorical draw; argmax when ``temperature == 0``), and its parts.

Each draw is :func:`categorical` (inverse CDF, two uniforms per row) after :func:`kth_largest`'s exact top-k
threshold: sampling a step's token costs 0.5 ms for one row of 50,257 logits on our 2-core CPU, where
``jax.random.categorical`` after a full-row bisection took 3.5 ms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["GROUP", "argmax", "categorical", "kth_largest", "sample_logits"]

_SIGN = 0x80000000  # the float32 sign bit


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of the float32 values of ``x`` whose unsigned order is the floats' order (NaN excepted),
    denormals included, which XLA:CPU's float comparisons flush to zero."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    sign = jnp.uint32(_SIGN)
    return jnp.where(bits >= sign, ~bits, bits | sign)


def _kth_largest_bisect(x: jax.Array, k: int) -> jax.Array:
    """The exact k-th largest value of each row (duplicates counted, as ``lax.top_k``), found by bisection
    over the floats' order-preserving uint32 keys: 32 compare-and-count passes over the row. On XLA:CPU this
    is ~10x faster than ``lax.top_k`` for a 50257-wide row (0.8 vs 9.7 ms of CPU per row, k=50)."""
    keys = _order_keys(x)
    sign = jnp.uint32(_SIGN)
    lo = jnp.zeros(x.shape[:-1] + (1,), jnp.uint32)  # invariant: count(keys >= lo) >= k; answer in [lo, hi]
    hi = jnp.full(x.shape[:-1] + (1,), 0xFFFFFFFF, jnp.uint32)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2  # upper middle, no overflow
        ok = jnp.sum(keys >= mid, axis=-1, keepdims=True) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    bits = jnp.where(lo >= sign, lo & ~sign, ~lo)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first index of the largest value; int32) for non-NaN ``x``, as a max
    and a min-index reduction: XLA:CPU's two-operand argmax reduction took 5 of 64 ms of a batch-8 gpt2 decode
    step (8 x 50,257 logits), these two take under 1."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)


GROUP = 128  # values per group in the two-level top-k threshold and sampler below


def _groups(x: jax.Array) -> jax.Array:
    """(..., V) -> (..., ceil(V / GROUP), GROUP), padded with -inf (never the k-th largest, never drawn)."""
    n = -(-x.shape[-1] // GROUP)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * GROUP - x.shape[-1])], constant_values=-jnp.inf)
    return x.reshape(*x.shape[:-1], n, GROUP)


def _kth_largest_grouped(x: jax.Array, k: int) -> jax.Array:
    """:func:`_kth_largest_bisect` on the k groups of GROUP values with the largest maxima only (k * GROUP
    values, not V). Exact: those groups hold k values >= the row's k-th largest t, because either every value
    >= t lies in them, or one lies outside and then each chosen group's maximum is >= it >= t."""
    if 2 * k * GROUP > x.shape[-1]:  # no saving
        return _kth_largest_bisect(x, k)
    g = _groups(x.astype(jnp.float32))
    signed_keys = jax.lax.bitcast_convert_type(_order_keys(g) ^ jnp.uint32(_SIGN), jnp.int32)
    _, top = jax.lax.top_k(jnp.max(signed_keys, axis=-1), k)  # (..., k) group indices, exact group maxima
    candidates = jnp.take_along_axis(g, top[..., None], axis=-2)  # (..., k, GROUP)
    return _kth_largest_bisect(candidates.reshape(*candidates.shape[:-2], -1), k)


def kth_largest(x: jax.Array, k: int) -> jax.Array:
    """The k-th largest value along the last axis, keepdims (torch.topk(x, k).values[..., -1:]).
    On CPU (where ``lax.top_k`` over a 50,257-wide row is slow) bisection over the values of the k groups of
    :data:`GROUP` with the largest maxima; ``lax.top_k`` elsewhere; the same values."""
    return jax.lax.platform_dependent(
        x, cpu=lambda x: _kth_largest_grouped(x, k), default=lambda x: jax.lax.top_k(x, k)[0][..., -1:])


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, the first index i with cumsum(weights)[i] > u * sum(weights) (so index i is drawn with
    probability weights[i] / sum, for u uniform in [0, 1)); never an index of weight 0, float rounding
    included (a u * sum that rounds up to the sum takes the last index of positive weight)."""
    c = jnp.cumsum(weights, axis=-1)
    i = jnp.sum(c <= (u * c[..., -1])[..., None], axis=-1)
    last = weights.shape[-1] - 1 - argmax(jnp.flip(weights, axis=-1) > 0)
    return jnp.minimum(i, last).astype(jnp.int32)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One index per row drawn from softmax(logits) (a -inf logit is never drawn), by inverse CDF in two
    levels: a group of :data:`GROUP` by the groups' probability masses, then an index within that group. The
    same distribution as ``jax.random.categorical`` (Gumbel-max), from two uniforms per row instead of Gumbel
    noise for every logit: on CPU, 0.2 instead of 2.1 ms per row of 50,257 logits (measured)."""
    g = _groups(logits.astype(jnp.float32))
    p = jnp.exp(g - jnp.max(g, axis=(-2, -1), keepdims=True))  # unnormalised softmax; -inf -> 0
    u = jax.random.uniform(key, (2, *logits.shape[:-1]))
    group = _inverse_cdf(jnp.sum(p, axis=-1), u[0])
    within = jnp.take_along_axis(p, group[..., None, None], axis=-2)[..., 0, :]  # (..., GROUP)
    return group * GROUP + _inverse_cdf(within, u[1])


def sample_logits(logits: jax.Array, key: jax.Array, temperature: jax.Array | float, *,
                  top_k: int | None) -> jax.Array:
    """One token per row from ``logits`` (batch, vocab), nanoGPT's way.

    ``temperature == 0``: argmax. Otherwise ``logits / temperature``, then (if ``top_k``) every logit below
    the ``top_k``-th largest is set to -inf (ties with it are kept), then a categorical draw from the
    softmax. ``temperature`` may be traced (greedy and sampling share one compiled function); ``top_k`` is
    static. Returns int32 (batch,).
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)

    def sample():
        scaled = logits / jnp.where(temperature == 0, 1.0, temperature)
        if top_k is not None:
            kth = kth_largest(scaled, min(top_k, scaled.shape[-1]))
            scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        return categorical(key, scaled)  # from softmax(scaled); -inf logits are never drawn

    def greedy():
        return argmax(logits)

    return jax.lax.cond(temperature == 0, greedy, sample)
