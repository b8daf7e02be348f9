"""Train-step benchmark: jaxgpt vs torch_ref (eager and torch.compile) vs transformers, one invocation.

    python -m benchmarks.train_step --config small --variants all --rounds 3 --steps 10
    python -m benchmarks.train_step --config gpt2 --rounds 2 --steps 10 --allocator tuned
    python -m benchmarks.train_step --quick        # CI: small, jaxgpt's default vs torch eager, ratio check
    python -m benchmarks.train_step --device gpu   # on a GPU: jaxgpt vs torch.compile (benchmarks.gpu.bench)

Every (variant, round) runs in a fresh subprocess (``benchmarks.worker``) with the same environment; the
variants are launched round-robin, the order rotated every round, so machine drift hits all of them alike.
Each worker builds the model from the same initial weights (torch_ref's seeded init, for jaxgpt and torch_ref;
transformers has its own init), trains on the same fixed batch with the same AdamW hyperparameters, and reports
the first step (cold: includes tracing/compilation), ``--warmup`` excluded steps, then ``--steps`` timed steps.
Steady step times are pooled over rounds: median, min and max. A GEMM probe (fp32, and bf16 operands with fp32
accumulation, in both frameworks) runs at the start of every round; the machine's peak is the best it reached.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.worker import TRAIN_VARIANTS

# benchmark shape name -> (model preset, seq, batch)
SHAPES = {
    "small": ("small", 256, 8),
    "gpt2": ("gpt2", 1024, 1),
    "gpt2-t256": ("gpt2", 256, 4),
    "tiny": ("tiny", 64, 4),  # plumbing checks only (tests, dry runs): not a benchmark
}
ALL_VARIANTS = list(TRAIN_VARIANTS)
TORCH_VARIANTS = [v for v, (fw, _, _) in TRAIN_VARIANTS.items() if fw != "jax"]
QUICK_MIN_RATIO = 0.8


def default_jax_variant() -> str:
    """The variant jaxgpt trains with by default here: ``precision: auto`` on the CPU (the workers pin JAX to
    the CPU), i.e. jax_bf16 where bf16 GEMMs beat fp32 ones (AMX, AMD with avx512_bf16), else jax_fp32."""
    from jaxgpt.precision import default_compute

    return f"jax_{default_compute('cpu')}"


def eager_twin(jax_variant: str) -> str:
    """torch_ref eager at the precision of ``jax_variant`` (jax_fp32 -> torch_eager_fp32)."""
    return jax_variant.replace("jax_", "torch_eager_")


def quick_variants() -> list[str]:
    """CI's pair: jaxgpt's default and torch_ref eager at the same precision."""
    d = default_jax_variant()
    return [d, eager_twin(d)]


def run(shape: str, variants: list[str], *, rounds: int, steps: int, warmup: int, allocator: str,
        probe: bool = True, seq: int | None = None, batch: int | None = None, log=print) -> dict[str, Any]:
    preset, T, B = SHAPES[shape]
    T, B = seq or T, batch or B
    init = common.ensure_init(preset)
    inductor = common.TMP / f"inductor-{time.strftime('%Y%m%d-%H%M%S')}"
    env = common.worker_env(allocator, inductor_cache=inductor)
    started = time.time()
    load_start = common.loadavg()
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    gemm: list[dict] = []
    for r in range(rounds):
        if probe:
            for fw in (["jax", "torch"] if r % 2 == 0 else ["torch", "jax"]):
                res = common.run_worker({"task": "gemm", "framework": fw}, env)
                res["round"] = r
                gemm.append(res)
                if "error" in res:
                    log(f"  gemm {fw}: ERROR {res['error'][-300:]}")
                else:
                    log(f"  round {r + 1} gemm {fw}: fp32 {res['fp32_gflops']:.0f} GFLOP/s, "
                        f"bf16 {res['bf16_gflops']:.0f} GFLOP/s (load {res['loadavg_start'][0]:.1f})")
        if r == 0:  # which variants this machine cannot run in reasonable time (e.g. torch bf16 on AVX2 only)
            skip = common.unusable_variants(variants, env, gemm, log=log)
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            if v in skip:
                runs[v] = [common.skipped_row(skip[v])]
                continue
            spec = {"task": "train", "variant": v, "config": preset, "seq": T, "batch": B, "steps": steps,
                    "warmup": warmup, "init": str(init)}
            res = common.run_worker(spec, env)
            res["round"] = r
            runs[v].append(res)
            if "error" in res:
                log(f"  round {r + 1} {v}: ERROR {res['error'][-500:]}")
            else:
                med = statistics.median(res["step_times_s"])
                log(f"  round {r + 1} {v:20s} {res['tokens_per_step'] / med:8.0f} tok/s  step {med * 1e3:7.1f} ms  "
                    f"cold {res['cold_first_step_s']:6.1f} s  rss {res['peak_rss_mib']:6.0f} MiB  "
                    f"loss {res['loss_first']:.4f}->{res['loss_last']:.4f}  load {res['loadavg_start'][0]:.1f}")
    return summarize(shape, preset, T, B, variants, runs, gemm, rounds=rounds, steps=steps, warmup=warmup,
                     allocator=allocator, env=env, started=started, load_start=load_start)


def _causal_flops(preset: str, B: int, T: int) -> float | None:
    """The step's matmul FLOPs with causal attention counted half (no implementation needs more): the work the
    targets table's ceiling is computed from."""
    try:
        from jaxgpt.config import GPTConfig
        from jaxgpt.flops import count_flops
    except ImportError:
        return None
    return float(count_flops(GPTConfig.preset(preset), T, batch_size=B, causal_halving=True).training_per_step)


