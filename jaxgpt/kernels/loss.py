"""The fused lm_head + cross-entropy (``Policy.fast_kernels``): ``mean(logsumexp(h W^T) - (h W^T)[target])`` over
the real vocabulary, computed in row chunks with its gradient formed in the same pass, so the (tokens x 50,304)
fp32 logits are never materialised whole, and never twice.

:func:`lm_head_cross_entropy` is what the model's loss calls; :func:`token_cross_entropy` gives each position's
loss (evaluation); the chunk size (:func:`_chunk_rows`, ``CE_CHUNK_ELEMENTS``) is read by ``jaxgpt.account``'s
memory model. On GPUs the logits GEMM sits behind an optimization barrier (``LOGITS_BARRIER``) so each chunk's
logits are written once; ``Policy.logits_dtype`` picks their dtype; ``fp8=True`` runs the logits GEMM on e4m3
operands (:mod:`jaxgpt.kernels.fp8`); ``lm_head="pallas"`` (``kernels.loss = "pallas"``) runs the bf16 logits GEMM as
a Pallas GEMM that also writes each tile's row max and sum of exp (:func:`logits_lse`), so no pass re-reads the
logits for them. ``tests/test_ops.py``, ``tests/kernels/test_loss_logits.py`` and
``tests/kernels/test_loss_kernel.py`` check it against the plain expression, values and gradients; what it saved is
measured in ``BENCHMARKS.md``. :func:`apply` is the op's entry point (``Policy.kernels.loss``)."""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from jaxgpt.kernels import fp8 as f8
from jaxgpt import ops
from jaxgpt.kernels import gemm
from jaxgpt.config import ConfigError

CE_CHUNK_ELEMENTS = 1 << 26  # fp32 logits per chunk of the fused loss on CPU (jaxgpt.account's memory model reads it)
# on GPUs: every chunk re-reads the bf16 head and rewrites the fp32 dW accumulator (~0.6 GB of HBM traffic at GPT-2's
# vocabulary), and there is no cache to stay inside; see _chunk_rows
CE_CHUNK_ELEMENTS_GPU = 1 << 28
# kernels.loss: pallas (GPUs; bf16 logits, the row max and sum of exp from the GEMM): 2 GiB of bf16 logits per chunk. Every
# chunk is a loop step with its own fixed work (slices, the dW carry's read and write, the dh rows' copy); at gpt2
# b16 the loss is one chunk, no loop (predicted -0.2 ms per step), at b64 four of 16,384 rows, where 16 of 4,096 were
# (the chunk's bf16 logits and softmax gradient, 3.3 GB, against 0.8 GB: the step's memory is still <= 32 GiB)
CE_CHUNK_ELEMENTS_LSE = 1 << 30
# a chunk's fixed cost in rows of work, for _chunk_rows' choice between padded rows and more chunks: each chunk reads
# the bf16 head and rewrites the fp32 dW (10 V C bytes) where a row costs its three GEMMs (6 V C FLOPs); at an
# H100's ~200 FLOP per byte of HBM a chunk is ~333 rows
CHUNK_COST_ROWS = 333


