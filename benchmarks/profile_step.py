"""Profile jaxgpt's train step: every dot in the compiled HLO with its operand dtypes, and where the time goes.

    python -m benchmarks.profile_step --config small                   # at the default precision here
    python -m benchmarks.profile_step --config small --precision bf16 --no-trace   # HLO only

Run it under the same allocator as the benchmark (``GLIBC_TUNABLES`` is taken from ``--allocator``: the script
re-executes itself with it). Writes ``benchmarks/results/profile-<config>-<precision>.{md,json}`` and the
optimized HLO text under ``benchmarks/results/tmp/``.

* HLO: the step is lowered and compiled exactly as ``jaxgpt.step.make_train_step`` jits it; every ``dot`` (inside
  fusions too) is listed with its output and operand shapes/dtypes and FLOPs. A dot with fp32 x fp32 operands in
  a bf16 step is flagged: it means the bf16 intent was lost (XLA:CPU's operand upcaster turns a bf16 dot into an
  fp32 one when an operand is transposed, which autodiff's dW = x^T g always is).
* Trace: ``jax.profiler`` with a Perfetto trace over ``--steps`` steps; events are summed by name (XLA:CPU emits
  one event per thunk: fusions, dots, custom calls), so the table shows which ops dominate the step.
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

from benchmarks import common

DOT_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?)\s+dot\((.*?)\)(.*)$")
OPERAND_RE = re.compile(r"(\w+)\[([\d,]*)\]")
DIMS_RE = re.compile(r"(lhs_contracting_dims|lhs_batch_dims)=\{([\d,]*)\}")


INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]")


def parse_dots(hlo: str) -> list[dict]:
    """Every dot of an optimized HLO module, operands resolved to their shapes (HLO text names them only)."""
    shapes = {m.group(1): (m.group(2), m.group(3)) for m in map(INSTR_RE.match, hlo.splitlines()) if m}
    dots, comp = [], None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and "{" in line and ("(" in line):
            comp = line.split("(")[0].replace("ENTRY", "").strip().lstrip("%")
        m = DOT_RE.match(line)
        if not m:
            continue
        name, out, args, rest = m.groups()
        ops = OPERAND_RE.findall(args) or [shapes.get(a.strip().lstrip("%"), ("?", ""))
                                            for a in args.split(",") if a.strip()]
        odt, oshape = OPERAND_RE.match(out).groups() if OPERAND_RE.match(out) else ("?", "")
        dims = dict(DIMS_RE.findall(rest))
        lhs_shape = [int(d) for d in ops[0][1].split(",") if d] if ops else []
        contract = [int(d) for d in dims.get("lhs_contracting_dims", "").split(",") if d]
        k = 1
        for c in contract:
            k *= lhs_shape[c] if c < len(lhs_shape) else 1
        n_out = 1
        for d in (int(x) for x in oshape.split(",") if x):
            n_out *= d
        dots.append({"name": name, "computation": comp, "out": f"{odt}[{oshape}]",
                     "operands": [f"{dt}[{sh}]" for dt, sh in ops[:2]],
                     "operand_dtypes": [dt for dt, _ in ops[:2]], "flops": 2 * n_out * k,
                     "meta": (re.search(r'op_name="([^"]+)"', rest) or [None, ""])[1][-90:]})
    return dots


LINE_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(")


def describe_instructions(hlo: str) -> dict[str, str]:
    """instruction name -> 'op out-shape <- source op' for naming trace events."""
    out = {}
    for line in hlo.splitlines():
        m = LINE_RE.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        src = re.search(r'op_name="([^"]+)"', line)
        kind = re.search(r'"kind":"(\w+)"', line)
        what = f"{op}{'/' + kind.group(1) if kind else ''} {shape.split('{')[0]}"
        if src:
            what += " <- " + src.group(1).replace("jit(step)/", "").replace("closed_call/", "")[-70:]
        out[name] = what
    return out


def summarize_trace(trace_dir: Path) -> list[tuple[str, float, int]]:
    files = sorted(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        return []
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    tot: dict[str, float] = collections.defaultdict(float)
    cnt: dict[str, int] = collections.defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            tot[e["name"]] += e["dur"] / 1e3
            cnt[e["name"]] += 1
    return sorted(((n, t, cnt[n]) for n, t in tot.items()), key=lambda x: -x[1])


def run(config: str, precision: str, steps: int, trace: bool) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from benchmarks import impl
    from benchmarks.train_step import SHAPES
    from benchmarks.worker import make_batch
    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT
    from jaxgpt.precision import Policy

    preset, T, B = SHAPES[config]
    cfg = GPTConfig.preset(preset)
    policy = Policy.named(precision)
    model = GPT(cfg, policy=policy, rngs=nnx.Rngs(0))
    opt, _ = impl.jax_optimizer()
    state, step_fn, src = impl.jax_train_step(model, opt, micro_steps=1)
    x, y = make_batch(cfg, 1, B, T)
    xd, yd, key = jax.numpy.asarray(x), jax.numpy.asarray(y), jax.random.key(0)
    jitted = getattr(step_fn, "jitted", step_fn)
    t0 = time.perf_counter()
    compiled = jitted.lower(state, xd, yd, key).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    common.TMP.mkdir(parents=True, exist_ok=True)
    hlo_path = common.TMP / f"hlo-{config}-{precision}.txt"
    hlo_path.write_text(hlo)
    dots = parse_dots(hlo)
    names = describe_instructions(hlo)
    ops = []
    if trace:
        for _ in range(3):
            state, m = step_fn(state, xd, yd, key)
        jax.block_until_ready(m)
        tdir = common.TMP / f"trace-{config}-{precision}-{int(time.time())}"
        times = []
        with jax.profiler.trace(str(tdir), create_perfetto_trace=True):
            for _ in range(steps):
                t0 = time.perf_counter()
                state, m = step_fn(state, xd, yd, key)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t0)
        ops = [(n, t, c, names.get(n, "")) for n, t, c in summarize_trace(tdir)]
    else:
        times = []
    return {"config": config, "precision": precision, "policy": str(policy), "train_step": src,
            "compile_s": compile_s, "hlo_file": str(hlo_path.relative_to(common.ROOT)), "dots": dots,
            "trace_ops": ops[:400], "step_times_s": times, "steps": steps, "loadavg": common.loadavg(),
            "env": common.recorded_env(dict(os.environ)), "git": common.git_rev(),
            "uncommitted_library_files": common.dirty_files()}


def markdown(res: dict) -> str:
    dots = res["dots"]
    total = sum(d["flops"] for d in dots) or 1
    f32 = [d for d in dots if d["operand_dtypes"] and all(t == "f32" for t in d["operand_dtypes"])]
    by = collections.Counter(" x ".join(d["operand_dtypes"]) + f" -> {d['out'].split('[')[0]}" for d in dots)
    lines = [f"**profile**: jaxgpt train step ({res['train_step']}), `{res['config']}`, policy {res['policy']}; "
             f"compile {res['compile_s']:.1f} s; load avg {res['loadavg'][0]:.2f}; git {res['git']}; "
             f"GLIBC_TUNABLES={res['env'].get('GLIBC_TUNABLES')}.", "",
             f"Dots in the optimized HLO: {len(dots)}; by operand dtypes: "
             + ", ".join(f"{k}: {v}" for k, v in by.most_common()) + ".",
             f"fp32 x fp32 dots: {len(f32)}, {sum(d['flops'] for d in f32) / 1e9:.1f} GFLOP "
             f"({100 * sum(d['flops'] for d in f32) / total:.0f}% of the static dot FLOPs: a dot inside a loop, "
             "e.g. the chunked loss, is counted once here, so compare with the analytic per-step count).", "",
             "| dot | out | operands | GFLOP | source op |", "|---|---|---|---:|---|"]
    for d in sorted(dots, key=lambda d: -d["flops"]):
        flag = " **fp32xfp32**" if d in f32 else ""
        lines.append(f"| {d['name']}{flag} | {d['out']} | {' x '.join(d['operands'])} | {d['flops'] / 1e9:.2f} "
                     f"| {d['meta']} |")
    if res["trace_ops"]:
        st = sorted(res["step_times_s"])
        med = st[len(st) // 2]
        thunks = [o for o in res["trace_ops"] if not o[0].startswith(("$", "PjitFunction", "ThunkExecutor",
                                                                       "SlinkyThreadPool", "while"))]
        lines += ["", f"Trace over {res['steps']} steps (median step {1e3 * med:.0f} ms; load avg "
                  f"{res['loadavg'][0]:.1f}). XLA:CPU thunks summed by name, share of the {res['steps']} steps' "
                  "wall time (ynn_fusion = a dot run by YNNPACK; counts > steps are inside the chunked loss loop):",
                  "", "| thunk | ms/step | share | count | what (HLO) |", "|---|---:|---:|---:|---|"]
        for n, t, c, what in thunks[:30]:
            lines.append(f"| {n[:40]} | {t / res['steps']:,.1f} | {100 * t / (med * 1e3 * res['steps']):.1f}% "
                         f"| {c} | {what.replace('|', '/')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", choices=["small", "gpt2", "gpt2-t256"])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto (default): what `precision: auto` trains with on this CPU")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--allocator", default="tuned", choices=sorted(common.ALLOCATORS))
    a = p.parse_args(argv)
    want = common.ALLOCATORS[a.allocator]
    if os.environ.get("GLIBC_TUNABLES") != want and not os.environ.get("_BENCH_REEXEC"):
        env = common.worker_env(a.allocator)
        env["_BENCH_REEXEC"] = "1"
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.profile_step", *sys.argv[1:]], env)
    if a.precision == "auto":
        from jaxgpt.precision import default_compute

        a.precision = default_compute("cpu")
    res = run(a.config, a.precision, a.steps, not a.no_trace)
    md = markdown(res)
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    stem = common.RESULTS / f"profile-{a.config}-{a.precision}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    stem.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
