"""Where jaxgpt's train step spends its time on a GPU: a ``jax.profiler`` trace, summarised into a table.

    python -m benchmarks.gpu.profile --batch 32        # on a GPU: profile-gpu-<device>-b32.{md,json}, trace kept
    python -m benchmarks.gpu.profile --batch 64 --variant jax_bf16_fast   # a bench variant's policy: ...-b64-jax_bf16_fast
    python -m benchmarks.gpu.profile --dry             # the same code path on the CPU, tiny shapes (tests)
    python -m benchmarks.gpu.profile --summarise TRACE --hlo HLO.txt.gz [--meta RUN.json] [--json OUT.json]
    python -m benchmarks.gpu.profile --summarise TRACE --hlo HLO.txt.gz --trim-to-one-step OUT.trace.json.gz

Every device event (a GPU kernel; on the CPU, an XLA:CPU thunk) is matched to the HLO instruction that launched
it: by the trace's ``hlo_op`` argument where it names one, and inside CUDA-graph command buffers (``hlo_op`` =
``command_buffer_N``) by walking the module's schedule along the kernels (``benchmarks.gpu.hlo_trace``). Each
instruction has a scope in the compiled module's metadata: jaxgpt names its pieces with ``jax.named_scope``
(``layer_norm``, ``attention``, ``gelu``, ``cross_entropy``, ``embed``, ``optimizer``; a fusion whose root op
has none takes the one most of its fused ops name), and autodiff marks the backward pass ``transpose(jvp(...))``.
The first matching category wins:

=====================================  ==========================================================================
optimizer                              the ``optimizer`` scope: clipping's global norm, AdamW, the update
cross-entropy GEMMs (lm_head)          the loss chunks' matmuls (logits, and in the same loop their gradients)
cross-entropy elementwise              the rest of the loss chunks: max, exp-sum, softmax - onehot, casts, slices
attention fwd / bwd                    cuDNN flash attention (its helper kernels and memsets included), or the
                                       ``attention`` scope's matmuls (XLA's attention)
matmuls fwd / bwd                      every other GEMM (qkv, out-proj, MLP; cuBLAS or Triton), by
                                       ``transpose(`` in its scope
attention casts, layout fwd / bwd      the ``attention`` scope's other fusions (q/k/v casts, reshapes)
LayerNorm fwd / bwd, GELU fwd / bwd    the ``layer_norm`` and ``gelu`` scopes' fusions (residual adds and bf16
                                       casts fused in)
embedding                              token + position lookups and their scatter-add backward
copies                                 memcpy / memset and copy instructions outside the scopes above
residual adds, converts fwd / bwd      XLA fusions outside every named scope: the residual adds, the bf16 casts
                                       of weights and gradients, the small bias-gradient sums
other                                  anything else: events no instruction was found for (named in the JSON)
host gaps (device idle)                the traced window minus the union of all device events
=====================================  ==========================================================================

Where kernels overlap (a CUDA graph may run two side by side), each gets the time no earlier kernel covered, so
the categories sum to the device-busy time. ``--json`` also writes the time of every HLO instruction
(``instruction_times``: scope, category, launches and ms per step, kernel names), which calibrations read.
The table also gives the ceiling: the MFU the step would reach if only its matmuls and attention ran, at the
rate they ran at (the time of everything else, gaps included, is what stands between the measured MFU and it).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.gpu import hlo_trace

CATEGORIES = ["matmuls fwd", "matmuls bwd", "attention fwd", "attention bwd", "attention casts, layout fwd",
              "attention casts, layout bwd", "cross-entropy GEMMs (lm_head)", "cross-entropy elementwise",
              "LayerNorm fwd", "LayerNorm bwd", "GELU fwd", "GELU bwd", "residual adds, converts fwd",
              "residual adds, converts bwd", "embedding", "optimizer", "copies", "other", "host gaps (device idle)"]
COMPUTE = ("matmuls fwd", "matmuls bwd", "attention fwd", "attention bwd", "cross-entropy GEMMs (lm_head)")
ATTN_KERNEL = re.compile(r"cudnn|fmha|flash|sdpa|fprop|bprop", re.I)
ATTN_BWD_KERNEL = re.compile(r"bprop|bwd|backward|dgrad|_dq|dkv", re.I)
COPY_KERNEL = re.compile(r"memcpy|memset|copy", re.I)
SCOPES = ("optimizer", "cross_entropy", "attention", "layer_norm", "gelu", "embed")  # the first found wins
SCOPE = re.compile(r"\b(" + "|".join(SCOPES) + r")\b")
PALLAS_GEMM = re.compile(r"/gemm(?:_n(?:n|t|tsum)|2_n[nt]n[nt])_\w+/pallas_call")
ROW = {"layer_norm": "LayerNorm", "gelu": "GELU"}


@functools.lru_cache(maxsize=2)
def _module(hlo: str) -> hlo_trace.Module:
    return hlo_trace.parse(hlo)


def scope_of(mod: hlo_trace.Module, ins: hlo_trace.Instr) -> str:
    """The named scope an instruction belongs to: the one in its op_name, else (a fusion whose root op has none,
    e.g. the bf16 cast after GELU) the one most of the fused instructions name; "" if none."""
    m = [s for s in SCOPES if re.search(rf"\b{s}\b", ins.op_name)]
    if m:
        return m[0]
    found = collections.Counter(g.group(1) for o in mod.fused_op_names(ins) if (g := SCOPE.search(o)))
    return found.most_common(1)[0][0] if found else ""


def categorize(kernel: str, ins: hlo_trace.Instr | None, mod: hlo_trace.Module | None = None) -> str:
    """The category of one device event: ``kernel`` its name, ``ins`` the HLO instruction that launched it (None
    if unknown; then only its name can tell a copy or a library kernel)."""
    if ins is None:
        if COPY_KERNEL.search(kernel):
            return "copies"
        if ATTN_KERNEL.search(kernel):
            return "attention bwd" if ATTN_BWD_KERNEL.search(kernel) else "attention fwd"
        return "other"
    scope = scope_of(mod, ins) if mod else ""
    bwd = " bwd" if "transpose(" in ins.op_name else " fwd"
    # a Pallas GEMM (jaxgpt.kernels.gemm's kernels, named gemm_nn_*, gemm_nt_*, gemm_ntsum_*) counts as a GEMM with its epilogue
    gemm = (mod.is_gemm(ins) if mod else False) or bool(PALLAS_GEMM.search(ins.op_name))
    root = SCOPE.search(ins.op_name)
    if scope == "optimizer":
        return "optimizer"
    if scope == "cross_entropy":
        return "cross-entropy GEMMs (lm_head)" if gemm else "cross-entropy elementwise"
    if "fmha" in ins.kind:
        return "attention bwd" if "Backward" in ins.kind else "attention fwd"
    if gemm:
        return ("attention" if root and root.group(1) == "attention" else "matmuls") + bwd
    if scope == "attention":
        return "attention casts, layout" + bwd
    if scope in ROW:
        return ROW[scope] + bwd
    if scope == "embed":
        return "embedding"
    if ins.opcode in ("copy", "copy-start") or (ins.opcode == "custom-call" and COPY_KERNEL.search(kernel)):
        return "copies"
    if ins.opcode in ("fusion", "fusion-start"):
        return "residual adds, converts" + bwd
    return "other"


def _leaves(pairs: list[tuple[dict, Any]], nested: bool) -> list[tuple[dict, Any]]:
    """On the CPU thunks nest (a while loop's thunk holds its body's): only the innermost events count."""
    if not nested:
        return pairs
    evs = [e for e, _ in pairs]
    return [p for i, p in enumerate(pairs)
            if not (i + 1 < len(evs) and evs[i + 1]["ts"] < evs[i]["ts"] + evs[i]["dur"]
                    and evs[i + 1]["ts"] + evs[i + 1]["dur"] <= evs[i]["ts"] + evs[i]["dur"])]


def _mapped(trace: dict[str, Any] | list, mod: hlo_trace.Module, steps: int | None,
            window_us: float | None = None) -> dict[str, Any]:
    """The mapped events of the traced steps, their number and window (see summarise)."""
    m = hlo_trace.map_events(trace, mod)
    pairs = _leaves(m["pairs"], m["source"] != "GPU kernels")
    if not pairs:
        raise ValueError("the trace holds no device events (was the step run inside jax.profiler.trace?)")
    if m["steps"]:  # the walk's whole steps: the window is theirs (a partial last step is left out)
        walked = [e for e, i in pairs if i is not None and e["hlo_op"] not in mod.instrs] or [pairs[0][0]]
        lo, hi = walked[0]["ts"], max(e["ts"] + e["dur"] for e in walked)
        pairs = [p for p in pairs if lo <= p[0]["ts"] < hi]
    start = min(e["ts"] for e, _ in pairs)
    stop = max(e["ts"] + e["dur"] for e, _ in pairs)
    if steps is None:
        steps = m["steps"] or _steps_from_counts(pairs, mod)
    return {**m, "pairs": pairs, "steps": steps, "window_us": window_us or (stop - start)}


def _steps_from_counts(pairs: list[tuple[dict, Any]], mod: hlo_trace.Module) -> int:
    """Steps in a trace mapped by hlo_op: the launches of the schedule's first instruction (one event each)."""
    first = next((la.instr for la in hlo_trace.schedule(mod) if not la.optional), None)
    n = sum(1 for _, i in pairs if i is first)
    if not n:
        raise ValueError("cannot tell how many steps the trace holds: pass --steps")
    return n


