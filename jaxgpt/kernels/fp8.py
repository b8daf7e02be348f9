"""fp8 forward GEMMs (``precision: fp8``): operands rounded to float8_e4m3fn with per-tensor current scaling.

What one fp8 GEMM ``x @ w`` does here (and, rounding for rounding, in ``torch_ref.fp8``):

1. each operand is cast to the policy's compute dtype (bf16), then its scale is taken from its own amax *at this
   call* (current scaling): ``scale = 2**e`` with ``amax / 448 = m 2**e``, ``m`` in [0.5, 1) (``frexp``), so
   ``amax / scale`` lies in [224, 448), 448 being e4m3's largest finite value;
2. ``q = e4m3(clip(x / scale, -448, 448))``, round to nearest even (flax.linen.fp8_ops.quantize);
3. ``y = (q_x @ q_w) * (scale_x * scale_w)``: the e4m3 operands go into the dot itself, with fp32 accumulation
   (``Precision.HIGHEST``: see below) and an fp32 result, and the product of the two scales multiplies that
   result; mathematically ``(q_x * scale_x) @ (q_w * scale_w)``.

Power-of-two scales make the scaling exact: ``x / scale`` only moves the exponent, so the one rounding is e4m3's
(3 mantissa bits: a relative error of at most 2**-4, 2**-3 ... for e4m3's subnormals below 2**-6 of the scale), and
the dequantized operand is exactly representable in bf16. So on a CPU the same numbers come out of a bf16 (or fp32)
GEMM of the dequantized operands: e4m3 x e4m3 products carry at most 8 significant bits and are exact in fp32.
A tensor whose amax is not finite gets a NaN scale: an overflow upstream shows as NaN, it is not clipped to 448.

The backward is bf16, straight-through: :func:`matmul`'s custom VJP differentiates the bf16 GEMM of the bf16
operands (``jaxgpt.ops.matmul``'s backward), as if the forward had not been quantized. The lm_head's fused loss
(``jaxgpt.kernels.loss.lm_head_cross_entropy(..., fp8=True)``) does the same: e4m3 logits GEMM, bf16 backward GEMMs.

On GPUs this is one cuBLASLt fp8 GEMM per layer (``__cublas$lt$matmul$f8``): XLA:GPU's GEMM rewriter takes a dot
of e4m3 operands and folds the multiply by the scales into the call's scale operand. Two things make it so:

* :func:`compiler_options` (the train and eval steps, :mod:`jaxgpt.step`, and the decoder of :mod:`jaxgpt.generate`
  are jitted with them): XLA's Triton GEMM emitter off for programs with fp8 GEMMs. XLA:GPU's GEMM fusion pass runs
  before the cuBLAS GEMM rewriter and claims every e4m3 dot (alone, transposed, dequantized or not) as a Triton GEMM
  fusion; only the autotuner on a GPU may hand one back to cuBLAS, so the program compiled here (compile-only, no
  autotuning) and the one a GPU runs could differ. With the option the fp8 program is cuBLAS everywhere, on the GPU
  as compiled here.
* ``Precision.HIGHEST`` on the e4m3 dot: XLA turns on cuBLASLt's fp8 fast accumulation
  (``CUBLASLT_MATMUL_DESC_FAST_ACCUM``, partial sums not promoted to fp32) for a dot of DEFAULT precision;
  HIGHEST keeps fp32 accumulation, as ``torch._scaled_mm``'s default in torch_ref does. On the CPU the
  precision of an e4m3 dot changes nothing (fp32 products of 4-bit significands, exact).

Dequantizing first (convert(f8 -> bf16) x scale -> dot, flax.linen.fp8_ops' form) would also be rewritten into a
cuBLASLt fp8 GEMM with the Triton emitter off, but with it on XLA:GPU removed the bf16 -> f8 -> bf16 convert pair
(excess precision allowed, its default) and ran a bf16 GEMM: the direct form is an e4m3 GEMM either way.

Current scaling keeps no state: nothing is added to the training state, so checkpoints, exact resume, gradient
accumulation and FSDP meshes need nothing new (the amax of a sharded tensor is a global reduction XLA inserts).
Parameters and optimizer state stay fp32.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jaxtyping import Array, Float

from jaxgpt import ops

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
# Which GEMMs ``precision: fp8`` runs in e4m3 (Policy.fp8 / TrainConfig.fp8_gemms): the attention projections
# (c_attn, attn.c_proj), the MLP's two (c_fc, mlp.c_proj), the tied lm_head. Attention's own QK^T and PV GEMMs stay
# bf16 (cuDNN's fused kernel on GPUs) in every setting.
Gemms = Literal["none", "lm_head", "mlp", "mlp+lm_head", "all"]
GEMM_SETS: dict[str, frozenset[str]] = {
    "none": frozenset(), "lm_head": frozenset({"lm_head"}), "mlp": frozenset({"mlp"}),
    "mlp+lm_head": frozenset({"mlp", "lm_head"}), "all": frozenset({"attn", "mlp", "lm_head"}),
}
GemmKind = Literal["attn", "mlp", "lm_head"]
DEFAULT_GEMMS = "all"  # what ``precision: fp8`` alone selects


def scale_of(amax: Float[Array, ""]) -> Float[Array, ""]:
    """The power-of-two scale with ``amax / scale`` in [224, 448) (1 for an all-zero tensor, NaN for a non-finite
    amax), in fp32."""
    amax = amax.astype(jnp.float32)
    _, e = jnp.frexp(amax / E4M3_MAX)
    scale = jnp.ldexp(jnp.float32(1.0), e)
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan).astype(jnp.float32)


def quantize(x: Float[Array, "..."]) -> tuple[Array, Float[Array, ""]]:
    """(e4m3 values, fp32 scale) of ``x`` with per-tensor current scaling: ``x ~ q * scale``."""
    scale = scale_of(jnp.max(jnp.abs(x)))
    return fp8_ops.quantize(x, E4M3, scale, x.dtype), scale


def dequantize(q: Array, scale: Float[Array, ""], dtype) -> Float[Array, "..."]:
    """``q * scale`` in ``dtype`` (exact for bf16 and fp32: a power-of-two scale of a 4-significant-bit value)."""
    return fp8_ops.dequantize(q, jnp.dtype(dtype), scale)


def round_e4m3(x: Float[Array, "..."], dtype) -> Float[Array, "..."]:
    """``x`` cast to ``dtype`` and rounded to its e4m3 grid (quantize, then dequantize), in ``dtype``."""
    xc = x.astype(dtype)
    q, scale = quantize(xc)
    return dequantize(q, scale, dtype)


def e4m3_dot(a: Array, b: Array, dimension_numbers=(((1,), (0,)), ((), ()))) -> Float[Array, "..."]:
    """The dot of two e4m3 operands with fp32 accumulation and an fp32 result (HIGHEST: no cuBLASLt fast
    accumulation on GPUs)."""
    return jax.lax.dot_general(a, b, dimension_numbers, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def compiler_options(gemms: str, platform: str) -> dict[str, Any]:
    """The XLA options of a program whose forward GEMMs ``gemms`` (:data:`GEMM_SETS`) are e4m3, compiled for
    ``platform``: on GPUs the Triton GEMM emitter off, so each e4m3 dot is a cuBLASLt fp8 GEMM (the module
    docstring says why); nothing elsewhere and for programs without fp8 GEMMs (their programs do not change)."""
    if platform != "gpu" or not GEMM_SETS[gemms]:
        return {}
    return {"xla_gpu_enable_triton_gemm": False}


def _forward(x, w, dtype, precision):
    xc, wc = x.astype(dtype), w.astype(dtype)
    (qx, sx), (qw, sw) = quantize(xc), quantize(wc)
    # the e4m3 operands go into the dot itself, the scales multiply its fp32 result (on GPUs: a cuBLASLt fp8 GEMM
    # with the scales as its scale operand, see the module docstring; the policy's precision is for its bf16
    # backward)
    y = e4m3_dot(qx, qw) * (sx * sw)
    return y, (xc, wc, jnp.zeros((), x.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul2d(x, w, dtype, precision):
    return _forward(x, w, dtype, precision)[0]


def _matmul2d_bwd(dtype, precision, res, g):
    xc, wc, x_like = res
    # the bf16 GEMMs of the unquantized operands (jaxgpt.ops.matmul's backward; its forward dot is dead code)
    _, pullback = jax.vjp(lambda a, b: ops.matmul(a, b, dtype=dtype, precision=precision), xc, wc)
    dx, dw = pullback(g)
    return dx.astype(x_like.dtype), dw.astype(jnp.float32)


_matmul2d.defvjp(_forward, _matmul2d_bwd)


def matmul(x: Float[Array, "... d_in"], w: Float[Array, "d_in d_out"], *, dtype=jnp.bfloat16,
           precision=None) -> Float[Array, "... d_out"]:
    """``x @ w`` with both operands rounded to e4m3 (per-tensor current scaling, after a cast to ``dtype``), fp32
    accumulation and result; the backward is ``dtype``'s GEMMs of the unrounded operands (straight-through)."""
    lead = x.shape[:-1]
    y = _matmul2d(x.reshape(-1, x.shape[-1]), w, jnp.dtype(dtype), precision)
    return y.reshape(*lead, w.shape[-1])


def scales_bytes(n_gemms: int) -> int:
    """Memory of the scales of ``n_gemms`` fp8 GEMMs: two fp32 scalars each, recomputed every call (nothing kept
    between steps, nothing checkpointed)."""
    return 2 * 4 * n_gemms
