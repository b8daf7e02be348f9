"""Write ``BENCHMARKS.md`` from the latest results under ``benchmarks/results/`` (``python -m benchmarks.report``).

It reads ``train_step-{small,gpt2,gpt2-t256}-tuned.json``, ``train_step-small-default.json``, ``generate.json``
and ``data_loader.json`` (whichever exist), and checks the speed targets against them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import common, data_loader, gemm_ceiling, generate, train_step

TRAIN_FILES = [("small", "tuned"), ("gpt2", "tuned"), ("gpt2-t256", "tuned"), ("small", "default")]


def _load(name: str) -> dict[str, Any] | None:
    p = common.RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _tps(res, v):
    r = res["variants"].get(v, {}) if res else {}
    return None if not r or "error" in r else r["tokens_per_s"]["median"]


def default_variant(res: dict[str, Any]) -> str:
    """jaxgpt's default variant in a train-step result (results from before the field existed: jax_bf16)."""
    return res.get("default_jax_variant", "jax_bf16")


def best_peak(res: dict[str, Any]) -> tuple[float | None, str | None]:
    """The machine's best measured GEMM rate in a train-step result, GFLOP/s, and its dtype (fp32 or bf16)."""
    pk = {dt: res["gemm_peak"][dt]["best_gflops"] for dt in ("fp32", "bf16") if res["gemm_peak"][dt]["best_gflops"]}
    if not pk:
        return None, None
    dt = max(pk, key=pk.get)
    return pk[dt], dt


