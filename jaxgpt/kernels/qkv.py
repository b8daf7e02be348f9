"""The attention's q, k and v projections as Pallas GEMMs (``kernels.qkv = "pallas"``): the bias add and the rounding
to bf16 that attention applies in the GEMMs' epilogues, and one GEMM for the input gradient.

The same function as :class:`jaxgpt.model.CausalSelfAttention`'s projections on GPUs (``x @ W_attn + b`` as q, k
and v's three column blocks, bf16 operands, fp32 accumulation and bias add, then rounded to bf16 by attention).
Compiled for the H100 (gpt2 124M, micro-batch 64, bf16, ``kernels.layer_norm: pallas``) each layer of the plain program
moves, around those GEMMs:

* forward: each of the three GEMMs writes fp32 (201 MB at [65536, 768]) and attention's convert pass reads it, adds
  the bias and writes the bf16 cuDNN takes (302 MB per projection);
* backward: each projection's input-gradient GEMM writes its fp32 dx (201 MB), and the LayerNorm kernel reads the
  three (one copy of ln(x) per GEMM, so each gradient is an array of its own; XLA's add of three was a pass).

Here :func:`jaxgpt.kernels.gemm.gemm_bias_cast` writes each bf16 projection directly (reading its column block of
W_attn in place), and the backward's input gradient is one GEMM over the three gradients
(:func:`jaxgpt.kernels.gemm.gemm_sum_nt`:
``[dq dk dv] @ W_attn^T`` without the concatenation, one fp32 accumulation over the 2,304 columns, as the CPU's
single c_attn GEMM does), so LayerNorm hands this op one ln(x) and reads one gradient; the same kernel sums the
bias gradient's columns from the bf16 gradients it reads anyway (XLA read each again: 36 passes of 101 MB at b64).
``dW`` is XLA's (per block, laid out as :func:`jaxgpt.ops._matmul2d_bwd` lays them out). The values are the plain
path's but for the order of fp32 sums. On CPUs and with fp32 compute nothing here runs: the model takes its plain path.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxgpt import ops
from jaxgpt.kernels import gemm
from jaxgpt.kernels.gemm import Impl


def applies(dtype) -> bool:
    """Whether :func:`projections` runs its kernels here: GPUs, bf16 operands (else the model's plain path)."""
    return ops.platform() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16


def _blocks(w, b, n):
    return jnp.split(w, n, axis=-1), (jnp.split(b, n) if b is not None else [None] * n)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _projections(x, w, b, n, dtype, precision, impl):
    return _projections_fwd(x, w, b, n, dtype, precision, impl)[0]


def _projections_fwd(x, w, b, n, dtype, precision, impl):
    xc, wc = x.astype(dtype), w.astype(dtype)
    if impl == "xla":
        ys = []
        for wi, bi in zip(*_blocks(wc, b, n), strict=True):
            y = ops._dot(xc, wi, dtype, precision)
            ys.append((y + bi if bi is not None else y).astype(dtype))
    else:  # each kernel reads its column block of W and b in place (slicing them was 6 copy kernels per layer)
        ys = [gemm.gemm_bias_cast(xc, wc, b, out_dtype=dtype, interpret=impl == "interpret", column_block=(s, n))
              for s in range(n)]
    return tuple(ys), (xc, wc, jnp.zeros((), x.dtype), None if b is None else jnp.zeros((), b.dtype))


def _projections_bwd(n, dtype, precision, impl, res, gs):
    xc, wc, x_like, b_like = res
    gcs = [g.astype(dtype) for g in gs]  # the cotangents of ``dtype`` results: already ``dtype``
    if impl == "xla":  # the blocks' input gradients, summed in fp32; the bias gradient summed in fp32
        dx = sum(ops._dot(g, ops.transpose_operand(wi), dtype, precision)
                 for g, wi in zip(gcs, _blocks(wc, None, n)[0], strict=True))
        sums = jnp.concatenate([g.astype(jnp.float32).sum(axis=0) for g in gs])[None]
    else:  # one GEMM: [g_1 ... g_n] @ W^T, W^T read as (d_in, sum of the blocks' widths), and the column sums
        dx, sums = gemm.gemm_sum_nt(gcs, wc, interpret=impl == "interpret")
    dw = jnp.concatenate([ops._dot(ops.transpose_operand(xc), g, dtype, precision) for g in gcs], axis=-1)
    db = None if b_like is None else sums.sum(axis=0).astype(b_like.dtype)
    return dx.astype(x_like.dtype), dw, db


_projections.defvjp(_projections_fwd, _projections_bwd)


def projections(x: Float[Array, "... d_in"], w: Float[Array, "d_in d_out"], b: Float[Array, " d_out"] | None, n: int,
                *, dtype, precision=None, impl: Impl = "auto") -> tuple[Float[Array, "... d_out/n"], ...]:
    """The ``n`` column blocks of ``x @ w + b`` (q, k and v for ``n = 3``), each rounded to ``dtype`` (bf16) once,
    after the bias add in fp32. ``impl``: "kernel" (Pallas Triton GEMMs: GPUs), "interpret" (the same kernels in
    Pallas' interpreter), "xla" (XLA's GEMMs, bias adds and roundings), "auto" (the kernels where
    :func:`applies`, else XLA's)."""
    impl = gemm.resolve(impl, dtype)
    if w.shape[-1] % n:
        raise gemm.GemmKernelError(f"qkv.projections: {w.shape[-1]} output columns do not split into {n} equal blocks; "
                                   "pass n that divides them (3 for q, k and v)")
    lead = x.shape[:-1]
    ys = _projections(x.reshape(-1, x.shape[-1]), w, b, n, jnp.dtype(dtype), precision, impl)
    return tuple(y.reshape(*lead, y.shape[-1]) for y in ys)


def gemms(impl: str, dtype) -> int:
    """How many GEMMs read the attention's input under ``impl`` (``Policy.kernels.qkv``): the one c_attn GEMM on
    CPUs, one op (:func:`projections`) under "pallas" where its kernels run, q, k and v's three elsewhere; the
    LayerNorm before hands one copy of its output to each, so that its backward sums their gradients itself."""
    return 1 if ops.platform() == "cpu" or (impl == "pallas" and applies(dtype)) else 3


def project(x: list[Float[Array, "batch seq embed"]], w: Float[Array, "embed qkv"], b: Float[Array, " qkv"] | None, *,
            policy, impl: str, decoding: bool = False) -> list[Float[Array, "batch seq embed"]]:
    """q, k and v: the three column blocks of ``x @ w + b`` (``x``: one copy of the input per GEMM, :func:`gemms`).
    "xla": on CPUs c_attn's one GEMM split in three (split's backward is one concatenate of dq, dk, dv, an unpack's
    three zero-padded copies of the whole gradient: 150 ms of a 6 s gpt2 124M step on 2 cores); elsewhere one GEMM
    per column block, so q, k and v come out dense as cuDNN takes them (splitting one output was 36 copy kernels
    forward and 24 concatenates backward in the compiled H100 step). "pallas": :func:`projections` (not while
    ``decoding``, whose steps take the per-block GEMMs)."""
    if impl == "pallas" and applies(policy.dtype) and not decoding:
        return list(projections(x[0], w, b, 3, dtype=policy.dtype, precision=policy.lax_precision))
    if len(x) == 1 and ops.platform() == "cpu":
        return jnp.split(ops.add_bias(policy.matmul(x[0], w, gemm="attn"), b), 3, axis=-1)
    xs = x if len(x) == 3 else x * 3
    bs = [None] * 3 if b is None else jnp.split(b, 3)
    return [ops.add_bias(policy.matmul(xi, wi, gemm="attn"), bi) for xi, wi, bi in zip(xs, jnp.split(w, 3, axis=-1), bs,
                                                                                  strict=True)]