def _flops(preset: str, B: int, T: int) -> tuple[float, str]:
    # imported lazily: jaxgpt.flops (when present) may import jax; that is fine in the orchestrator
    from benchmarks.impl import flops_per_step
    from jaxgpt.config import GPTConfig

    return flops_per_step(GPTConfig.preset(preset), B, T, 1)


def summarize(shape, preset, T, B, variants, runs, gemm, *, rounds, steps, warmup, allocator, env, started,
              load_start) -> dict[str, Any]:
    flops, flops_src = _flops(preset, B, T)
    ok_gemm = [g for g in gemm if "error" not in g]
    peak = {}
    for dt in ("fp32", "bf16"):
        vals = {fw: max((g[f"{dt}_gflops"] for g in ok_gemm if g["framework"] == fw), default=None)
                for fw in ("jax", "torch")}
        lib = [g["library"][dt] / 1e9 for g in ok_gemm if isinstance(g.get("library", {}).get(dt), (int, float))]
        if lib:  # jaxgpt.account.measure_cpu_peak (1024^3 jnp.dot) counts as one more JAX probe
            vals["jax"] = max([x for x in (vals["jax"], *lib) if x])
            vals["jaxgpt_account"] = max(lib)
        best = max((v for v in vals.values() if v), default=None)
        peak[dt] = {"best_gflops": best, **{f"{fw}_gflops": v for fw, v in vals.items()}}
    rows = {}
    for v in variants:
        ok = [r for r in runs[v] if "error" not in r]
        if not ok:
            rows[v] = runs[v][0] if runs[v] and runs[v][0].get("skipped") else \
                {"error": runs[v][0]["error"] if runs[v] else "not run"}
            continue
        times = [t for r in ok for t in r["step_times_s"]]
        st = common.summarize(times)
        tok = ok[0]["tokens_per_step"]
        colds = [r["cold_first_step_s"] for r in ok]
        precision = TRAIN_VARIANTS[v][1]
        achieved = flops / st["median"] / 1e9
        pk = peak[precision]["best_gflops"]
        rows[v] = {
            "framework": TRAIN_VARIANTS[v][0], "precision": precision, "compiled": TRAIN_VARIANTS[v][2],
            "tokens_per_step": tok,
            "step_s": st, "tokens_per_s": {"median": tok / st["median"], "min": tok / st["max"], "max": tok / st["min"]},
            "round_median_tokens_per_s": [tok / statistics.median(r["step_times_s"]) for r in ok],
            "cold_first_step_s": {"first_round": colds[0], "median": statistics.median(colds), "all": colds},
            "compile_s_estimate": colds[0] - st["median"],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
            "achieved_gflops": achieved, "fraction_of_peak": (achieved / pk) if pk else None,
            "loss_first": ok[0]["loss_first"], "loss_last": [r["loss_last"] for r in ok],
            "sources": {k: ok[0].get(k) for k in ("train_step", "optimizer", "hyper_source", "policy",
                                                  "torch_threads", "optimizer_class")},
            "loadavg": [r["loadavg_start"][0] for r in ok],
            "errors": [r["error"] for r in runs[v] if "error" in r],
        }
    torch_rows = {v: r for v, r in rows.items() if v in TORCH_VARIANTS and "error" not in r}
    fastest = max(torch_rows, key=lambda v: torch_rows[v]["tokens_per_s"]["median"]) if torch_rows else None
    for v, r in rows.items():
        if "error" not in r and fastest:
            r["vs_fastest_torch"] = r["tokens_per_s"]["median"] / rows[fastest]["tokens_per_s"]["median"]
    return {
        "benchmark": "train_step", "shape": shape, "preset": preset, "seq": T, "batch": B, "micro_steps": 1,
        "rounds": rounds, "steps": steps, "warmup": warmup, "allocator": allocator,
        "flops_per_step": flops, "flops_source": flops_src, "flops_per_step_causal": _causal_flops(preset, B, T),
        "gemm_peak": peak, "gemm_runs": gemm,
        "fastest_torch": fastest, "default_jax_variant": default_jax_variant(), "variants": rows,
        "machine": common.cpu_info(), "versions": common.versions(), "env": common.recorded_env(env),
        "git": common.git_rev(), "uncommitted_library_files": common.dirty_files(), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "duration_s": time.time() - started, "loadavg_start": load_start, "loadavg_end": common.loadavg(),
        "command": common.command_line(), "raw": runs,
    }


