"""The MLP with GELU in its GEMMs' epilogues (``Policy.gelu = "pallas-gemm"``): two Pallas Triton GEMMs.

The same function as :class:`jaxgpt.model.MLP`'s plain path, ``gelu(x @ W_fc + b_fc) @ W_proj`` (bf16 operands,
fp32 accumulation, GPT-2's tanh GELU in fp32, its output rounded to bf16 as c_proj's operand); c_proj's bias is
added by the caller, as :class:`jaxgpt.model.Linear` adds it. What changes is where GELU runs. Under
``gelu: pallas`` (:mod:`jaxgpt.gelu`) each layer of the gpt2 b64 step still moves, around the GEMMs:

* forward: the c_fc GEMM writes ``h`` (fp32, [65536, 3072]: 805 MB); an XLA fusion reads it back and writes
  ``gelu(h)`` in bf16 (403 MB) for c_proj: 1.2 GB;
* backward: c_proj's input-gradient GEMM writes ``g`` (fp32, 805 MB); the GELU backward kernel reads ``g`` and
  ``h`` and writes the bf16 ``dh`` and the bias gradient's partial sums: 2.0 GB.

Here the c_fc GEMM adds the bias and applies GELU to its fp32 accumulator before writing anything
(:func:`fc_gemm_gelu`: ``h`` for the backward and ``gelu(h)`` in bf16 come out of one kernel), and c_proj's
input-gradient GEMM multiplies its fp32 accumulator by ``gelu'(h)`` (:func:`proj_gemm_gelu_backward`: reads ``h``,
writes the bf16 ``dh`` and the bias gradient's partial sums): ``g`` is never written, and ``h`` is read once per
pass instead of twice. Each GEMM's accumulator is the fp32 value the XLA GEMM writes (a sum in another order),
and the epilogues compute what :mod:`jaxgpt.gelu` computes from it, so the numbers are the default policy's.

:func:`mlp` owns both GEMMs' backward (the cotangent of an fp32 ``h`` must be fp32, so no narrower custom VJP can
hand the GEMMs a bf16 ``dh`` without a round trip). ``dx``, ``dW_fc`` and ``dW_proj`` are XLA GEMMs laid out as
:func:`jaxgpt.ops._matmul2d_bwd` lays them out, so their classes are the ones the calibration measured. On CPUs
(and with ``impl="xla"``) the same VJP computes every step with XLA (the plain path's values, bit for bit);
tests run the kernels in Pallas' interpreter. Shapes that are not multiples of the blocks are zero-padded (zero
rows and columns add nothing to the kept parts or to the sums); GPT-2's never are.

Under ``Policy.c_proj = "pallas"`` (``fold=True``) the VJP owns c_proj's bias as well, and the input-gradient GEMM
reads c_proj's fp32 output gradient itself (rounding it to bf16 as it reads it, as XLA's convert did) and writes
that rounding and the gradient's column sums: the weight-gradient GEMM and the bias gradient read those, and XLA's
pass that read the fp32 gradient back to make them (302 MB per layer at gpt2 b64) is gone.

The GEMMs' tile loop, blocks and padding are :mod:`jaxgpt.gemm`'s.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxgpt import gelu, gemm, ops
from jaxgpt.gemm import GemmKernelError, Impl

SCOPE = gelu.SCOPE  # the profile's and jaxgpt.compile's category: GELU's
FIX = "the kernels take bf16 operands (and fp32 h): mlp(impl='xla' or 'auto') for other dtypes, or gelu: plain"


def _fwd_kernel(x_ref, w_ref, b_ref, h_ref, y_ref, *, bk: int):
    """One (bm, bn) tile: h = x @ w + b accumulated in fp32, then h and gelu(h) in y_ref's dtype."""
    h = gemm.accumulate(x_ref, w_ref, bk=bk) + b_ref[...]
    h_ref[...] = h
    y_ref[...] = jax.nn.gelu(h, approximate=True).astype(y_ref.dtype)