def summarise(trace: dict[str, Any] | list, hlo: str, steps: int | None = None,
              window_us: float | None = None) -> dict[str, Any]:
    """Per-category time per step (ms), share of the step, events per step and the top kernels; host gaps are the
    window (``window_us``: the traced steps' wall time; default first event start to last event end) minus the
    union of device events; where kernels overlap, each category gets the time no earlier kernel covered
    (``exclusive_us``), so the categories sum to the device-busy time (``device_busy_ms_per_step``) and, with the
    host gaps, to the window. ``steps``: how many steps the trace holds (default: the whole steps the
    command-buffer walk found, else the launches of the schedule's first instruction)."""
    mod = _module(hlo)
    m = _mapped(trace, mod, steps, window_us)
    steps, window, pairs = m["steps"], m["window_us"], m["pairs"]
    busy = hlo_trace.busy_union([(e["ts"], e["ts"] + e["dur"]) for e, _ in pairs])
    per: dict[str, dict[str, Any]] = {c: {"us": 0.0, "count": 0, "kernels": collections.Counter()} for c in CATEGORIES}
    unknown = collections.Counter()
    for (e, ins), us in zip(pairs, hlo_trace.exclusive_us([e for e, _ in pairs])):
        c = categorize(e["name"], ins, mod)
        if c == "other":
            unknown[f"{ins.name if ins else e['hlo_op'] or '?'} ({e['name'][:60]})"] += us
        per[c]["us"] += us
        per[c]["count"] += 1
        per[c]["kernels"][e["name"][:80]] += us
    per["host gaps (device idle)"]["us"] = max(0.0, window - busy)
    rows = [{"category": c, "ms_per_step": v["us"] / steps / 1e3, "share": v["us"] / window,
             "events_per_step": v["count"] / steps,
             "top": [(k, t / steps / 1e3) for k, t in v["kernels"].most_common(3)]} for c, v in per.items()]
    summed = sum(r["ms_per_step"] for r in rows[:-1])  # = busy (exclusive_us), up to rounding
    return {"source": m["source"], "mapping": m["mapping"], "steps": steps, "step_ms": window / steps / 1e3,
            "window_ms": window / 1e3, "device_busy_ms_per_step": busy / steps / 1e3,
            "kernel_ms_per_step": summed, "events": len(pairs), "rows": rows,
            "other_share_of_busy": per["other"]["us"] / busy if busy else 0.0,
            "other_top": [(k, t / steps / 1e3) for k, t in unknown.most_common(10)]}


