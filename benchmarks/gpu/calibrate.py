"""Fit jaxgpt.compile's calibrated prediction to what a GPU did: the rate of every kernel class, from a profile
trace matched kernel by kernel to the optimized HLO of the program that ran, one file per device.

    python -m benchmarks.gpu.calibrate --profile benchmarks/results/h200-DATE/profile-gpu-h200-b64.json \\
        --profile benchmarks/results/h200-DATE/profile-gpu-h200-b64-jax_bf16_fast.json
        # writes jaxgpt/compile/calibration-h200.json: the device the profiles ran on; each profile's step time
        # (without the profiler) is its variant's row of the bench beside it, or --step-ms, once per --profile
    python -m benchmarks.gpu.calibrate --trace TRACE.json.gz --hlo HLO.txt.gz --device-kind "NVIDIA H200" \\
        --step-ms 150.2 [--device h200] [--out jaxgpt/compile/calibration-h200.json]
    python -m benchmarks.gpu.calibrate --check     # the H100's accuracy: benchmarks/results/calibration-h100.json

The device is the one the trace ran on: the profile's JSON (``benchmarks.gpu.profile`` writes it beside the trace
and the HLO, with the GPU's name and every instruction's measured time, so a profile fits without its trace) or
``--device-kind``; ``--device`` and ``--out`` default to it and its
``calibration-<device>.json`` (``jaxgpt.compile.calibrated.path_for``), and a fit refuses to write any other
device's file (a ``--device``, an ``--out`` name or an existing file's device that is not the trace's).

Each HLO instruction's measured time per step (``benchmarks.gpu.profile.instruction_times``) is divided by its
executions per step; its class (``jaxgpt.compile.calibrated.kernel_class``: GEMMs by engine, dtypes and layout,
cuDNN attention by direction, fusions by kind, copies, and each of jaxgpt's Pallas kernels by its name, a Pallas
GEMM with its epilogue as the one kernel the trace timed) gets ``latency + FLOPs / rate + bytes / bandwidth`` fitted
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

from benchmarks import common
from jaxgpt.compile import calibrated, hlo

# the terms each kind's classes are fitted with; a kind without "latency" gets the fusions' launch cost, fixed
# (its launches all do much the same work: a fixed cost and a rate cannot be told apart). A Pallas GEMM's rate is
# its GEMM FLOPs over the time of the whole kernel, epilogue included; another Pallas kernel's, bytes over time.
TERMS = {"gemm": ("flops",), "attention": ("flops",), "fusion": ("latency", "bytes"),
         "copy": ("latency", "bytes"), "collective": ("latency", "bytes"), "pallas-gemm": ("flops",),
         "pallas": ("bytes",)}


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
    # weight: launches / time (a relative, per-step error); a time at or under the fixed latency weighs as 1 ps
    w = np.sqrt(np.array([k.count for k, _ in rows]) / np.maximum(y, 1e-12))
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    coef, _ = nnls(x / scale * w[:, None], y * w)
    coef = coef / scale
    c = dict(zip(terms, coef))
    inv = lambda v: (1.0 / v) if v and v > 0 else None  # noqa: E731
    return calibrated.Rate(kind, name, float(c.get("latency", latency)), inv(c.get("flops")), inv(c.get("bytes")),
                           samples=len(rows), measured_s=float(sum(t * k.count for k, t in rows)))


def fit(times: list[dict], hlo_text: str, step_s: float, device: str, provenance: dict) -> calibrated.Calibration:
    """The calibration of ``device`` from one program's measured instruction times (``instruction_times``) and its
    optimized HLO. A Pallas GEMM's instruction is sampled as its GEMM half (the reader splits it into a GEMM and an
    epilogue; the trace timed them as one kernel, whose whole time its class's rate takes)."""
    return fit_many([(times, hlo_text, step_s)], device, provenance)


