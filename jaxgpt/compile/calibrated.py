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

* jaxgpt's own Pallas kernels, each by its name (``pallas_call(name=...)``), a class of its own: a Pallas GEMM
  (``gemm_*``: the GEMM and its epilogue, which the trace times as one kernel) a fixed cost and an achieved TFLOP/s
  of its GEMM FLOPs, the epilogue's work inside that rate; any other Pallas kernel (LayerNorm, GELU) a fixed cost
  and an achieved bandwidth.

The rates are fitted offline (``benchmarks/gpu/calibrate.py``) from a profile of one GPU running one program,
matched kernel by kernel to that program's optimized HLO, and stored with their provenance beside this module, one
file per device: ``calibration-<device>.json`` (:func:`path_for`; the H100 SXM's is ``calibration-h100.json``). A
target without its own file has no calibrated estimate (:func:`status` says so): no device's rates stand in for
another's. A kernel of a class its device's trace never saw (a new layout, an fp8 GEMM, a Pallas kernel, a
collective) takes the least efficient measured class of its kind (for a collective: of the bandwidth-bound kinds;
a Pallas GEMM: the least efficient measured GEMM for its GEMM and the least efficient fusion rate for its
epilogue's extra bytes, one after the other; another Pallas kernel: the least efficient fusion) and is marked
uncalibrated. The roofline (:mod:`jaxgpt.compile.predict`) stays the lower bound beside it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxgpt.compile.hlo import COLLECTIVES, Kernel, is_epilogue
from jaxgpt.compile.targets import TARGETS

HERE = Path(__file__).parent
FILE_NAMES = {"h100-sxm": "h100"}  # the first calibration's file name (2026-11-26), kept; others by target name
KINDS = ("gemm", "attention", "fusion", "copy", "collective", "pallas-gemm", "pallas")
# where a class the trace never saw takes its stand-in rate: the least efficient measured class of these kinds
STAND_IN = {"collective": ("fusion", "copy"), "copy": ("fusion", "copy"), "pallas-gemm": ("gemm",),
            "pallas": ("fusion",)}


class CalibrationError(ValueError):
    """A calibration file that does not belong where it lies (another device's rates), with the fix."""


def path_for(device: str) -> Path:
    """The calibration file of a compile target (``jaxgpt.compile.targets.TARGETS`` key), present or not."""
    return HERE / f"calibration-{FILE_NAMES.get(device, device)}.json"


CALIBRATIONS = {name: path_for(name) for name in TARGETS}


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
    if k.gemm.startswith("pallas ") or is_epilogue(k):  # jaxgpt's own GEMM, timed with its epilogue: by its name
        return "pallas-gemm", k.pallas or k.gemm
    if k.gemm:  # "bf16->f32 NT": the engine (cuBLAS or Triton) is left out: autotuning on the GPU picks either
        return "gemm", k.gemm.split(" ", 1)[1]
    if k.pallas:  # a Pallas kernel that is no GEMM (LayerNorm, GELU's backward): by its name
        return "pallas", k.pallas
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
        of its kind stands in (:data:`STAND_IN`); a Pallas GEMM's epilogue half: of the fusions)."""
        kind, name = kernel_class(k)
        known = self.rates.get((kind, name))
        if known is not None and (known.bytes_per_s or known.flops_per_s or not (k.bytes or k.flops)):
            return known, True
        # unseen, or seen only without work (copies of nothing): the least efficient of its kind, or of the
        # bandwidth-bound kinds for data movement
        near = ("fusion",) if is_epilogue(k) else STAND_IN.get(kind, (kind,))
        pool = [r for r in self.rates.values() if r.kind in near and r.efficiency() > 0]
        if not pool:
            raise ValueError(f"the {self.device} calibration measured no {kind} kernel to stand in for {name!r}")
        worst = min(pool, key=Rate.efficiency)
        return worst, False

    def time_s(self, k: Kernel) -> tuple[Rate, bool, float]:
        """(rate, calibrated, seconds per execution) of ``k``: the epilogue half of a Pallas GEMM whose class was
        measured costs nothing of its own (the class's rate timed GEMM and epilogue as one kernel)."""
        rate, known = self.rate(k)
        return rate, known, 0.0 if known and is_epilogue(k) else rate.time_s(k)


def for_target(name: str) -> Calibration | None:
    """``name``'s own calibration (None where no trace of that device was fitted); a file holding another device's
    rates is refused."""
    path = path_for(name)
    if not path.is_file():
        return None
    cal = Calibration.load(path)
    if cal.device != name:
        raise CalibrationError(f"{path.name} holds {cal.device}'s rates, not {name}'s: fit {name}'s own from its trace "
                               "(python -m benchmarks.gpu.calibrate --profile RUN/profile-gpu-....json) or remove it")
    return cal


def status(name: str) -> dict[str, Any]:
    """Whether ``name`` has a calibration and from which trace: what ``python -m jaxgpt.compile`` prints and writes
    beside its estimate."""
    path = path_for(name)
    cal = for_target(name)
    if cal is None:
        return dict(calibrated=False, device=name, file=None,
                    why=f"no {path.name}: no {name} trace has been fitted (python -m benchmarks.gpu.calibrate on a "
                        "profile from that GPU writes it)", estimate="the roofline lower bound only")
    p = cal.provenance
    return dict(calibrated=True, device=name, file=f"jaxgpt/compile/{path.name}", trace=p.get("trace"),
                hlo=p.get("hlo"), device_kind=p.get("device_kind"), jax=p.get("jax"), measured=p.get("measured"),
                classes=len(cal.rates))


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
        rate, known, seconds = calibration.time_s(k)
        kind = kernel_class(k)[0]
        # an unseen Pallas kernel is shown under the kind whose rate stands in (a Pallas GEMM's GEMM half: "gemm",
        # its epilogue: "fusion"), any other unseen kernel under its own
        out.append(KernelTime(k, rate.kind if known or kind.startswith("pallas") else kind, rate.name, known,
                              seconds * k.count))
    return Estimate(out, calibration.step_overhead_s * executions, calibration)
