"""The MLP with GELU in its GEMMs' epilogues (``kernels.mlp = "pallas-gemm"``): two Pallas Triton GEMMs.

The same function as :class:`jaxgpt.model.MLP`'s plain path, ``gelu(x @ W_fc + b_fc) @ W_proj`` (bf16 operands,
fp32 accumulation, GPT-2's tanh GELU in fp32, its output rounded to bf16 as c_proj's operand); c_proj's bias is
added by the caller, as :class:`jaxgpt.model.Linear` adds it. What changes is where GELU runs. Under a GELU
backward kernel of its own (``gelu: pallas`` until issue 44) each layer of the gpt2 b64 step still moves, around the
GEMMs:

* forward: the c_fc GEMM writes ``h`` (fp32, [65536, 3072]: 805 MB); an XLA fusion reads it back and writes
  ``gelu(h)`` in bf16 (403 MB) for c_proj: 1.2 GB;
* backward: c_proj's input-gradient GEMM writes ``g`` (fp32, 805 MB); the GELU backward kernel reads ``g`` and
  ``h`` and writes the bf16 ``dh`` and the bias gradient's partial sums: 2.0 GB.

Here the c_fc GEMM adds the bias and applies GELU to its fp32 accumulator before writing anything
(:func:`fc_gemm_gelu`: ``h`` for the backward and ``gelu(h)`` in bf16 come out of one kernel), and c_proj's
input-gradient GEMM multiplies its fp32 accumulator by ``gelu'(h)`` (:func:`proj_gemm_gelu_backward`: reads ``h``,
writes the bf16 ``dh`` and the bias gradient's partial sums): ``g`` is never written, and ``h`` is read once per
pass instead of twice. Each GEMM's accumulator is the fp32 value the XLA GEMM writes (a sum in another order),
and the epilogues compute what :mod:`jaxgpt.kernels.gelu` computes from it, so the numbers are the default policy's.

:func:`mlp` owns both GEMMs' backward (the cotangent of an fp32 ``h`` must be fp32, so no narrower custom VJP can
hand the GEMMs a bf16 ``dh`` without a round trip). ``dx``, ``dW_fc`` and ``dW_proj`` are XLA GEMMs laid out as
:func:`jaxgpt.ops._matmul2d_bwd` lays them out, so their classes are the ones the calibration measured. On CPUs
(and with ``impl="xla"``) the same VJP computes every step with XLA (the plain path's values, bit for bit);
tests run the kernels in Pallas' interpreter. Shapes that are not multiples of the blocks are zero-padded (zero
rows and columns add nothing to the kept parts or to the sums); GPT-2's never are.

``kernels.mlp = "pallas-recompute"`` (``recompute=True``) trades FLOPs for memory: the forward kernel does not write
h, and the backward kernel computes each tile's h again from x, w_fc and b_fc (the forward's tiles and K steps, so
the same values), a second GEMM in the kernel: 805 MB less per layer at gpt2 b64, 9.0 GiB in all, for 309 GFLOP more
per layer (llm.c's GELU recompute, in one kernel).

``Policy.gelu_h_dtype = "bfloat16"`` (``h_dtype=bfloat16``) trades one rounding for traffic: the forward kernel writes
h in bf16 (after computing gelu(h) from the fp32 h: the forward's values are unchanged) and the backward kernel
widens it as it reads it, so gelu'(h) comes from the rounded h, as in torch_ref under autocast (whose c_fc GEMM writes
h in bf16): 403 MB less written, read and held per layer at gpt2 b64 (the bf16 policies' parity bounds:
parity_tests/tolerances.py).

The GEMMs' tile loop, blocks and padding are :mod:`jaxgpt.kernels.gemm`'s.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxgpt import ops
from jaxgpt.kernels import gelu, gemm
from jaxgpt.kernels.gemm import GemmKernelError, Impl

SCOPE = gelu.SCOPE  # the profile's and jaxgpt.compile's category: GELU's
FIX = ("the kernels take bf16 operands (and an fp32 h, or a bf16 one: gelu_h_dtype: bfloat16): mlp(impl='xla' or "
       "'auto') for other dtypes, or kernels.mlp: xla")


def _fwd_kernel(x_ref, w_ref, b_ref, *out_refs, bk: int):
    """One (bm, bn) tile: h = x @ w + b accumulated in fp32, then h in h_ref's dtype (unless ``out_refs`` is y_ref
    alone: the backward recomputes it) and gelu(h), of the fp32 h, in y_ref's dtype."""
    h = gemm.accumulate(x_ref, w_ref, bk=bk) + b_ref[...]
    *h_ref, y_ref = out_refs
    if h_ref:
        h_ref[0][...] = h.astype(h_ref[0].dtype)
    y_ref[...] = jax.nn.gelu(h, approximate=True).astype(y_ref.dtype)


