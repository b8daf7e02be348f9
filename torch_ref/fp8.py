"""torch_ref's twin of ``jaxgpt/kernels/fp8.py``: forward GEMMs with float8_e4m3fn operands, the same rounding.

Each operand is cast to the compute dtype (bf16 under ``torch.autocast``, else fp32), scaled by the power of two
``2**e`` with ``amax / 448 = m 2**e`` (``torch.frexp``; ``amax / scale`` in [224, 448); NaN scale for a non-finite
amax), clipped to +-448 and rounded to nearest even by ``.to(torch.float8_e4m3fn)``: the same scale and the same
rounding as jaxgpt. The GEMM accumulates in fp32:

* on the CPU (and any device without fp8 GEMMs) the e4m3 values times their scales, exactly representable in
  bf16 and fp32, go through an fp32 matmul: e4m3 x e4m3 products are exact in fp32, so only the summation order
  differs from a real fp8 GEMM;
* on a CUDA GPU with fp8 tensor cores (compute capability >= 8.9), ``torch._scaled_mm`` with the two scales and an
  fp32 output, where its shape rules allow (K and N multiples of 16: :func:`_scaled_mm_ok`; else the emulation).
  That path has not run here (no GPU on the machine this was written on); its guard is tested against torch's
  own shape checks (the meta registration of ``_scaled_mm``) on the CPU.

The backward is straight-through in the compute dtype, as jaxgpt's: ``dx = g @ w^T`` and ``dw = x^T @ g`` of the
unrounded (compute-dtype) operands with fp32 accumulation.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# the same GEMM selections as jaxgpt.kernels.fp8.GEMM_SETS
GEMM_SETS = {"none": frozenset(), "lm_head": frozenset({"lm_head"}), "mlp": frozenset({"mlp"}),
             "mlp+lm_head": frozenset({"mlp", "lm_head"}), "all": frozenset({"attn", "mlp", "lm_head"})}


def compute_dtype(device_type: str) -> torch.dtype:
    """The dtype matmul operands get here: autocast's (bf16) inside ``torch.autocast``, else fp32."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else torch.float32


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float()
    _, e = torch.frexp(amax / E4M3_MAX)
    scale = torch.ldexp(torch.ones((), device=amax.device), e)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale) of ``x``: ``x ~ q * scale``."""
    scale = scale_of(x.abs().max())
    return (x / scale.to(x.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def _has_fp8_gemm(device: torch.device) -> bool:
    """A CUDA GPU with fp8 tensor cores (compute capability >= 8.9: Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` takes ``x (M, K) @ w (K, N)`` as :func:`_forward` lays it out. torch 2.13's
    checks for a CUDA ``_scaled_mm`` (``_meta_registrations._check_scaled_mm_sizes``): 2-D fp8 operands, ``self``
    row-major and ``mat2`` column-major, ``K`` and both dimensions of ``mat2`` (``K``, ``N``) divisible by 16, and for
    per-tensor scales two fp32 scalars. _forward builds the layouts, dtypes and scales; the shapes are the model's:
    GPT-2's lm_head (N = 50257) and the char model's (N = 65) fail them and take the emulation, as does every GEMM
    off a device with fp8 tensor cores."""
    return x.shape[-1] % 16 == 0 and w.shape[-1] % 16 == 0 and _has_fp8_gemm(x.device)


def _forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    (xq, sx), (wq, sw) = quantize(x), quantize(w)
    if _scaled_mm_ok(x, w):  # cuBLASLt's fp8 GEMM: b column-major, per-tensor scales, fp32 output
        return torch._scaled_mm(xq, wq.t().contiguous().t(), scale_a=sx, scale_b=sw, out_dtype=torch.float32)
    return (xq.float() * sx) @ (wq.float() * sw)


class _FP8MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, dtype):
        xc, wc = x.to(dtype), w.to(dtype)
        ctx.save_for_backward(xc, wc)
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return _forward(xc.reshape(-1, xc.shape[-1]), wc).reshape(*x.shape[:-1], w.shape[-1])

    @staticmethod
    def backward(ctx, g):
        xc, wc = ctx.saved_tensors
        dtype = xc.dtype
        g2 = g.reshape(-1, g.shape[-1]).to(dtype).float()  # compute-dtype operands, fp32 accumulation
        dx = (g2 @ wc.float().t()).reshape(*xc.shape[:-1], wc.shape[0])
        dw = xc.reshape(-1, xc.shape[-1]).float().t() @ g2
        return dx.to(ctx.x_dtype), dw.to(ctx.w_dtype), None


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` with e4m3 operands (after the cast to the compute dtype), fp32 accumulation and result; backward
    in the compute dtype (straight-through). Runs with autocast off inside: its dtypes are its own."""
    dtype = compute_dtype(x.device.type)
    with torch.autocast(x.device.type, enabled=False):
        return _FP8MatMul.apply(x, w, dtype)
