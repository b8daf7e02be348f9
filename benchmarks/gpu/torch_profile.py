"""Where torch.compile spends its train step on a GPU: ``torch.profiler`` on the bench's ``torch_compile_bf16``
step (torch_ref under ``torch.compile`` + bf16 autocast, SDPA attention, fused AdamW; built by
:func:`benchmarks.gpu.worker._torch`, the same step the table times), its kernels grouped by kind.

    python -m benchmarks.gpu.torch_profile --batch 64      # on a GPU: torch-profile-gpu-<device>-b64.json
    python -m benchmarks.gpu.torch_profile --dry           # the same code path on the CPU, tiny shapes (tests)

After a cold step and 3 warm-up steps, ``--steps`` steps run under the profiler; its chrome trace (kept in the
scratch dir, not among the results: the device tool brings back 8 files) is read back and every device event
(``cat`` kernel / gpu_memcpy / gpu_memset; on the CPU, where there are none, the ATen ops and inductor's C++
kernels) is put in the first matching kind of :data:`KINDS` by its name. Where events overlap, each gets the time
no earlier event covered (as :mod:`benchmarks.gpu.profile` does for jaxgpt), so the kinds sum to the busy time;
"host gaps" is the profiled wall time per step minus it. One JSON file: the table (also as markdown), the 30
longest kernels with their kind, and the run's facts.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

# (kind, pattern on the kernel's / op's name), first match wins; fwd / bwd is said where the name says it
KINDS: list[tuple[str, str]] = [
    ("copies / memsets", r"memcpy|memset|^aten::(copy_|to|_to_copy|fill_|zero_)$"),
    ("attention bwd", r"(flash|fmha|sdpa|attention).*(bwd|bprop|backward)|(bwd|backward).*(flash|fmha|attention)"),
    ("attention fwd", r"flash|fmha|sdpa|attention"),
    ("GEMMs", r"gemm|nvjet|xmma|cutlass|cublas|triton_tem|^aten::(mm|addmm|bmm|matmul|linear)$|\b(add)?mmbackward"),
    ("optimizer (fused AdamW, grad clip)", r"adam|multi_tensor|foreach|clip_grad|^aten::_fused"),
    ("cross-entropy", r"log_?softmax|nll_?loss|cross_?entropy"),
    ("LayerNorm bwd", r"layer_?norm_?backward"),
    ("LayerNorm fwd", r"layer_?norm"),
    ("GELU bwd", r"(gelu|tanh)_?backward"),
    ("GELU fwd", r"gelu|tanh"),
    ("embedding", r"embedding|index_put|scatter|gather"),
    ("other Triton / inductor fusions", r"^triton_|cpp_fused|^graph_"),
    ("other ATen kernels", r"elementwise_kernel|reduce_kernel|^aten::|at::native"),
    ("other", r""),
]
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op",)  # the CPU (dry mode): torch's ops stand in for kernels
_COMPILED = [(k, re.compile(p, re.IGNORECASE)) for k, p in KINDS]


def kind_of(name: str) -> str:
    """The kind of one kernel (or, on the CPU, op) by its name."""
    return next(k for k, p in _COMPILED if p.search(name))


def device_events(trace: dict[str, Any] | list) -> tuple[list[dict[str, Any]], str]:
    """The trace's complete events that ran on the device (kernels, copies, memsets), or, where there are none
    (the CPU), its top-level ATen ops: (events, source)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    dev = [e for e in xs if e.get("cat") in DEVICE_CATS]
    if dev:
        return dev, "GPU kernels"
    return _outermost([e for e in xs if e.get("cat") in HOST_CATS]), "CPU ops (no device events)"


