"""Pallas Triton GEMMs with fused epilogues: the tile loop every such kernel shares, a GEMM whose epilogue adds the
bias and rounds to bf16 (:func:`gemm_bias_cast`), and one that sums the products of several lhs blocks
(:func:`gemm_sum_nt`).

A kernel here computes one (bm, bn) output tile of ``a @ b`` with bf16 operands, accumulating in fp32 over K in
steps of bk (:func:`accumulate`), then does its epilogue on the fp32 accumulator before anything is written: the
value XLA's GEMM would write (a sum in another order), followed by what XLA would do in a separate pass.
:mod:`jaxgpt.kernels.mlp` puts GELU there, :mod:`jaxgpt.kernels.qkv` the bias add and bf16 rounding attention
applies to q, k and v, :mod:`jaxgpt.kernels.loss` the loss's row max and sum of exp. :mod:`jaxgpt.compile.hlo`
reads a Pallas kernel named ``gemm_nn_*`` or ``gemm_nt_*`` as a GEMM (its first operand the (M, K) lhs, its second
the rhs, (K, N) or (N, K), its first result (M, N)) plus the epilogue's extra bytes, one named ``gemm_ntsum_*`` as
the GEMM of its lhs blocks (every operand but the last) by its last, (N, sum K), and one named ``gemm2_<l1><l2>_*``
as two GEMMs onto the same (M, N) tile (operands lhs_1, rhs_1, lhs_2, rhs_2 first: :mod:`jaxgpt.kernels.mlp`'s
recomputing backward): every kernel here is named so.

The block sizes are Triton's usual Hopper choice for a bf16 GEMM (128 x 128 tiles, K in steps of 64); they were
not tuned on a GPU (none was lent when this was written). Shapes that are not multiples of the blocks are
zero-padded where a kernel says so (zero rows and columns add nothing to the kept part); GPT-2's never are.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxgpt import ops

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # one program's output tile and its K step
NUM_WARPS, NUM_STAGES = 8, 3
Impl = Literal["auto", "kernel", "interpret", "xla"]
QKV_FIX = "the kernels take bf16 operands and widths that are multiples of 16: use kernels.qkv: xla for other models"


class GemmKernelError(ValueError):
    """Inputs a GEMM kernel cannot take (wrong rank or dtype, mismatched shapes, an unknown implementation)."""


def pad_to(a: jax.Array, rows: int, cols: int) -> jax.Array:
    """``a`` zero-padded up to multiples of (rows, cols)."""
    pad = ((0, -a.shape[0] % rows), (0, -a.shape[1] % cols))
    return jnp.pad(a, pad) if any(p for _, p in pad) else a


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def blocks(m: int, n: int, k: int, block: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """(bm, bn, bk): ``block``, else the tile ``kernels: auto`` chose for this shape (jaxgpt.kernels.tiles), else the
    defaults, each at most the next power of two of its extent (at least 16: a Triton dot's smallest tile)."""
    from jaxgpt.kernels import tiles  # (the kernel layer's own tile table)

    tiles.note("gemm", (m, n, k))
    tile = tiles.chosen("gemm", (m, n, k))
    bm, bn, bk = block or (tile.block if tile is not None else (BLOCK_M, BLOCK_N, BLOCK_K))
    return tuple(min(b, max(16, _next_pow2(e))) for b, e in ((bm, m), (bn, n), (bk, k)))


def compiler_params(interpret: bool, shape: tuple[int, int, int] | None = None) -> dict:
    """``pallas_call``'s Triton compiler parameters (none in the interpreter): the warps and stages ``kernels: auto``
    chose for ``shape`` = (m, n, k) (jaxgpt.kernels.tiles), else the defaults."""
    from jax.experimental.pallas import triton as plgpu

    from jaxgpt.kernels import tiles

    tile = tiles.chosen("gemm", shape)
    warps, stages = (tile.warps, tile.stages) if tile is not None else (NUM_WARPS, NUM_STAGES)
    return {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=warps, num_stages=stages)}


def check(name: str, arrays: dict[str, tuple[jax.Array, object, str]], fix: str) -> None:
    """Every ``{key: (array, dtype, "(rows, cols)")}`` is 2-D of that dtype, else a :class:`GemmKernelError` naming
    it and ``fix`` (what the caller's user can do instead)."""
    for key, (a, dtype, shape) in arrays.items():
        if getattr(a, "ndim", 0) != 2:
            raise GemmKernelError(f"{name}: {key} must be 2-D, {shape}, got shape {tuple(getattr(a, 'shape', ()))} "
                                  "(an activation's leading axes flatten with a.reshape(-1, a.shape[-1]))")
        if a.dtype != dtype:
            raise GemmKernelError(f"{name}: {key} must be {jnp.dtype(dtype).name}, got {a.dtype}; {fix}")