def fit_many(programs: list[tuple[list[dict], str, float]], device: str, provenance: dict) -> calibrated.Calibration:
    """:func:`fit` over several programs one device ran (the default's and the fast set's profiles): each class's
    rate fitted over the instructions of all of them; the host's overhead per execution, each program's measured
    step less its kernels, averaged."""
    groups: dict[tuple[str, str], list] = collections.defaultdict(list)
    overheads, kernel_ms, step_ms = [], [], []
    for times, hlo_text, step_s in programs:
        kernels, _ = hlo.kernels(hlo_text)
        for k, t in samples(times, kernels):
            groups[calibrated.kernel_class(k)].append((k, t))
        kernel_s = sum(t["ms_per_step"] for t in times) / 1e3
        overheads.append(max(0.0, step_s - kernel_s))
        kernel_ms.append(kernel_s * 1e3)
        step_ms.append(step_s * 1e3)
    rates = {key: fit_class(*key, rows) for key, rows in sorted(groups.items()) if "latency" in TERMS[key[0]]}
    lat = [r.latency_s for r in rates.values() for _ in range(r.samples)]
    launch = float(np.median(lat)) if lat else 0.0
    rates.update({key: fit_class(*key, rows, launch) for key, rows in sorted(groups.items()) if key not in rates})
    one = len(programs) == 1
    return calibrated.Calibration(device, rates, float(np.mean(overheads)),
                                  {**provenance, "kernel_ms_per_step": kernel_ms[0] if one else kernel_ms,
                                   "step_ms": step_ms[0] if one else step_ms})


# ---- accuracy: the committed program (per category) and the programs compiled here (out of sample) ------------
DATA = common.ROOT / "tests" / "data" / "hlo"
H100_RUN = common.ROOT / "benchmarks" / "results" / "h100-2026-11-26"  # the run the H100 calibration was fitted on
CHECKS = [  # (label, HLO, measured step s, where it was measured, jax of the program)
    ("gpt2 b64, 1 micro-step (the program that ran; in sample)", H100_RUN / "profile-gpu-h100-b64.hlo.txt.gz",
     64 * 1024 / 371_044, "benchmarks.gpu.bench, 371,044 tok/s", "0.11.2 (on the GPU)"),
    ("gpt2 b64, 1 micro-step, compiled here", DATA / "gpt2-b64-h100-jax0.10.2.hlo.txt.gz", 64 * 1024 / 371_044,
     "benchmarks.gpu.bench, 371,044 tok/s (the 0.11.2 program)", "0.10.2 (compile-only)"),
    ("gpt2 b16, 1 micro-step, compiled here", DATA / "gpt2-b16-h100-jax0.10.2.hlo.txt.gz", 16 * 1024 / 300_168,
     "benchmarks.gpu.bench, 300,168 tok/s", "0.10.2 (compile-only)"),
    ("configs/gpt2-124m.yaml, b64 x 8 micro-steps, compiled here", DATA / "gpt2-124m-yaml-h100-jax0.10.2.hlo.txt.gz",
     1.395, "python -m jaxgpt.train, 1,390-1,406 ms per step", "0.10.2 (compile-only)"),
]


def check(profile_json: Path) -> dict:
    """The calibration's accuracy: every program of :data:`CHECKS` predicted against its measured step, and the
    committed program per profile category against the profile's per-instruction times."""
    cal = calibrated.for_target("h100-sxm")
    rows = []
    for label, path, measured, where, jax in CHECKS:
        kernels, _ = hlo.kernels(read_text(path))
        est = calibrated.estimate(kernels, cal)
        rows.append(dict(label=label, hlo=str(path.relative_to(common.ROOT)), jax=jax, measured_s=measured,
                         measured_by=where, predicted_s=est.time_s, uncalibrated_s=est.uncalibrated_s,
                         error=est.time_s / measured - 1))
    times = json.loads(profile_json.read_text())["instructions"]
    est = calibrated.estimate(hlo.kernels(read_text(CHECKS[0][1]))[0], cal)
    by_name = {k.kernel.name: k.time_s for k in est.kernels}
    cats: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for t in times:
        cats[t["category"]][0] += t["ms_per_step"] / 1e3
        cats[t["category"]][1] += by_name[t["name"]]
    return dict(benchmark="calibration-h100", calibration=cal.provenance, step_overhead_s=cal.step_overhead_s,
                programs=rows, categories=[dict(category=c, measured_s=m, predicted_s=p) for c, (m, p) in
                                           sorted(cats.items(), key=lambda kv: -kv[1][0])])


