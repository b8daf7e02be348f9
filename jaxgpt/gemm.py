"""Pallas Triton GEMMs with fused epilogues: the tile loop every such kernel shares, and the attention's q, k and v
projections with their bias add and bf16 rounding in the epilogue (``Policy.qkv = "pallas"``).

A kernel here computes one (bm, bn) output tile of ``a @ b`` with bf16 operands, accumulating in fp32 over K in
steps of bk (:func:`accumulate`), then does its epilogue on the fp32 accumulator before anything is written: the
value XLA's GEMM would write (a sum in another order), followed by what XLA would do in a separate pass.
:mod:`jaxgpt.gelu_gemm` puts GELU there; :func:`linear_cast` puts the bias add and the rounding to bf16 that
attention applies to q, k and v. :mod:`jaxgpt.compile.hlo` reads a Pallas kernel named ``gemm_nn_*`` or
``gemm_nt_*`` as a GEMM (its first operand the (M, K) lhs, its second the rhs, (K, N) or (N, K), its first result
(M, N)) plus the epilogue's extra bytes: every kernel here is named so.

Compiled for the H100 (gpt2 124M, micro-batch 64, bf16), each q, k or v projection is an XLA GEMM writing fp32
(201 MB at [65536, 768]) and a convert pass in attention's scope that reads it, adds the bias and writes the bf16
operand cuDNN takes (302 MB moved, 36 such passes per step). :func:`linear_cast` writes the bf16 result directly.
Its backward is :func:`jaxgpt.ops._matmul2d_bwd`'s, with the bias gradient summed from the (bf16) cotangent as the
convert's backward would: the values are the plain path's. On CPUs (and fp32 compute) nothing changes: the plain
``x @ w + b`` in fp32 (attention rounds it itself).

The block sizes are Triton's usual Hopper choice for a bf16 GEMM (128 x 128 tiles, K in steps of 64); they were
not tuned on a GPU (none was lent when this was written). Shapes that are not multiples of the blocks are
zero-padded (zero rows and columns add nothing to the kept part); GPT-2's never are.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxgpt import ops

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # one program's output tile and its K step
NUM_WARPS, NUM_STAGES = 8, 3
Impl = Literal["auto", "kernel", "interpret", "xla"]


class GemmKernelError(ValueError):
    """Inputs a GEMM kernel cannot take (wrong rank or dtype, mismatched shapes, an unknown implementation)."""


def pad_to(a: jax.Array, rows: int, cols: int) -> jax.Array:
    """``a`` zero-padded up to multiples of (rows, cols)."""
    pad = ((0, -a.shape[0] % rows), (0, -a.shape[1] % cols))
    return jnp.pad(a, pad) if any(p for _, p in pad) else a


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def blocks(m: int, n: int, k: int, block: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """(bm, bn, bk): ``block`` or the defaults, each at most the next power of two of its extent (at least 16: a
    Triton dot's smallest tile)."""
    bm, bn, bk = block or (BLOCK_M, BLOCK_N, BLOCK_K)
    return tuple(min(b, max(16, _next_pow2(e))) for b, e in ((bm, m), (bn, n), (bk, k)))


def compiler_params(interpret: bool) -> dict:
    """``pallas_call``'s Triton compiler parameters (none in the interpreter)."""
    from jax.experimental.pallas import triton as plgpu

    return {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)}


def check(name: str, arrays: dict[str, tuple[jax.Array, object, str]]) -> None:
    """Every ``{key: (array, dtype, "(rows, cols)")}`` is 2-D of that dtype, else a :class:`GemmKernelError` naming
    it."""
    for key, (a, dtype, shape) in arrays.items():
        if getattr(a, "ndim", 0) != 2:
            raise GemmKernelError(f"{name}: {key} must be 2-D, {shape}, got shape {tuple(getattr(a, 'shape', ()))} "
                                  "(an activation's leading axes flatten with a.reshape(-1, a.shape[-1]))")
        if a.dtype != dtype:
            raise GemmKernelError(f"{name}: {key} must be {jnp.dtype(dtype).name}, got {a.dtype}: the kernels take "
                                  "bf16 operands (fp32 h and partial sums); cast them, or use impl 'xla' (or "
                                  "'auto') for another compute dtype")


def grid(row_tiles: int, col_tiles: int) -> tuple[int, int]:
    """The launch grid of a GEMM whose (M, K) operand is the large one (M = batch x sequence rows): the column tiles
    first, so that (the GPU launching the first axis fastest) every column tile of a row block runs together and
    the row block is read from memory once, the weight (at most 3072 x 768 here: 4.7 MB) staying in L2; row tiles
    first would read the whole (M, K) operand once per column tile (24 times over for c_fc at gpt2 b64: 2.4 GB).
    Index maps take (j, i): column tile, row tile."""
    return col_tiles, row_tiles


