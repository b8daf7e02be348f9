"""The accelerators jaxgpt knows (dense peak FLOP/s by matmul dtype, memory, bandwidth, price) and this machine's
CPU (its GEMM peak measured on the spot, its RAM): the one device table that :mod:`jaxgpt.account`,
:mod:`jaxgpt.compile` and :mod:`jaxgpt.train` read. It imports nothing of jaxgpt but :mod:`jaxgpt.config` (for the
error type), so every package can sit above it."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any, Mapping

from jaxgpt.config import ConfigError

GiB = 1 << 30
MATMUL_DTYPES = ("fp32", "tf32", "bf16", "fp8")


class DeviceError(ConfigError):
    """A device or matmul dtype the table does not have (the message says what it has). Also a bad argument to the
    accountant: :class:`jaxgpt.account.AccountError` is this class."""


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Dense peak FLOP/s by matmul dtype, memory and bandwidth of one accelerator."""

    name: str
    description: str
    peak: Mapping[str, float | None]  # fp32 (no tensor cores), tf32, bf16, fp8; dense, not 2:4 sparse
    memory_bytes: int
    bandwidth_bytes_s: float | None
    dollars_per_hour: float
    source: str


DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): A100 80GB SXM: FP32 19.5 TFLOPS, TF32 156 TFLOPS
    # (312 with sparsity), BF16 312 TFLOPS (624 with sparsity), no FP8 (Ampere has no fp8 tensor cores: XLA runs
    # an e4m3 GEMM there on upcast operands, so mixed_peak prices precision: fp8's e4m3 FLOPs at the bf16 peak);
    # 80GB HBM2e, 2,039 GB/s.
    "a100-sxm-80gb": DeviceSpec(
        "a100-sxm-80gb", "NVIDIA A100 SXM4 80GB",
        {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp8": None},
        80 * GiB, 2039e9, 1.79, "NVIDIA A100 datasheet"),
    # NVIDIA H100 Tensor Core GPU datasheet: H100 SXM: FP32 67 TFLOPS, TF32 989 / BF16 1,979 / FP8 3,958
    # TFLOPS *with sparsity*; dense = half, as in the H100 architecture whitepaper (494.7 / 989.4 / 1978.9);
    # fp8 = E4M3 (and E5M2) tensor-core GEMMs, twice the bf16 rate; 80GB HBM3, 3.35 TB/s.
    "h100-sxm": DeviceSpec(
        "h100-sxm", "NVIDIA H100 SXM5 80GB",
        {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp8": 1978.9e12},
        80 * GiB, 3.35e12, 2.99, "NVIDIA H100 datasheet (sparse figures / 2) and H100 whitepaper"),
    # Same datasheet, H100 PCIe: FP32 51 TFLOPS, TF32 756 / BF16 1,513 / FP8 3,026 TFLOPS with sparsity
    # (dense 378 / 756 / 1513); 80GB HBM2e, 2 TB/s.
    "h100-pcie": DeviceSpec(
        "h100-pcie", "NVIDIA H100 PCIe 80GB",
        {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp8": 1513e12},
        80 * GiB, 2.0e12, 2.49, "NVIDIA H100 datasheet (sparse figures / 2)"),
    # NVIDIA H200 Tensor Core GPU datasheet: H200 SXM: FP32 67 TFLOPS, TF32 989 / BF16 1,979 / FP8 3,958
    # TFLOPS with sparsity (same GH100 compute as H100 SXM; dense = half); 141GB HBM3e, 4.8 TB/s.
    "h200": DeviceSpec(
        "h200", "NVIDIA H200 SXM 141GB",
        {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp8": 1978.9e12},
        141 * 10**9, 4.8e12, 3.79, "NVIDIA H200 datasheet (sparse figures / 2)"),
    # Measured on the spot by measure_cpu_peak(); memory is this machine's RAM.
    "cpu": DeviceSpec("cpu", "this machine's CPU (GEMM probe)", {}, 0, None, 0.0, "measured: measure_cpu_peak()"),
}
# Prices are rough 2025 on-demand single-GPU list prices; they vary ~2x between providers: pass
# --dollars-per-hour for your own.
ALIASES = {"a100": "a100-sxm-80gb", "a100-sxm": "a100-sxm-80gb", "a100-80gb": "a100-sxm-80gb",
           "h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200"}
_DTYPE_ALIASES = {"float32": "fp32", "f32": "fp32", "bfloat16": "bf16", "float8": "fp8",
                  "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def device_from_kind(kind: str) -> str | None:
    """The table key of a ``jax.Device.device_kind`` (e.g. "NVIDIA H100 80GB HBM3" -> "h100-sxm"); None if unknown."""
    k = kind.lower()
    if "a100" in k:
        return "a100-sxm-80gb"
    if "h200" in k:
        return "h200"
    if "h100" in k:
        return "h100-pcie" if "pcie" in k else "h100-sxm"
    if "cpu" in k:
        return "cpu"
    return None


def resolve_device(device: Any) -> str:
    """A device table key from a name, an alias, or a ``jax.Device`` (matched on its ``device_kind``)."""
    if not isinstance(device, str):
        platform = getattr(device, "platform", None)
        kind = getattr(device, "device_kind", "")
        name = "cpu" if platform == "cpu" else device_from_kind(str(kind))
        if name is None:
            raise DeviceError(f"device {kind!r} is not in the peak table; valid devices are {sorted(DEVICES)}")
        return name
    key = device.lower().strip()
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        raise DeviceError(f"unknown device {device!r}; valid devices are {sorted(DEVICES)} "
                           f"(aliases: {sorted(ALIASES)})")
    return key


def resolve_dtype(dtype: str) -> str:
    """A :data:`MATMUL_DTYPES` name from a name or an alias (float32, bfloat16, float8_e4m3fn, ...)."""
    d = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if d not in MATMUL_DTYPES:
        raise DeviceError(f"unknown matmul dtype {dtype!r}; valid dtypes are {list(MATMUL_DTYPES)}")
    return d


@dataclasses.dataclass(frozen=True)
class CPUPeak:
    """Measured GEMM FLOP/s of this CPU: fp32 operands, and bf16 operands with fp32 accumulation.
    ``float(peak)`` is the fp32 figure."""

    fp32: float
    bf16: float
    n: int
    seconds: float

    def __float__(self) -> float:
        return self.fp32

    def get(self, dtype: str) -> float:
        return self.bf16 if dtype == "bf16" else self.fp32


def _probe(n: int, dtype_name: str, seconds: float) -> float:
    import jax
    import jax.numpy as jnp

    dt = jnp.float32 if dtype_name == "fp32" else jnp.bfloat16
    a = jax.random.normal(jax.random.key(0), (n, n), dt)
    b = jax.random.normal(jax.random.key(1), (n, n), dt)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()  # compile and warm up
    best, t_end = math.inf, time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return 2.0 * n**3 / best


@functools.lru_cache(maxsize=None)
def measure_cpu_peak(seconds: float = 0.5, n: int = 1024) -> CPUPeak:
    """Time ``jnp.dot`` of two (n, n) matrices (fp32 inputs, then bf16 inputs with
    ``preferred_element_type=float32``), best of ~``seconds`` each; FLOP/s = 2 n^3 / best time.
    Cached per process (the train loop and the benchmark harness call it repeatedly)."""
    t0 = time.perf_counter()
    fp32 = _probe(n, "fp32", seconds)
    bf16 = _probe(n, "bf16", seconds)
    return CPUPeak(fp32=fp32, bf16=bf16, n=n, seconds=time.perf_counter() - t0)


def cpu_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def peak_flops(device: Any, dtype: str) -> float:
    """Dense peak FLOP/s of ``device`` (a name from :data:`DEVICES`, an alias, or a ``jax.Device``) for
    matmuls in ``dtype`` (fp32, tf32, bf16, fp8; float32/bfloat16 accepted). ``cpu`` is measured
    (:func:`measure_cpu_peak`; tf32 means fp32 there). Raises :class:`DeviceError` when the device has no
    such mode (fp8 on A100 or CPU)."""
    name = resolve_device(device)
    d = resolve_dtype(dtype)
    if name == "cpu":
        if d == "fp8":
            raise DeviceError("device 'cpu' has no fp8 matmul peak; use fp32 or bf16")
        return measure_cpu_peak().get(d)
    value = DEVICES[name].peak[d]
    if value is None:
        have = [k for k, v in DEVICES[name].peak.items() if v is not None]
        raise DeviceError(f"device {name!r} has no {d} matmul peak; it has {have}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class MixedPeak:
    """The peak of a step whose GEMMs run at two rates (``precision: fp8``): ``e4m3_flops`` with e4m3 operands at
    the device's dense fp8 peak, ``other_flops`` (the rest: backward, attention's QK^T and PV, the GEMMs fp8_gemms
    leaves out) at the ``other_dtype`` peak (bf16). The ideal time is the sum over both classes,
    ``e4m3_flops / fp8_peak + other_flops / other_peak``, and :attr:`peak` the FLOPs over that time (the
    FLOP-weighted harmonic mean of the two peaks). MFU against it (:meth:`mfu`) is the ideal time over the step's
    time: not inflated, as dividing every FLOP by the bf16 peak would be, nor deflated, as dividing every FLOP by
    the fp8 peak would be. ``fp8_native`` False: the device has no fp8 tensor cores (A100, the CPU), its e4m3 GEMMs
    run on upcast operands, and ``fp8_peak`` is the ``other_dtype`` peak (so :attr:`peak` is that peak)."""

    device: str
    e4m3_flops: float
    other_flops: float
    fp8_peak: float  # the rate the e4m3 FLOPs are priced at (the other_dtype peak where fp8_native is False)
    other_peak: float
    other_dtype: str = "bf16"
    fp8_native: bool = True

    @property
    def flops(self) -> float:
        return self.e4m3_flops + self.other_flops

    @property
    def ideal_time_s(self) -> float:
        """Both classes at their dense peaks, one after the other."""
        return self.e4m3_flops / self.fp8_peak + self.other_flops / self.other_peak

    @property
    def peak(self) -> float:
        """The blended peak: all the FLOPs over :attr:`ideal_time_s`."""
        return self.flops / self.ideal_time_s if self.flops else self.other_peak

    def mfu(self, step_time_s: float) -> float:
        if step_time_s <= 0:
            raise DeviceError(f"step_time_s = {step_time_s!r}: must be > 0")
        return self.ideal_time_s / step_time_s

    def note(self) -> str:
        """One line: the two classes, their peaks, the ideal time and the blended peak (or the fallback)."""
        fp8 = (f"fp8 dense peak {self.fp8_peak / 1e12:,.1f}" if self.fp8_native else
               f"{self.other_dtype} peak {self.fp8_peak / 1e12:,.1f} ({self.device} has no fp8 tensor cores: e4m3 "
               f"GEMMs run upcast, no fp8 gain)")
        return (f"{self.e4m3_flops / 1e12:,.3f} TFLOP in e4m3 at the {fp8} + {self.other_flops / 1e12:,.3f} TFLOP in "
                f"{self.other_dtype} at {self.other_peak / 1e12:,.1f} TFLOP/s = ideal "
                f"{self.ideal_time_s * 1e3:,.2f} ms; blended peak {self.peak / 1e12:,.1f} TFLOP/s")


def fp8_peak(device: Any, fallback: str = "bf16") -> tuple[float, bool]:
    """(the rate e4m3 GEMMs run at on ``device``, whether it is a native fp8 peak): the table's dense fp8 peak, or,
    on a device without fp8 tensor cores (A100, the CPU), the ``fallback`` dtype's peak and False."""
    name = resolve_device(device)
    native = DEVICES[name].peak.get("fp8") if name != "cpu" else None
    if native is not None:
        return float(native), True
    return peak_flops(name, fallback), False


def mixed_peak(device: Any, e4m3_flops: float, other_flops: float, other_dtype: str = "bf16") -> MixedPeak:
    """The :class:`MixedPeak` of a step with ``e4m3_flops`` in e4m3 GEMMs and ``other_flops`` in ``other_dtype``
    ones on ``device`` (e.g. from :meth:`jaxgpt.flops.FlopCount.training_per_step_by_dtype`)."""
    if e4m3_flops < 0 or other_flops < 0:
        raise DeviceError(f"FLOPs must be >= 0 (got e4m3 {e4m3_flops!r}, {other_dtype} {other_flops!r})")
    name = resolve_device(device)
    other = peak_flops(name, other_dtype)
    f8, native = fp8_peak(name, other_dtype)
    return MixedPeak(name, float(e4m3_flops), float(other_flops), f8, other, resolve_dtype(other_dtype), native)


def mfu(flops_per_step: float, step_time_s: float, device: Any, dtype: str) -> float:
    """Model FLOPs utilisation: achieved FLOP/s (``flops_per_step / step_time_s``) over the dense peak."""
    if step_time_s <= 0:
        raise DeviceError(f"step_time_s = {step_time_s!r}: must be > 0")
    return flops_per_step / step_time_s / peak_flops(device, dtype)