def markdown(res: dict) -> list[str]:
    prov = res["calibration"]
    out = ["### The calibrated prediction (`python -m jaxgpt.compile`)", "",
           f"`jaxgpt.compile`'s step time is now an estimate at the rates the H100 ran each class of kernel, fitted "
           f"by `python -m benchmarks.gpu.calibrate` from `{prov['trace']}` against `{prov['hlo']}` "
           f"({prov['jax']}; `jaxgpt/compile/calibration-h100.json`): GEMMs by dtypes and layout (achieved TFLOP/s), "
           "cuDNN attention forward and backward (TFLOP/s), XLA fusions by kind and copies (a fixed cost per launch "
           "plus an achieved bandwidth), and the host's "
           f"{res['step_overhead_s'] * 1e3:.1f} ms per program execution (the measured step minus its kernels). "
           "The roofline stays beside it as the lower bound. Predicted (`python -m jaxgpt.compile --hlo FILE "
           "--target h100`) against measured:", "",
           "| program | jax | measured | predicted | error |", "|---|---|---:|---:|---:|"]
    for r in res["programs"]:
        out.append(f"| {r['label']} | {r['jax']} | {r['measured_s'] * 1e3:,.1f} ms | {r['predicted_s'] * 1e3:,.1f} ms | "
                   f"{r['error']:+.1%} |")
    out += ["", "The program that ran, per profile category (its trace's time per step; the estimate of the same "
            "instructions):", "", "| category | measured ms | predicted ms | error |", "|---|---:|---:|---:|"]
    for c in res["categories"]:
        err = f"{c['predicted_s'] / c['measured_s'] - 1:+.1%}" if c["measured_s"] else "-"
        out.append(f"| {c['category']} | {c['measured_s'] * 1e3:.2f} | {c['predicted_s'] * 1e3:.2f} | {err} |")
    a, b = res["programs"][0], res["programs"][1]
    out += ["", f"The b64 program compiled here (jax 0.10.2, compile-only) and the one the GPU ran (0.11.2) have the "
            "same GEMM shapes (on Triton here, on cuBLAS on the GPU: a compile-only build does not autotune), "
            "attention, LayerNorm, GELU and optimizer kernels. They differ in the loss chunks: the padded "
            "vocabulary's mask (`where(valid, logits, -inf)` over the fp32 logits) is fused into the Triton logits "
            "GEMM here, while on the GPU, with the GEMM on cuBLAS, it is a kernel of its own that reads and writes "
            "the 1 GB of fp32 logits of every chunk again (`gemm_fusion_dot_general.75`: 8.7 ms per b64 step "
            "measured, 5% of it). At the measured rates the program compiled here is "
            f"{(a['predicted_s'] - b['predicted_s']) * 1e3:.1f} ms per b64 micro-step faster; that is shown, not "
            "fitted away, and is most of why the out-of-sample programs are predicted under their measured steps "
            "(whether jax 0.11.2 would compile the same program here could not be checked: the package index "
            "offers jaxlib up to 0.10.2, so the out-of-sample programs were compiled with 0.10.2 only).",
            "", "Command: `python -m benchmarks.gpu.calibrate --check` (writes `benchmarks/results/calibration-h100.json`"
            "); tests: `tests/test_calibration.py`.", ""]
    return out


class FitError(ValueError):
    """A fit that cannot say which device it measured, or would write another device's file: one line, the fix."""


