"""LayerNorm with a hand-written backward (``kernels.layer_norm = "fused"``).

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
``layernorm_backward`` does) needs a kernel that reduces along both axes at once, which no XLA fusion does:
``kernels.layer_norm = "pallas"`` is that kernel, a Pallas Triton one (:func:`layer_norm_backward`, below), for the
LayerNorms, which it sees as ``(x, ln(x))`` branches so that it also adds the residual stream's gradient (ln_f, which
no block adds to, as a branch without x: ``residual=False``). Their forward is one Pallas kernel too
(:func:`layer_norm_forward`): it adds a branch's output to the residual stream, takes the row statistics and writes
ln(x) in the GEMMs' operand dtype in one pass, where XLA reads the sum three times.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Literal

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


def _backward_xla(x, mean, rstd, scale, bias, dy):
    """(dx, d(scale), d(bias)) as the two passes above (rows, then one multi-output column reduction)."""
    dy = dy.astype(x.dtype)
    x_hat = (x - mean) * rstd
    g = dy * scale.astype(x.dtype)
    c1 = (g * x_hat).mean(axis=-1, keepdims=True)
    c2 = g.mean(axis=-1, keepdims=True)
    dx = (g - c2 - x_hat * c1) * rstd
    d_scale, d_bias = _column_sums(dy * x_hat, dy if bias is not None else None)
    return dx, d_scale.astype(scale.dtype), None if bias is None else d_bias.astype(bias.dtype)


def _layer_norm_bwd(eps, res, dy):
    del eps  # inside rstd
    with jax.named_scope(SCOPE):
        return _backward_xla(*res, dy)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def layer_norm(x: Float[Array, "rows embed"], scale: Float[Array, " embed"], bias: Float[Array, " embed"] | None,
               *, eps: float) -> Float[Array, "rows embed"]:
    """``(x - mean) * rsqrt(var + eps) * scale + bias`` over the last axis of a floating (rows, embed) ``x``, in
    x's dtype (the caller casts to fp32 first, as the plain LayerNorm does), with the two-pass backward above."""
    _check(x, scale, bias)
    return _layer_norm(x, scale, bias, float(eps))


# ---- kernels.layer_norm: pallas: the LayerNorm of a residual branch, its backward one kernel ----------------------
# On GPUs the row pass above is a fusion that also adds dx to the residual stream's gradient (XLA fuses the add in),
# and the column pass re-reads x and dy. One kernel can do both, but only if the custom VJP is handed the residual
# gradient: a VJP of the LayerNorm alone gets dy, and XLA would add its dx to the residual gradient in a pass of its
# own. So :func:`layer_norm_branch` returns x itself beside LayerNorm(x); the Block adds its branch to that x, and the
# backward gets both cotangents: ``d_x = d_x_out + LN_backward(dh)``, one read of x, dy and d_x_out, one write.
Backward = Literal["auto", "kernel", "interpret", "xla"]
BLOCK_ROWS = 128  # rows per program: its d(scale), d(bias) partial sums are one row of the partial-sum outputs
SUB_ROWS = 8  # rows per inner step: (8, 1024) fp32 tiles of x, dy and the residual gradient over 8 warps
NUM_WARPS, NUM_STAGES = 8, 2


