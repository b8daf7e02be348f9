"""GPT-2's tanh GELU's derivative, as the MLP's kernels (:mod:`jaxgpt.kernels.mlp`) and its XLA path compute it.

``gelu(h) = 0.5 h (1 + tanh(K (h + C3 h^3)))``. :func:`gelu_grad` is written as autodiff of :func:`jax.nn.gelu`
writes it (cdf + h * d cdf), so the kernels' gelu'(h) is the XLA expression's; :func:`gelu_backward_xla` is the
reference backward of c_fc's GELU: dh = g * gelu'(h) and its column sum (the bias gradient).

(``gelu: pallas``, a c_fc + GELU custom VJP whose GELU backward was one Pallas kernel, was superseded by
``kernels.mlp: pallas-gemm``, GELU in the GEMMs' epilogues, and removed with issue 44: docs/kernels.md.)
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

SCOPE = "gelu"  # the profile's and jaxgpt.compile's category (custom_vjp rules trace outside the caller's scopes)
K = float(np.sqrt(2 / np.pi))  # jax.nn.gelu's sqrt(2 / pi)
C3 = 0.044715  # GPT-2's tanh GELU: 0.5 h (1 + tanh(K (h + C3 h^3)))


def gelu_grad(h: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """d gelu(h) / dh of GPT-2's tanh GELU, in h's dtype: the derivative of ``h * 0.5 (1 + tanh(u))`` with
    ``u = K (h + C3 h^3)``, written as autodiff of :func:`jax.nn.gelu` writes it (cdf + h * d cdf)."""
    t = jnp.tanh(K * (h + C3 * (h * h * h)))
    return 0.5 * (1.0 + t) + h * (0.5 * (1.0 - t * t) * K * (1.0 + 3.0 * C3 * (h * h)))


def gelu_backward_xla(g: Float[Array, "rows d_ff"], h: Float[Array, "rows d_ff"], *, out_dtype=jnp.bfloat16
                      ) -> tuple[Float[Array, "rows d_ff"], Float[Array, "1 d_ff"]]:
    """GELU's backward as the plain path's autodiff computes it: ``dh`` from the VJP of :func:`jax.nn.gelu` (fp32),
    rounded to ``out_dtype``, and its fp32 column sum (one row of partial sums)."""
    dh = jax.vjp(partial(jax.nn.gelu, approximate=True), h)[1](g)[0]
    return dh.astype(out_dtype), dh.sum(axis=0, keepdims=True)