def ceiling(res: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest jaxgpt's default step could possibly run in ``res``: its matmul FLOPs, with causal attention
    counted half (no implementation needs more), at the best rate the jax GEMM probe reached at the default
    precision, with all other work (softmax, LayerNorm, GELU, AdamW, copies) taking no time. A ratio target above
    ``ceiling / torch`` cannot be met on that machine with XLA's GEMMs."""
    precision = default_variant(res).removeprefix("jax_")
    gflops = res["gemm_peak"].get(precision, {}).get("jax_gflops")
    flops = res.get("flops_per_step_causal")  # absent from results older than the count: then no valid bound
    if not (gflops and flops):
        return None
    tokens = res["seq"] * res["batch"] * res.get("micro_steps", 1)
    return {"precision": precision, "gflops": gflops, "tokens_per_s": tokens * gflops * 1e9 / flops}


def targets(train: dict[str, dict], gen: dict | None) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows. The issue's targets compare jaxgpt's default with torch_ref's
    torch.compile + bf16 autocast; where another torch variant is faster on this machine, a row compares with
    that one too (the stricter reading)."""
    rows = []
    for shape in ("small", "gpt2", "gpt2-t256"):
        res = train.get(f"{shape}-tuned")
        if not res:
            continue
        d, fastest = default_variant(res), res.get("fastest_torch")
        j, t = _tps(res, d), _tps(res, "torch_compile_bf16")
        tc = res["variants"].get("torch_compile_bf16", {})
        if j and t:
            rows.append((f"{shape}: jaxgpt default ({d}) >= 1.2x torch_ref torch.compile bf16",
                         f"{j:,.0f} / {t:,.0f} tok/s = {j / t:.2f}x", "met" if j / t >= 1.2 else "NOT met"))
        elif j and tc.get("skipped"):  # e.g. torch's bf16 GEMM at ~1 GFLOP/s on an AVX2-only CPU
            rows.append((f"{shape}: jaxgpt default ({d}) >= 1.2x torch_ref torch.compile bf16",
                         f"torch_compile_bf16 {tc['error']}", "not measurable here: see the fastest torch variant"))
        f = _tps(res, fastest)
        if j and f and fastest != "torch_compile_bf16":
            rows.append((f"{shape}: jaxgpt default ({d}) >= 1.2x the fastest torch variant here ({fastest})",
                         f"{j:,.0f} / {f:,.0f} tok/s = {j / f:.2f}x", "met" if j / f >= 1.2 else "NOT met"))
        c = ceiling(res)
        if c and f:
            rows.append((f"{shape}: ceiling of that ratio (the step's matmul FLOPs, causal attention counted half, "
                         f"at the best jax {c['precision']} GEMM probe, {c['gflops']:,.0f} GFLOP/s, and nothing else)",
                         f"{c['tokens_per_s']:,.0f} / {f:,.0f} tok/s = {c['tokens_per_s'] / f:.2f}x",
                         "1.2x reachable in principle" if c["tokens_per_s"] / f >= 1.2
                         else "1.2x out of reach at the probe's GEMM rate"))
    res = train.get("small-tuned")
    d = default_variant(res) if res else None
    if res and "error" not in res["variants"].get(d, {"error": 1}):
        pk, dt = best_peak(res)
        ach = res["variants"][d]["achieved_gflops"]
        if pk:
            label = "bf16->fp32" if dt == "bf16" else "fp32"
            rows.append((f"small: {d} >= 60% of the machine's GEMM peak (the faster of the fp32 and bf16->fp32 "
                         f"probes: {label})", f"{ach:,.0f} of {pk:,.0f} GFLOP/s = {100 * ach / pk:.0f}%",
                         "met" if ach / pk >= 0.6 else "NOT met"))
    res = train.get("gpt2-tuned")
    d = default_variant(res) if res else None
    if res and "error" not in res["variants"].get(d, {"error": 1}):
        c = res["variants"][d]["cold_first_step_s"]["first_round"]
        rows.append((f"gpt2 124M (T=1024): {d} cold first step (trace + compile + run) <= 30 s", f"{c:.1f} s",
                     "met" if c <= 30 else "NOT met"))
    if gen:
        for n in gen["prompt_counts"]:
            jk = [k for k in gen["rows"] if k.startswith("jax_") and k.endswith(f"@{n}") and "error" not in gen["rows"][k]]
            hk = [k for k in gen["rows"] if k.startswith("hf_") and k.endswith(f"@{n}") and "error" not in gen["rows"][k]]
            if jk and hk:
                bj = max(jk, key=lambda k: gen["rows"][k]["tokens_per_s"]["median"])
                bh = max(hk, key=lambda k: gen["rows"][k]["tokens_per_s"]["median"])
                a, b = gen["rows"][bj]["tokens_per_s"]["median"], gen["rows"][bh]["tokens_per_s"]["median"]
                rows.append((f"generate, {n} prompt(s): jaxgpt with cache >= transformers generate",
                             f"{bj.split('@')[0]} {a:,.1f} vs {bh.split('@')[0]} {b:,.1f} tok/s = {a / b:.2f}x",
                             "met" if a >= b else "NOT met"))
    return rows


def allocator_table(train: dict[str, dict]) -> str | None:
    t, d = train.get("small-tuned"), train.get("small-default")
    if not (t and d):
        return None
    lines = ["| variant | default malloc tok/s | tuned GLIBC_TUNABLES tok/s | tuned / default |", "|---|---:|---:|---:|"]
    for v in t["variants"]:
        a, b = _tps(d, v), _tps(t, v)
        if a and b:
            lines.append(f"| {v} | {a:,.0f} | {b:,.0f} | {b / a:.2f}x |")
    return "\n".join(lines)


def _is_dot(name: str, what: str) -> bool:
    return name.startswith("ynn_fusion") and "dot_general" in what


def profile_section(train: dict[str, dict]) -> list[str]:
    """Where jaxgpt's default step's time goes (``benchmarks.profile_step``'s trace of the small config at the
    default precision), and the floor it implies: the step's matmul FLOPs at the GEMM probe's peak, plus the
    measured non-matmul work."""
    res = train.get("small-tuned")
    precision = default_variant(res).removeprefix("jax_") if res else "bf16"
    name = f"profile-small-{precision}"
    prof = _load(name)
    if not prof or not prof.get("trace_ops"):
        return []
    steps = prof["steps"]
    # thunks only: not the Python-side events ($...), the executor, the while loop (its body's thunks are listed
    # on their own) or thread-pool waits
    ops = [(n, ms / steps, c, w) for n, ms, c, w in prof["trace_ops"]
           if not n.startswith(("$", "while", "SlinkyThreadPool")) and "Execute" not in n and "Pjit" not in n]
    times = sorted(prof["step_times_s"])
    step_ms = 1e3 * times[len(times) // 2]
    dot_ms = sum(ms for n, ms, _, w in ops if _is_dot(n, w))
    head_ms = sum(ms for n, ms, _, w in ops if _is_dot(n, w) and "/while/" in w)  # the chunked lm_head + loss
    other_ms = sum(ms for n, ms, _, w in ops if not _is_dot(n, w))
    if precision == "bf16":
        upcast = sum(1 for d in prof.get("dots", []) if d["operand_dtypes"] == ["f32", "f32"])
        dtypes = ("Every dot takes bf16 operands" if not upcast else
                  f"{upcast} dot(s) run with fp32 operands where bf16 was meant") + " (the HLO check in the same run)."
    else:
        dtypes = "Every dot is fp32 x fp32 -> fp32, as the policy asks."
    out = [f"## Where the time goes (small, jax_{precision})", "",
           f"`python -m benchmarks.profile_step --config small --precision {precision}` (git {prof['git']}, load "
           f"avg {prof['loadavg'][0]:.2f}; full tables in `benchmarks/results/{name}.md`): median step "
           f"{step_ms:,.0f} ms under the profiler. XLA:CPU thunks summed over the step: matmuls (YNNPACK) "
           f"{dot_ms:,.0f} ms, of which the lm_head's (inside the chunked loss) {head_ms:,.0f} ms; everything else "
           f"{other_ms:,.0f} ms (XLA runs independent thunks concurrently, so the sums can exceed the step). "
           + dtypes, ""]
    if res:
        causal = res.get("flops_per_step_causal")  # the same count as the targets' ceiling row, where recorded
        gflop = (causal or res["flops_per_step"]) / 1e9
        peak = res["gemm_peak"][precision]["best_gflops"]
        floor_ms = 1e3 * gflop / peak
        fastest = res.get("fastest_torch")
        t = _tps(res, fastest)
        tokens = res["seq"] * res["batch"] * res.get("micro_steps", 1)  # per step
        from jaxgpt.config import GPTConfig

        cfg = GPTConfig.preset(res["preset"])
        head = 6 * tokens * cfg.n_embd * cfg.vocab_size / 1e9  # the tied lm_head's forward + 2 backward matmuls
        row = res["variants"].get(f"jax_{precision}", {})
        bench_ms = 1e3 * row["step_s"]["median"] if row and not common.failed(row) else None
        out += [f"Floor: {gflop:,.1f} GFLOP of matmuls per step ("
                + ("causal attention counted half" if causal else "attention unmasked")
                + f") at the probe's {precision} {peak:,.0f} GFLOP/s is "
                f"{floor_ms:,.0f} ms = {tokens / floor_ms * 1e3:,.0f} tok/s"
                + (f", {tokens / floor_ms * 1e3 / t:.2f}x this run's fastest torch variant ({fastest})" if t else "")
                + (f"; the train-step table's jax_{precision} step takes {bench_ms:,.0f} ms, {bench_ms / floor_ms:.2f}x "
                   "that floor" if bench_ms else "")
                + f". The lm_head's three matmuls are {100 * head / gflop:.0f}% of the FLOPs. The thunk times above "
                "are not a serial budget: XLA:CPU runs independent thunks (a backward's dX and dW dots, elementwise "
                "fusions beside them) concurrently, each on part of the cores, so a thunk's time includes what ran "
                "beside it and the sums exceed the step.", ""]
    out += ["| thunk | ms/step | calls/step | what |", "|---|---:|---:|---|"]
    for n, ms, c, w in sorted(ops, key=lambda r: -r[1])[:12]:
        out.append(f"| {n} | {ms:,.1f} | {c / steps:g} | {w[:90]} |")
    return out + [""]


def ceiling_section(ceil: dict | None, train: dict) -> list[str]:
    """How close the GEMM libraries, and jaxgpt's small step, come to what this CPU can do at all."""
    if not ceil:
        return []
    out = ["## GEMM ceiling: what this CPU allows", "", gemm_ceiling.markdown(ceil), ""]
    if "skipped" in ceil:
        return out
    kern = ceil[f"kernel_gflops_{ceil['cores']}t"]
    res = train.get("small-tuned")
    row = (res or {}).get("variants", {}).get("jax_fp32", {})
    note = ("The FMA row is the hard bound: the units' peak with no loads at all. The microkernel is the inner loop "
            "of a BLAS GEMM with its operands already in L1/L2; a full GEMM adds packing, memory traffic and edges "
            "to it, so its rate is a practical ceiling for an fp32 matmul on this CPU (measured, not proven).")
    if row and not common.failed(row) and res.get("flops_per_step_causal"):
        gflops = res["flops_per_step_causal"] / 1e9 / (row["step_s"]["median"])
        tokens = res["seq"] * res["batch"] * res.get("micro_steps", 1)
        best = tokens * kern * 1e9 / res["flops_per_step_causal"]
        fastest = res.get("fastest_torch")
        t = _tps(res, fastest)
        note += (f" jaxgpt's small step (the train-step table above: another run, and this machine's speed drifts "
                 f"by several percent between runs) runs its matmul FLOPs, causal attention counted half, "
                 f"at {gflops:,.0f} GFLOP/s = {gflops / kern:.0%} of the microkernel; every matmul at the microkernel "
                 f"rate and nothing else would be {best:,.0f} tok/s"
                 + (f", {best / t:.2f}x {fastest}" if t else "") + ".")
    return out + [note, "", f"Command: `{ceil['command']}`", ""]


def gpu_section() -> list[str]:
    """The GPU tables written by the harness on a GPU (``train_step-gpu-<device>*.json``, the A/B, the profile,
    the end-to-end training run), or what to run where there are none yet."""
    from benchmarks.gpu import bench

    tables = sorted(p for p in common.RESULTS.glob("train_step-gpu-*.json") if "dry" not in p.name)
    out = ["## GPU: gpt2 124M against torch.compile", ""]
    if not tables:
        return out + [
            "**Not yet measured**: no GPU has been lent to this project's sessions since the GPU harness was built "
            "(issue 15). On a GPU, `python -m benchmarks.gpu.bench` writes "
            "`train_step-gpu-<device>.json` (jaxgpt's bf16 default against torch_ref under torch.compile + bf16 "
            "autocast + flash SDPA + fused AdamW, and eager, at micro-batch 16, 32, 64, 128 until one does not "
            "fit, with tokens/s, MFU against the device's dense bf16 peak, peak memory and the cold first step), "
            "and `python -m benchmarks.gpu.session {table,ab,profile,parity}` runs the whole plan (the A/B of the "
            "XLA flags and kernel choices, the traced step summarised by `benchmarks.gpu.profile`, the end-to-end "
            "`python -m jaxgpt.train` check, the CUDA parity tests) in parts of under 10 minutes. "
            "`python -m benchmarks.gpu.bench --dry` rehearses the same code on the CPU (the GPU tools: "
            "`benchmarks/gpu/`).", ""]
    for p in tables:
        res = json.loads(p.read_text())
        dev = p.stem.removeprefix("train_step-gpu-")
        out += gpu_summary(res, e2e_result(dev)) + [f"### `{p.stem}`", "", bench.markdown(res), "",
                                                     f"Command: `{res['command']}`", ""]
    for name, title in (("gpu-ab", "jaxgpt A/B, one knob at a time"),):
        md = common.RESULTS / f"{name}.md"
        if md.exists():
            out += [f"### {title}", "", md.read_text().rstrip(), ""]
    for md in sorted(common.RESULTS.glob("profile-gpu-*.md")):
        if "dry" not in md.name:
            one = common.ROOT / "tests" / "data" / f"{md.stem}-one-step.trace.json.gz"
            out += [f"### Where the step's time goes (`{md.stem}`)", "", md.read_text().rstrip(), "",
                    f"Summarised from the run's trace and its optimized HLO (`benchmarks/results/{md.stem}.hlo.txt.gz`)"
                    f" by `python -m benchmarks.gpu.profile --summarise TRACE --hlo HLO --meta RUN.json --json OUT`; "
                    f"`{md.stem}.json` also holds every HLO instruction's time, scope and kernels."
                    + (f" The raw trace is not in the repository; one step of it is `{one.relative_to(common.ROOT)}` "
                       "(`--trim-to-one-step`), which the tests read." if one.exists() else ""), ""]
    for md in sorted(common.RESULTS.glob("analysis-gpu-*.md")):  # written by hand from a profile (issue 32)
        out += [md.read_text().rstrip(), ""]
    if cal := _load("calibration-h100"):  # python -m benchmarks.gpu.calibrate --check
        from benchmarks.gpu import calibrate

        out += calibrate.markdown(cal)
    return out


def e2e_result(dev: str) -> dict[str, Any] | None:
    """The end-to-end training run on a GPU (``e2e-gpu-<device>.json`` and the metrics.jsonl it names), if any."""
    meta = common.RESULTS / f"e2e-gpu-{dev}.json"
    if not meta.exists():
        return None
    res = json.loads(meta.read_text())
    recs = [json.loads(ln) for ln in (common.RESULTS / res["metrics_file"]).read_text().splitlines() if ln.strip()]
    res["train"] = [r for r in recs if r.get("type") == "train"]
    log = common.RESULTS / res.get("log_file", "-")
    done = [ln for ln in log.read_text().splitlines() if ln.startswith("done:")] if log.exists() else []
    res["summary_line"] = done[-1] if done else None
    return res


def _e2e_steps(e2e: dict[str, Any]) -> tuple[str, list[str]]:
    """The training run's steady steps: median and range of the steps within 5% of the median (after the first),
    and the steps outside it."""
    steps = e2e["train"][1:]
    times = sorted(r["step_time"] for r in steps)
    med = times[len(times) // 2]
    typical = [r for r in steps if abs(r["step_time"] / med - 1) <= 0.05]
    lo, hi = min(r["step_time"] for r in typical), max(r["step_time"] for r in typical)
    tps = sorted(r["tokens_per_s"] for r in typical)
    mfu = sorted(r["mfu"] for r in typical if r.get("mfu"))
    first = e2e["train"][0]["step_time"]
    text = (f"{1e3 * lo:,.0f}-{1e3 * hi:,.0f} ms per step ({tps[0] / 1e3:,.0f}-{tps[-1] / 1e3:,.0f}k tok/s"
            + (f", {100 * mfu[len(mfu) // 2]:.1f}% MFU" if mfu else "") + f"), first step {first:.1f} s")
    return text, [f"step {r['step']} {1e3 * r['step_time']:,.0f} ms" for r in steps if r not in typical]


def gpu_summary(res: dict[str, Any], e2e: dict[str, Any] | None) -> list[str]:
    """The headline of a GPU run: device, software, jaxgpt against torch.compile per micro-batch, the training
    run, the targets' verdicts."""
    g, v = res["gpu"], res["versions"]
    rows = {(r["batch"], r["variant"]): r for r in res["rows"] if "error" not in r and r["shape"] == "gpt2"}
    out = [f"Measured on one {g.get('name')} (driver {g.get('driver')}, {g.get('memory')}), {res['started'][:10]}, "
           f"git {res['git']}, with that machine's software: python {v.get('python')}, jax / jaxlib {v.get('jax')} / "
           f"{v.get('jaxlib')}, flax {v.get('flax')}, optax {v.get('optax')}, torch {v.get('torch')}, transformers "
           f"{v.get('transformers')}, numpy {v.get('numpy')} (not README's pinned versions).", "",
           "| gpt2 124M, T=1024 | jaxgpt (default policy) | torch_ref: torch.compile + bf16 autocast + flash SDPA + "
           "fused AdamW | jaxgpt / torch.compile |", "|---|---|---|---:|"]
    fmt = (lambda r: f"{r['step_ms']['median']:,.1f} ms, {r['tokens_per_s']:,.0f} tok/s, {100 * r['mfu']:.1f}% MFU, "
           f"{r['peak_device_gib']:.1f} GiB")
    for b in sorted({b for b, _ in rows}, reverse=True):
        j, t = rows.get((b, "jax_bf16")), rows.get((b, "torch_compile_bf16"))
        if j and t:
            out.append(f"| micro-batch {b}, one step | {fmt(j)} | {fmt(t)} | "
                       f"{t['step_ms']['median'] / j['step_ms']['median']:.2f}x |")
    notes = []
    if e2e and e2e["train"]:
        text, outliers = _e2e_steps(e2e)
        tokens = e2e["train"][0]["tokens"]
        out.append(f"| `configs/gpt2-124m.yaml`, `python -m jaxgpt.train` ({tokens:,} tokens per step) | {text} | | |")
        notes.append(f"The training run: `{e2e['command']}` on {e2e['data']} ({e2e['date']}, git {e2e['git']})"
                     + (f"; outside the range: {', '.join(outliers)}" if outliers else "") + "."
                     + (f" Its summary line said \"{e2e['summary_line'].split(', ')[-2]}\"." if e2e.get("summary_line")
                        else "") + (f" {e2e['note']}" if e2e.get("note") else ""))
    verdicts = [f"{t['target']}: " + ("not run" if t["measured"] is None else "met" if t["met"] else "NOT met")
                for t in res.get("targets", [])]
    notes.append("Targets (the table below): " + "; ".join(verdicts) + ".")
    return out + [""] + [n + "\n" for n in notes]


def gpu_compiled_section() -> list[str]:
    """What ``python -m benchmarks.gpu.compiled`` wrote: the step compiled for GPUs without one (not run)."""
    md = common.RESULTS / "gpu-compiled.md"
    if not md.exists():
        return []
    return ["## GPU, compiled (not run)", "", md.read_text().rstrip(), "", *prediction_vs_measured(),
            "Command: `python -m benchmarks.gpu.compiled record --label ...` per change, then `python -m "
            "benchmarks.gpu.compiled markdown`; the memory table from `python -m jaxgpt.compile --config "
            "configs/gpt2-124m.yaml --target {h100,h200,a100} --json benchmarks/results/compile-gpt2-124m-TARGET.json`.",
            ""]


def prediction_vs_measured() -> list[str]:
    """The compiled H100 prediction of configs/gpt2-124m.yaml beside the step a GPU measured, where both exist."""
    pred, e2e = _load("compile-gpt2-124m-h100"), e2e_result("h100")
    if not (pred and e2e and e2e["train"][1:]):
        return []
    times = sorted(r["step_time"] for r in e2e["train"][1:])
    med = times[len(times) // 2]
    p = pred["prediction"]
    bound = p.get("bound_s")
    what = (f"predicted {1e3 * p['time_s']:,.0f} ms (calibrated) and {1e3 * bound:,.0f} ms (roofline bound)" if bound
            else f"predicted {1e3 * p['time_s']:,.0f} ms (the roofline lower bound, MFU "
                 f"{100 * pred['predicted_mfu']:.1f}%)")
    return [f"Measured since, on one {e2e['device']} ({e2e['date']}, section \"GPU\" above): "
            f"`{pred['config']}` (b{pred['micro_batch']} x {pred['micro_steps']} micro-steps) took a median "
            f"{1e3 * med:,.0f} ms per step; {what} for the program compiled here with jax {pred['jax']}: the GPU took "
            f"{med / p['time_s']:.2f}x the prediction. The per-micro-step figures of this section are predictions "
            "of the same kind.", ""]


def write(path: Path | None = None) -> Path:
    if path is None:  # results redirected (dry runs, tests): keep the report beside them
        path = common.ROOT / "BENCHMARKS.md" if common.RESULTS == common.ROOT / "benchmarks" / "results" \
            else common.RESULTS / "BENCHMARKS.md"
    train = {f"{s}-{a}": r for s, a in TRAIN_FILES if (r := _load(f"train_step-{s}-{a}"))}
    gen, data, ceil = _load("generate"), _load("data_loader"), _load("gemm_ceiling")
    if gen:  # variants measured in separate invocations (generate --out generate-<name>) join the table
        for extra in sorted(common.RESULTS.glob("generate-*.json")):
            more = json.loads(extra.read_text())
            gen["rows"].update(more["rows"])
            gen.setdefault("extra_runs", []).append({k: more[k] for k in ("command", "started", "loadavg_start",
                                                                           "loadavg_end", "rounds", "repeats")})
        for n in gen["prompt_counts"]:
            hf = [r["tokens_per_s"]["median"] for k, r in gen["rows"].items()
                  if k.startswith("hf_") and k.endswith(f"@{n}") and "error" not in r]
            for k, r in gen["rows"].items():
                if k.endswith(f"@{n}") and "error" not in r and hf:
                    r["vs_fastest_hf"] = r["tokens_per_s"]["median"] / max(hf)
    any_res = next(iter(train.values()), None) or gen
    if any_res is None:
        raise SystemExit("no results under benchmarks/results/: run python -m benchmarks.run_all first")
    m, v, env = any_res["machine"], any_res["versions"], any_res["env"]
    flags = ", ".join(f"{k} {'yes' if on else 'no'}" for k, on in m.get("flags", {}).items())
    out = [
        "# Benchmarks",
        "",
        "Measured by the harness in `benchmarks/` (see its module docstrings). Reproduce everything, and rewrite "
        "this file, with",
        "",
        "```",
        "python -m benchmarks.run_all            # ~1 h on the 2-core machine below; waits for load < 1.5 first",
        "```",
        "",
        "or one piece at a time: `python -m benchmarks.train_step --config {small,gpt2,gpt2-t256} --variants all "
        "--rounds 3 --steps 10 [--allocator default]`, `python -m benchmarks.generate`, "
        "`python -m benchmarks.data_loader`, then `python -m benchmarks.report` (this file from "
        "`benchmarks/results/*.json`). CI runs `python -m benchmarks.train_step --quick` through "
        "`tests/test_benchmarks.py`.",
        "",
        "## Machine and software (the CPU tables)",
        "",
        f"* CPU: {m.get('model_name')} (vendor {m.get('vendor')}, family {m.get('family')} model {m.get('model')}"
        f"{', KVM guest' if m.get('hypervisor') else ''}), {m.get('cores')} cores, {m.get('mem_gib')} GiB; {flags}.",
        f"* Versions: python {v.get('python')}, jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, flax {v.get('flax')}, "
        f"optax {v.get('optax')}, torch {v.get('torch')}, transformers {v.get('transformers')}, numpy {v.get('numpy')}, "
        f"glibc {v.get('glibc')}.",
        f"* Environment of every worker (both frameworks alike): GLIBC_TUNABLES=`{env.get('GLIBC_TUNABLES')}` "
        f"(`--allocator tuned`, the default; `--allocator default` unsets it), XLA_FLAGS=`{env.get('XLA_FLAGS')}`, "
        f"JAX_PLATFORMS=`{env.get('JAX_PLATFORMS')}`, OMP_NUM_THREADS=`{env.get('OMP_NUM_THREADS')}`; torch uses "
        "its default thread count (2).",
        "* Method: every (variant, round) is a fresh subprocess, launched round-robin with the order rotated each "
        "round; first step (cold, includes compilation) and warm-up steps excluded; steady step times pooled over "
        "rounds (median, min, max). Same initial weights (torch_ref's seeded init) for jaxgpt and torch_ref, same "
        "fixed batch, same AdamW hyperparameters (`jaxgpt.optim.OptimConfig()` defaults; torch: "
        "`torch_ref.train.param_groups` + `torch.optim.AdamW(fused=True)` with `torch_ref.train.get_lr`). "
        "transformers' `GPT2LMHeadModel` has its own init, `vocab_size` = the padded rows so the shapes match, "
        "sdpa attention, loss from its logits. FLOPs: `jaxgpt.flops.count_flops` (matmuls only, causal attention "
        "counted dense). Peak: the best GFLOP/s of a GEMM probe (512^3, 2048^3, 4096x1024x4096 and the small "
        "config's lm_head, 2048x256x50304; fp32, and bf16 operands with fp32 accumulation -- torch's bf16 GEMM "
        "rounds its output to bf16; a size that would take over 30 s at the rate of the last size measured is "
        "skipped) run in both "
        "frameworks at the start of every round; '% of peak' compares each variant with the peak of its compute "
        "dtype. A variant whose framework's bf16 GEMM runs below 5% of its fp32 rate (torch on a CPU without "
        "avx512_bf16 or AMX: about 1 GFLOP/s) is listed as not run.",
        "* Load average: the machine is shared; each table gives the 1-minute load average at its start and end, "
        "and the JSON files hold it per worker.",
        "",
    ]
    named = [(f"train_step {k}", r) for k, r in train.items()] + ([("generate", gen)] if gen else [])
    # a worker keeps both cores busy, so back-to-back parts start and end near a 1-minute load average of 2 on
    # their own; clearly above that, other jobs shared the cores
    cores = (any_res.get("machine") or {}).get("cores") or 2
    noisy = [(n, r) for n, r in named if max(r["loadavg_start"][0], r["loadavg_end"][0]) > 1.1 * cores]
    if noisy:
        out += [f"> **Noisy results**: the {cores} cores were shared with other jobs while these ran (1-minute load "
                "average, start -> end): " + "; ".join(f"{n} {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}"
                                                       for n, r in noisy)
                + ". Oversubscription slows torch (OpenMP spin-waits) more than JAX, so even same-run ratios from "
                "those runs are biased; re-run them on an idle machine before quoting them.", ""]
    out += gpu_section()
    out += gpu_compiled_section()
    tr = targets(train, gen)
    if tr:
        out += ["## Targets", "", "| target | measured | |", "|---|---|---|"]
        out += [f"| {a} | {b} | {c} |" for a, b, c in tr] + [""]
    for key, title in (("small-tuned", "Train step: small (L4 H4 C256, 16.1M params), T=256, batch 8"),
                       ("gpt2-tuned", "Train step: gpt2 124M, T=1024, batch 1"),
                       ("gpt2-t256-tuned", "Train step: gpt2 124M, T=256, batch 4")):
        if key in train:
            out += [f"## {title}", "", train_step.markdown(train[key]), "",
                    f"Command: `{train[key]['command']}`", ""]
    out += profile_section(train)
    out += ceiling_section(ceil, train)
    at = allocator_table(train)
    if at:
        out += ["## Allocator: glibc default vs tuned GLIBC_TUNABLES (small)", "",
                train_step.markdown(train["small-default"]), "", at, "",
                f"Command: `{train['small-default']['command']}`", ""]
    if gen:
        out += ["## Generation (KV cache)", "", generate.markdown(gen), "",
                "torch_ref has no KV cache (nanoGPT's plain generate recomputes the whole context for every token); "
                "it is listed for reference, not as a like-for-like competitor.", "",
                f"Command: `{gen['command']}`"
                + "".join(f"; plus `{e['command']}` ({e['started']}, load avg {e['loadavg_start'][0]:.2f} -> "
                          f"{e['loadavg_end'][0]:.2f})" for e in gen.get("extra_runs", [])), ""]
    if data:
        out += ["## Data loader", "", data_loader.markdown(data), "", f"Command: `{data['command']}`", ""]
    for name, title in (("eval_speed", "Evaluation: HellaSwag scoring"), ("checkpoint_io", "Checkpoint digests"),
                        ("muon", "Optimizers: Muon against AdamW"),
                        ("shakespeare-char-cpu", "nanoGPT's first run: character-level Shakespeare"),
                        ("fp8-loss-curve", "precision: fp8 against bf16: the char recipe's loss curve (CPU)")):
        md = common.RESULTS / f"{name}.md"
        if md.exists():  # their own tables, machine and command included (benchmarks/eval_speed.py, checkpoint_io.py)
            out += [f"## {title}", "", md.read_text().rstrip(), ""]
    dirty = sorted({f for r in [*train.values(), gen] if r for f in r.get("uncommitted_library_files", [])})
    if dirty:
        out += ["## Provenance", "", "These library files were uncommitted (being edited) while some of the results "
                "above were measured, so those results describe the working tree at the time, not a commit: "
                + ", ".join(f"`{f}`" for f in dirty) + ".", ""]
    path.write_text("\n".join(out))
    return path


def main() -> int:
    print(f"wrote {write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