def markdown(res: dict[str, Any]) -> str:
    pk = res["gemm_peak"]
    lines = [
        f"**{res['shape']}**: preset `{res['preset']}`, T={res['seq']}, batch {res['batch']} "
        f"({res['seq'] * res['batch']:,} tokens/step), {res['flops_per_step'] / 1e9:,.1f} GFLOP/step "
        f"({res['flops_source']}); allocator `{res['allocator']}`; {res['rounds']} rounds x {res['steps']} steps "
        f"(+1 cold +{res['warmup']} warm-up excluded); load avg {res['loadavg_start'][0]:.2f} -> "
        f"{res['loadavg_end'][0]:.2f}; {res['started']}, git {res['git']}.",
        "",
        f"GEMM peak (best of both frameworks, this run): fp32 {common.fmt(pk['fp32']['best_gflops'])} GFLOP/s "
        f"(jax {common.fmt(pk['fp32']['jax_gflops'])}, torch {common.fmt(pk['fp32']['torch_gflops'])}); "
        f"bf16->fp32 {common.fmt(pk['bf16']['best_gflops'])} GFLOP/s (jax {common.fmt(pk['bf16']['jax_gflops'])}, "
        f"torch {common.fmt(pk['bf16']['torch_gflops'])}).",
        "",
        "| variant | tok/s median | tok/s min-max | step ms | cold 1st step s | peak RSS MiB | GFLOP/s | % of peak | "
        "vs fastest torch | loss 1st -> last |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for v, r in res["variants"].items():
        if "error" in r:
            what = r["error"] if r.get("skipped") else f"error: {r['error'][:120]}"
            lines.append(f"| {v} | {what.replace('|', '/')} |||||||||")
            continue
        tps = r["tokens_per_s"]
        frac = f"{100 * r['fraction_of_peak']:.0f}% {r['precision']}" if r["fraction_of_peak"] else "-"
        cold = r["cold_first_step_s"]
        cold_s = f"{cold['first_round']:.1f}" + (f" ({min(cold['all'][1:]):.1f} warm)"
                                                if r["compiled"] and r["framework"] != "jax" and len(cold['all']) > 1 else "")
        name = f"**{v}**" if v == res["default_jax_variant"] else v
        lines.append(
            f"| {name} | {tps['median']:,.0f} | {tps['min']:,.0f}-{tps['max']:,.0f} | {r['step_s']['median'] * 1e3:,.0f} "
            f"| {cold_s} | {r['peak_rss_mib']:,.0f} | {r['achieved_gflops']:,.0f} | {frac} "
            f"| {r.get('vs_fastest_torch', 0):.2f}x | {r['loss_first']:.3f} -> {statistics.median(r['loss_last']):.3f} |")
    srcs = {r["sources"]["train_step"] for r in res["variants"].values() if "error" not in r and r["framework"] == "jax"}
    opts = {f"{v}: {r['sources']['optimizer']}" for v, r in res["variants"].items() if "error" not in r}
    lines += ["", f"{res['shape']}, allocator `{res['allocator']}`: fastest torch variant `{res['fastest_torch']}`; "
              f"jaxgpt train step: {', '.join(sorted(srcs)) or '-'}; "
              f"optimizers: {'; '.join(sorted(set(o.split(': ')[1] for o in opts)))}."]
    return "\n".join(lines)


def save(res: dict[str, Any], name: str | None = None) -> tuple[Path, Path]:
    return common.save_result(name or f"train_step-{res['shape']}-{res['allocator']}", res, markdown(res))


def quick_check(res: dict[str, Any], min_ratio: float = QUICK_MIN_RATIO) -> tuple[bool, str]:
    """CI's gross-regression check: jaxgpt's default variant (``res["default_jax_variant"]``) at least
    ``min_ratio`` x torch_ref eager at the same precision, tokens/s in the same run."""
    jv = res["default_jax_variant"]
    tv = eager_twin(jv)
    j, t = res["variants"].get(jv, {}), res["variants"].get(tv, {})
    if "error" in j or "error" in t or not j or not t:
        return False, f"a variant failed or did not run: {jv}={j.get('error', j or 'missing')}, " \
                      f"{tv}={t.get('error', t or 'missing')}"
    ratio = j["tokens_per_s"]["median"] / t["tokens_per_s"]["median"]
    msg = (f"{jv} {j['tokens_per_s']['median']:,.0f} tok/s vs {tv} "
           f"{t['tokens_per_s']['median']:,.0f} tok/s: ratio {ratio:.2f} (must be >= {min_ratio})")
    return ratio >= min_ratio, msg


def parse_variants(text: str) -> list[str]:
    if text == "all":
        return list(ALL_VARIANTS)
    out = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in out if v not in TRAIN_VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; valid: all or a comma list of {ALL_VARIANTS}")
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--device" or a.startswith("--device=") for a in argv):  # the GPU mode: benchmarks.gpu.bench
        from benchmarks.gpu import bench

        return bench.main(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(SHAPES), help="benchmark shape")
    p.add_argument("--variants", default="all", help=f"all, or a comma list of {ALL_VARIANTS}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steady steps per variant per round")
    p.add_argument("--warmup", type=int, default=2, help="excluded steps after the (cold) first one")
    p.add_argument("--allocator", default="tuned", choices=sorted(common.ALLOCATORS))
    p.add_argument("--seq", type=int, help="override the shape's sequence length")
    p.add_argument("--batch", type=int, help="override the shape's batch size")
    p.add_argument("--no-probe", action="store_true", help="skip the GEMM peak probe")
    p.add_argument("--quick", action="store_true",
                   help="CI mode: small, jaxgpt's default precision vs torch_ref eager at the same precision, 2 "
                        f"rounds x 3 steps, no probe; exit 1 if jaxgpt < {QUICK_MIN_RATIO}x torch eager")
    p.add_argument("--out", help="results file stem under benchmarks/results/ (default train_step-<config>-<allocator>)")
    a = p.parse_args(argv)
    if a.quick:
        a.config, a.rounds, a.steps, a.warmup, a.no_probe = "small", 2, 3, 1, True
        variants = quick_variants()
        a.out = a.out or "quick"
    else:
        variants = parse_variants(a.variants)
    print(f"train_step {a.config}: variants {variants}, {a.rounds} rounds x {a.steps} steps, "
          f"allocator {a.allocator}, load {common.loadavg()}", flush=True)
    res = run(a.config, variants, rounds=a.rounds, steps=a.steps, warmup=a.warmup, allocator=a.allocator,
              probe=not a.no_probe, seq=a.seq, batch=a.batch, log=lambda s: print(s, flush=True))
    j, m = save(res, a.out)
    print(markdown(res))
    print(f"\nwrote {common.shown(j)} and {common.shown(m)}")
    if a.quick:
        ok, msg = quick_check(res)
        print(("OK: " if ok else "REGRESSION: ") + msg)
        return 0 if ok else 1
    return 1 if any(common.failed(r) for r in res["variants"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
