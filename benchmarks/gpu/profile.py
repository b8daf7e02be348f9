"""Where jaxgpt's train step spends its time on a GPU: a ``jax.profiler`` trace, summarised into a table.

    python -m benchmarks.gpu.profile --batch 32        # on a GPU: profile-gpu-<device>-b32.{md,json}, trace kept
    python -m benchmarks.gpu.profile --dry             # the same code path on the CPU, tiny shapes (tests)
    python -m benchmarks.gpu.profile --summarise DIR --hlo HLO.txt   # re-read a saved trace

Every device event (a GPU kernel; on the CPU, an XLA:CPU thunk) is matched to the HLO instruction that launched it
(the trace's ``hlo_op`` argument, else its name) and that instruction's source scope in the compiled module's
metadata: jaxgpt names its pieces with ``jax.named_scope`` (``layer_norm``, ``attention``, ``gelu``,
``cross_entropy``, ``embed``, ``optimizer``), and autodiff marks the backward pass ``transpose(jvp(...))``. The
first matching category wins:

=====================================  ==========================================================================
optimizer                              the ``optimizer`` scope: clipping's global norm, AdamW, the update
cross-entropy (lm_head + loss)         the fused chunked lm_head matmuls and cross-entropy (forward and backward)
attention fwd / bwd                    the ``attention`` scope: cuDNN flash attention (or XLA's), its reshapes
matmuls fwd / bwd                      every other dot / cuBLAS / Triton GEMM (qkv, out-proj, MLP)
LayerNorm/GELU fwd / bwd               the ``layer_norm`` and ``gelu`` scopes' fusions (residual adds fused in)
embedding                              token + position lookups and their scatter-add backward
copies                                 memcpy / memset and copy instructions
other                                  anything else (named in the JSON)
host gaps (device idle)                the traced window minus the union of all device events
=====================================  ==========================================================================

The table also gives the ceiling: the MFU the step would reach if only its matmuls and attention ran, at the
rate they ran at (the time of everything else, gaps included, is what stands between the measured MFU and it).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

CATEGORIES = ["matmuls fwd", "matmuls bwd", "attention fwd", "attention bwd", "cross-entropy (lm_head + loss)",
              "LayerNorm/GELU fwd", "LayerNorm/GELU bwd", "embedding", "optimizer", "copies", "other",
              "host gaps (device idle)"]
COMPUTE = ("matmuls fwd", "matmuls bwd", "attention fwd", "attention bwd")  # the ceiling's "useful" time
GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|s16816|hmma", re.I)
ATTN_KERNEL = re.compile(r"cudnn|fmha|flash|sdpa|fprop|bprop", re.I)
ATTN_BWD_KERNEL = re.compile(r"bprop|bwd|backward|dgrad|_dq|dkv", re.I)
COPY_KERNEL = re.compile(r"memcpy|memset|copy", re.I)
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\(")


def hlo_index(hlo: str) -> dict[str, dict[str, str]]:
    """instruction name -> {"opcode", "op_name" (source scope), "target" (custom-call target / fusion kind)} for
    every instruction of an optimized HLO module's text."""
    out, with_dot, comp = {}, set(), None
    for line in hlo.splitlines():  # computations holding a dot: a fusion that calls one is a matmul
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$", line)
        if head:
            comp = head.group(1)
        elif comp and re.search(r"\s(dot|convolution)\(", line):
            with_dot.add(comp)
    for line in hlo.splitlines():
        m = INSTR.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        if calls and calls.group(1) in with_dot and opcode == "fusion":
            opcode = "fusion(dot)"
        op_name = re.search(r'op_name="([^"]*)"', line)
        target = re.search(r'custom_call_target="([^"]*)"', line) or re.search(r"kind=(k\w+)", line)
        triton = "__triton" in line or "triton_gemm" in line
        out[name] = {"opcode": opcode, "op_name": op_name.group(1) if op_name else "",
                     "target": (target.group(1) if target else "") + (" triton_gemm" if triton else "")}
    return out