def _bwd_kernel(g_ref, w_ref, h_ref, dh_ref, db_ref, *g_refs, bk: int):
    """One (bm, bn) tile: dh = (g @ w^T) * gelu'(h), the GEMM accumulated in fp32; dh written in dh_ref's dtype,
    its fp32 column sums into db_ref. With ``g_refs`` (an fp32 g, rounded to w's dtype as it is read): the first
    column tile's programs also write their rows of g rounded and g's fp32 column sums (c_proj's backward GEMM
    operand and its bias gradient's partial sums)."""
    from jax.experimental import pallas as pl

    dh = gemm.accumulate(g_ref, w_ref, bk=bk, trans_b=True) * gelu.gelu_grad(h_ref[...])
    dh_ref[...] = dh.astype(dh_ref.dtype)
    db_ref[...] = dh.sum(axis=0, keepdims=True)
    if not g_refs:
        return
    gc_ref, gs_ref = g_refs

    @pl.when(pl.program_id(0) == 0)  # the row block's other column tiles read the same g: one program writes it
    def _():
        for c in range(0, g_ref.shape[1], bk):
            g = g_ref[:, pl.ds(c, bk)]
            gc_ref[:, pl.ds(c, bk)] = g.astype(gc_ref.dtype)
            gs_ref[:, pl.ds(c, bk)] = g.sum(axis=0, keepdims=True)


def fc_gemm_gelu(x: Float[Array, "rows d_in"], w: Float[Array, "d_in d_ff"], b: Float[Array, " d_ff"] | None, *,
                 interpret: bool = False, block: tuple[int, int, int] | None = None
                 ) -> tuple[Float[Array, "rows d_ff"], Float[Array, "rows d_ff"]]:
    """``(h, y)``: ``h = x @ w + b`` (bf16 operands, fp32 accumulation and result) and ``y = gelu(h)`` (tanh, fp32)
    rounded to bf16, as one Pallas Triton GEMM (``interpret=True``: Pallas' interpreter, on any backend).
    ``block``: (bm, bn, bk), the tile and K step (defaults :data:`BLOCK_M`, :data:`BLOCK_N`, :data:`BLOCK_K`)."""
    from jax.experimental import pallas as pl

    bf16, f32 = jnp.bfloat16, jnp.float32
    gemm.check("fc_gemm_gelu", {"x": (x, bf16, "(rows, d_in)"), "w": (w, bf16, "(d_in, d_ff)")}, FIX)
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k or (b is not None and b.shape != (n,)):
        raise GemmKernelError(f"fc_gemm_gelu: x {tuple(x.shape)}, w {tuple(w.shape)} and bias "
                              f"{None if b is None else tuple(b.shape)} do not chain: want (rows, d_in), (d_in, d_ff), "
                              "(d_ff,)")
    bm, bn, bk = gemm.blocks(m, n, k, block)
    b2 = (jnp.zeros((n,), f32) if b is None else b.astype(f32))[None, :]
    xp, wp, bp = gemm.pad_to(x, bm, bk), gemm.pad_to(w, bk, bn), gemm.pad_to(b2, 1, bn)
    (mp, kp), np_ = xp.shape, wp.shape[1]
    h, y = pl.pallas_call(
        partial(_fwd_kernel, bk=bk),
        out_shape=(jax.ShapeDtypeStruct((mp, np_), f32), jax.ShapeDtypeStruct((mp, np_), bf16)),
        grid=gemm.grid(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda j, i: (i, 0)), pl.BlockSpec((kp, bn), lambda j, i: (0, j)),
                  pl.BlockSpec((1, bn), lambda j, i: (0, j))],
        out_specs=(pl.BlockSpec((bm, bn), lambda j, i: (i, j)),) * 2,
        interpret=interpret, name="gemm_nn_bias_gelu", **gemm.compiler_params(interpret))(xp, wp, bp)
    return (h[:m, :n], y[:m, :n]) if (mp, np_) != (m, n) else (h, y)