def accumulate(a_ref, b_ref, *, bk: int, trans_b: bool = False) -> jax.Array:
    """Inside a kernel: ``a_ref @ b_ref`` (or ``a_ref @ b_ref.T``) of the program's blocks, (bm, K) by (K, bn) (or
    (bn, K)), accumulated in fp32 over K in steps of ``bk``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    k = a_ref.shape[1]

    def step(i, acc):
        at = pl.ds(i * bk, bk)
        rhs = b_ref[:, at] if trans_b else b_ref[at, :]
        return acc + plgpu.dot(a_ref[:, at], rhs, trans_b=trans_b)

    rows, cols = a_ref.shape[0], b_ref.shape[0] if trans_b else b_ref.shape[1]
    return jax.lax.fori_loop(0, k // bk, step, jnp.zeros((rows, cols), jnp.float32))


def resolve(impl: Impl, dtype) -> Impl:
    """"auto": the kernels on GPUs with bf16 operands (they take no other), XLA elsewhere."""
    if impl not in ("auto", "kernel", "interpret", "xla"):
        raise GemmKernelError(f"impl = {impl!r}: allowed values are 'auto', 'kernel', 'interpret', 'xla' (and, for "
                              "linear_cast, 'plain')")
    if impl != "auto":
        return impl
    return "kernel" if ops.platform() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16 else "xla"


def _bias_cast_kernel(x_ref, w_ref, b_ref, y_ref, *, bk: int):
    """One (bm, bn) tile: (x @ w + b) accumulated and added in fp32, written in y_ref's dtype."""
    y_ref[...] = (accumulate(x_ref, w_ref, bk=bk) + b_ref[...]).astype(y_ref.dtype)


def gemm_bias_cast(x: Float[Array, "rows d_in"], w: Float[Array, "d_in d_out"], b: Float[Array, " d_out"] | None, *,
                   out_dtype=jnp.bfloat16, interpret: bool = False, block: tuple[int, int, int] | None = None
                   ) -> Float[Array, "rows d_out"]:
    """``x @ w + b`` with bf16 operands, fp32 accumulation and bias add, rounded once to ``out_dtype``, as one Pallas
    Triton GEMM (``interpret=True``: Pallas' interpreter, on any backend)."""
    from jax.experimental import pallas as pl

    check("gemm_bias_cast", {"x": (x, jnp.bfloat16, "(rows, d_in)"), "w": (w, jnp.bfloat16, "(d_in, d_out)")})
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k or (b is not None and b.shape != (n,)):
        raise GemmKernelError(f"gemm_bias_cast: x {tuple(x.shape)}, w {tuple(w.shape)} and bias "
                              f"{None if b is None else tuple(b.shape)} do not chain: want (rows, d_in), "
                              "(d_in, d_out), (d_out,)")
    bm, bn, bk = blocks(m, n, k, block)
    b2 = (jnp.zeros((n,), jnp.float32) if b is None else b.astype(jnp.float32))[None, :]
    xp, wp, bp = pad_to(x, bm, bk), pad_to(w, bk, bn), pad_to(b2, 1, bn)
    (mp, kp), np_ = xp.shape, wp.shape[1]
    y = pl.pallas_call(
        partial(_bias_cast_kernel, bk=bk),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=grid(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda j, i: (i, 0)), pl.BlockSpec((kp, bn), lambda j, i: (0, j)),
                  pl.BlockSpec((1, bn), lambda j, i: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda j, i: (i, j)),
        interpret=interpret, name="gemm_nn_bias_cast", **compiler_params(interpret))(xp, wp, bp)
    return y[:m, :n] if (mp, np_) != (m, n) else y


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _linear_cast(x, w, b, dtype, precision, impl):
    return _linear_cast_fwd(x, w, b, dtype, precision, impl)[0]


def _linear_cast_fwd(x, w, b, dtype, precision, impl):
    xc, wc = x.astype(dtype), w.astype(dtype)
    if impl == "xla":
        y = ops._dot(xc, wc, dtype, precision)
        y = (y + b if b is not None else y).astype(dtype)
    else:
        y = gemm_bias_cast(xc, wc, b, out_dtype=dtype, interpret=impl == "interpret")
    return y, (xc, wc, jnp.zeros((), x.dtype), None if b is None else jnp.zeros((), b.dtype))


def _linear_cast_bwd(dtype, precision, impl, res, g):
    xc, wc, x_like, b_like = res
    gc = g.astype(dtype)  # the cotangent of a ``dtype`` result: already ``dtype``
    db = None if b_like is None else g.astype(jnp.float32).sum(axis=0).astype(b_like.dtype)
    dx = ops._dot(gc, ops.transpose_operand(wc), dtype, precision)  # as ops._matmul2d_bwd (fp32 GEMM output)
    dw = ops._dot(ops.transpose_operand(xc), gc, dtype, precision)
    return dx.astype(x_like.dtype), dw, db


_linear_cast.defvjp(_linear_cast_fwd, _linear_cast_bwd)


def linear_cast(x: Float[Array, "... d_in"], w: Float[Array, "d_in d_out"], b: Float[Array, " d_out"] | None, *,
                dtype, precision=None, impl: Impl | Literal["plain"] = "auto") -> Float[Array, "... d_out"]:
    """``x @ w + b`` as an attention projection feeds attention. On GPUs with bf16 operands ("auto" there:
    "kernel") one Pallas GEMM whose epilogue adds the bias in fp32 and rounds the result to bf16, with
    :func:`jaxgpt.ops._matmul2d_bwd`'s backward; "interpret" (the kernel in Pallas' interpreter) and "xla" (XLA's
    GEMM, bias add and rounding) compute the same on any backend. Elsewhere ("auto" on CPUs or with fp32 compute:
    "plain") the plain fp32 ``ops.matmul(x, w) + b`` of :class:`jaxgpt.model.Linear`, which attention rounds to the
    compute dtype itself."""
    if impl == "auto":
        impl = "kernel" if ops.platform() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16 else "plain"
    if impl == "plain":
        y = ops.matmul(x, w, dtype=dtype, precision=precision)
        return y + b if b is not None else y
    resolve(impl, dtype)  # refuses an unknown impl
    lead = x.shape[:-1]
    y = _linear_cast(x.reshape(-1, x.shape[-1]), w, b, jnp.dtype(dtype), precision, impl)
    return y.reshape(*lead, w.shape[-1])