def instruction_times(trace_path_or_events: str | Path | dict | list, hlo_text: str,
                      steps: int | None = None) -> list[dict[str, Any]]:
    """The measured time of every HLO instruction of the traced step, in schedule order: one dict each with
    ``name``, ``opcode``, ``kind`` (a fusion's kind -- kLoop, kInput, kCustom, ``__triton`` appended -- or a
    custom-call's target), ``shape`` (its result type), ``op_name``, ``scope`` (its named scope, see
    ``scope_of``), ``direction`` (fwd, or bwd under autodiff's ``transpose(jvp(...))``), ``category`` (the
    profile table's row), ``executions_per_step`` (how often the HLO schedule runs it: a loop body's trip count; a
    loop condition's is one more, though a counted loop on a GPU may not run it at all),
    ``executions_mapped_per_step`` (how often the command-buffer walk found it run; None without a walk),
    ``launches_per_step`` (the events mapped to it, a library call's helper kernels and memsets included),
    ``ms_per_step`` (its kernels' durations summed) and ``kernels`` ({kernel name: launches per step}).

    ``trace_path_or_events``: a ``*.trace.json.gz`` file (or a directory holding one), the loaded trace, or its
    list of events; ``hlo_text``: the optimized HLO module the trace ran; ``steps`` as in ``summarise``. Events no
    instruction could be found for are left out (``summarise`` counts them as "other")."""
    trace = trace_path_or_events
    if isinstance(trace, (str, Path)):
        trace = hlo_trace.read_trace(Path(trace))
    mod = _module(hlo_text)
    m = _mapped(trace, mod, steps)
    steps = m["steps"]
    execs = collections.Counter(la.instr.name for la in hlo_trace.schedule(mod))
    ran = m["executions"]
    acc: dict[str, dict[str, Any]] = {}
    for e, ins in m["pairs"]:
        if ins is None:
            continue
        a = acc.setdefault(ins.name, {"us": 0.0, "n": 0, "kernels": collections.Counter(), "ins": ins,
                                      "category": categorize(e["name"], ins, mod)})
        a["us"] += e["dur"]
        a["n"] += 1
        a["kernels"][e["name"]] += 1
    order = {name: k for k, name in enumerate(dict.fromkeys(la.instr.name for la in hlo_trace.schedule(mod)))}
    out = []
    for name, a in sorted(acc.items(), key=lambda kv: order.get(kv[0], len(order))):
        ins = a["ins"]
        out.append({"name": name, "opcode": ins.opcode, "kind": ins.kind, "shape": ins.shape,
                    "op_name": ins.op_name, "scope": scope_of(mod, ins),
                    "direction": "bwd" if "transpose(" in ins.op_name else "fwd", "category": a["category"],
                    "executions_per_step": execs.get(name, 0),
                    "executions_mapped_per_step": ran[name] / steps if ran is not None else None,
                    "launches_per_step": a["n"] / steps,
                    "ms_per_step": a["us"] / steps / 1e3,
                    "kernels": {k: n / steps for k, n in a["kernels"].most_common()}})
    return out


