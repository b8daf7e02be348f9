"""The accountant's view of the devices: the device table of :mod:`jaxgpt.devices` (re-exported: accelerators,
peaks by matmul dtype, the CPU's measured peak, MFU), the peak and attention a precision policy picks, and the
floating-point formats' ranges."""

from __future__ import annotations

import dataclasses

from jaxgpt.devices import (  # noqa: F401  (re-exported: jaxgpt.account's public names)
    ALIASES,
    DEVICES,
    CPUPeak,
    DeviceSpec,
    cpu_memory_bytes,
    device_from_kind,
    measure_cpu_peak,
    MixedPeak,
    fp8_peak,
    mfu,
    mixed_peak,
    peak_flops,
    resolve_device,
    resolve_dtype,
)

_device_from_kind = device_from_kind  # its name before jaxgpt.devices (benchmarks/gpu/bench.py reads it)


def default_matmul_dtype(precision: str, device: str) -> str:
    """bf16 policy -> bf16 peak. fp8 -> bf16 for everything that is not an e4m3 GEMM (the account prices those
    at the fp8 peak: :func:`jaxgpt.devices.mixed_peak`). fp32 policy -> tf32 on A100/H100/H200 (JAX's default matmul
    precision runs float32 dots on TF32 tensor cores there; ``Policy(matmul_precision="highest")`` would need fp32),
    fp32 on CPU."""
    if precision in ("bf16", "fp8"):
        return "bf16"
    return "fp32" if resolve_device(device) == "cpu" else "tf32"


def default_attention(precision: str, device: str) -> str:
    """What ``kernels.attention: auto`` picks: cuDNN fused attention on GPU with bf16 compute (fp8's included),
    jaxgpt.ops' einsum kernel on CPU, XLA's path otherwise."""
    if resolve_device(device) == "cpu":
        return "einsum"
    return "cudnn" if precision in ("bf16", "fp8") else "xla"


# ---- data types -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DTypeInfo:
    name: str
    bits: int
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int  # explicit fraction bits (the leading 1 is implicit)
    max: float
    smallest_normal: float
    eps: float  # distance from 1.0 to the next representable number


def dtype_table() -> list[DTypeInfo]:
    """fp32, fp16, bf16, fp8 e4m3 (``float8_e4m3fn``: no infinities, max 448) and fp8 e5m2, from
    ``jnp.finfo`` (ml_dtypes)."""
    import jax.numpy as jnp

    rows = []
    for name, dt in [("fp32", jnp.float32), ("fp16", jnp.float16), ("bf16", jnp.bfloat16),
                     ("fp8 e4m3", jnp.float8_e4m3fn), ("fp8 e5m2", jnp.float8_e5m2)]:
        fi = jnp.finfo(dt)
        rows.append(DTypeInfo(name=name, bits=int(fi.bits), sign_bits=1, exponent_bits=int(fi.nexp),
                              mantissa_bits=int(fi.nmant), max=float(fi.max),
                              smallest_normal=float(fi.smallest_normal), eps=float(fi.eps)))
    return rows
