"""The MLP's c_fc GEMM + bias + tanh GELU with a one-kernel GELU backward (``Policy.gelu = "pallas"``).

The same function as :class:`jaxgpt.model.MLP`'s plain path (``h = x @ W + b`` with bf16 operands and fp32
accumulation as :func:`jaxgpt.ops.matmul` computes it, then GPT-2's tanh GELU of ``h`` in fp32). What changes is
the backward. Compiled for the H100 (gpt2 124M, micro-batch 64, the default bf16 policy), autodiff of the plain
path runs two XLA fusions per layer after the incoming fp32 gradient ``g`` of GELU's output:

* ``loop_add_fusion`` (``transpose(jvp(gelu))``): reads ``g`` and ``h`` (fp32, [65536, 3072]: 805 MB each),
  recomputes the tanh and writes ``dh`` in fp32: 2.4 GB moved, 0.787 ms predicted;
* ``input_convert_reduce_fusion``: reads that fp32 ``dh`` again and writes the bf16 ``dh`` the two backward GEMMs
  take plus fp32 column partial sums for the bias gradient: 1.2 GB, 0.426 ms.

XLA does not fuse the GELU backward into the column reduction, so ``dh`` makes an fp32 round trip through HBM
(~1.6 GB per layer). :func:`gelu_backward` is one Pallas kernel that reads ``g`` and ``h`` once and writes the
bf16 ``dh`` and per-row-block partial column sums (``d(bias)``): ~2.0 GB per layer instead of ~3.6.

The cotangent of an fp32 ``h`` must itself be fp32, so a custom VJP of GELU alone could not hand the GEMMs a bf16
``dh``: :func:`fc_gelu` owns the c_fc GEMM's backward too. ``dx`` and ``dW`` are computed as
:func:`jaxgpt.ops._matmul2d_bwd` computes them (same operands, dot dimension order and dtypes), so the GEMMs are
the classes the calibration measured. On CPUs the same VJP takes the plain XLA expression of GELU's derivative
(autodiff's, the same numbers as the plain path) in place of the kernel; tests run the kernel there with
``interpret=True``. Row and column counts that are not multiples of the kernel's blocks are zero-padded (a zero
``g`` row or column adds nothing to ``dh``'s kept part or to the sums); GPT-2's shapes never are.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxgpt import ops

SCOPE = "gelu"  # the profile's and jaxgpt.compile's category (custom_vjp rules trace outside the caller's scopes)
BLOCK_ROWS, BLOCK_COLS = 256, 256  # one program's tile of g, h and dh; its partial sums are one row of the output
SUB_ROWS = 16  # rows per inner step: a (16, 256) fp32 slice of g and h is 32 values per thread of 4 warps
NUM_WARPS, NUM_STAGES = 4, 2
K = float(np.sqrt(2 / np.pi))  # jax.nn.gelu's sqrt(2 / pi)
C3 = 0.044715  # GPT-2's tanh GELU: 0.5 h (1 + tanh(K (h + C3 h^3)))
Backward = Literal["auto", "kernel", "interpret", "xla"]


class GeluKernelError(ValueError):
    """Inputs the GELU backward kernel cannot take (wrong rank, mismatched shapes, non-float32 g or h)."""


def gelu_grad(h: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """d gelu(h) / dh of GPT-2's tanh GELU, in h's dtype: the derivative of ``h * 0.5 (1 + tanh(u))`` with
    ``u = K (h + C3 h^3)``, written as autodiff of :func:`jax.nn.gelu` writes it (cdf + h * d cdf)."""
    t = jnp.tanh(K * (h + C3 * (h * h * h)))
    return 0.5 * (1.0 + t) + h * (0.5 * (1.0 - t * t) * K * (1.0 + 3.0 * C3 * (h * h)))


def _kernel(g_ref, h_ref, dh_ref, db_ref, *, sub: int):
    """One (rows, cols) tile: dh = g * gelu'(h) written in dh_ref's dtype, its fp32 column sums into db_ref."""
    from jax.experimental import pallas as pl

    rows, cols = g_ref.shape

    def step(i, acc):
        at = pl.ds(i * sub, sub)
        dh = g_ref[at, :] * gelu_grad(h_ref[at, :])  # fp32
        dh_ref[at, :] = dh.astype(dh_ref.dtype)
        return acc + dh.sum(axis=0)

    db_ref[0, :] = jax.lax.fori_loop(0, rows // sub, step, jnp.zeros((cols,), jnp.float32))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def blocks(rows: int, cols: int) -> tuple[int, int]:
    """(row block, column block) of the kernel for a (rows, cols) input: :data:`BLOCK_ROWS` x :data:`BLOCK_COLS`,
    smaller powers of two (at least :data:`SUB_ROWS` rows) for smaller inputs; Triton tiles are powers of two."""
    return (min(BLOCK_ROWS, max(SUB_ROWS, _next_pow2(rows))), min(BLOCK_COLS, max(16, _next_pow2(cols))))


def _check(g, h) -> None:
    if getattr(g, "ndim", 0) != 2 or tuple(g.shape) != tuple(getattr(h, "shape", ())):
        raise GeluKernelError(f"gelu_backward takes g and h of one (rows, features) shape, got "
                              f"{tuple(getattr(g, 'shape', ()))} and {tuple(getattr(h, 'shape', ()))}; reshape them "
                              "with a.reshape(-1, a.shape[-1])")
    if g.dtype != jnp.float32 or h.dtype != jnp.float32:
        raise GeluKernelError(f"gelu_backward takes float32 g and h (the fp32 GEMM output and its gradient), got "
                              f"{g.dtype} and {h.dtype}")


def gelu_backward(g: Float[Array, "rows d_ff"], h: Float[Array, "rows d_ff"], *, out_dtype=jnp.bfloat16,
                  interpret: bool = False) -> tuple[Float[Array, "rows d_ff"], Float[Array, "row_blocks d_ff"]]:
    """``(dh, partial_sums)``: ``dh = g * gelu'(h)`` rounded to ``out_dtype`` and the fp32 column sums of the
    unrounded ``dh`` per block of rows (``partial_sums.sum(0)`` is the bias gradient), as one Pallas Triton
    kernel (``interpret=True``: Pallas' interpreter, on any backend). Rows and columns are zero-padded up to the
    blocks (:func:`blocks`) where they are not multiples of them: padded rows of g are zero, so they add nothing."""
    from jax.experimental import pallas as pl  # here, not at import: Pallas adds ~0.2-0.3 s to `import jaxgpt.model`
    from jax.experimental.pallas import triton as plgpu

    _check(g, h)
    rows, cols = g.shape
    br, bc = blocks(rows, cols)
    pad_r, pad_c = -rows % br, -cols % bc
    if pad_r or pad_c:
        g, h = (jnp.pad(a, ((0, pad_r), (0, pad_c))) for a in (g, h))
    n_r, n_c = (rows + pad_r) // br, (cols + pad_c) // bc
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)}
    dh, partial_sums = pl.pallas_call(
        partial(_kernel, sub=min(SUB_ROWS, br)),
        out_shape=(jax.ShapeDtypeStruct(g.shape, out_dtype), jax.ShapeDtypeStruct((n_r, g.shape[1]), jnp.float32)),
        grid=(n_r, n_c),
        in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))] * 2,
        out_specs=(pl.BlockSpec((br, bc), lambda i, j: (i, j)), pl.BlockSpec((1, bc), lambda i, j: (i, j))),
        interpret=interpret, name="gelu_backward_bias", **kwargs)(g, h)
    if pad_r or pad_c:
        dh, partial_sums = dh[:rows, :cols], partial_sums[:, :cols]
    return dh, partial_sums


def gelu_backward_xla(g: Float[Array, "rows d_ff"], h: Float[Array, "rows d_ff"], *, out_dtype=jnp.bfloat16
                      ) -> tuple[Float[Array, "rows d_ff"], Float[Array, "1 d_ff"]]:
    """What :func:`gelu_backward` computes, as the plain path's autodiff computes it: ``dh`` from the VJP of
    :func:`jax.nn.gelu` (fp32), rounded to ``out_dtype``, and its fp32 column sum (one row of partial sums)."""
    dh = jax.vjp(partial(jax.nn.gelu, approximate=True), h)[1](g)[0]
    return dh.astype(out_dtype), dh.sum(axis=0, keepdims=True)