def grid(row_tiles: int, col_tiles: int) -> tuple[int, int]:
    """The launch grid of a GEMM whose (M, K) operand is the large one (M = batch x sequence rows): the column tiles
    first, so that (the GPU launching the first axis fastest) every column tile of a row block runs together and
    the row block is read from memory once, the weight (at most 3072 x 768 here: 4.7 MB) staying in L2; row tiles
    first would read the whole (M, K) operand once per column tile (24 times over for c_fc at gpt2 b64: 2.4 GB).
    Index maps take (j, i): column tile, row tile."""
    return col_tiles, row_tiles


def accumulate(a_ref, b_ref, *, bk: int, trans_b: bool = False, b_offset: int = 0, acc: jax.Array | None = None
               ) -> jax.Array:
    """Inside a kernel: ``a_ref @ b_ref`` (or ``a_ref @ b_ref.T``) of the program's blocks, (bm, K) by (K, bn) (or
    (bn, K)), accumulated in fp32 over K in steps of ``bk``, onto ``acc`` (zeros if None). ``b_offset``: where
    a_ref's K starts along b_ref's (a_ref one of several lhs blocks that split K). An lhs wider than the rhs (an fp32
    gradient) is rounded to the rhs's dtype as it is read, as XLA's convert before its GEMM rounds it."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    k = a_ref.shape[1]

    def step(i, acc):
        at, bt = pl.ds(i * bk, bk), pl.ds(b_offset + i * bk, bk)
        rhs = b_ref[:, bt] if trans_b else b_ref[bt, :]
        return acc + plgpu.dot(a_ref[:, at].astype(b_ref.dtype), rhs, trans_b=trans_b)

    rows, cols = a_ref.shape[0], b_ref.shape[0] if trans_b else b_ref.shape[1]
    return jax.lax.fori_loop(0, k // bk, step, jnp.zeros((rows, cols), jnp.float32) if acc is None else acc)


def resolve(impl: Impl, dtype) -> Impl:
    """"auto": the kernels on GPUs with bf16 operands (they take no other), XLA elsewhere."""
    if impl not in ("auto", "kernel", "interpret", "xla"):
        raise GemmKernelError(f"impl = {impl!r}: allowed values are 'auto', 'kernel', 'interpret', 'xla'")
    if impl != "auto":
        return impl
    return "kernel" if ops.platform() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16 else "xla"


def _bias_cast_kernel(x_ref, w_ref, b_ref, y_ref, *, bk: int):
    """One (bm, bn) tile: (x @ w + b) accumulated and added in fp32, written in y_ref's dtype."""
    y_ref[...] = (accumulate(x_ref, w_ref, bk=bk) + b_ref[...]).astype(y_ref.dtype)


def gemm_bias_cast(x: Float[Array, "rows d_in"], w: Float[Array, "d_in d_out"], b: Float[Array, " d_out"] | None, *,
                   out_dtype=jnp.bfloat16, interpret: bool = False, block: tuple[int, int, int] | None = None,
                   column_block: tuple[int, int] | None = None) -> Float[Array, "rows d_out/blocks"]:
    """``x @ w + b`` with bf16 operands, fp32 accumulation and bias add, rounded once to ``out_dtype``, as one Pallas
    Triton GEMM (``interpret=True``: Pallas' interpreter, on any backend). ``column_block=(s, count)``: only the s-th
    of ``w``'s and ``b``'s ``count`` equal column blocks (q, k or v of the attention's c_attn), read in place where
    the block and K are whole tiles (no slice of the weight is copied first; the kernel is then named
    ``gemm_nn_colblock_*``, which the HLO reader reads as a column block); the same values as the kernel on the
    slice."""
    from jax.experimental import pallas as pl

    check("gemm_bias_cast", {"x": (x, jnp.bfloat16, "(rows, d_in)"), "w": (w, jnp.bfloat16, "(d_in, d_out)")},
          QKV_FIX)
    (m, k), width = x.shape, w.shape[1]
    if w.shape[0] != k or (b is not None and b.shape != (width,)):
        raise GemmKernelError(f"gemm_bias_cast: x {tuple(x.shape)}, w {tuple(w.shape)} and bias "
                              f"{None if b is None else tuple(b.shape)} do not chain: want (rows, d_in), "
                              "(d_in, d_out), (d_out,)")
    s, count = column_block or (0, 1)
    if not 0 <= s < count or width % count:
        raise GemmKernelError(f"gemm_bias_cast: column_block {column_block} of w's {width} columns: want (s, count) "
                              "with 0 <= s < count and count dividing the columns")
    n = width // count
    bm, bn, bk = blocks(m, n, k, block)
    if count > 1 and (n % bn or k % bk):  # not whole tiles (w would be padded, a copy): the block's slice, padded
        return gemm_bias_cast(x, w[:, s * n:(s + 1) * n], None if b is None else b[s * n:(s + 1) * n],
                              out_dtype=out_dtype, interpret=interpret, block=block)
    offset = s * n // bn  # the block's first column tile in w
    b2 = (jnp.zeros((width,), jnp.float32) if b is None else b.astype(jnp.float32))[None, :]
    xp, wp, bp = pad_to(x, bm, bk), pad_to(w, bk, bn), pad_to(b2, 1, bn)
    mp, kp = xp.shape
    np_ = wp.shape[1] // count
    y = pl.pallas_call(
        partial(_bias_cast_kernel, bk=bk),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=grid(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda j, i: (i, 0)), pl.BlockSpec((kp, bn), lambda j, i: (0, j + offset)),
                  pl.BlockSpec((1, bn), lambda j, i: (0, j + offset))],
        out_specs=pl.BlockSpec((bm, bn), lambda j, i: (i, j)),
        interpret=interpret, name="gemm_nn_colblock_bias_cast" if count > 1 else "gemm_nn_bias_cast",
        **compiler_params(interpret, (m, n, k)))(xp, wp, bp)
    return y[:m, :n] if (mp, np_) != (m, n) else y


