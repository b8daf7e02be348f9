"""Fit jaxgpt.compile's calibrated prediction to what a GPU did: the rate of every kernel class, from a profile
trace matched kernel by kernel to the optimized HLO of the program that ran.

    python -m benchmarks.gpu.calibrate --trace TRACE.json.gz --hlo HLO.txt.gz --step-ms 176.6 \\
        [--device h100-sxm] [--out jaxgpt/compile/calibration-h100.json]

Each HLO instruction's measured time per step (``benchmarks.gpu.profile.instruction_times``) is divided by its
executions per step; its class (``jaxgpt.compile.calibrated.kernel_class``: GEMMs by engine, dtypes and layout,
cuDNN attention by direction, fusions by kind, copies) gets ``latency + FLOPs / rate + bytes / bandwidth`` fitted
by non-negative least squares over the class's instructions, each weighted by its share of the step (a class's
fitted total stays close to its measured total; the many tiny kernels set the latency). ``--step-ms``, the step
time measured without the profiler, minus the kernels' sum is the per-execution host overhead. The written JSON
says where every number came from; jaxgpt reads it, never this script.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from jaxgpt.compile import calibrated, hlo

TERMS = {"gemm": ("flops",), "attention": ("flops",), "fusion": ("latency", "bytes"),
         "copy": ("latency", "bytes"), "collective": ("latency", "bytes")}


def read_text(path: str | Path) -> str:
    path = Path(path)
    return gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()


def samples(times: list[dict], kernels: list[hlo.Kernel]) -> list[tuple[hlo.Kernel, float]]:
    """(kernel, measured seconds per execution) of every instruction the trace timed."""
    by_name = {k.name: k for k in kernels}
    missing = [t["name"] for t in times if t["name"] not in by_name]
    if missing:
        raise ValueError(f"{len(missing)} traced instructions are not kernels of the HLO (another program?): "
                         f"{missing[:5]}")
    return [(by_name[t["name"]], t["ms_per_step"] / 1e3 / by_name[t["name"]].count) for t in times
            if t["ms_per_step"] > 0]


def fit_class(kind: str, name: str, rows: list[tuple[hlo.Kernel, float]], latency: float = 0.0) -> calibrated.Rate:
    """``latency`` given: fixed (the GEMM and attention classes, whose launches all do much the same work, cannot
    tell a fixed cost from a rate: they get the fusions' launch cost and the rate is fitted on the rest)."""
    terms = TERMS[kind]
    feats = {"latency": lambda k: 1.0, "flops": lambda k: k.flops, "bytes": lambda k: k.bytes}
    x = np.array([[feats[t](k) for t in terms] for k, _ in rows], dtype=float)
    y = np.array([t for _, t in rows]) - latency
    w = np.sqrt(np.array([k.count for k, _ in rows]) / y)  # weight: launches / time (a relative, per-step error)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    coef, _ = nnls(x / scale * w[:, None], y * w)
    coef = coef / scale
    c = dict(zip(terms, coef))
    inv = lambda v: (1.0 / v) if v and v > 0 else None  # noqa: E731
    return calibrated.Rate(kind, name, float(c.get("latency", latency)), inv(c.get("flops")), inv(c.get("bytes")),
                           samples=len(rows), measured_s=float(sum(t * k.count for k, t in rows)))


def fit(times: list[dict], hlo_text: str, step_s: float, device: str, provenance: dict) -> calibrated.Calibration:
    kernels, _ = hlo.kernels(hlo_text)
    groups: dict[tuple[str, str], list] = collections.defaultdict(list)
    for k, t in samples(times, kernels):
        groups[calibrated.kernel_class(k)].append((k, t))
    rates = {key: fit_class(*key, rows) for key, rows in sorted(groups.items()) if "latency" in TERMS[key[0]]}
    lat = [r.latency_s for r in rates.values() for _ in range(r.samples)]
    launch = float(np.median(lat)) if lat else 0.0
    rates.update({key: fit_class(*key, rows, launch) for key, rows in sorted(groups.items()) if key not in rates})
    kernel_s = sum(t["ms_per_step"] for t in times) / 1e3
    return calibrated.Calibration(device, rates, max(0.0, step_s - kernel_s),
                                  {**provenance, "kernel_ms_per_step": kernel_s * 1e3, "step_ms": step_s * 1e3})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True, help="the jax.profiler trace (*.trace.json.gz) of the program")
    p.add_argument("--hlo", required=True, help="its optimized HLO text (.gz accepted)")
    p.add_argument("--step-ms", type=float, required=True, help="its step time measured without the profiler")
    p.add_argument("--device", default="h100-sxm")
    p.add_argument("--out", default=str(calibrated.CALIBRATIONS["h100-sxm"]))
    p.add_argument("--device-kind", default="NVIDIA H100 80GB HBM3", help="provenance: the GPU that ran it")
    p.add_argument("--jax", default="jax 0.11.2", help="provenance: the jax/jaxlib (and plugin) that compiled it")
    p.add_argument("--date", default="2026-11-26", help="provenance: when it ran")
    p.add_argument("--note", default="", help="provenance: anything else (the commands)")
    args = p.parse_args(argv)
    from benchmarks.gpu.profile import instruction_times

    text = read_text(args.hlo)
    times = instruction_times(args.trace, text)
    prov = {"trace": Path(args.trace).name, "hlo": Path(args.hlo).name, "device_kind": args.device_kind,
            "jax": args.jax, "measured": args.date, "note": args.note, "fitted": datetime.date.today().isoformat(),
            "by": "python -m benchmarks.gpu.calibrate " + " ".join(argv if argv is not None else sys.argv[1:])}
    cal = fit(times, text, args.step_ms / 1e3, args.device, prov)
    Path(args.out).write_text(json.dumps(cal.to_dict(), indent=1) + "\n")
    for r in cal.rates.values():
        print(f"{r.kind:<10}{r.name:<32}{r.samples:>5} sites {r.measured_s * 1e3:8.2f} ms  latency "
              f"{r.latency_s * 1e6:6.2f} us  " + (f"{r.flops_per_s / 1e12:6.0f} TFLOP/s  " if r.flops_per_s else "")
              + (f"{r.bytes_per_s / 1e12:5.2f} TB/s" if r.bytes_per_s else ""))
    print(f"host overhead per execution {cal.step_overhead_s * 1e3:.2f} ms; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