def _chunk_rows(n_rows: int, vocab_rows: int, budget: int | None = None, *, fp8: bool = False, multiple: int = 1
                ) -> int:
    """Rows per chunk so one chunk's fp32 logits stay near ``budget`` elements (256 MiB): at GPT-2's vocabulary
    at most 1,334 rows, so 2 chunks of 1,024 rows for 2,048 tokens and one chunk for 1,024. Measured on 2-core
    CPUs: 158-row chunks were 25% slower than 512 (the dW dot's contraction gets short); at gpt2's 1,024 tokens
    x C=768 one 1,024-row chunk took 1.53-1.56 s against 1.62-1.65 s for two of 512 and 1.68 s for four of 256;
    at the small config's 2,048 x 256, 512- and 1,024-row chunks were equal (1.18-1.27 s) and one 2,048-row
    chunk slower (1.25-1.31 s: more memory traffic per pass). ``multiple``: rows a multiple of it (the logits
    kernel's row block, whose chunks must not be sliced): of the chunk counts from the fewest up to 8 more, the one
    with the least work counting each chunk as :data:`CHUNK_COST_ROWS` rows (under a 2^28 budget at gpt2 b64 16
    chunks of 4,096 rows, none padded, where 13 of 5,042 were; at b128 25 of 5,248, 128 padded, not 32 of 4,096;
    the logits kernel's own budget, :data:`CE_CHUNK_ELEMENTS_LSE`, makes b64 4 chunks of 16,384))."""
    if budget is None:
        budget = CE_CHUNK_ELEMENTS if ops.platform() == "cpu" else CE_CHUNK_ELEMENTS_GPU
    rows = max(1, min(n_rows, budget // vocab_rows))
    n_chunks = math.ceil(n_rows / rows)
    rows = math.ceil(n_rows / n_chunks)  # balanced chunks: the padded last chunk wastes < n_chunks rows
    if multiple > 1:
        fits = [-(-math.ceil(n_rows / n) // multiple) * multiple for n in range(n_chunks, n_chunks + 9)]
        rows = min(fits, key=lambda r: (math.ceil(n_rows / r) * (r + CHUNK_COST_ROWS), -r))
    if fp8 and ops.platform() != "cpu":
        # e4m3 logits GEMM: cuBLASLt's fp8 GEMM takes dimensions divisible by 16; XLA pads a chunk of other rows
        # and slices its (rows, vocab) fp32 result back, a pass over each chunk's logits (2 GB at gpt2 b64)
        rows = -(-rows // 16) * 16
    return rows


_NT = (((1,), (1,)), ((), ()))  # dot_general dims for a @ b^T
LmHead = Literal["plain", "pallas"]  # kernels.loss: xla (plain), pallas


def _logits_lse_kernel(h_ref, w_ref, raw_ref, m_ref, s_ref, *, bk: int, bn: int, vocab_size: int):
    """One (bm, bn) tile of a chunk's logits h @ w^T: written in bf16, and the row max and sum of exp of those bf16
    values (in fp32, the padded vocabulary's columns masked out) written as this tile's column of partials."""
    from jax.experimental import pallas as pl

    raw = gemm.accumulate(h_ref, w_ref, bk=bk, trans_b=True).astype(raw_ref.dtype)
    raw_ref[...] = raw
    cols = pl.program_id(1) * bn + jax.lax.broadcasted_iota(jnp.int32, raw.shape, 1)
    vals = jnp.where(cols < vocab_size, raw.astype(jnp.float32), -jnp.inf)
    m = vals.max(axis=1)
    s = jnp.exp(vals - m[:, None]).sum(axis=1)
    m_ref[...] = m[None, :]
    s_ref[...] = jnp.where(m == -jnp.inf, 0.0, s)[None, :]  # a tile of padded columns only adds nothing


def logits_lse(h: Float[Array, "rows embed"], w: Float[Array, "vocab_rows embed"], vocab_size: int, *,
               interpret: bool = False, block: tuple[int, int, int] | None = None
               ) -> tuple[Float[Array, "rows vocab_rows"], Float[Array, "rows 1"], Float[Array, "rows 1"]]:
    """``(raw, max, sum_exp)`` of a chunk: its bf16 logits ``h @ w^T`` (bf16 operands, fp32 accumulation, one
    rounding) and each row's max and sum of ``exp(logit - max)`` over the first ``vocab_size`` columns of the bf16
    values in fp32, as one Pallas Triton GEMM writing per-tile partials and a small reduction combining them (the
    online softmax's rescaling). The rows and the head's rows must be multiples of the blocks (the chunks are made
    so: :func:`_chunk_rows`' ``multiple``; a padded vocabulary of 50,304 is 393 blocks of 128)."""
    from jax.experimental import pallas as pl

    bf16 = jnp.bfloat16
    fix = "use kernels.loss: xla for these shapes or dtypes"
    gemm.check("logits_lse", {"h": (h, bf16, "(rows, embed)"), "w": (w, bf16, "(vocab_rows, embed)")}, fix)
    (m_rows, k), n = h.shape, w.shape[0]
    bm, bn, bk = gemm.blocks(m_rows, n, k, block)
    if not 0 < vocab_size <= n:
        raise gemm.GemmKernelError(f"logits_lse: vocab_size {vocab_size} must be in (0, {n}], the head's rows")
    if w.shape[1] != k or m_rows % bm or n % bn or k % bk:
        raise gemm.GemmKernelError(f"logits_lse: h {tuple(h.shape)} and w {tuple(w.shape)} must share the embedding "
                                   f"width and be multiples of the ({bm}, {bn}, {bk}) blocks; {fix}")
    # row tiles first (the GPU launches the first axis fastest): a chunk's rows (4,096 x 768 in bf16: 6.3 MB) stay in
    # L2 while each block of the head (77 MB in all) is read once, the opposite of jaxgpt.kernels.gemm.grid's order
    raw, tile_m, tile_s = pl.pallas_call(
        partial(_logits_lse_kernel, bk=bk, bn=bn, vocab_size=vocab_size),
        out_shape=(jax.ShapeDtypeStruct((m_rows, n), bf16),
                   *(jax.ShapeDtypeStruct((n // bn, m_rows), jnp.float32),) * 2),
        grid=(m_rows // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((bn, k), lambda i, j: (j, 0))],
        out_specs=(pl.BlockSpec((bm, bn), lambda i, j: (i, j)), *(pl.BlockSpec((1, bm), lambda i, j: (j, i)),) * 2),
        interpret=interpret, name="gemm_nt_logits_lse", **gemm.compiler_params(interpret))(h, w)
    m = tile_m.max(axis=0)
    s = jnp.sum(tile_s * jnp.exp(tile_m - m[None, :]), axis=0)  # a masked tile's -inf max: exp(-inf) = 0
    return raw, m[:, None], s[:, None]


def _lse_kernel(lm_head: LmHead, dtype, logits_dtype, fp8: bool, vocab_rows: int, width: int) -> str | None:
    """How the chunks' row max and sum of exp are computed: "kernel" or "interpret" (:func:`logits_lse`: lm_head
    pallas on GPUs, bf16 operands and logits, the head a multiple of the kernel's column block), None (XLA's
    pass)."""
    if lm_head not in ("plain", "pallas"):
        raise ValueError(f"lm_head = {lm_head!r}: allowed values are 'plain', 'pallas'")
    if lm_head == "plain" or ops.platform() != "gpu" or fp8 or jnp.dtype(dtype) != jnp.bfloat16 \
            or jnp.dtype(logits_dtype) != jnp.bfloat16:
        return None
    if vocab_rows % gemm.BLOCK_N:
        raise ConfigError(f"lm_head = 'pallas' takes the head's rows in blocks of {gemm.BLOCK_N}, got {vocab_rows} "
                          f"(the vocabulary unpadded): set model.padded_vocab_size to a multiple of {gemm.BLOCK_N} "
                          "(GPT-2: 50304), or kernels.loss: xla")
    if width % 16:
        raise ConfigError(f"lm_head = 'pallas' takes an embedding width that is a multiple of 16 (a Triton dot's K), "
                          f"got n_embd {width}: use kernels.loss: xla")
    return _LSE_IMPL


_LSE_IMPL = "kernel"  # tests run the kernel in Pallas' interpreter through the GPU path: "interpret"


def _head_rows(w, vocab_size: int, dtype):
    """The lm_head rows a chunk multiplies by, and what then masks its logits.

    On CPU only the real vocabulary's rows: padded columns then need no -inf mask, a whole pass over the (rows, V)
    logits that measured ~7 ms per 512 rows (~30 ms of a `small` step). On GPUs every padded row (50,304 for
    GPT-2: what ``padded_vocab_size`` is for): slicing 50,257 rows out made XLA:GPU pad each chunk's operands back
    to an aligned width and rewrite the fp32 dW accumulator through a slice (the compiled H100 step's largest
    copies, ``BENCHMARKS.md``), while the mask fuses into the max/sum reductions and the softmax-gradient pass that
    read the logits anyway. Masked columns get exp(-inf) = 0, so their softmax, gradient and dW are exactly 0."""
    if ops.platform() == "cpu" or w.shape[0] == vocab_size:
        return w.astype(dtype)[:vocab_size], lambda logits: logits
    real = jnp.arange(w.shape[0]) < vocab_size
    return w.astype(dtype), lambda logits: jnp.where(real, logits, -jnp.inf)


def _max_and_sum_exp(logits: Float[Array, "rows vocab"]) -> tuple[Float[Array, "rows 1"], Float[Array, "rows 1"]]:
    """(max, sum(exp(logits - max))) of each row in one pass: a reduction over (value, 1) pairs that rescales the
    running sum whenever the running max grows (the online softmax of flash attention). On GPUs the two separate
    reductions each read the chunk's fp32 logits from memory (3.3 GB per pass at gpt2's b16 micro-step)."""

    def combine(a, b):
        (ma, sa), (mb, sb) = a, b
        m = jnp.maximum(ma, mb)
        # an all -inf side (masked padded columns) adds nothing; exp(-inf - -inf) would be NaN
        sa = jnp.where(ma == -jnp.inf, 0.0, sa * jnp.exp(ma - m))
        sb = jnp.where(mb == -jnp.inf, 0.0, sb * jnp.exp(mb - m))
        return m, sa + sb

    init = (jnp.array(-jnp.inf, logits.dtype), jnp.array(0.0, logits.dtype))
    m, s = lax.reduce((logits, jnp.ones_like(logits)), init, combine, (1,))
    return m[:, None], s[:, None]


LOGITS_DTYPES = ("float32", "bfloat16")  # what the fused loss's logits GEMM may write (_head_logits)
# GPUs: end the logits GEMM's fusion at its output (_head_logits); False compiles the 2026-11-26 program
LOGITS_BARRIER = True


def _logits_dtype(name) -> jnp.dtype:
    dt = jnp.dtype(name)
    if dt.name not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype = {dt.name!r}: the lm_head's logits are written as one of "
                         f"{', '.join(LOGITS_DTYPES)}")
    return dt


def _head_logits(a, b, precision, logits_dtype, mask_padded
                 ) -> tuple[Float[Array, "rows vocab"], Float[Array, "rows vocab"]]:
    """A chunk's logits ``a @ b^T`` as the GEMM wrote them, and as the loss reads them: fp32 values, padded columns
    masked to -inf. The targets' logits are gathered from the first (a target is never a padded column): a gather
    behind the convert and the mask would be a fusion that takes the whole chunk as its operand.

    The GEMM accumulates in fp32 and writes its result once, in ``logits_dtype``: fp32 (exact, the default) or bf16
    (torch.autocast's and llm.c's numerics: the lse and softmax are then computed in fp32 from the bf16 values, half
    the bytes for every pass over them). On GPUs an optimization barrier ends the GEMM's fusion at its output, so
    that nothing is fused into it as an epilogue: the -inf mask (and a bf16 -> fp32 convert) then fuse into the two
    passes that read the logits anyway. Without it XLA fused the mask into the Triton GEMM, and the GPU, whose
    autotuner picks cuBLAS for this GEMM, ran it as a pass of its own that read and rewrote the chunk's fp32 logits
    (8.7 ms per b64 micro-step on the H100, 2026-11-26). On CPU, and for fp32 operands on GPUs, the fp32 result is
    rounded to ``logits_dtype``."""
    if ops.platform() == "cpu":
        acc = lax.dot_general(a, b, _NT, precision=precision, preferred_element_type=jnp.float32)
        # rounded in place (fp32 values on bf16's grid), not by an fp32 -> bf16 -> fp32 convert pair: XLA:CPU's
        # YNNPACK fusions (jax 0.10.2) drop such a pair when they fuse it with the dot and the reductions (under
        # jax.grad alone, the loss unused, the rounding vanished from the gradient)
        acc = ops.round_to(acc, logits_dtype)
        return acc.astype(logits_dtype), mask_padded(acc)
    # a GEMM cannot write a narrower dtype than its operands' (fp32 compute): fp32 then, rounded behind it
    written = logits_dtype if a.dtype.itemsize <= logits_dtype.itemsize else jnp.dtype(jnp.float32)
    raw = lax.dot_general(a, b, _NT, precision=precision, preferred_element_type=written).astype(logits_dtype)
    if not LOGITS_BARRIER:  # the 2026-11-26 program: the mask fused into the GEMM, the targets gathered behind it
        logits = mask_padded(raw.astype(jnp.float32))
        return logits, logits
    raw = lax.optimization_barrier(raw)
    return raw, mask_padded(raw.astype(jnp.float32))


def _e4m3_head(h, w_c, pad, chunks_shape, dtype, fp8):
    """(extra scan inputs, operands(h_i, *extra_i), the logits' scale) of the logits GEMM. Without ``fp8``: ((),
    (h_i, w_c), 1). With it (``precision: fp8``, jaxgpt.kernels.fp8): h and the head rounded to e4m3 with per-tensor
    scales of the whole arrays, the e4m3 chunks fed to the dot as they are and its result multiplied by the two scales
    (a dequantize-then-dot form was turned back into a bf16 GEMM by XLA:GPU, see jaxgpt.kernels.fp8)."""
    if not fp8:
        return (), lambda h_i: (h_i, w_c), None
    hq, h_scale = f8.quantize(h.astype(dtype))
    wq, w_scale = f8.quantize(w_c)
    hq = jnp.pad(hq, ((0, pad), (0, 0))).reshape(chunks_shape)
    return (hq,), lambda _, hq_i: (hq_i, wq), h_scale * w_scale


def _head_precision(precision, fp8: bool):
    """The logits GEMM's precision: HIGHEST for e4m3 operands (fp32 accumulation: no cuBLASLt fp8 fast
    accumulation, see jaxgpt.kernels.fp8.e4m3_dot), the policy's otherwise."""
    return lax.Precision.HIGHEST if fp8 else precision


def _scaled(scale, raw, logits):
    """(raw, logits) times the e4m3 operands' power-of-two scale (exact); as they are without one."""
    if scale is None:
        return raw, logits
    return raw * scale.astype(raw.dtype), logits * scale


def _ce_pass(h, w, targets, vocab_size, dtype, precision, with_grad, fp8=False, logits_dtype=jnp.float32,
             lm_head: LmHead = "plain"):
    """Loss sum over all rows, and (with_grad) d(mean)/dh and d(mean)/dw. h (M, C), w (V, C), targets (M,).
    ``fp8``: the logits GEMM in e4m3 (:func:`_e4m3_head`), the backward GEMMs in ``dtype`` as without it.
    ``logits_dtype``: what the logits GEMM writes (:func:`_head_logits`). ``lm_head``: "pallas" has the logits
    GEMM write the row max and sum of exp too (:func:`logits_lse`, where :func:`_lse_kernel` allows)."""
    M, C = h.shape
    V = w.shape[0]
    lse_kernel = _lse_kernel(lm_head, dtype, logits_dtype, fp8, V, C)
    rows = _chunk_rows(M, V, CE_CHUNK_ELEMENTS_LSE if lse_kernel else None, fp8=fp8,
                       multiple=gemm.BLOCK_M if lse_kernel else 1)
    n_chunks = math.ceil(M / rows)
    pad = n_chunks * rows - M
    hp = jnp.pad(h.astype(dtype), ((0, pad), (0, 0)))
    tp = jnp.pad(targets, (0, pad))
    valid_row = (jnp.arange(n_chunks * rows) < M).reshape(n_chunks, rows)
    hc = hp.reshape(n_chunks, rows, C)
    tc = tp.reshape(n_chunks, rows)
    w_c, mask_padded = _head_rows(w, vocab_size, dtype)
    e4m3_xs, logits_operands, logits_scale = _e4m3_head(h, w_c, pad, hc.shape, dtype, fp8)
    Vc = w_c.shape[0]
    online = ops.platform() != "cpu"  # GPUs: max and sum of exp in one pass over the fp32 logits (_max_and_sum_exp)

    def chunk(carry, inp):
        dw_t = carry  # dW's accumulator: (V, C) on GPUs, (C, V), transposed at the end, on CPUs
        h_i, t_i, ok, *hq_i = inp
        # h W^T straight from row-major W: YNNPACK runs this NT dot in bf16 (only *backward*-style transposed
        # operands get upcast), and a materialised W^T copy measured slower.
        if lse_kernel:  # the GEMM's epilogue: the row max and sum of exp of each tile, combined
            raw, m, s = logits_lse(h_i, w_c, vocab_size, interpret=lse_kernel == "interpret")
            logits = mask_padded(raw.astype(jnp.float32))
        else:
            raw, logits = _scaled(logits_scale, *_head_logits(*logits_operands(h_i, *hq_i),
                                                              _head_precision(precision, fp8), logits_dtype,
                                                              mask_padded))
        # one exp pass: e = exp(logits - max) serves both the loss (through its sum) and the softmax
        # (logsumexp + a second exp(logits - lse) pass measured 2x slower on the 2-core CPU)
        if lse_kernel:
            e = jnp.exp(logits - m)  # in the gradient's pass, as below
        elif online:
            m, s = _max_and_sum_exp(logits)
            e = jnp.exp(logits - m)  # recomputed inside the gradient's pass, not stored
        else:
            m = jnp.max(logits, axis=-1, keepdims=True)
            e = jnp.exp(logits - m)
            s = jnp.sum(e, axis=-1, keepdims=True)
        lse = (m + jnp.log(s))[:, 0]
        tgt = jnp.take_along_axis(raw, t_i[:, None], axis=-1)[:, 0].astype(jnp.float32)
        loss_sum = jnp.sum(jnp.where(ok, lse - tgt, 0.0))
        if not with_grad:
            return dw_t, (loss_sum, jnp.zeros((0,), jnp.float32))
        # d(lse - tgt)/dlogits = softmax - onehot, zero on padded rows,
        # of the *mean*: the 1/M folds into this pass instead of two more passes over dh and dW
        dlogits = (e * (1.0 / s) - jax.nn.one_hot(t_i, Vc, dtype=jnp.float32)) * (1.0 / M)
        dlogits = jnp.where(ok[:, None], dlogits, 0.0).astype(dtype)
        dh_i = ops._dot(dlogits, w_c, dtype, precision)  # (rows, V) @ (V, C)
        if not cpu:  # (V, rows) @ (rows, C): dW as W is laid out, the transpose folded into the GEMM (no pass)
            dw_i = ops._dot(dlogits.T, h_i, dtype, precision)
            dw_t = dw_t + dw_i if Vc == V else lax.dynamic_update_slice(dw_t, dw_t[:Vc] + dw_i, (0, 0))
            return dw_t, (loss_sum, dh_i)
        # CPUs: (C, rows) @ (rows, V), added in place into the real columns; the padded columns' dW stays 0. A real
        # copy of h_i^T in fp32 too: the transposed-operand dot measured ~10% slower at this short contraction
        dw_i = ops._dot(ops.materialize_transpose(h_i), dlogits, dtype, precision)
        dw_t = dw_t + dw_i if Vc == V else lax.dynamic_update_slice(dw_t, dw_t[:, :Vc] + dw_i, (0, 0))
        return dw_t, (loss_sum, dh_i)

    cpu = ops.platform() == "cpu"
    dw_t0 = jnp.zeros(((C, V) if cpu else (V, C)) if with_grad else (0,), jnp.float32)
    dw_t, (loss_sums, dh) = lax.scan(chunk, dw_t0, (hc, tc, valid_row, *e4m3_xs))
    loss_sum = jnp.sum(loss_sums)
    if not with_grad:
        return loss_sum
    # CPUs: the barrier keeps XLA from folding this transpose into the dW dot (with one chunk the scan is inlined,
    # and a bf16 dot with a transposed operand then has no CPU kernel at all)
    dw = lax.optimization_barrier(dw_t).T if cpu else dw_t
    return loss_sum, dh.reshape(-1, C)[:M], dw


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _fused_ce(h, w, targets, vocab_size, dtype, precision, fp8=False, logits_dtype=jnp.float32, lm_head="plain"):
    return _ce_pass(h, w, targets, vocab_size, dtype, precision, with_grad=False, fp8=fp8,
                    logits_dtype=logits_dtype, lm_head=lm_head) / h.shape[0]


def _fused_ce_fwd(h, w, targets, vocab_size, dtype, precision, fp8=False, logits_dtype=jnp.float32, lm_head="plain"):
    with jax.named_scope("cross_entropy"):  # custom_vjp's forward is traced outside the caller's scopes
        loss_sum, dh, dw = _ce_pass(h, w, targets, vocab_size, dtype, precision, with_grad=True, fp8=fp8,
                                    logits_dtype=logits_dtype, lm_head=lm_head)
    return loss_sum / h.shape[0], (dh, dw, targets)


def _fused_ce_bwd(vocab_size, dtype, precision, fp8, logits_dtype, lm_head, res, g):
    dh, dw, targets = res
    with jax.named_scope("cross_entropy"):
        return (g * dh).astype(jnp.float32), (g * dw).astype(jnp.float32), None


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def lm_head_cross_entropy(
    h: Float[Array, "batch seq embed"],
    w: Float[Array, "vocab_rows embed"],
    targets: Int[Array, "batch seq"],
    *,
    vocab_size: int,
    dtype,
    precision=None,
    fp8: bool = False,
    logits_dtype=jnp.float32,
    lm_head: LmHead = "plain",
) -> Float[Array, ""]:
    """Mean next-token cross-entropy of the tied lm_head ``logits = h @ w^T`` over the first ``vocab_size``
    columns, in fp32; the same value as ``cross_entropy(logits[..., :vocab_size], targets)``. ``fp8``: the logits
    GEMM with e4m3 operands (jaxgpt.kernels.fp8), its backward GEMMs in ``dtype``. ``logits_dtype``: what the logits
    GEMM writes, fp32 (exact) or bf16 (torch.autocast's bf16 lm_head output: the loss and its gradient computed in fp32
    from the rounded logits; :func:`_head_logits`). ``lm_head``: "pallas" computes the row max and sum of exp in
    the logits GEMM's epilogue on GPUs (:func:`logits_lse`; bf16 logits), "plain" in a pass of their own."""
    C = h.shape[-1]
    return _fused_ce(h.reshape(-1, C).astype(jnp.float32), w, targets.reshape(-1), vocab_size,
                     jnp.dtype(dtype), precision, fp8, _logits_dtype(logits_dtype), lm_head)


def token_cross_entropy(
    h: Float[Array, "batch seq embed"],
    w: Float[Array, "vocab_rows embed"],
    targets: Int[Array, "batch seq"],
    *,
    vocab_size: int,
    dtype,
    precision=None,
    fp8: bool = False,
    logits_dtype=jnp.float32,
) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"]]:
    """Each token's cross-entropy ``logsumexp(logits) - logits[target]`` of the tied lm_head ``logits = h @ w^T``
    over the first ``vocab_size`` columns, in fp32, and whether the target has the largest logit (greedy decoding
    would pick it): what evaluation scores with, without the gradient. Chunked like
    :func:`lm_head_cross_entropy`, so the (tokens, vocab) fp32 logits never exist whole; ``logits_dtype`` as
    there."""
    B, T, C = h.shape
    logits_dtype = _logits_dtype(logits_dtype)
    M = B * T
    rows = _chunk_rows(M, w.shape[0], fp8=fp8)
    n_chunks = math.ceil(M / rows)
    pad = n_chunks * rows - M
    hc = jnp.pad(h.reshape(M, C).astype(dtype), ((0, pad), (0, 0))).reshape(n_chunks, rows, C)
    tc = jnp.pad(targets.reshape(M), (0, pad)).reshape(n_chunks, rows)
    w_c, mask_padded = _head_rows(w, vocab_size, dtype)
    e4m3_xs, logits_operands, logits_scale = _e4m3_head(h.reshape(M, C), w_c, pad, hc.shape, dtype, fp8)

    def chunk(inp):
        h_i, t_i, *hq_i = inp
        raw, logits = _scaled(logits_scale, *_head_logits(*logits_operands(h_i, *hq_i),
                                                          _head_precision(precision, fp8), logits_dtype, mask_padded))
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(raw, t_i[:, None], axis=-1)[:, 0].astype(jnp.float32)
        return lse - tgt, tgt >= jnp.max(logits, axis=-1)

    losses, greedy = lax.map(chunk, (hc, tc, *e4m3_xs))
    return losses.reshape(-1)[:M].reshape(B, T), greedy.reshape(-1)[:M].reshape(B, T)


def cross_entropy(logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"]) -> Float[Array, ""]:
    """The reference: mean of -log softmax(logits)[target], computed in fp32."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # fp32 (fp64 stays)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - target_logit)


def apply(h: Float[Array, "batch seq embed"], w: Float[Array, "vocab_rows embed"], targets: Int[Array, "batch seq"],
          logits, *, vocab_size: int, policy, impl: str) -> Float[Array, ""]:
    """The tied lm_head and the mean cross-entropy under ``policy`` with ``impl`` (``Policy.kernels.loss``): with
    ``fast_kernels`` :func:`lm_head_cross_entropy` (the same value, the fp32 logits never materialised whole; "pallas":
    the row max and sum of exp in the logits GEMM's epilogue on GPUs), else ``cross_entropy(logits(h), targets)``."""
    if not policy.fast_kernels:
        return cross_entropy(logits(h), targets)
    return lm_head_cross_entropy(h, w, targets, vocab_size=vocab_size, dtype=policy.dtype,
                                 logits_dtype=policy.logits_dtype, precision=policy.lax_precision,
                                 fp8=policy.fp8_on("lm_head"), lm_head="pallas" if impl == "pallas" else "plain")
