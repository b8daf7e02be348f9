"""Write ``BENCHMARKS.md`` and ``docs/benchmark-history.md`` from the results under ``benchmarks/results/``
(``python -m benchmarks.report``; ``tests/test_report.py`` checks the committed files are its output).

BENCHMARKS.md puts what was measured first: each GPU run's headline (``benchmarks/results/<device>-<date>/``,
:mod:`benchmarks.gpu.report`) and the CPU's targets, then the GPU runs' tables and the CPU tables
(``train_step-{small,gpt2,gpt2-t256}-tuned.json``, ``train_step-small-default.json``, ``generate.json``,
``data_loader.json`` and the other CPU benchmarks' files, whichever exist), then the predictions in one labelled
table. The change-by-change history of predictions and analyses goes to docs/benchmark-history.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import common, data_loader, gemm_ceiling, generate, train_step
from benchmarks.gpu.report import (e2e_result, gpu_compiled_section, gpu_details, gpu_headlines, gpu_section,  # noqa: F401
                                   history, prediction_vs_measured, predictions_section)

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


def demote(lines: list[str]) -> list[str]:
    """A section's headings one level down (its ``## X`` under this file's ``## CPU tables``)."""
    return [("#" + ln) if ln.startswith("## ") else ln for ln in lines]


def paths() -> tuple[Path, Path]:
    """Where BENCHMARKS.md and the history go: the repository, or beside redirected results (dry runs, tests)."""
    if common.RESULTS == common.ROOT / "benchmarks" / "results":
        return common.ROOT / "BENCHMARKS.md", common.ROOT / "docs" / "benchmark-history.md"
    return common.RESULTS / "BENCHMARKS.md", common.RESULTS / "benchmark-history.md"


def render() -> dict[Path, str]:
    """{path: text} of BENCHMARKS.md and docs/benchmark-history.md (see the module's docstring)."""
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
    tr = targets(train, gen)
    dates = sorted(r["started"][:10] for r in [*train.values(), gen] if r and r.get("started")) or ["?"]
    cpu_targets = (["| target | measured | |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in tr] + [""]
                   if tr else [])
    flags = ", ".join(f"{k} {'yes' if on else 'no'}" for k, on in m.get("flags", {}).items())
    out = [
        "# Benchmarks",
        "",
        "Measured results first: each GPU run (its device, date, software and commands; the files as the GPU wrote "
        "them under `benchmarks/results/<device>-<date>/`) and the CPU's, headlines then tables; then the "
        "**predictions** for what no GPU has run, in one labelled table. The change-by-change history of "
        "predictions and analyses is [docs/benchmark-history.md](docs/benchmark-history.md); how to run the GPU "
        "measurements and bring their files back, [docs/gpu.md](docs/gpu.md). `python -m benchmarks.report` writes "
        "both files from `benchmarks/results/` (no hand edits; `tests/test_report.py` checks it).",
        "",
        *gpu_headlines(),
        "## Measured on the CPU",
        "",
        f"{m.get('model_name')} (family {m.get('family')} model {m.get('model')}), {m.get('cores')} cores; jax "
        f"{v.get('jax')}, torch {v.get('torch')}; measured {' to '.join(sorted({dates[0], dates[-1]}))} (each table "
        "gives its date, load and command; machine, software and method under \"CPU tables\" below). "
        "`python -m benchmarks.run_all` (~1 h on this machine; waits for load < 1.5 first) measures them all, or one "
        "piece at a time: `python -m benchmarks.train_step --config {small,gpt2,gpt2-t256} --variants all "
        "--rounds 3 --steps 10 [--allocator default]`, `python -m benchmarks.generate`, "
        "`python -m benchmarks.data_loader`. CI runs `python -m benchmarks.train_step --quick` through "
        "`tests/test_benchmarks.py`.",
        "",
        *cpu_targets,
        "## GPU tables",
        "",
        *gpu_details(),
        "## CPU tables",
        "",
        "### Machine, software and method",
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
    for key, title in (("small-tuned", "Train step: small (L4 H4 C256, 16.1M params), T=256, batch 8"),
                       ("gpt2-tuned", "Train step: gpt2 124M, T=1024, batch 1"),
                       ("gpt2-t256-tuned", "Train step: gpt2 124M, T=256, batch 4")):
        if key in train:
            out += [f"### {title}", "", train_step.markdown(train[key]), "",
                    f"Command: `{train[key]['command']}`", ""]
    out += demote(profile_section(train))
    out += demote(ceiling_section(ceil, train))
    at = allocator_table(train)
    if at:
        out += ["### Allocator: glibc default vs tuned GLIBC_TUNABLES (small)", "",
                train_step.markdown(train["small-default"]), "", at, "",
                f"Command: `{train['small-default']['command']}`", ""]
    if gen:
        out += ["### Generation (KV cache)", "", generate.markdown(gen), "",
                "torch_ref has no KV cache (nanoGPT's plain generate recomputes the whole context for every token); "
                "it is listed for reference, not as a like-for-like competitor.", "",
                f"Command: `{gen['command']}`"
                + "".join(f"; plus `{e['command']}` ({e['started']}, load avg {e['loadavg_start'][0]:.2f} -> "
                          f"{e['loadavg_end'][0]:.2f})" for e in gen.get("extra_runs", [])), ""]
    if data:
        out += ["### Data loader", "", data_loader.markdown(data), "", f"Command: `{data['command']}`", ""]
    for name, title in (("eval_speed", "Evaluation: HellaSwag scoring"), ("checkpoint_io", "Checkpoint digests"),
                        ("muon", "Optimizers: Muon against AdamW"),
                        ("shakespeare-char-cpu", "nanoGPT's first run: character-level Shakespeare"),
                        ("fp8-loss-curve", "precision: fp8 against bf16: the char recipe's loss curve (CPU)")):
        md = common.RESULTS / f"{name}.md"
        if md.exists():  # their own tables, machine and command included (benchmarks/eval_speed.py, checkpoint_io.py)
            out += [f"### {title}", "", *demote(md.read_text().rstrip().splitlines()), ""]
    dirty = sorted({f for r in [*train.values(), gen] if r for f in r.get("uncommitted_library_files", [])})
    if dirty:
        out += ["### Provenance", "", "These library files were uncommitted (being edited) while some of the results "
                "above were measured, so those results describe the working tree at the time, not a commit: "
                + ", ".join(f"`{f}`" for f in dirty) + ".", ""]
    out += [*predictions_section(), "## History", "",
            "What was predicted and analysed change by change before a GPU measured it (issue 32's table of changes, "
            "the LayerNorm analysis, the compiled-only memory and traffic tables): "
            "[docs/benchmark-history.md](docs/benchmark-history.md).", ""]
    bench_md, history_md = paths()
    return {bench_md: "\n".join(out), history_md: history()}


def write() -> list[Path]:
    written = []
    for path, text in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def main() -> int:
    for path in write():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