class LayerNormKernelError(ValueError):
    """Inputs the LayerNorm kernels or their branch cannot take (wrong rank or shapes, dtypes, settings)."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tile(first: int, sub: int, rows: int, col, col_ok):
    """``sub`` rows from ``first`` over the masked columns: (row ids, row mask, tile mask, tile index) for the kernels'
    loads and stores."""
    row = first + jnp.arange(sub)
    row_ok = row < rows
    return row, row_ok, row_ok[:, None] & col_ok[None, :], (row[:, None], col[None, :])


def _kernel(x_ref, *refs, n_dy: int, block: int, sub: int, width: int, has_dres: bool):
    """Rows [i * block, (i + 1) * block) of x, dy and the residual gradient, ``sub`` rows at a time, each row's
    ``width`` (a power of two >= the embedding) columns masked to the real ones: dx + residual gradient written
    (fp32), the rows' fp32 column sums of dy * x_hat and dy into row i of ds_ref and db_ref. ``refs``: the ``n_dy``
    parts of dy (summed here, in fp32), then the residual gradient (unless ``has_dres`` is False: a LayerNorm that is
    no residual branch, ln_f), mean, rstd, scale, dx, ds and db."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    dy_refs, rest = refs[:n_dy], refs[n_dy:]
    dres_ref, rest = (rest[0], rest[1:]) if has_dres else (None, rest)
    mean_ref, rstd_ref, scale_ref, dx_ref, ds_ref, db_ref = rest
    rows, cols = x_ref.shape
    i = pl.program_id(0)
    col = jnp.arange(width)
    col_ok = col < cols
    scale = plgpu.load(scale_ref.at[col], mask=col_ok, other=0.0).astype(jnp.float32)

    def step(s, acc):
        row, row_ok, ok, at = _tile(i * block + s * sub, sub, rows, col, col_ok)
        x = plgpu.load(x_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
        dy = plgpu.load(dy_refs[0].at[at], mask=ok, other=0.0).astype(jnp.float32)
        for dy_ref in dy_refs[1:]:  # the other GEMMs' input gradients: XLA would add them in a pass of its own
            dy = dy + plgpu.load(dy_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
        mean = plgpu.load(mean_ref.at[row], mask=row_ok, other=0.0)[:, None]
        rstd = plgpu.load(rstd_ref.at[row], mask=row_ok, other=0.0)[:, None]
        x_hat = jnp.where(ok, (x - mean) * rstd, 0.0)  # padded columns: 0, not -mean * rstd
        g = dy * scale[None, :]
        c1 = (g * x_hat).sum(axis=1, keepdims=True) / cols
        c2 = g.sum(axis=1, keepdims=True) / cols
        dx = (g - c2 - x_hat * c1) * rstd
        if has_dres:
            dx = dx + plgpu.load(dres_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
        plgpu.store(dx_ref.at[at], dx.astype(dx_ref.dtype), mask=ok)
        return acc[0] + (dy * x_hat).sum(axis=0), acc[1] + dy.sum(axis=0)

    zero = jnp.zeros((width,), jnp.float32)
    sums = jax.lax.fori_loop(0, block // sub, step, (zero, zero))
    for ref, total in zip((ds_ref, db_ref), sums, strict=True):
        plgpu.store(ref.at[i, col], total, mask=col_ok)


def _check_kernel(x, dys, dres, mean, rstd, scale) -> None:
    if not dys:
        raise LayerNormKernelError("layer_norm_backward takes at least one dy")
    shapes = [tuple(a.shape) for a in (x, *dys, *([] if dres is None else [dres]))]
    if getattr(x, "ndim", 0) != 2 or len(set(shapes)) != 1:
        raise LayerNormKernelError(f"layer_norm_backward takes x, dy (or each of its parts) and the residual gradient "
                                   f"of one (rows, embed) shape, got {', '.join(map(str, shapes))}; reshape them with "
                                   "a.reshape(-1, a.shape[-1])")
    dtypes = [a.dtype for a in dys]
    dres_dtype = jnp.float32 if dres is None else dres.dtype
    if x.dtype != jnp.float32 or dres_dtype != jnp.float32 or any(d not in (jnp.float32, jnp.bfloat16) for d in dtypes):
        raise LayerNormKernelError(f"layer_norm_backward takes float32 x and residual gradient and a float32 or "
                                   f"bfloat16 dy, got {x.dtype}, {dres_dtype} and {', '.join(map(str, dtypes))}")
    if tuple(mean.shape) != (x.shape[0], 1) or tuple(rstd.shape) != (x.shape[0], 1) or scale.shape != x.shape[1:]:
        raise LayerNormKernelError(f"layer_norm_backward: mean and rstd must be ({x.shape[0]}, 1) and scale "
                                   f"({x.shape[1]},), got {tuple(mean.shape)}, {tuple(rstd.shape)}, "
                                   f"{tuple(scale.shape)}")


def layer_norm_backward(x: Float[Array, "rows embed"],
                        dy: Float[Array, "rows embed"] | Sequence[Float[Array, "rows embed"]],
                        dres: Float[Array, "rows embed"] | None, mean: Float[Array, "rows 1"],
                        rstd: Float[Array, "rows 1"],
                        scale: Float[Array, " embed"], *, interpret: bool = False
                        ) -> tuple[Float[Array, "rows embed"], ...]:
    """``(dres + dx, d_scale_partials, d_bias_partials)`` of the LayerNorm whose forward saved ``mean`` and ``rstd``,
    as one Pallas Triton kernel (``interpret=True``: Pallas' interpreter, on any backend): ``dx = rstd * (g - mean(g)
    - x_hat * mean(g * x_hat))`` with ``g = dy * scale``, and per block of :data:`BLOCK_ROWS` rows the fp32 column
    sums of ``dy * x_hat`` and ``dy`` (``.sum(0)`` of each is d(scale), d(bias)). ``dy`` may be a sequence of parts
    (the input gradients of the GEMMs that read the LayerNorm's output), summed in the kernel in fp32 in that order.
    Ragged rows and an embedding that is not a power of two are masked in the kernel, not padded in memory. ``dres``
    None: no residual gradient (a LayerNorm that is no residual branch: ln_f), nothing read for it."""
    from jax.experimental import pallas as pl  # here, not at import: Pallas adds ~0.2-0.3 s to `import jaxgpt.model`
    from jax.experimental.pallas import triton as plgpu

    dys = tuple(dy) if isinstance(dy, (list, tuple)) else (dy,)
    _check_kernel(x, dys, dres, mean, rstd, scale)
    rows, cols = x.shape
    block = min(BLOCK_ROWS, max(SUB_ROWS, _next_pow2(rows)))
    n = -(-rows // block)
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)}
    partials = jax.ShapeDtypeStruct((n, cols), jnp.float32)
    return pl.pallas_call(
        partial(_kernel, n_dy=len(dys), block=block, sub=min(SUB_ROWS, block), width=max(16, _next_pow2(cols)),
                has_dres=dres is not None),
        out_shape=(jax.ShapeDtypeStruct(x.shape, jnp.float32), partials, partials),
        grid=(n,), interpret=interpret, name="layer_norm_backward_residual", **kwargs,
    )(x, *dys, *([] if dres is None else [dres]), mean.reshape(-1), rstd.reshape(-1), scale.astype(jnp.float32))


def _forward_kernel(x_ref, *refs, has_add: bool, block: int, sub: int, width: int, eps: float):
    """Rows [i * block, (i + 1) * block) of x (plus the branch ``add``), ``sub`` rows at a time, columns masked to the
    real ones as in :func:`_kernel`: the sum written (fp32) when there is one, the row statistics (two-pass variance,
    as :func:`_stats`) and ``ln = (x - mean) * rstd * scale + bias`` written in y_ref's dtype. ``refs``: [add],
    scale, bias, then the outputs [x + add], y, mean, rstd."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    add_ref, refs = (refs[0], refs[1:]) if has_add else (None, refs)
    scale_ref, bias_ref, *outs = refs
    xo_ref, (y_ref, mean_ref, rstd_ref) = (outs[0], outs[1:]) if has_add else (None, outs)
    rows, cols = x_ref.shape
    i = pl.program_id(0)
    col = jnp.arange(width)
    col_ok = col < cols
    scale = plgpu.load(scale_ref.at[col], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
    bias = plgpu.load(bias_ref.at[col], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]

    def step(s, carry):
        row, row_ok, ok, at = _tile(i * block + s * sub, sub, rows, col, col_ok)
        x = plgpu.load(x_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
        if has_add:  # the residual stream plus the branch: XLA would write it, then read it twice for the statistics
            x = x + plgpu.load(add_ref.at[at], mask=ok, other=0.0).astype(jnp.float32)
            plgpu.store(xo_ref.at[at], x, mask=ok)
        mean = x.sum(axis=1, keepdims=True) / cols
        centered = jnp.where(ok, x - mean, 0.0)  # padded columns: 0, not -mean
        rstd = jax.lax.rsqrt((centered * centered).sum(axis=1, keepdims=True) / cols + eps)
        plgpu.store(y_ref.at[at], (centered * rstd * scale + bias).astype(y_ref.dtype), mask=ok)
        plgpu.store(mean_ref.at[row], mean[:, 0], mask=row_ok)
        plgpu.store(rstd_ref.at[row], rstd[:, 0], mask=row_ok)
        return carry

    jax.lax.fori_loop(0, block // sub, step, 0)


def layer_norm_forward(x: Float[Array, "rows embed"], add: Float[Array, "rows embed"] | None,
                       scale: Float[Array, " embed"], bias: Float[Array, " embed"] | None, *, eps: float,
                       dtype=jnp.float32, interpret: bool = False
                       ) -> tuple[Float[Array, "rows embed"], Float[Array, "rows embed"], Float[Array, "rows 1"],
                                  Float[Array, "rows 1"]]:
    """``(x + add, ln(x + add), mean, rstd)`` as one Pallas Triton kernel (``interpret=True``: Pallas' interpreter):
    the residual stream's sum (fp32; ``x`` itself when ``add`` is None), its LayerNorm in ``dtype`` (the GEMMs'
    operand dtype: what the next GEMM reads, so the fp32 LayerNorm output never reaches memory) and the row
    statistics the backward kernel takes. The sum is read once where XLA writes it and reads it twice (its mean,
    then its variance) before the pass that normalises it. Ragged rows and widths are masked, as in the backward."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    _check(x, scale, bias)
    if x.dtype != jnp.float32 or (add is not None and (add.shape != x.shape or add.dtype != jnp.float32)):
        raise LayerNormKernelError(f"layer_norm_forward takes a float32 x and an optional float32 add of x's shape, "
                                   f"got {x.dtype} {tuple(x.shape)} and "
                                   f"{None if add is None else (str(add.dtype), tuple(add.shape))}")
    rows, cols = x.shape
    block = min(BLOCK_ROWS, max(SUB_ROWS, _next_pow2(rows)))
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)}
    row = jax.ShapeDtypeStruct((rows,), jnp.float32)
    outs = pl.pallas_call(
        partial(_forward_kernel, has_add=add is not None, block=block, sub=min(SUB_ROWS, block),
                width=max(16, _next_pow2(cols)), eps=float(eps)),
        out_shape=(*([jax.ShapeDtypeStruct(x.shape, jnp.float32)] if add is not None else []),
                   jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), row, row),
        grid=(-(-rows // block),), interpret=interpret, name="layer_norm_forward_residual", **kwargs,
    )(x, *([add] if add is not None else []), scale.astype(jnp.float32),
      (jnp.zeros_like(scale) if bias is None else bias).astype(jnp.float32))
    x_out, y, mean, rstd = outs if add is not None else (x, *outs)
    return x_out, y, mean.reshape(rows, 1), rstd.reshape(rows, 1)


def _resolve(backward: Backward) -> Backward:
    if backward != "auto":
        return backward
    return "kernel" if ops.platform() == "gpu" else "xla"


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _branch(x, add, scale, bias, eps, backward, copies, dtype, residual):
    # without gradients: the same kernels
    return _branch_fwd(x, add, scale, bias, eps, backward, copies, dtype, residual)[0]


def _branch_fwd(x, add, scale, bias, eps, backward, copies, dtype, residual):
    had_add = None if add is None else jnp.zeros((), jnp.float32)  # a residual: whether add's gradient is due
    with jax.named_scope(SCOPE):
        if _resolve(backward) == "xla":
            x = x if add is None else x + add
            y, (x, mean, rstd, scale, bias) = _layer_norm_fwd(x, scale, bias, eps)
        else:  # written in dtype and returned as fp32: the GEMMs' cast back to dtype folds the pair away in XLA
            x, y, mean, rstd = layer_norm_forward(x, add, scale, bias, eps=eps, dtype=dtype,
                                                  interpret=_resolve(backward) == "interpret")
            y = y.astype(jnp.float32)
    return ((x,) if residual else ()) + (y,) * copies, (x, mean, rstd, scale, bias, had_add)


def _branch_bwd(eps, backward, copies, dtype, residual, res, cotangents):
    del eps, copies  # eps: inside rstd; copies: the cotangents' count
    d_x_out, dys = (cotangents[0], cotangents[1:]) if residual else (None, cotangents)
    x, mean, rstd, scale, bias, had_add = res
    res = res[:5]
    with jax.named_scope(SCOPE):
        if _resolve(backward) == "xla":  # the two passes of layer_norm: fused (on CPUs the same numbers as it)
            dy = sum(dys[1:], dys[0])  # what autodiff would have added before the VJP, in the same order
            dx, d_scale, d_bias = _backward_xla(*res, dy)
            dx = dx if d_x_out is None else d_x_out.astype(x.dtype) + dx
        else:
            dx, ds, db = layer_norm_backward(
                x, [dy if dy.dtype == jnp.bfloat16 else dy.astype(x.dtype) for dy in dys],
                None if d_x_out is None else d_x_out.astype(x.dtype), mean, rstd, scale,
                interpret=_resolve(backward) == "interpret")
            d_scale, d_bias = ds.sum(axis=0).astype(scale.dtype), None if bias is None else db.sum(axis=0).astype(
                bias.dtype)
    return dx, None if had_add is None else dx, d_scale, d_bias


_branch.defvjp(_branch_fwd, _branch_bwd)


def layer_norm_branch(x: Float[Array, "rows embed"], scale: Float[Array, " embed"],
                      bias: Float[Array, " embed"] | None, *, eps: float, backward: Backward = "auto",
                      copies: int = 1, add: Float[Array, "rows embed"] | None = None, dtype=jnp.float32,
                      residual: bool = True
                      ) -> tuple[Float[Array, "rows embed"], ...]:
    """``(x, layer_norm(x))`` for a residual branch (``kernels.layer_norm = "pallas"``): the same values, with a
    backward that adds LayerNorm's dx to x's other gradient in the same pass that computes it. ``backward``:
    "kernel" (:func:`layer_norm_backward`, and :func:`layer_norm_forward` for the forward: GPUs), "interpret"
    (those kernels in Pallas' interpreter), "xla" (the passes of :func:`layer_norm`), "auto" (the kernels on GPUs,
    XLA elsewhere: :func:`jaxgpt.ops.platform`).

    ``add``: a branch's output to add to x first (the Block's ``x + attn(...)``): the result is then ``(x + add,
    layer_norm(x + add), ...)``, the sum made in the forward kernel, and add's gradient is the sum's. ``dtype``: what
    the forward kernel writes layer_norm(x) in: the following GEMMs' operand dtype (they cast to it anyway), so that
    the fp32 LayerNorm is not written out. It is returned as fp32 all the same, so its gradients are fp32 as before:
    XLA folds the upcast into the GEMMs' cast back (the compiled H100 step reads the kernel's bf16 output directly).
    The XLA path ignores it (no rounding).

    ``copies``: how many GEMMs read layer_norm(x). The result is ``(x, y_1, ..., y_copies)``, the same y each time;
    given one copy per GEMM, the backward gets each GEMM's input gradient apart and the kernel sums them as it reads
    them (on GPUs the attention's q, k and v projections are three GEMMs: their three fp32 input gradients were
    added by an XLA pass of their own, 0.8 GB moved per layer at gpt2 b64).

    ``residual=False``: a LayerNorm that is no residual branch (ln_f, after the last block's ``add``): the result is
    ``(y_1, ..., y_copies)`` without x, and the backward kernel reads no residual gradient (a zero one would be
    written and read: 0.2 GB at gpt2 b64)."""
    if backward not in ("auto", "kernel", "interpret", "xla"):
        raise LayerNormKernelError(f"layer_norm_branch: backward = {backward!r}: allowed values are 'auto', 'kernel', "
                                   "'interpret', 'xla'")
    if not isinstance(copies, int) or copies < 1:
        raise LayerNormKernelError(f"layer_norm_branch: copies = {copies!r}: the number of GEMMs that read the "
                                   "LayerNorm's output, an int >= 1")
    _check(x, scale, bias)
    if x.dtype != jnp.float32 or (add is not None and (add.shape != x.shape or add.dtype != jnp.float32)):
        raise LayerNormKernelError(f"layer_norm_branch takes a float32 x (the residual stream) and an optional float32 "
                                   f"add of its shape, got {x.dtype} {tuple(x.shape)} and "
                                   f"{None if add is None else (str(add.dtype), tuple(add.shape))}")
    return _branch(x, add, scale, bias, float(eps), backward, copies, jnp.dtype(dtype), bool(residual))


def _reference(x: Float[Array, "rows embed"], scale, bias, eps: float) -> Float[Array, "rows embed"]:
    """GPT-2's LayerNorm: statistics over the last axis, biased variance (as torch.nn.LayerNorm), eps in the rsqrt."""
    mean = x.mean(axis=-1, keepdims=True)
    var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * scale
    return y + bias if bias is not None else y


def add_layer_norm(hidden: Float[Array, "batch seq embed"], residual: Float[Array, "batch seq embed"] | None,
                   scale: Float[Array, " embed"], bias: Float[Array, " embed"] | None, *, eps: float, impl: str,
                   copies: int = 1, dtype=jnp.float32, keep_residual: bool = True
                   ) -> tuple[Float[Array, "batch seq embed"], ...]:
    """The residual add and the LayerNorm after it: ``x = residual + hidden`` (``hidden`` alone where ``residual`` is
    None: the embeddings), then ``(x, ln(x), ..., ln(x))`` with ``copies`` copies of ln(x), one per GEMM that reads
    it (without x where ``keep_residual`` is False: ln_f). ``impl`` (``Policy.kernels.layer_norm``): "xla" (the
    reference: XLA's add, the expression, autodiff), "fused" (:func:`layer_norm`'s two-pass backward), "pallas"
    (:func:`layer_norm_branch`: on GPUs the add inside one custom VJP whose forward and backward are one Pallas kernel
    each, ln(x) written in ``dtype``, the GEMMs' operand dtype; elsewhere XLA's add and fused's passes, fused's values
    bit for bit)."""
    lead, width = hidden.shape[:-1], hidden.shape[-1]
    rows = (-1, width)
    x, add = (hidden, None) if residual is None else (residual, hidden)
    if impl == "pallas" and x.dtype == jnp.float32:
        # XLA adds a bf16 branch (autocast's c_proj without a bias: x + a promotes, and autodiff rounds a's gradient its
        # own way), and every branch where the kernels do not run (CPUs): there the VJP is fused's passes, and the add
        # inside it changed XLA:CPU's code (fp32 sums in another order), so it stays outside, as fused's
        if add is not None and (add.dtype != jnp.float32 or _resolve("auto") == "xla"):
            x, add = x + add, None
        with jax.named_scope(SCOPE):
            outs = layer_norm_branch(x.reshape(rows), scale, bias, eps=eps, copies=copies, dtype=dtype,
                                     add=None if add is None else add.reshape(rows), residual=keep_residual)
            return tuple(o.reshape(*lead, width) for o in outs)
    x = x if add is None else x + add
    with jax.named_scope(SCOPE):  # named scopes label the profile's fusions (benchmarks.gpu.profile)
        y = _rows(x, scale, bias, eps, fused=impl in ("fused", "pallas"))
    return ((x,) if keep_residual else ()) + (y,) * copies


def _rows(x: Float[Array, "... embed"], scale, bias, eps: float, *, fused: bool) -> Float[Array, "... embed"]:
    """The LayerNorm of x as (rows, embed), in fp32 (fp64 stays): with a leading batch of 1, XLA:CPU ran the
    backward's sum over rows for d(scale) ~7x slower on the 3-D (1, T, C) array (6-7 ms per LayerNorm at gpt2's
    T=1024, 25 per step)."""
    xr = x.reshape(-1, x.shape[-1]).astype(jnp.promote_types(x.dtype, jnp.float32))
    y = layer_norm(xr, scale, bias, eps=eps) if fused else _reference(xr, scale, bias, eps)
    return y.reshape(x.shape)