def proj_gemm_gelu_backward(g: Float[Array, "rows d_out"], w: Float[Array, "d_ff d_out"], h: Float[Array, "rows d_ff"],
                            *, interpret: bool = False, block: tuple[int, int, int] | None = None
                            ) -> tuple[Float[Array, "rows d_ff"], ...]:
    """``(dh, partial_sums)``: ``dh = (g @ w^T) * gelu'(h)`` with bf16 ``g`` and ``w`` (c_proj's output gradient and
    kernel, stored (d_ff, d_out)) and fp32 accumulation, rounded to bf16, and the fp32 column sums of the unrounded
    ``dh`` per block of rows (their sum is c_fc's bias gradient), as one Pallas Triton GEMM.

    An fp32 ``g`` (``Policy.c_proj = "pallas"``) is rounded to bf16 as the kernel reads it, and two more results come
    out: ``g`` rounded to bf16 (what c_proj's weight-gradient GEMM reads) and g's fp32 column sums per block of rows
    (c_proj's bias gradient): XLA's pass that reads the fp32 g to make them is gone."""
    from jax.experimental import pallas as pl

    bf16, f32 = jnp.bfloat16, jnp.float32
    wide = getattr(g, "dtype", None) == f32
    gemm.check("proj_gemm_gelu_backward", {"g": (g, f32 if wide else bf16, "(rows, d_out)"),
                                            "w": (w, bf16, "(d_ff, d_out)"), "h": (h, f32, "(rows, d_ff)")}, FIX)
    (m, k), n = g.shape, w.shape[0]
    if w.shape[1] != k or h.shape != (m, n):
        raise GemmKernelError(f"proj_gemm_gelu_backward: g {tuple(g.shape)}, w {tuple(w.shape)} and h "
                              f"{tuple(h.shape)} do not chain: want (rows, d_out), (d_ff, d_out), (rows, d_ff)")
    bm, bn, bk = gemm.blocks(m, n, k, block)
    gp, wp, hp = gemm.pad_to(g, bm, bk), gemm.pad_to(w, bn, bk), gemm.pad_to(h, bm, bn)
    (mp, kp), np_ = gp.shape, wp.shape[0]
    g_outs = ((jax.ShapeDtypeStruct((mp, kp), bf16), jax.ShapeDtypeStruct((mp // bm, kp), f32)) if wide else ())
    dh, sums, *g_parts = pl.pallas_call(
        partial(_bwd_kernel, bk=bk),
        out_shape=(jax.ShapeDtypeStruct((mp, np_), bf16), jax.ShapeDtypeStruct((mp // bm, np_), f32), *g_outs),
        grid=gemm.grid(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda j, i: (i, 0)), pl.BlockSpec((bn, kp), lambda j, i: (j, 0)),
                  pl.BlockSpec((bm, bn), lambda j, i: (i, j))],
        out_specs=(pl.BlockSpec((bm, bn), lambda j, i: (i, j)), pl.BlockSpec((1, bn), lambda j, i: (i, j)),
                   *((pl.BlockSpec((bm, kp), lambda j, i: (i, 0)), pl.BlockSpec((1, kp), lambda j, i: (i, 0)))
                     if wide else ())),
        interpret=interpret, name="gemm_nt_gelu_backward", **gemm.compiler_params(interpret))(gp, wp, hp)
    out = (dh[:m, :n], sums[:, :n]) if (mp, np_) != (m, n) else (dh, sums)
    return out + (g_parts[0][:m, :k], g_parts[1][:, :k]) if wide else out


def _resolve(impl: Impl, dtype) -> Impl:
    """The kernels on GPUs with bf16 operands, XLA elsewhere (:func:`jaxgpt.gemm.resolve`; tests replace it)."""
    return gemm.resolve(impl, dtype)


def _forward(xc, wfc, b, dtype, precision, impl):
    """(h, y) of c_fc + GELU: the kernel's, or XLA's (the plain path's: GEMM, bias add, GELU in fp32, rounded)."""
    if impl == "xla":
        h = ops._dot(xc, wfc, dtype, precision)
        if b is not None:
            h = h + b
        with jax.named_scope(SCOPE):
            return h, jax.nn.gelu(h, approximate=True).astype(dtype)
    with jax.named_scope(SCOPE):
        return fc_gemm_gelu(xc, wfc, b, interpret=impl == "interpret")


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _mlp(x, w_fc, b_fc, w_proj, b_proj, dtype, precision, out, impl, fold):
    return _mlp_fwd(x, w_fc, b_fc, w_proj, b_proj, dtype, precision, out, impl, fold)[0]


def _like(a):
    return None if a is None else jnp.zeros((), a.dtype)


def _mlp_fwd(x, w_fc, b_fc, w_proj, b_proj, dtype, precision, out, impl, fold):
    xc, wfc, wpc = x.astype(dtype), w_fc.astype(dtype), w_proj.astype(dtype)
    h, y = _forward(xc, wfc, b_fc, dtype, precision, _resolve(impl, dtype))
    m = ops._dot(y, wpc, dtype, precision, out)  # c_proj, as ops._matmul2d_fwd
    if fold and b_proj is not None:  # c_proj's bias, as Linear adds it
        m = m + b_proj
    return m, (xc, wfc, wpc, h, y, jnp.zeros((), x.dtype), _like(b_fc), _like(b_proj))


def _mlp_bwd(dtype, precision, out, impl, fold, res, dm):
    xc, wfc, wpc, h, y, x_like, b_like, bp_like = res
    impl = _resolve(impl, dtype)
    gc = dm.astype(dtype) if impl == "xla" or not fold else None
    with jax.named_scope(SCOPE):
        if impl == "xla":
            g = ops._dot(gc, ops.transpose_operand(wpc), dtype, precision, out)
            dh, sums = gelu.gelu_backward_xla(g, h, out_dtype=dtype)
        elif fold:  # the kernel rounds dm as it reads it and writes the rounding and dm's column sums
            dh, sums, gc, dm_sums = proj_gemm_gelu_backward(dm.astype(jnp.float32), wpc, h,
                                                            interpret=impl == "interpret")
        else:
            dh, sums = proj_gemm_gelu_backward(gc, wpc, h, interpret=impl == "interpret")
        db = None if b_like is None else sums.sum(axis=0).astype(b_like.dtype)
    dw_proj = ops._dot(ops.transpose_operand(y), gc, dtype, precision)  # as ops._matmul2d_bwd: fp32
    db_proj = None
    if fold and bp_like is not None:  # autodiff of Linear's bias add: the sum of dm over rows
        db_proj = (dm.sum(axis=0) if impl == "xla" else dm_sums.sum(axis=0)).astype(bp_like.dtype)
    dx = ops._dot(dh, ops.transpose_operand(wfc), dtype, precision, out)
    dw_fc = ops._dot(ops.transpose_operand(xc), dh, dtype, precision)
    return dx.astype(x_like.dtype), dw_fc, db, dw_proj, db_proj


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def mlp(x: Float[Array, "... d_in"], w_fc: Float[Array, "d_in d_ff"], b_fc: Float[Array, " d_ff"] | None,
        w_proj: Float[Array, "d_ff d_in"], *, dtype=jnp.bfloat16, precision=None, out_dtype=jnp.float32,
        impl: Impl = "auto", b_proj: Float[Array, " d_in"] | None = None, fold: bool = False
        ) -> Float[Array, "... d_in"]:
    """``gelu(x @ w_fc + b_fc) @ w_proj`` without c_proj's bias (the caller adds it, as Linear does): operands in
    ``dtype``, fp32 accumulation, GELU in fp32 rounded to ``dtype`` as c_proj's operand, the result and the
    backward's ``dx`` in fp32 (the default policies' GEMM output). ``impl``: "kernel" (the two Pallas Triton GEMMs:
    GPUs, bf16 operands), "interpret" (the same kernels in Pallas' interpreter), "xla" (XLA's GEMMs and the plain
    expressions), "auto" (the kernels on GPUs with bf16 operands, XLA elsewhere: :func:`jaxgpt.ops.platform`).

    ``fold`` (``Policy.c_proj = "pallas"``): c_proj's bias ``b_proj`` is added here, and on the kernel path c_proj's
    input-gradient GEMM reads the fp32 output gradient itself, rounding it as it reads it, and writes the rounded
    copy (the weight-gradient GEMM's operand) and the bias gradient's partial sums: XLA's pass that reads the fp32
    gradient back for them is gone. The same values but for the order of the bias gradient's sum."""
    if b_proj is not None and not fold:
        raise GemmKernelError("gelu_gemm.mlp adds c_proj's bias only with fold=True (else the caller adds it)")
    gemm.resolve(impl, dtype)  # refuses an unknown impl
    if jnp.dtype(out_dtype) != jnp.float32:
        raise GemmKernelError(f"gelu_gemm.mlp keeps the GEMMs' fp32 outputs (gemm_output float32), got out_dtype "
                              f"{jnp.dtype(out_dtype).name}: use gelu: plain with that policy")
    lead = x.shape[:-1]
    m = _mlp(x.reshape(-1, x.shape[-1]), w_fc, b_fc, w_proj, b_proj, jnp.dtype(dtype), precision,
             jnp.dtype(out_dtype), impl, bool(fold))
    return m.reshape(*lead, w_proj.shape[-1])