def _bwd_kernel(g_ref, w_ref, *refs, bk: int, bk_fc: int | None):
    """One (bm, bn) tile: dh = (g @ w^T) * gelu'(h), the GEMM accumulated in fp32; dh written in dh_ref's dtype,
    its fp32 column sums into db_ref. ``refs``: h, or with ``bk_fc`` (its K step) the forward's x, w_fc and bias, from
    which
    the tile's h is computed again as the forward kernel computed it (a second GEMM: the same tile, K steps and fp32
    bias add)."""
    if bk_fc is not None:
        x_ref, wfc_ref, b_ref, dh_ref, db_ref = refs
        h = gemm.accumulate(x_ref, wfc_ref, bk=bk_fc) + b_ref[...]
    else:
        h_ref, dh_ref, db_ref = refs
        h = h_ref[...].astype(jnp.float32)  # a bf16 h (gelu_h_dtype: bfloat16) widened as it is read
    dh = gemm.accumulate(g_ref, w_ref, bk=bk, trans_b=True) * gelu.gelu_grad(h)
    dh_ref[...] = dh.astype(dh_ref.dtype)
    db_ref[...] = dh.sum(axis=0, keepdims=True)


def fc_gemm_gelu(x: Float[Array, "rows d_in"], w: Float[Array, "d_in d_ff"], b: Float[Array, " d_ff"] | None, *,
                 interpret: bool = False, block: tuple[int, int, int] | None = None, keep_h: bool = True,
                 h_dtype=jnp.float32) -> tuple[Float[Array, "rows d_ff"] | None, Float[Array, "rows d_ff"]]:
    """``(h, y)``: ``h = x @ w + b`` (bf16 operands, fp32 accumulation and result) and ``y = gelu(h)`` (tanh, fp32)
    rounded to bf16, as one Pallas Triton GEMM (``interpret=True``: Pallas' interpreter, on any backend).
    ``block``: (bm, bn, bk), the tile and K step (defaults :data:`BLOCK_M`, :data:`BLOCK_N`, :data:`BLOCK_K`).
    ``keep_h=False``: h is not written (None; the backward recomputes it). ``h_dtype``: the dtype h is written in
    (bf16: ``gelu_h_dtype: bfloat16``, rounded from the fp32 h after gelu(h) was computed from it)."""
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
    if jnp.dtype(h_dtype) not in (jnp.dtype(f32), jnp.dtype(bf16)):
        raise GemmKernelError(f"fc_gemm_gelu: h_dtype must be float32 or bfloat16, got {jnp.dtype(h_dtype).name}")
    outs = (jax.ShapeDtypeStruct((mp, np_), h_dtype),) * keep_h + (jax.ShapeDtypeStruct((mp, np_), bf16),)
    *h, y = pl.pallas_call(
        partial(_fwd_kernel, bk=bk),
        out_shape=outs,
        grid=gemm.grid(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda j, i: (i, 0)), pl.BlockSpec((kp, bn), lambda j, i: (0, j)),
                  pl.BlockSpec((1, bn), lambda j, i: (0, j))],
        out_specs=(pl.BlockSpec((bm, bn), lambda j, i: (i, j)),) * len(outs),
        interpret=interpret, name="gemm_nn_bias_gelu", **gemm.compiler_params(interpret))(xp, wp, bp)
    h = h[0] if keep_h else None
    if (mp, np_) != (m, n):
        return None if h is None else h[:m, :n], y[:m, :n]
    return h, y