def profile_inputs(profile: Path, step_ms: float | None) -> tuple[list[dict], str, float, dict]:
    """(instruction times, HLO text, step seconds, the profile's result) of one profile's JSON: the times from its
    trace where the trace lies beside it, else the per-instruction list the profile wrote (what the trace said);
    the step time measured without the profiler from ``step_ms``, else from the bench beside it (the row of the
    profile's variant, ``label``, or the default's, at its micro-batch)."""
    if not profile.is_file():
        raise FitError(f"--profile {profile}: no such file (the JSON python -m benchmarks.gpu.profile wrote)")
    meta = json.loads(profile.read_text())
    hlo_path = profile.with_name(meta.get("hlo_file") or "-")
    if not hlo_path.is_file():
        raise FitError(f"{profile}: its HLO {hlo_path.name} is not beside it")
    text = read_text(hlo_path)
    trace = profile.with_name(meta.get("trace_file") or "-")
    if trace.is_file():
        from benchmarks.gpu.profile import instruction_times

        times = instruction_times(trace, text)
    elif meta.get("instructions"):
        times = meta["instructions"]
    else:
        raise FitError(f"{profile}: neither its trace ({trace.name}) nor a per-instruction list to fit")
    if step_ms is None:
        variant = meta.get("label") or "jax_bf16"
        rows = [r for b in sorted(profile.parent.glob("train_step-gpu-*.json")) for r in json.loads(b.read_text())["rows"]
                if r["variant"] == variant and r["batch"] == meta.get("batch") and "error" not in r]
        if not rows:
            raise FitError(f"{profile}: no bench row of {variant} at b{meta.get('batch')} beside it to take the step "
                           "time from: give --step-ms (measured without the profiler)")
        step_ms = rows[0]["step_ms"]["median"]
    return times, text, step_ms / 1e3, meta


def device_of(kind: str | None, device: str | None) -> str:
    """The compile target whose calibration a trace from a GPU named ``kind`` fits: derived from the name, and
    ``device`` (``--device``) must agree with it."""
    from jaxgpt.devices import device_from_kind

    if not kind:
        raise FitError("which GPU ran the trace is unknown: give --profile (the profile's JSON names it) or "
                       "--device-kind NAME (as nvidia-smi / jax.Device.device_kind says it)")
    derived = device_from_kind(kind)
    if derived not in calibrated.CALIBRATIONS:
        raise FitError(f"the trace ran on {kind!r}, which is no compile target ({', '.join(calibrated.CALIBRATIONS)})"
                       ": add it to jaxgpt.compile.targets first")
    if device is not None and device != derived:
        raise FitError(f"--device {device}, but the trace ran on {kind} ({derived}): a fit writes only the calibration "
                       f"of the device its trace ran on; drop --device or fit a {device}'s own trace")
    return derived


