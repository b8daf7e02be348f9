"""A step time estimated at the rates a real GPU ran each kind of kernel: the calibrated prediction.

Every kernel of a compiled program (:mod:`jaxgpt.compile.hlo`) falls in a class, and each class has a fitted cost
per execution ``latency + FLOPs / achieved FLOP/s + bytes / achieved bytes/s``:

* GEMMs (cuBLAS calls, Triton GEMM fusions) by engine, operand and result dtype and layout (``cublas bf16->f32
  NT``): a fixed cost and an achieved TFLOP/s (the bytes term: what the GEMM streams beyond what overlaps);
* cuDNN flash attention forward and backward: a fixed cost and an achieved TFLOP/s (of the causal FLOPs);
* XLA fusions by kind (``kLoop`` elementwise, ``kInput`` reductions, ``__triton`` fusions, async fusions) and
  copies: a fixed cost (launch, ramp-up, tail) and an achieved bandwidth, so the achieved share of the HBM's
  bandwidth grows with the bytes a kernel moves, as it does on the GPU;
* once per program execution, the host's dispatch: the measured step time minus the sum of its kernels.

The rates are fitted offline (``benchmarks/gpu/calibrate.py``) from a profile of the GPU running one program,
matched kernel by kernel to that program's optimized HLO, and stored with their provenance beside this module
(``calibration-<device>.json``). A kernel of a class the trace never saw (a new layout, an fp8 GEMM, a Pallas
kernel, a collective) takes the least efficient measured class of its kind (for a collective: of the
bandwidth-bound kinds) and is marked uncalibrated. A Pallas GEMM (jaxgpt.gemm's) is read as its GEMM, a class of
its own (so the least efficient measured GEMM rate), and its epilogue's extra bytes, a Pallas kernel (the least
efficient fusion rate), one after the other. The roofline (:mod:`jaxgpt.compile.predict`) stays the lower
bound beside it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxgpt.compile.hlo import COLLECTIVES, Kernel

CALIBRATIONS = {"h100-sxm": Path(__file__).with_name("calibration-h100.json")}
KINDS = ("gemm", "attention", "fusion", "copy", "collective")


@dataclasses.dataclass(frozen=True)
class Rate:
    """One kernel class's fitted cost of one execution: ``latency_s + flops / flops_per_s + bytes / bytes_per_s``
    (a rate of None: that term is left out)."""

    kind: str
    name: str
    latency_s: float
    flops_per_s: float | None
    bytes_per_s: float | None
    samples: int = 0  # launch sites of the calibration program in this class
    measured_s: float = 0.0  # their measured time per step

    def time_s(self, k: Kernel) -> float:
        t = self.latency_s
        if self.flops_per_s:
            t += k.flops / self.flops_per_s
        if self.bytes_per_s:
            t += k.bytes / self.bytes_per_s
        return t

    def efficiency(self) -> float:
        """Lower is less efficient: achieved FLOP/s, or bytes/s for the bandwidth-bound kinds."""
        return (self.flops_per_s if self.kind in ("gemm", "attention") else self.bytes_per_s) or 0.0


def kernel_class(k: Kernel) -> tuple[str, str]:
    """(kind, class) of a kernel: what its rate is looked up by. Never its name: a class is a shape of work."""
    if "fmha" in k.opcode:
        return "attention", "cudnn bwd" if "Backward" in k.opcode else "cudnn fwd"
    if k.opcode.startswith("__cudnn"):
        return "attention", k.opcode
    if k.gemm:  # "bf16->f32 NT": the engine (cuBLAS or Triton) is left out: autotuning on the GPU picks either
        engine, cls = k.gemm.split(" ", 1)
        return "gemm", k.gemm if engine == "pallas" else cls  # a Pallas GEMM (jaxgpt's own) is a class of its own
    if k.opcode in COLLECTIVES:
        return "collective", k.opcode
    if k.opcode in ("copy", "copy-start", "transpose"):
        return "copy", "copy"
    # kLoop, kInput, __triton, fusion-start (an async fusion), ...; a library or Pallas kernel the reader has no
    # FLOPs for is bandwidth-bound as far as it can tell: the fusions' kind
    return "fusion", k.opcode


@dataclasses.dataclass(frozen=True)
class Calibration:
    device: str
    rates: dict[tuple[str, str], Rate]
    step_overhead_s: float  # per program execution: the host's dispatch, the gaps between command buffers
    provenance: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        data = json.loads(Path(path).read_text())
        rates = {(r["kind"], r["name"]): Rate(**r) for r in data["rates"]}
        return cls(data["device"], rates, data["step_overhead_s"], data.get("provenance", {}))

    def to_dict(self) -> dict[str, Any]:
        return dict(device=self.device, step_overhead_s=self.step_overhead_s, provenance=self.provenance,
                    rates=[dataclasses.asdict(r) for r in self.rates.values()])

    def rate(self, k: Kernel) -> tuple[Rate, bool]:
        """The kernel's rate and whether the trace measured its class (False: the least efficient measured class
        of its kind stands in; a collective's kind is bandwidth-bound: fusions and copies)."""
        kind, name = kernel_class(k)
        known = self.rates.get((kind, name))
        if known is not None and (known.bytes_per_s or known.flops_per_s or not (k.bytes or k.flops)):
            return known, True
        # unseen, or seen only without work (copies of nothing): the least efficient of its kind, or of the
        # bandwidth-bound kinds for data movement
        near = ("fusion", "copy") if kind in ("collective", "copy") else (kind,)
        pool = [r for r in self.rates.values() if r.kind in near and r.efficiency() > 0]
        if not pool:
            raise ValueError(f"the {self.device} calibration measured no {kind} kernel to stand in for {name!r}")
        worst = min(pool, key=Rate.efficiency)
        return worst, False