def _outermost(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per thread, the ops no other op encloses (an ATen op's children would count its time twice)."""
    out, ends = [], {}
    for e in sorted(events, key=lambda e: (e.get("tid"), float(e["ts"]), -float(e["dur"]))):
        t, s = e.get("tid"), float(e["ts"])
        if s >= ends.get(t, -1.0):
            out.append(e)
            ends[t] = s + float(e["dur"])
    return out


def summarise(trace: dict[str, Any] | list, steps: int, wall_s: float | None = None) -> dict[str, Any]:
    """Busy time per kind and per kernel name, in ms per step (events clipped to the time no earlier event
    covered, so they sum to the device-busy time); ``wall_s`` (the profiled steps' synchronised wall time) adds
    the host gaps."""
    events, source = device_events(trace)
    kinds: dict[str, float] = {k: 0.0 for k, _ in KINDS}
    kernels: dict[str, dict[str, Any]] = {}
    covered = float("-inf")
    for e in sorted(events, key=lambda e: float(e["ts"])):
        s, d = float(e["ts"]), float(e["dur"])
        own = max(0.0, s + d - max(s, covered))
        covered = max(covered, s + d)
        k = kind_of(e["name"])
        kinds[k] += own
        r = kernels.setdefault(e["name"], {"name": e["name"], "kind": k, "launches": 0, "us": 0.0})
        r["launches"] += 1
        r["us"] += own
    busy_ms = sum(kinds.values()) / 1e3 / steps
    rows = [{"kind": k, "ms_per_step": us / 1e3 / steps} for k, us in kinds.items() if us > 0]
    step_ms = wall_s * 1e3 / steps if wall_s else None
    if step_ms is not None:
        rows.append({"kind": "host gaps (device idle)", "ms_per_step": max(0.0, step_ms - busy_ms)})
    total = sum(r["ms_per_step"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["ms_per_step"] / total
    top = sorted(kernels.values(), key=lambda r: -r["us"])[:30]
    return {"source": source, "events": len(events), "steps": steps, "busy_ms_per_step": busy_ms,
            "step_ms": step_ms, "rows": rows,
            "top_kernels": [{"name": r["name"][:160], "kind": r["kind"], "launches_per_step": r["launches"] / steps,
                             "ms_per_step": r["us"] / 1e3 / steps} for r in top]}


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    step = f"{s['step_ms']:.1f} ms per profiled step" if s["step_ms"] else "no wall time"
    how = "torch.compile + bf16 autocast" if res["variant"] == "torch_compile_bf16" else "bf16 autocast, eager"
    head = (f"**torch_ref under {how}**, {res['preset']} b={res['batch']} T={res['seq']} "
            f"on {res['device_kind']}: {step}, device busy {s['busy_ms_per_step']:.1f} ms "
            f"({s['events']} {s['source']} over {s['steps']} steps; torch {res['versions'].get('torch')})")
    lines = [head, "", "| kind | ms per step | share |", "|---|---:|---:|"]
    lines += [f"| {r['kind']} | {r['ms_per_step']:.2f} | {r['share']:.1%} |" for r in s["rows"]]
    lines += ["", "| longest kernels | kind | launches per step | ms per step |", "|---|---|---:|---:|"]
    lines += [f"| `{r['name'][:90]}` | {r['kind']} | {r['launches_per_step']:g} | {r['ms_per_step']:.2f} |"
              for r in s["top_kernels"][:15]]
    return "\n".join(lines)


def _load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def profile(*, dry: bool, batch: int, steps: int, compiled: bool = True) -> dict[str, Any]:
    """Build the bench's torch.compile step (``compiled=False``: eager), run a cold step and 3 warm-up steps,
    profile ``steps`` steps."""
    import torch

    from benchmarks.gpu import worker as gpu_worker
    from benchmarks.gpu.bench import DRY_SHAPES, PAD, SHAPES
    from benchmarks.worker import gpt_config, load_init, make_batch

    preset, seq = (DRY_SHAPES if dry else SHAPES)["gpt2"]
    spec = {"device": "cpu" if dry else "gpu", "config": preset, "overrides": PAD, "seq": seq, "batch": batch}
    cfg = gpt_config(spec)
    x, y = make_batch(cfg, 1, batch, seq)
    fns = gpu_worker._torch(spec, cfg, "bf16", compiled, x, y, load_init(str(common.ensure_init(preset, PAD))))
    t0 = time.perf_counter()
    fns["step"]()
    fns["sync"]()
    cold_s = time.perf_counter() - t0
    for _ in range(3):
        fns["step"]()
    fns["sync"]()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([] if dry else [torch.profiler.ProfilerActivity.CUDA])
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            last = fns["step"]()
        fns["sync"]()
        wall = time.perf_counter() - t0
    common.TMP.mkdir(parents=True, exist_ok=True)
    trace_path = common.TMP / f"torch-trace-{int(time.time())}.json"
    prof.export_chrome_trace(str(trace_path))
    summary = summarise(_load(trace_path), steps, wall)
    info = fns["info"]
    return {"benchmark": "torch_profile", "dry": dry, "device_kind": info["device_kind"], "preset": preset,
            "seq": seq, "batch": batch, "variant": "torch_compile_bf16" if compiled else "torch_eager_bf16",
            "step": info, "cold_first_step_s": cold_s,
            "profiled_step_ms": wall / steps * 1e3, "loss_last": fns["value"](last), "summary": summary,
            "trace_kept": common.shown(trace_path), "versions": common.versions(),
            "git": os.environ.get("JAXGPT_GIT_REV") or common.git_rev()}


def result_name(dry: bool, device_kind: str, batch: int) -> str:
    kind = device_kind.lower()
    dev = "dry" if dry else "h200" if "h200" in kind else "h100" if "h100" in kind else "a100" if "a100" in kind \
        else "other"
    return f"torch-profile-gpu-{dev}-b{batch}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after a cold one and 3 warm-up steps)")
    p.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (the code path; tests)")
    p.add_argument("--eager", action="store_true", help="without torch.compile (--dry: the default; inductor's "
                   "C++ compile of even the tiny model takes minutes on a small CPU)")
    p.add_argument("--compile", action="store_true", help="with --dry: torch.compile all the same")
    p.add_argument("--summarise", metavar="TRACE", help="only summarise a saved chrome trace (.json or .json.gz)")
    a = p.parse_args(argv)
    if a.batch < 1 or a.steps < 1:
        raise SystemExit(f"--batch {a.batch} / --steps {a.steps}: both must be >= 1")
    if a.summarise:
        path = Path(a.summarise)
        if not path.is_file():
            raise SystemExit(f"--summarise {path}: no such file (a chrome trace torch.profiler exported)")
        s = summarise(_load(path), a.steps)
        print(json.dumps(s, indent=1))
        return 0
    compiled = not (a.eager or (a.dry and not a.compile))
    res = profile(dry=a.dry, batch=a.batch, steps=a.steps, compiled=compiled)
    res["markdown"] = markdown(res)
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    out = common.RESULTS / f"{result_name(a.dry, res['device_kind'], a.batch)}.json"
    out.write_text(json.dumps(res, indent=1, default=str))
    print(res["markdown"])
    print(f"\nwrote {common.shown(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
