"""A step time predicted from a compiled program's kernels: each kernel's roofline time
``max(FLOPs / peak, bytes / bandwidth)``, times its launches per step, summed.

It is a lower bound on time from a compiled program, not a measurement: every kernel is assumed to run at the
device's peak matmul rate or its full memory bandwidth, whichever binds, with no launch gaps, no tail effects,
no cache reuse between kernels and perfect overlap of collectives with nothing (collectives are costed at HBM
bandwidth only: on one host NVLink moves less, so they are bounded below too). GEMM tiles are untuned in a
compile-only build (no GPU to autotune on), which this bound does not see either.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jaxgpt.compile.hlo import Kernel

# the table's rows, in reading order (a category no kernel falls in is left out)
CATEGORIES = ["matmuls fwd", "matmuls bwd", "attention fwd (cuDNN)", "attention bwd (cuDNN)", "attention (einsum)",
              "attention: casts, layout",
              "lm_head + cross-entropy", "LayerNorm", "GELU", "embedding", "optimizer", "copies / layout",
              "other elementwise", "collectives"]


@dataclasses.dataclass(frozen=True)
class Peaks:
    """What the roofline divides by: matmul peaks by operand dtype, the vector (non-matmul) rate, bandwidth."""

    name: str
    matmul: dict[str, float]  # "bf16", "f32" (as the program runs fp32 dots), "f8..."
    vector: float  # FLOP/s of non-matmul arithmetic
    bandwidth: float  # bytes/s

    def matmul_peak(self, dtype: str | None) -> float:
        if dtype is None:
            return self.vector
        if dtype in self.matmul:
            return self.matmul[dtype]
        return self.matmul.get("f8" if dtype.startswith("f8") else "f32", self.vector)


def gpu_peaks(target, *, fp32_dots: str = "tf32") -> Peaks:
    """Dense peaks of a :class:`~jaxgpt.compile.targets.GpuTarget` (jaxgpt.devices' table). fp32 dots run as
    TF32 on tensor cores under JAX's default matmul precision; pass ``fp32_dots="fp32"`` for pinned precision.
    GEMMs of fp8 operands (``f8e4m3fn``, precision: fp8) get the device's dense fp8 peak (twice bf16's on Hopper),
    or its bf16 peak on a device without fp8 tensor cores (jaxgpt.devices.fp8_peak): this is a lower bound, so the
    true peak is what it takes (the calibrated estimate prices these unmeasured GEMMs on its own terms)."""
    from jaxgpt.devices import fp8_peak, peak_flops

    f32 = peak_flops(target.name, fp32_dots)
    bf16 = peak_flops(target.name, "bf16")
    return Peaks(target.name, {"bf16": bf16, "f16": bf16, "f32": f32, "f8": fp8_peak(target.name, "bf16")[0]},
                 vector=peak_flops(target.name, "fp32"), bandwidth=target.memory_bandwidth)


@dataclasses.dataclass(frozen=True)
class Row:
    category: str
    launches: int
    flops: float
    bytes: float
    time_s: float
    compute_s: float  # of time_s, what was compute-bound
    memory_s: float


@dataclasses.dataclass(frozen=True)
class Prediction:
    peaks: Peaks
    rows: list[Row]
    model_flops: float  # jaxgpt.flops' count for the step (MFU's numerator)
    tokens: int

    @property
    def time_s(self) -> float:
        return sum(r.time_s for r in self.rows)

    @property
    def bytes(self) -> float:
        return sum(r.bytes for r in self.rows)

    @property
    def flops(self) -> float:
        return sum(r.flops for r in self.rows)

    def mfu(self, peak: float) -> float:
        return self.model_flops / self.time_s / peak

    def table(self, *, peak: float, peak_name: str) -> str:
        lines = [f"{'kernels by scope':<26}{'launches':>10}{'TFLOP':>10}{'GB moved':>10}{'time ms':>10}"
                 f"{'bound':>9}{'share':>7}"]
        total = self.time_s
        for r in self.rows:
            bound = "compute" if r.compute_s >= r.memory_s else "memory"
            lines.append(f"{r.category:<26}{r.launches:>10,}{r.flops / 1e12:>10.2f}{r.bytes / 1e9:>10.2f}"
                         f"{r.time_s * 1e3:>10.2f}{bound:>9}{r.time_s / total:>7.0%}")
        lines.append(f"{'total':<26}{sum(r.launches for r in self.rows):>10,}{self.flops / 1e12:>10.2f}"
                     f"{self.bytes / 1e9:>10.2f}{total * 1e3:>10.2f}")
        lines.append(f"predicted step >= {total * 1e3:,.1f} ms, {self.tokens / total:,.0f} tokens/s per device; MFU "
                     f"<= {self.mfu(peak):.1%} ({self.model_flops / 1e12:,.1f} model TFLOP per step, jaxgpt.flops, "
                     f"over {peak_name})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dict(peaks=dataclasses.asdict(self.peaks), time_s=self.time_s, bytes=self.bytes, flops=self.flops,
                    model_flops=self.model_flops, tokens=self.tokens,
                    rows=[dataclasses.asdict(r) for r in self.rows])


def kernel_time(k: Kernel, peaks: Peaks) -> tuple[float, float]:
    """(compute-bound time, memory-bound time) of one launch."""
    return k.flops / peaks.matmul_peak(k.matmul_dtype), k.bytes / peaks.bandwidth


def predict(kernels: list[Kernel], peaks: Peaks, *, model_flops: float, tokens: int) -> Prediction:
    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for k in kernels:
        c, m = kernel_time(k, peaks)
        a = acc[k.category]
        a[0] += k.count
        a[1] += k.flops * k.count
        a[2] += k.bytes * k.count
        a[3] += max(c, m) * k.count
        a[4] += (c if c >= m else 0.0) * k.count
        a[5] += (m if m > c else 0.0) * k.count
    order = CATEGORIES + sorted(set(acc) - set(CATEGORIES))
    rows = [Row(cat, int(a[0]), a[1], a[2], a[3], a[4], a[5]) for cat in order if (a := acc.get(cat))]
    return Prediction(peaks, rows, model_flops, tokens)