def ceiling(summary: dict[str, Any], mfu: float | None) -> float | None:
    """The MFU if the step were only its matmuls and attention, at the rate they ran at."""
    compute = sum(r["ms_per_step"] for r in summary["rows"] if r["category"] in COMPUTE)
    return mfu * summary["step_ms"] / compute if mfu and compute else None


def profile(*, dry: bool, batch: int, steps: int, policy: dict | None = None, label: str = "") -> dict[str, Any]:
    """Compile jaxgpt's train step (gpt2 124M, T=1024, padded vocabulary; ``dry``: tiny on the CPU), run 3
    warm-up steps, trace ``steps`` steps, and summarise the trace. ``label`` (a bench variant's name) goes into the
    files' stem; the Pallas kernels the step was built with are recorded (``pallas_kernels``)."""
    import jax
    from flax import nnx

    from benchmarks import impl
    from benchmarks.gpu import pallas_tiles
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
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t0 = time.perf_counter()
    with pallas_tiles.recording() as kernels:  # traced (its Pallas kernels built) in the lowering
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
    trace = hlo_trace.load_trace(tdir)
    summary = summarise(trace, hlo, steps)
    instructions = instruction_times(trace, hlo, steps)
    dev = jax.devices()[0]
    peak, peak_src = peak_of(dev.device_kind)
    full, causal = flops(preset, batch, seq)
    mfu = full / (wall / steps) / peak if peak else None
    stem = _stem(dry, dev.device_kind, batch, label)
    hlo_path = common.RESULTS / f"{stem}.hlo.txt.gz"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    with gzip.open(hlo_path, "wt") as f:
        f.write(hlo)
    trace_copy = common.RESULTS / f"{stem}.trace.json.gz"
    trace_copy.write_bytes(sorted(tdir.rglob("*.trace.json.gz"))[-1].read_bytes())
    return {"benchmark": "gpu_profile", "dry": dry, "device_kind": dev.device_kind, "preset": preset, "seq": seq,
            "batch": batch, "label": label, "started": started, "policy": str(pol), "pallas_kernels": kernels,
            "train_step": src, "compile_s": compile_s,
            "traced_step_ms": wall / steps * 1e3, "mfu": mfu, "peak_source": peak_src, "flops_per_step": full,
            "flops_per_step_causal_halved": causal, "ceiling_mfu": ceiling(summary, mfu), "summary": summary,
            "instructions": instructions,
            "versions": common.versions(), "git": os.environ.get("JAXGPT_GIT_REV") or common.git_rev(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "hlo_file": hlo_path.name, "trace_file": trace_copy.name}


def _stem(dry: bool, kind: str, batch: int, label: str = "") -> str:
    k = kind.lower()
    dev = "dry" if dry else "h200" if "h200" in k else "h100" if "h100" in k else "a100" if "a100" in k else "gpu"
    return f"profile-gpu-{dev}-b{batch}" + (f"-{label}" if label else "")


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    mfu = f"{100 * res['mfu']:.1f}%" if res.get("mfu") else "-"
    ceil = f"{100 * res['ceiling_mfu']:.1f}%" if res.get("ceiling_mfu") else "-"
    lines = [f"jaxgpt train step, `{res.get('preset')}` T={res.get('seq')} micro-batch {res.get('batch')}, "
             f"{res.get('device_kind')}, policy {res.get('policy')}; compile {res.get('compile_s', 0):.1f} s; "
             f"{s['steps']} traced steps of {res.get('traced_step_ms', s['step_ms']):.1f} ms (MFU {mfu}); "
             f"{s['source']}: {s['events']} events, device busy {s['device_busy_ms_per_step']:.1f} of "
             f"{s['step_ms']:.1f} ms per step; ceiling (only matmuls, the lm_head and attention, at their measured "
             f"rate): MFU {ceil}. git {res.get('git')}; jax {res.get('versions', {}).get('jax')}; "
             f"XLA_FLAGS={res.get('xla_flags') or '(none)'}.", "",
             f"Kernels mapped to HLO instructions by {s.get('mapping', 'hlo_op')}; \"other\" is "
             f"{100 * s.get('other_share_of_busy', 0):.1f}% of the device-busy time; the kernel rows sum to "
             f"{s.get('kernel_ms_per_step', 0):.2f} ms per step.", "",
             "| where | ms/step | share | events/step | largest (ms/step) |", "|---|---:|---:|---:|---|"]
    for r in s["rows"]:
        top = "; ".join(f"`{k[:50]}` {t:.2f}" for k, t in r["top"][:2])
        lines.append(f"| {r['category']} | {r['ms_per_step']:.2f} | {100 * r['share']:.1f}% | "
                     f"{r['events_per_step']:.0f} | {top} |")
    if s["other_top"]:
        lines += ["", "Largest uncategorised: " + "; ".join(f"`{k[:70]}` {t:.2f} ms" for k, t in s["other_top"][:5])]
    if res.get("pallas_kernels"):
        from benchmarks.gpu.pallas_tiles import gemm_tiles

        tiles = gemm_tiles(res["pallas_kernels"])
        lines += ["", "Pallas GEMM tiles (bm x bn x bk, warps, stages, grid): " + ("; ".join(tiles) if tiles else "none")]
    return "\n".join(lines)


def dumps(res: dict[str, Any]) -> str:
    """The result as JSON, one line per instruction of its per-instruction list (a few hundred kB, not MBs)."""
    rest = {k: v for k, v in res.items() if k != "instructions"}
    text = json.dumps(rest, indent=1)
    if "instructions" not in res:
        return text + "\n"
    rows = ",\n  ".join(json.dumps(i, separators=(",", ":")) for i in res["instructions"])
    return text[:-2] + ',\n "instructions": [\n  ' + rows + "\n ]\n}\n"


def _read_hlo(path: str) -> str:
    if not Path(path).is_file():
        raise SystemExit(f"--hlo {path}: no such file (the optimized HLO text the profile wrote, .txt or .txt.gz)")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def resummarise(trace_path: Path, hlo: str, meta: dict[str, Any] | None = None,
                steps: int | None = None) -> dict[str, Any]:
    """A saved trace summarised again: ``meta`` (the result the harness wrote with it) keeps its run's fields
    (device, policy, compile time, measured MFU, versions); summary, ceiling and the per-instruction list are new."""
    trace = hlo_trace.read_trace(trace_path)
    summary = summarise(trace, hlo, steps)
    res = dict(meta or {})
    res.update({"summary": summary, "instructions": instruction_times(trace, hlo, summary["steps"]),
                "ceiling_mfu": ceiling(summary, res.get("mfu")), "trace_file": trace_path.name,
                "summarised_by": "python -m benchmarks.gpu.profile --summarise"})
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=None,
                   help="steps to trace (default 5); with --summarise: steps in the trace (default: found in it)")
    p.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (the code path; tests)")
    p.add_argument("--policy", default="{}", help='Policy overrides as JSON, e.g. \'{"attention": "xla"}\'')
    p.add_argument("--variant", help="a bench variant's Policy fields (benchmarks.gpu.worker.VARIANT_POLICY, e.g. "
                   "jax_bf16_fast), added to --policy; its name goes into the files' stem")
    p.add_argument("--summarise", metavar="TRACE", help="only summarise a saved trace (a .trace.json.gz or the "
                   "directory holding it; with --hlo)")
    p.add_argument("--hlo", help="the compiled HLO text (.txt or .txt.gz) of the traced step")
    p.add_argument("--meta", help="with --summarise: the result JSON the profile wrote with the trace (its run's "
                   "device, policy, MFU, versions are kept)")
    p.add_argument("--json", metavar="FILE", help="with --summarise: write the result (table, per-instruction "
                   "times) to FILE and its table to FILE with .md")
    p.add_argument("--trim-to-one-step", metavar="OUT", help="with --summarise: write one step of the trace "
                   "(its GPU events only) to OUT (.trace.json.gz)")
    a = p.parse_args(argv)
    if a.summarise:
        if not a.hlo:
            p.error("--summarise needs --hlo")
        hlo = _read_hlo(a.hlo)
        trace_path = Path(a.summarise)
        if a.trim_to_one_step:
            try:
                kept = hlo_trace.trim_to_one_step(hlo_trace.read_trace(trace_path), hlo, Path(a.trim_to_one_step))
            except (ValueError, FileNotFoundError) as err:
                raise SystemExit(f"cannot trim {a.summarise}: {err}") from None
            print(f"wrote {a.trim_to_one_step}: step {kept['step']} of {kept['of_steps']}, {kept['events']} events, "
                  f"device busy {kept['busy_ms']:.1f} ms")
            return 0
        meta = json.loads(Path(a.meta).read_text()) if a.meta else None
        try:
            res = resummarise(trace_path, hlo, meta, a.steps)
        except (ValueError, FileNotFoundError) as err:
            raise SystemExit(f"cannot summarise {a.summarise}: {err}") from None
        print(markdown(res))
        if a.json:
            out = Path(a.json)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(dumps(res))
            out.with_suffix(".md").write_text(markdown(res) + "\n")
            print(f"\nwrote {out} and {out.with_suffix('.md')}")
        return 0
    if a.json or a.meta or a.trim_to_one_step:
        p.error("--json, --meta and --trim-to-one-step go with --summarise")
    if a.dry:
        os.environ["JAX_PLATFORMS"] = "cpu"
    policy = json.loads(a.policy)
    if a.variant:
        from benchmarks.gpu.worker import VARIANT_POLICY

        if a.variant not in VARIANT_POLICY:
            p.error(f"--variant {a.variant}: not a bench variant with Policy fields; valid: {sorted(VARIANT_POLICY)}")
        policy = {**VARIANT_POLICY[a.variant], **policy}
    res = profile(dry=a.dry, batch=a.batch, steps=a.steps or 5, policy=policy, label=a.variant or "")
    j, m = common.save_result(_stem(a.dry, res["device_kind"], a.batch, a.variant or ""), res, markdown(res))
    j.write_text(dumps(res))  # one line per instruction
    print(markdown(res))
    print(f"\nwrote {common.shown(j)}, {common.shown(m)}, {res['hlo_file']} and {res['trace_file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
