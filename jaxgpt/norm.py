"""LayerNorm with a hand-written backward (``Policy.layer_norm = "fused"``).

The same function as :class:`jaxgpt.model.LayerNorm`'s plain expression (GPT-2: statistics over the last axis,
biased variance, eps inside the rsqrt)::

    y = (x - mean) * rsqrt(var + eps) * scale + bias

What changes is the backward. Autodiff of the plain expression, compiled for the H100, recomputes the mean and
variance from ``x`` twice, reads ``dy`` three times and writes ``x_hat * dy`` in fp32 only to sum it for
``d(scale)`` (``benchmarks/results/analysis-gpu-h100-b64-layernorm-bwd.md``: 1.81 GB moved per LayerNorm at b64).
Here the forward keeps the row statistics (``mean``, ``rstd``: one fp32 number per row each) and the backward is
two passes that XLA fuses one kernel each:

* rows: ``dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))`` with ``g = dy * scale`` and
  ``x_hat = (x - mean) * rstd`` rebuilt from the saved statistics: x and dy read once, dx written once (and the
  residual stream's gradient it is added to, where XLA fuses the add in);
* columns: ``d(scale) = sum_rows(dy * x_hat)`` and ``d(bias) = sum_rows(dy)``, one multi-output reduction that
  reads x and dy once more.

A single pass (dx and per-block partial sums of d(scale) and d(bias) in one kernel, as llm.c's
``layernorm_backward`` does) needs a kernel that reduces along both axes at once, which no XLA fusion does.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxgpt import ops

SCOPE = "layer_norm"  # the profile's and jaxgpt.compile's category (custom_vjp rules trace outside the caller's)


class LayerNormError(ValueError):
    """Inputs the LayerNorm cannot take (wrong rank, mismatched widths, integer dtypes)."""


def _check(x, scale, bias) -> None:
    if getattr(x, "ndim", 0) != 2:
        raise LayerNormError(f"layer_norm takes x as (rows, embed), got shape {tuple(getattr(x, 'shape', ()))}; "
                             "reshape it with x.reshape(-1, x.shape[-1])")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise LayerNormError(f"layer_norm needs a floating-point x, got dtype {x.dtype}")
    for name, p in (("scale", scale), ("bias", bias)):
        if p is not None and tuple(p.shape) != (x.shape[-1],):
            raise LayerNormError(f"layer_norm: {name} has shape {tuple(p.shape)} but x has {x.shape[-1]} features; "
                                 f"{name} must have shape ({x.shape[-1]},)")


def _stats(x: Float[Array, "rows embed"], eps: float) -> tuple[Float[Array, "rows 1"], Float[Array, "rows 1"]]:
    mean = x.mean(axis=-1, keepdims=True)
    var = jnp.square(x - mean).mean(axis=-1, keepdims=True)  # biased, as torch.nn.LayerNorm
    return mean, jax.lax.rsqrt(var + eps)


def _normalize(x, mean, rstd, scale, bias):
    y = (x - mean) * rstd * scale.astype(x.dtype)
    return y + bias.astype(x.dtype) if bias is not None else y


def _column_sums(a: Float[Array, "rows embed"], b: Float[Array, "rows embed"] | None):
    """``(a.sum(0), b.sum(0))``; on GPUs as one variadic reduce: one kernel that reads the operands' producers
    (x, dy) once, where two reduces (or autodiff's) leave XLA to write ``dy * x_hat`` out and read it back.
    XLA:CPU runs a variadic reduce ~2.5x slower than two plain ones (one LayerNorm's forward and backward at
    8 x 256 x 256: 3.4 ms against 1.1 ms, the plain LayerNorm 1.7-2.4 ms), so the CPU gets the two sums."""
    if b is None or ops.platform() == "cpu":
        return a.sum(axis=0), None if b is None else b.sum(axis=0)
    zero = jnp.zeros((), a.dtype)
    return jax.lax.reduce((a, b), (zero, zero), lambda u, v: (u[0] + v[0], u[1] + v[1]), (0,))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, eps):
    mean, rstd = _stats(x, eps)
    return _normalize(x, mean, rstd, scale, bias)


def _layer_norm_fwd(x, scale, bias, eps):
    with jax.named_scope(SCOPE):
        mean, rstd = _stats(x, eps)
        # the barrier keeps the statistics as buffers: without it XLA recomputes them from x inside each backward
        # fusion, and a column reduction cannot hold a row reduction, so d(scale)'s dy * x_hat was written out
        saved = jax.lax.optimization_barrier((mean, rstd))
        return _normalize(x, mean, rstd, scale, bias), (x, *saved, scale, bias)


def _layer_norm_bwd(eps, res, dy):
    del eps  # inside rstd
    x, mean, rstd, scale, bias = res
    with jax.named_scope(SCOPE):
        dy = dy.astype(x.dtype)
        x_hat = (x - mean) * rstd
        g = dy * scale.astype(x.dtype)
        c1 = (g * x_hat).mean(axis=-1, keepdims=True)
        c2 = g.mean(axis=-1, keepdims=True)
        dx = (g - c2 - x_hat * c1) * rstd
        d_scale, d_bias = _column_sums(dy * x_hat, dy if bias is not None else None)
    return dx, d_scale.astype(scale.dtype), None if bias is None else d_bias.astype(bias.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def layer_norm(x: Float[Array, "rows embed"], scale: Float[Array, " embed"], bias: Float[Array, " embed"] | None,
               *, eps: float) -> Float[Array, "rows embed"]:
    """``(x - mean) * rsqrt(var + eps) * scale + bias`` over the last axis of a floating (rows, embed) ``x``, in
    x's dtype (the caller casts to fp32 first, as the plain LayerNorm does), with the two-pass backward above."""
    _check(x, scale, bias)
    return _layer_norm(x, scale, bias, float(eps))