def proj_gemm_gelu_backward(g: Float[Array, "rows d_out"], w: Float[Array, "d_ff d_out"],
                            h: Float[Array, "rows d_ff"] | None, *, fc: tuple | None = None, interpret: bool = False,
                            block: tuple[int, int, int] | None = None) -> tuple[Float[Array, "rows d_ff"], ...]:
    """``(dh, partial_sums)``: ``dh = (g @ w^T) * gelu'(h)`` with bf16 ``g`` and ``w`` (c_proj's output gradient and
    kernel, stored (d_ff, d_out)) and fp32 accumulation, rounded to bf16, and the fp32 column sums of the unrounded
    ``dh`` per block of rows (their sum is c_fc's bias gradient), as one Pallas Triton GEMM.

    ``fc``: ``(x, w_fc, b_fc)`` (bf16, bf16, fp32 or None) instead of ``h`` (``kernels.mlp: pallas-recompute``): each
    tile's h is computed again as :func:`fc_gemm_gelu` computed it (the same tiles and K steps), a second GEMM in the
    kernel (named ``gemm2_ntnn_*``: :mod:`jaxgpt.compile.hlo` reads both), so the forward need not keep h."""
    from jax.experimental import pallas as pl

    bf16, f32 = jnp.bfloat16, jnp.float32
    if (h is None) == (fc is None):
        raise GemmKernelError("proj_gemm_gelu_backward takes h or fc=(x, w_fc, b_fc) to recompute it, one of the two")
    arrays = {"g": (g, bf16, "(rows, d_out)"), "w": (w, bf16, "(d_ff, d_out)")}
    if fc is None:  # fp32 h, or bf16 (gelu_h_dtype: bfloat16), widened as it is read
        arrays["h"] = (h, bf16 if getattr(h, "dtype", None) == bf16 else f32, "(rows, d_ff)")
    else:
        arrays.update(x=(fc[0], bf16, "(rows, d_in)"), w_fc=(fc[1], bf16, "(d_in, d_ff)"))
    gemm.check("proj_gemm_gelu_backward", arrays, FIX)
    (m, k), n = g.shape, w.shape[0]
    h_shape = tuple(h.shape) if fc is None else (fc[0].shape[0], fc[1].shape[1])
    if w.shape[1] != k or h_shape != (m, n) or (fc is not None and (
            fc[0].shape[1] != fc[1].shape[0] or (fc[2] is not None and fc[2].shape != (n,)))):
        raise GemmKernelError(f"proj_gemm_gelu_backward: g {tuple(g.shape)}, w {tuple(w.shape)} and h {h_shape} (or "
                              "x @ w_fc + b_fc) do not chain: want (rows, d_out), (d_ff, d_out), (rows, d_ff)")
    bm, bn, bk = gemm.blocks(m, n, k, block)
    gp, wp = gemm.pad_to(g, bm, bk), gemm.pad_to(w, bn, bk)
    (mp, kp), np_ = gp.shape, wp.shape[0]
    if fc is None:
        operands = [gemm.pad_to(h, bm, bn)]
        specs = [pl.BlockSpec((bm, bn), lambda j, i: (i, j))]
        bk_fc, name = None, "gemm_nt_gelu_backward"
    else:  # the forward kernel's tiles: the same (bm, bn) (same m, n) and its own K step
        x, w_fc, b_fc = fc
        bk_fc = gemm.blocks(m, n, x.shape[1], block)[2]
        b2 = (jnp.zeros((n,), f32) if b_fc is None else b_fc.astype(f32))[None, :]
        operands = [gemm.pad_to(x, bm, bk_fc), gemm.pad_to(w_fc, bk_fc, bn), gemm.pad_to(b2, 1, bn)]
        kfc = operands[0].shape[1]
        specs = [pl.BlockSpec((bm, kfc), lambda j, i: (i, 0)), pl.BlockSpec((kfc, bn), lambda j, i: (0, j)),
                 pl.BlockSpec((1, bn), lambda j, i: (0, j))]
        name = "gemm2_ntnn_gelu_backward"
    dh, sums = pl.pallas_call(
        partial(_bwd_kernel, bk=bk, bk_fc=bk_fc),
        out_shape=(jax.ShapeDtypeStruct((mp, np_), bf16), jax.ShapeDtypeStruct((mp // bm, np_), f32)),
        grid=gemm.grid(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda j, i: (i, 0)), pl.BlockSpec((bn, kp), lambda j, i: (j, 0)), *specs],
        out_specs=(pl.BlockSpec((bm, bn), lambda j, i: (i, j)), pl.BlockSpec((1, bn), lambda j, i: (i, j))),
        interpret=interpret, name=name, **gemm.compiler_params(interpret))(gp, wp, *operands)
    return (dh[:m, :n], sums[:, :n]) if (mp, np_) != (m, n) else (dh, sums)


def _resolve(impl: Impl, dtype) -> Impl:
    """The kernels on GPUs with bf16 operands, XLA elsewhere (:func:`jaxgpt.kernels.gemm.resolve`; tests replace it)."""
    return gemm.resolve(impl, dtype)


def _fc(xc, wfc, b, dtype, precision):
    """h = x @ w_fc + b as the plain path computes it (XLA's GEMM, then the fp32 bias add)."""
    h = ops._dot(xc, wfc, dtype, precision)
    return h if b is None else h + b


def _forward(xc, wfc, b, dtype, precision, impl, keep_h=True, h_dtype=jnp.float32):
    """(h, y) of c_fc + GELU: the kernel's, or XLA's (the plain path's: GEMM, bias add, GELU in fp32, rounded);
    h None where the kernel does not keep it (``keep_h=False``), else kept in ``h_dtype`` (y from the fp32 h)."""
    if impl == "xla":
        h = _fc(xc, wfc, b, dtype, precision)
        with jax.named_scope(SCOPE):
            return h.astype(h_dtype) if keep_h else None, jax.nn.gelu(h, approximate=True).astype(dtype)
    with jax.named_scope(SCOPE):
        return fc_gemm_gelu(xc, wfc, b, interpret=impl == "interpret", keep_h=keep_h, h_dtype=h_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _mlp(x, w_fc, b_fc, w_proj, dtype, precision, out, impl, recompute, h_dtype):
    return _mlp_fwd(x, w_fc, b_fc, w_proj, dtype, precision, out, impl, recompute, h_dtype)[0]


def _like(a):
    return None if a is None else jnp.zeros((), a.dtype)


def _mlp_fwd(x, w_fc, b_fc, w_proj, dtype, precision, out, impl, recompute, h_dtype):
    xc, wfc, wpc = x.astype(dtype), w_fc.astype(dtype), w_proj.astype(dtype)
    h, y = _forward(xc, wfc, b_fc, dtype, precision, _resolve(impl, dtype), keep_h=not recompute, h_dtype=h_dtype)
    m = ops._dot(y, wpc, dtype, precision, out)  # c_proj, as ops._matmul2d_fwd
    # recompute: b_fc itself is kept (h is rebuilt from x, w_fc and b_fc), not only its dtype
    b_saved = b_fc if recompute else _like(b_fc)
    return m, (xc, wfc, wpc, h, y, jnp.zeros((), x.dtype), b_saved)


def _mlp_bwd(dtype, precision, out, impl, recompute, h_dtype, res, dm):
    xc, wfc, wpc, h, y, x_like, b_like = res
    impl = _resolve(impl, dtype)
    fc = (xc, wfc, b_like) if recompute else None  # b_like: b_fc itself under recompute
    gc = dm.astype(dtype)
    with jax.named_scope(SCOPE):
        if impl == "xla":
            if recompute:
                h = _fc(xc, wfc, b_like, dtype, precision)
            g = ops._dot(gc, ops.transpose_operand(wpc), dtype, precision, out)
            dh, sums = gelu.gelu_backward_xla(g, h.astype(jnp.float32), out_dtype=dtype)
        else:
            dh, sums = proj_gemm_gelu_backward(gc, wpc, h, fc=fc, interpret=impl == "interpret")
        db = None if b_like is None else sums.sum(axis=0).astype(b_like.dtype)
    dw_proj = ops._dot(ops.transpose_operand(y), gc, dtype, precision)  # as ops._matmul2d_bwd: fp32
    dx = ops._dot(dh, ops.transpose_operand(wfc), dtype, precision, out)
    dw_fc = ops._dot(ops.transpose_operand(xc), dh, dtype, precision)
    return dx.astype(x_like.dtype), dw_fc, db, dw_proj


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def mlp(x: Float[Array, "... d_in"], w_fc: Float[Array, "d_in d_ff"], b_fc: Float[Array, " d_ff"] | None,
        w_proj: Float[Array, "d_ff d_in"], *, dtype=jnp.bfloat16, precision=None, out_dtype=jnp.float32,
        impl: Impl = "auto", recompute: bool = False, h_dtype=jnp.float32) -> Float[Array, "... d_in"]:
    """``gelu(x @ w_fc + b_fc) @ w_proj`` without c_proj's bias (the caller adds it, as Linear does): operands in
    ``dtype``, fp32 accumulation, GELU in fp32 rounded to ``dtype`` as c_proj's operand, the result and the
    backward's ``dx`` in fp32 (the default policies' GEMM output). ``impl``: "kernel" (the two Pallas Triton GEMMs:
    GPUs, bf16 operands), "interpret" (the same kernels in Pallas' interpreter), "xla" (XLA's GEMMs and the plain
    expressions), "auto" (the kernels on GPUs with bf16 operands, XLA elsewhere: :func:`jaxgpt.ops.platform`).

    ``recompute`` (``kernels.mlp = "pallas-recompute"``): the forward does not keep h (fp32, (rows, d_ff): 805 MB
    per layer at gpt2 b64); the backward computes it again from x, w_fc and b_fc, on GPUs inside the
    input-gradient GEMM's kernel (a second GEMM per tile, as the forward kernel computed it: the same values).

    ``h_dtype`` bfloat16 (``Policy.gelu_h_dtype = "bfloat16"``): h is kept for the backward rounded to bf16 (torch_ref
    under autocast takes gelu'(h) at its bf16 c_fc output too): the forward's values are unchanged (gelu(h) of the
    fp32 h), the backward's gelu'(h) is computed from the rounded h (widened to fp32 as it is read): half of h's
    memory and of its traffic in both kernels (tolerances.py: the bf16 policies' gradient and training bounds). On
    XLA's path the rounding is an f32 -> bf16 -> f32 convert pair, which XLA:GPU's excess-precision simplification
    may drop: a bf16 policy on a GPU takes the kernels, so only a direct call with ``impl="xla"`` there could see
    fp32 h's values."""
    gemm.resolve(impl, dtype)  # refuses an unknown impl
    if jnp.dtype(out_dtype) != jnp.float32:
        raise GemmKernelError(f"gelu_gemm.mlp keeps the GEMMs' fp32 outputs (gemm_output float32), got out_dtype "
                              f"{jnp.dtype(out_dtype).name}: use kernels.mlp: xla with that policy")
    if jnp.dtype(h_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) or (
            recompute and jnp.dtype(h_dtype) != jnp.float32):
        raise GemmKernelError(f"gelu_gemm.mlp keeps h in float32 or bfloat16 (and recompute keeps none), got h_dtype "
                              f"{jnp.dtype(h_dtype).name} with recompute={recompute}")
    lead = x.shape[:-1]
    m = _mlp(x.reshape(-1, x.shape[-1]), w_fc, b_fc, w_proj, jnp.dtype(dtype), precision, jnp.dtype(out_dtype), impl,
             bool(recompute), jnp.dtype(h_dtype))
    return m.reshape(*lead, w_proj.shape[-1])


def _bias_gelu(y: Float[Array, "... d"], bias: Float[Array, " d"]) -> Float[Array, "... d"]:
    """GPT-2's tanh GELU of ``y + bias`` (fp32: a bf16 ``y`` is promoted by the fp32 bias, as in torch_ref)."""
    return jax.nn.gelu(y + bias, approximate=True)


def apply(x: Float[Array, "batch seq embed"], w_fc: Float[Array, "embed d_ff"], b_fc: Float[Array, " d_ff"] | None,
          w_proj: Float[Array, "d_ff embed"], b_proj: Float[Array, " embed"] | None, *, policy, impl: str
          ) -> Float[Array, "batch seq embed"]:
    """``c_proj(gelu(c_fc(x)))`` under ``policy`` with ``impl`` (``Policy.kernels.mlp``). The reference ("xla"):
    the GEMMs as every Linear runs them (:meth:`jaxgpt.precision.Policy.matmul`), GPT-2's tanh GELU in fp32 between;
    with a bf16 GEMM output or an fp8 c_fc (a cuBLASLt call on GPUs that fuses nothing after it) the backward keeps
    the GEMM's output and recomputes bias + GELU from it (the same values; XLA kept the fp32 tanh as well, 805 MB per
    layer at gpt2 b64); with ``gelu_h_dtype`` bfloat16, :func:`mlp`'s XLA path. "pallas-gemm", "pallas-recompute":
    :func:`mlp` (its kernels on GPUs with bf16 operands, its XLA path elsewhere)."""
    h_dtype = jnp.dtype(policy.gelu_h_dtype)
    if impl in ("pallas-gemm", "pallas-recompute") or h_dtype == jnp.bfloat16:
        y = mlp(x, w_fc, b_fc, w_proj, dtype=policy.dtype, precision=policy.lax_precision, out_dtype=policy.out_dtype,
                impl="xla" if impl == "xla" else "auto", recompute=impl == "pallas-recompute", h_dtype=h_dtype)
        return ops.add_bias(y, b_proj)
    y = policy.matmul(x, w_fc, gemm="mlp")  # fp32 accumulation
    if (policy.gemm_output != "float32" or policy.fp8_on("mlp")) and b_fc is not None:
        with jax.named_scope(SCOPE):
            h = jax.checkpoint(_bias_gelu)(y, b_fc)
    else:
        h = ops.add_bias(y, b_fc)
        with jax.named_scope(SCOPE):
            h = jax.nn.gelu(h, approximate=True)  # GPT-2's tanh GELU, in fp32
    y = policy.matmul(h, w_proj, gemm="mlp")
    return ops.add_bias(y, b_proj)