def for_target(name: str) -> Calibration | None:
    path = CALIBRATIONS.get(name)
    return Calibration.load(path) if path is not None and path.is_file() else None


@dataclasses.dataclass(frozen=True)
class KernelTime:
    kernel: Kernel
    kind: str
    rate: str  # the class whose rate it was given
    calibrated: bool
    time_s: float  # per step (all its executions)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The calibrated step time: every kernel's, and the host's per-execution overhead."""

    kernels: list[KernelTime]
    overhead_s: float
    calibration: Calibration

    @property
    def time_s(self) -> float:
        return sum(k.time_s for k in self.kernels) + self.overhead_s

    @property
    def uncalibrated_s(self) -> float:
        return sum(k.time_s for k in self.kernels if not k.calibrated)

    def by(self, key) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        for k in self.kernels:
            out[key(k)] += k.time_s
        return dict(out)

    def to_dict(self) -> dict[str, Any]:
        return dict(time_s=self.time_s, overhead_s=self.overhead_s, uncalibrated_s=self.uncalibrated_s,
                    by_category=self.by(lambda k: k.kernel.category),
                    by_class=self.by(lambda k: f"{k.kind}: {k.rate}" + ("" if k.calibrated else " (uncalibrated)")),
                    uncalibrated=sorted({f"{k.kind}: {kernel_class(k.kernel)[1]}" for k in self.kernels
                                         if not k.calibrated}),
                    calibration=dict(device=self.calibration.device, **self.calibration.provenance))


def estimate(kernels: list[Kernel], calibration: Calibration, *, executions: int = 1) -> Estimate:
    """The calibrated time of one execution of the program whose kernels these are (``executions``: how many
    times the host dispatches it per step; a program with gradient accumulation inside is dispatched once)."""
    out = []
    for k in kernels:
        rate, known = calibration.rate(k)
        out.append(KernelTime(k, rate.kind if known else kernel_class(k)[0], rate.name, known,
                              rate.time_s(k) * k.count))
    return Estimate(out, calibration.step_overhead_s * executions, calibration)