def _is_matmul(opcode: str, target: str, kernel: str) -> bool:
    return (opcode in ("dot", "convolution", "fusion(dot)") or "gemm" in target.lower() or "cublas" in target.lower()
            or bool(GEMM_KERNEL.search(kernel)))


def categorize(kernel: str, instr: dict[str, str] | None) -> str:
    """The category of one device event: ``kernel`` its name, ``instr`` its HLO instruction (or None)."""
    op_name = instr["op_name"] if instr else ""
    opcode, target = (instr["opcode"], instr["target"]) if instr else ("", "")
    bwd = "transpose(" in op_name
    if "optimizer" in op_name:
        return "optimizer"
    if "cross_entropy" in op_name:
        return "cross-entropy (lm_head + loss)"
    if "attention" in op_name or (not instr and ATTN_KERNEL.search(kernel)) or "fmha" in target.lower():
        back = bwd or (not instr and bool(ATTN_BWD_KERNEL.search(kernel))) or "backward" in target.lower()
        return "attention bwd" if back else "attention fwd"
    if _is_matmul(opcode, target, kernel):
        return "matmuls bwd" if bwd else "matmuls fwd"
    if "layer_norm" in op_name or "gelu" in op_name:
        return "LayerNorm/GELU bwd" if bwd else "LayerNorm/GELU fwd"
    if "embed" in op_name:
        return "embedding"
    if opcode in ("copy", "copy-start", "copy-done") or COPY_KERNEL.search(kernel):
        return "copies"
    return "other"