def _sum_kernel(*refs, bk: int, widths: tuple[int, ...]):
    """One (bm, bn) tile of sum_s a_s @ b[:, K_s]^T, the lhs blocks a_s splitting b's K, accumulated in fp32; the
    first column tile's programs also write the fp32 column sums of their rows of every a_s (bias gradients)."""
    from jax.experimental import pallas as pl

    *a_refs, b_ref, out_ref, sums_ref = refs
    acc, offset = None, 0
    for a_ref, width in zip(a_refs, widths, strict=True):
        acc = accumulate(a_ref, b_ref, bk=bk, trans_b=True, b_offset=offset, acc=acc)
        offset += width
    out_ref[...] = acc.astype(out_ref.dtype)

    @pl.when(pl.program_id(0) == 0)  # the row block's other column tiles read the same a_s: one program sums them
    def _():
        start = 0
        for a_ref, width in zip(a_refs, widths, strict=True):
            for c in range(0, width, bk):
                sums_ref[:, pl.ds(start + c, bk)] = a_ref[:, pl.ds(c, bk)].astype(jnp.float32).sum(
                    axis=0, keepdims=True)
            start += width


def gemm_sum_nt(a: list[Float[Array, "rows k_s"]], b: Float[Array, "n k"], *, out_dtype=jnp.float32,
                interpret: bool = False, block: tuple[int, int, int] | None = None
                ) -> tuple[Float[Array, "rows n"], Float[Array, "row_blocks k"]]:
    """``(concat(a, axis=1) @ b.T, partial_sums)`` without the concatenation: the sum over the lhs blocks ``a_s``
    (bf16, (rows, K_s)) of ``a_s @ b[:, K_s]^T`` with ``b`` bf16 (n, sum K_s), accumulated in fp32 in one Pallas
    Triton GEMM (the input gradient of a layer whose output was split in column blocks: q, k and v's), and the fp32
    column sums of ``concat(a)`` per block of rows (``partial_sums.sum(0)``: the layer's bias gradient). Every K_s
    must be a multiple of 16; rows and n that are not multiples of the tile are zero-padded (GPT-2's are)."""
    from jax.experimental import pallas as pl

    bf16 = jnp.bfloat16
    if not a:
        raise GemmKernelError("gemm_sum_nt: no lhs blocks: pass at least one (rows, k_s) array")
    check("gemm_sum_nt", {**{f"a[{i}]": (x, bf16, "(rows, k_s)") for i, x in enumerate(a)},
                          "b": (b, bf16, "(n, sum k_s)")}, QKV_FIX)
    m, n = a[0].shape[0], b.shape[0]
    widths = tuple(x.shape[1] for x in a)
    step = math.gcd(*widths) & -math.gcd(*widths)  # the largest power of two dividing every block's width
    bm, bn, bk = blocks(m, n, min(step, BLOCK_K), block)
    if any(x.shape[0] != m for x in a) or sum(widths) != b.shape[1] or bk < 16 or any(w % bk for w in widths):
        raise GemmKernelError(f"gemm_sum_nt: lhs blocks {[tuple(x.shape) for x in a]} and b {tuple(b.shape)} must "
                              f"share their rows and split b's {b.shape[1]} columns, in widths that are multiples of "
                              f"16 (a Triton dot's K); {QKV_FIX}")
    ap, bp = [pad_to(x, bm, 1) for x in a], pad_to(b, bn, 1)
    mp, np_ = ap[0].shape[0], bp.shape[0]
    k = b.shape[1]
    y, sums = pl.pallas_call(
        partial(_sum_kernel, bk=bk, widths=widths),
        out_shape=(jax.ShapeDtypeStruct((mp, np_), out_dtype), jax.ShapeDtypeStruct((mp // bm, k), jnp.float32)),
        grid=grid(mp // bm, np_ // bn),
        in_specs=[*(pl.BlockSpec((bm, w), lambda j, i: (i, 0)) for w in widths),
                  pl.BlockSpec((bn, k), lambda j, i: (j, 0))],
        out_specs=(pl.BlockSpec((bm, bn), lambda j, i: (i, j)), pl.BlockSpec((1, k), lambda j, i: (i, 0))),
        interpret=interpret, name="gemm_ntsum_split_input_grad", **compiler_params(interpret))(*ap, bp)
    return (y[:m, :n] if (mp, np_) != (m, n) else y), sums