def out_for(device: str, out: str | None) -> Path:
    """Where ``device``'s fit goes: its own file (default), or ``out`` if that is not another device's."""
    path = Path(out) if out else calibrated.path_for(device)
    for other, own in calibrated.CALIBRATIONS.items():
        if other != device and path.name == own.name:
            raise FitError(f"--out {path}: that is {other}'s calibration file; a fit from a {device} trace writes "
                           f"{calibrated.path_for(device).name}")
    if path.is_file():
        held = json.loads(path.read_text()).get("device")
        if held != device:
            raise FitError(f"--out {path} holds {held}'s rates: a fit from a {device} trace does not overwrite another "
                           "device's calibration; give another --out")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="only measure the committed H100 calibration's accuracy")
    p.add_argument("--profile", action="append", default=[], help="a profile's result JSON (benchmarks.gpu.profile): "
                   "device, HLO and trace (or its per-instruction times); repeat for more programs of the same GPU")
    p.add_argument("--step-ms", type=float, action="append", default=[],
                   help="each profile's step time measured without the profiler, in --profile's order (default: "
                        "its variant's row of the bench beside it)")
    p.add_argument("--trace", help="instead of --profile: the jax.profiler trace (*.trace.json.gz)")
    p.add_argument("--hlo", help="with --trace: its optimized HLO text (.gz accepted)")
    p.add_argument("--device", help="the compile target; default (and only allowed): the GPU the trace ran on")
    p.add_argument("--out", help="default: jaxgpt/compile/calibration-<device>.json of that device")
    p.add_argument("--device-kind", help="the GPU that ran it (default: the profile's device_kind)")
    p.add_argument("--jax", help="provenance: the jax/jaxlib that compiled it (default: the profile's versions)")
    p.add_argument("--date", help="provenance: when it ran (default: the profile's date)")
    p.add_argument("--note", default="", help="provenance: anything else (the commands)")
    args = p.parse_args(argv)
    if args.check:
        res = check(H100_RUN / "profile-gpu-h100-b64.json")
        (common.RESULTS / "calibration-h100.json").write_text(json.dumps(res, indent=1) + "\n")
        print("\n".join(markdown(res)))
        return 0
    try:
        if args.profile:
            if args.step_ms and len(args.step_ms) != len(args.profile):
                raise FitError(f"{len(args.step_ms)} --step-ms for {len(args.profile)} --profile: give one each, or none")
            steps = args.step_ms or [None] * len(args.profile)
            programs = [profile_inputs(Path(f), ms) for f, ms in zip(args.profile, steps)]
            kinds = {m.get("device_kind") for *_, m in programs}
            if len(kinds) > 1:
                raise FitError(f"the profiles ran on different GPUs ({sorted(map(str, kinds))}): one device per fit")
            meta = programs[0][3]
            sources = [(Path(f).name, m.get("trace_file")) for f, (*_, m) in zip(args.profile, programs)]
        elif args.trace and args.hlo and len(args.step_ms) == 1:
            from benchmarks.gpu.profile import instruction_times

            text = read_text(args.hlo)
            programs = [(instruction_times(args.trace, text), text, args.step_ms[0] / 1e3, {})]
            meta, sources = {}, [(Path(args.hlo).name, Path(args.trace).name)]
        else:
            p.error("give --profile (with or without --step-ms), or --trace, --hlo and one --step-ms, or --check")
        device = device_of(args.device_kind or meta.get("device_kind"), args.device)
        out = out_for(device, args.out)
    except FitError as e:
        raise SystemExit(f"python -m benchmarks.gpu.calibrate: error: {e}") from None
    v = meta.get("versions", {})
    prov = {"trace": ", ".join(t or "(per-instruction list)" for _, t in sources),
            "hlo": ", ".join(h for h, _ in sources) if args.trace else ", ".join(m.get("hlo_file", "?")
                                                                             for *_, m in programs),
            "device_kind": args.device_kind or meta.get("device_kind"),
            "jax": args.jax or (f"jax/jaxlib {v.get('jax')}/{v.get('jaxlib')}" if v else "unknown"),
            "measured": args.date or str(meta.get("started", ""))[:10] or "unknown", "note": args.note,
            "fitted": datetime.date.today().isoformat(), "git": meta.get("git"),
            "by": "python -m benchmarks.gpu.calibrate " + " ".join(argv if argv is not None else sys.argv[1:])}
    cal = fit_many([prog[:3] for prog in programs], device, prov)
    out.write_text(json.dumps(cal.to_dict(), indent=1) + "\n")
    for r in cal.rates.values():
        print(f"{r.kind:<12}{r.name:<32}{r.samples:>5} sites {r.measured_s * 1e3:8.2f} ms  latency "
              f"{r.latency_s * 1e6:6.2f} us  " + (f"{r.flops_per_s / 1e12:6.0f} TFLOP/s  " if r.flops_per_s else "")
              + (f"{r.bytes_per_s / 1e12:5.2f} TB/s" if r.bytes_per_s else ""))
    print(f"host overhead per execution {cal.step_overhead_s * 1e3:.2f} ms; wrote {out} ({device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