def device_events(trace: dict[str, Any], instrs: dict[str, dict[str, str]]) -> tuple[list[dict], str]:
    """The trace's device events ({name, hlo_op, ts, dur} in microseconds) and where they came from: GPU kernels
    (events of a ``/device:GPU`` process) where there are any, else XLA:CPU thunks (host events named like an HLO
    instruction of the module)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in procs.items() if "/device:GPU" in name}
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if gpu_pids:
        out = []
        for e in xs:
            if e["pid"] not in gpu_pids:
                continue
            args = e.get("args", {})
            hlo_op = args.get("hlo_op") or args.get("long_name", "").split(":")[0] or e["name"]
            out.append({"name": e["name"], "hlo_op": hlo_op, "ts": float(e["ts"]), "dur": float(e["dur"])})
        return out, "GPU kernels"
    out = [{"name": e["name"], "hlo_op": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])}
           for e in xs if e["name"] in instrs]
    return out, "XLA:CPU thunks"


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarise(trace: dict[str, Any], hlo: str, steps: int, window_us: float | None = None) -> dict[str, Any]:
    """Per-category time per step (ms), share of the step, events per step and the top kernels; host gaps are the
    window (``window_us``: the traced steps' wall time; default first event start to last event end) minus the
    union of device events. On the CPU, thunks nest (a while loop's thunk holds its body's): only the innermost
    events (those containing no other) are summed, so nothing counts twice."""
    instrs = hlo_index(hlo)
    evs, source = device_events(trace, instrs)
    if not evs:
        raise ValueError("the trace holds no device events (was the step run inside jax.profiler.trace?)")
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    leaf = [e for i, e in enumerate(evs)
            if not (i + 1 < len(evs) and evs[i + 1]["ts"] < e["ts"] + e["dur"]
                    and evs[i + 1]["ts"] + evs[i + 1]["dur"] <= e["ts"] + e["dur"] and source != "GPU kernels")]
    start = min(e["ts"] for e in evs)
    stop = max(e["ts"] + e["dur"] for e in evs)
    window = window_us or (stop - start)
    busy = busy_union([(e["ts"], e["ts"] + e["dur"]) for e in evs])
    per: dict[str, dict[str, Any]] = {c: {"us": 0.0, "count": 0, "kernels": collections.Counter()} for c in CATEGORIES}
    unknown = collections.Counter()
    for e in leaf:
        instr = instrs.get(e["hlo_op"])
        c = categorize(e["name"], instr)
        if c == "other":
            unknown[f"{e['hlo_op']} ({e['name'][:60]})"] += e["dur"]
        per[c]["us"] += e["dur"]
        per[c]["count"] += 1
        per[c]["kernels"][e["name"][:80]] += e["dur"]
    per["host gaps (device idle)"]["us"] = max(0.0, window - busy)
    step_ms = window / steps / 1e3
    rows = [{"category": c, "ms_per_step": v["us"] / steps / 1e3, "share": v["us"] / window,
             "events_per_step": v["count"] / steps,
             "top": [(k, t / steps / 1e3) for k, t in v["kernels"].most_common(3)]} for c, v in per.items()]
    return {"source": source, "steps": steps, "step_ms": step_ms, "window_ms": window / 1e3,
            "device_busy_ms_per_step": busy / steps / 1e3, "events": len(evs), "rows": rows,
            "other_top": [(k, t / steps / 1e3) for k, t in unknown.most_common(10)]}


def ceiling(summary: dict[str, Any], mfu: float | None) -> float | None:
    """The MFU if the step were only its matmuls and attention, at the rate they ran at."""
    compute = sum(r["ms_per_step"] for r in summary["rows"] if r["category"] in COMPUTE)
    return mfu * summary["step_ms"] / compute if mfu and compute else None


def load_trace(trace_dir: Path) -> dict[str, Any]:
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir} (jax.profiler.trace(create_perfetto_trace=True))")
    with gzip.open(files[-1]) as f:
        return json.load(f)


def profile(*, dry: bool, batch: int, steps: int, policy: dict | None = None) -> dict[str, Any]:
    """Compile jaxgpt's train step (gpt2 124M, T=1024, padded vocabulary; ``dry``: tiny on the CPU), run 3
    warm-up steps, trace ``steps`` steps, and summarise the trace."""
    import jax
    from flax import nnx

    from benchmarks import impl
    from benchmarks.gpu.bench import DRY_SHAPES, PAD, SHAPES, flops, peak_of
    from benchmarks.worker import make_batch
    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT
    from jaxgpt.precision import Policy

    preset, seq = (DRY_SHAPES if dry else SHAPES)["gpt2"]
    cfg = GPTConfig.preset(preset, **PAD)
    pol = Policy.named("bf16", **(policy or {}))
    model = GPT(cfg, policy=pol, rngs=nnx.Rngs(0))
    opt, _ = impl.jax_optimizer()
    state, step_fn, src = impl.jax_train_step(model, opt, micro_steps=1)
    x, y = make_batch(cfg, 1, batch, seq)
    xd, yd, key = jax.device_put(x), jax.device_put(y), jax.random.key(0)
    t0 = time.perf_counter()
    hlo = step_fn.jitted.lower(state, xd, yd, key).compile().as_text()
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        state, _ = step_fn(state, xd, yd, key)
    jax.block_until_ready(state)
    tdir = common.TMP / f"gpu-trace-{int(time.time())}"
    with jax.profiler.trace(str(tdir), create_perfetto_trace=True):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, _ = step_fn(state, xd, yd, key)
        jax.block_until_ready(state)
        wall = time.perf_counter() - t0
    summary = summarise(load_trace(tdir), hlo, steps)
    dev = jax.devices()[0]
    peak, peak_src = peak_of(dev.device_kind)
    full, causal = flops(preset, batch, seq)
    mfu = full / (wall / steps) / peak if peak else None
    hlo_path = common.RESULTS / f"{_stem(dry, dev.device_kind, batch)}.hlo.txt.gz"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    with gzip.open(hlo_path, "wt") as f:
        f.write(hlo)
    trace_copy = common.RESULTS / f"{_stem(dry, dev.device_kind, batch)}.trace.json.gz"
    trace_copy.write_bytes(sorted(tdir.rglob("*.trace.json.gz"))[-1].read_bytes())
    return {"benchmark": "gpu_profile", "dry": dry, "device_kind": dev.device_kind, "preset": preset, "seq": seq,
            "batch": batch, "policy": str(pol), "train_step": src, "compile_s": compile_s,
            "traced_step_ms": wall / steps * 1e3, "mfu": mfu, "peak_source": peak_src, "flops_per_step": full,
            "flops_per_step_causal_halved": causal, "ceiling_mfu": ceiling(summary, mfu), "summary": summary,
            "versions": common.versions(), "git": os.environ.get("JAXGPT_GIT_REV") or common.git_rev(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "hlo_file": hlo_path.name, "trace_file": trace_copy.name}


def _stem(dry: bool, kind: str, batch: int) -> str:
    k = kind.lower()
    dev = "dry" if dry else "h200" if "h200" in k else "h100" if "h100" in k else "a100" if "a100" in k else "gpu"
    return f"profile-gpu-{dev}-b{batch}"


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    mfu = f"{100 * res['mfu']:.1f}%" if res.get("mfu") else "-"
    ceil = f"{100 * res['ceiling_mfu']:.1f}%" if res.get("ceiling_mfu") else "-"
    lines = [f"jaxgpt train step, `{res.get('preset')}` T={res.get('seq')} micro-batch {res.get('batch')}, "
             f"{res.get('device_kind')}, policy {res.get('policy')}; compile {res.get('compile_s', 0):.1f} s; "
             f"{s['steps']} traced steps of {res.get('traced_step_ms', s['step_ms']):.1f} ms (MFU {mfu}); "
             f"{s['source']}: {s['events']} events, device busy {s['device_busy_ms_per_step']:.1f} of "
             f"{s['step_ms']:.1f} ms per step; ceiling (only matmuls and attention, at their measured rate): "
             f"MFU {ceil}. git {res.get('git')}; jax {res.get('versions', {}).get('jax')}; "
             f"XLA_FLAGS={res.get('xla_flags') or '(none)'}.", "",
             "| where | ms/step | share | events/step | largest (ms/step) |", "|---|---:|---:|---:|---|"]
    for r in s["rows"]:
        top = "; ".join(f"`{k[:50]}` {t:.2f}" for k, t in r["top"][:2])
        lines.append(f"| {r['category']} | {r['ms_per_step']:.2f} | {100 * r['share']:.1f}% | "
                     f"{r['events_per_step']:.0f} | {top} |")
    if s["other_top"]:
        lines += ["", "Largest uncategorised: " + "; ".join(f"`{k[:70]}` {t:.2f} ms" for k, t in s["other_top"][:5])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (the code path; tests)")
    p.add_argument("--policy", default="{}", help='Policy overrides as JSON, e.g. \'{"attention": "xla"}\'')
    p.add_argument("--summarise", metavar="TRACE_DIR", help="only summarise a saved trace (with --hlo)")
    p.add_argument("--hlo", help="the compiled HLO text (.txt or .txt.gz) of the traced step")
    a = p.parse_args(argv)
    if a.summarise:
        if not a.hlo:
            p.error("--summarise needs --hlo")
        opener = gzip.open if a.hlo.endswith(".gz") else open
        with opener(a.hlo, "rt") as f:
            hlo = f.read()
        if Path(a.summarise).is_dir():
            trace = load_trace(Path(a.summarise))
        else:
            with gzip.open(a.summarise) as f:
                trace = json.load(f)
        print(markdown({"summary": summarise(trace, hlo, a.steps)}))
        return 0
    if a.dry:
        os.environ["JAX_PLATFORMS"] = "cpu"
    res = profile(dry=a.dry, batch=a.batch, steps=a.steps, policy=json.loads(a.policy))
    j, m = common.save_result(_stem(a.dry, res["device_kind"], a.batch), res, markdown(res))
    print(markdown(res))
    print(f"\nwrote {common.shown(j)}, {common.shown(m)}, {res['hlo_file']} and {res['trace_file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
