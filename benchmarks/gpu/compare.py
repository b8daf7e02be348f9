"""The compare part: everything the fast set claims, measured on one GPU in one command of at most
:data:`BUDGET_S` seconds, in the order of value (``python -m benchmarks.gpu.session compare``):

1. gpt2 124M, T=1024, micro-batch 64: jaxgpt's default, the fast set (:mod:`benchmarks.gpu.fastset`), torch.compile;
2. the same at micro-batch 16 (1 and 2 are one bench: its rows, each a fresh worker);
3. the fast set's profile at b64 (trace + optimized HLO: what a calibration of its Pallas kernels is fitted on);
4. the default's profile at b64;
5. the recipe (configs/gpt2-124m.yaml, 10 steps of 524,288 tokens on tiny Shakespeare x 3) with the fast set;
6. the recipe with the default, if time is left;
7. torch.compile's profile at b64, if time is left.

Each step (and bench row) has a budget: its expected process time from the processes measured on the H100 on
2026-11-26 (:data:`MEASURED_S`; where a step never ran there, the measured parts it is made of, said per budget),
and the plan is checked to fit before anything runs (``--plan``: print it and stop). A step the plan cannot reach
is recorded and printed "not measured: budget", a failed one with its one-line error, and the rest go on
(:mod:`benchmarks.gpu.budget`). The fast set's rows are scored against torch.compile at the same micro-batch, and
against issue 32's targets (b64 <= 131 ms, b16 <= 39.5 ms, the recipe <= 1,050 ms per step).

Results land as measured (:mod:`benchmarks.gpu.results`): the run's files and ``run.json`` in a directory named
``<device>-<date>``, packed after every step into ``$OUT/<device>-<date>.tar`` beside ``$OUT/session-compare.json``
(the summary: plan, step records, scores, the recipe's steps, the Pallas GEMMs' tiles). ``--dry``: the same plan
on the CPU at tiny shapes (torch eager instead of torch.compile), the rehearsal.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.gpu import budget, fastset, results
from benchmarks.gpu.budget import Step

BUDGET_S = 540.0  # the device tool's 600 s per command, less start-up (imports, nvidia-smi) and the last packing
# The process times measured on 2026-11-26 (one H100 80GB HBM3, jax 0.11.2, torch 2.11; benchmarks/results/
# h100-2026-11-26/train_step-gpu-h100.json, each row's details.process_s: the worker's start to its exit, 20 timed
# steps included; the bench's duration_s, 191.2 s, is 7.7 s more than its four workers: start-up, init weights)
MEASURED_S = {("jax_bf16", 64): 36.53, ("torch_compile_bf16", 64): 62.68,
              ("jax_bf16", 16): 30.69, ("torch_compile_bf16", 16): 53.58}
BENCH_OVERHEAD_S = 191.22 - sum(MEASURED_S.values())
# Not measured, an allowance: the Triton compiles of the fast set's Pallas kernels (about ten distinct kernels; no
# GPU has compiled them yet), added to whatever the default's measured process took
PALLAS_COMPILE_S = 15.0
# the profile of one b64 step: the default's b64 worker (36.5 s: start-up, the cold step with its 14.7 s compile, 23
# steps) less its 20 timed steps (3.5 s), plus 4 traced steps and the trace's collection and writing (~5 s, not
# measured; summarising the 2026-11-26 trace took 1 s on the 2-core AMD EPYC)
PROFILE_S = round(MEASURED_S[("jax_bf16", 64)] - 20 * 0.1766 + 4 * 0.1818 + 5.0, 1)
# the recipe's 10 steps: 63.7 s of wall time inside python -m jaxgpt.train on 2026-11-26 (its "done:" line; first
# step 17.0 s, checkpoints at 5 and 10 and samples at 10, which this plan leaves out), plus the start-up the bench
# worker shows (its 36.5 s less the cold step's 19.4 s and 23 steps' 4.1 s: 13 s)
RECIPE_S = round(63.7 + (MEASURED_S[("jax_bf16", 64)] - 19.42 - 23 * 0.1766), 1)
# tiny Shakespeare x 3 tokenised into shards: 2.3 s on the 2-core AMD EPYC (family 25 model 17), 2026-11-29
DATA_S = 10.0
# torch.compile's profile: its b64 worker (62.7 s) and 3 profiled steps with the trace's export (~5 s, not measured)
TORCH_PROFILE_S = round(MEASURED_S[("torch_compile_bf16", 64)] + 5.0, 1)
TARGETS_MS = {"b64": 131.0, "b16": 39.5, "recipe": 1050.0}  # issue 32's, for the fast set (benchmarks.gpu.changes)
_TRIPLE = ("import pathlib, sys; t = pathlib.Path(sys.argv[1]).read_text(); d = pathlib.Path(sys.argv[2]); "
           "d.mkdir(parents=True, exist_ok=True); [(d / f'ts-{i}.txt').write_text(t) for i in range(3)]")
MARGIN_S = 10.0  # of the bench step's timeout kept for writing its results after its last row


def bench_rows(dry: bool) -> list[tuple[str, int, float, str]]:
    """(variant, batch, budget_s, why) of the bench's rows in run order."""
    torch_v = "torch_eager_bf16" if dry else "torch_compile_bf16"
    out = []
    for b in ((2,) if dry else (64, 16)):
        d = MEASURED_S[("jax_bf16", 64 if dry else b)]
        t = MEASURED_S[("torch_compile_bf16", 64 if dry else b)]
        out += [("jax_bf16", b, d, f"measured b{b} process (2026-11-26)"),
                (fastset.VARIANT, b, round(d + PALLAS_COMPILE_S, 1),
                 f"the default's b{b} process + {PALLAS_COMPILE_S:.0f} s for its Pallas kernels' compiles"),
                (torch_v, b, t, f"measured b{b} process (2026-11-26)")]
    return out


def recipe_args(dry: bool, data: Path, run: Path, fast: bool) -> list[str]:
    tiny = ["--model_preset=tiny", "--batch_size=2", "--seq_len=64", "--total_batch_tokens=256", "--max_steps=2",
            "--precision=bf16"] if dry else ["--max_steps=10"]
    return [sys.executable, "-m", "jaxgpt.train", "--config", str(common.ROOT / "configs" / "gpt2-124m.yaml"),
            *tiny, *(fastset.train_flags() if fast else []), f"--data_dir={data}", f"--out_dir={run}",
            "--eval_interval=0", "--sample_interval=0", "--checkpoint_interval=0", "--hellaswag_interval=0",
            "--progress=false", "--log_interval=1"]


def plan(*, dry: bool, text: Path | None, work: Path) -> list[Step]:
    """The steps in the order of value, with their budgets (see the module's docstring); scratch files (the
    recipe's text, shards and run directories) under ``work``."""
    if text is None:
        raise SystemExit("the compare part's recipe needs a text file: --text PATH (tiny Shakespeare; "
                         "python -m benchmarks.gpu.carry packs it into .gpu_carry/)")
    py = [sys.executable, "-m"]
    d = ["--dry"] if dry else []
    b64 = 2 if dry else 64
    rows = bench_rows(dry)
    # torch eager (--dry) is the bench's eager row, after each batch's variants
    variants = [v for v in dict.fromkeys(v for v, *_ in rows) if v != "torch_eager_bf16"]
    bench_s = round(sum(r[2] for r in rows) + BENCH_OVERHEAD_S, 1)
    texts, shards = work / "text", work / "shards"
    batches = ",".join(str(r[1]) for r in rows[::3])
    return [
        Step("bench: " + " then ".join(f"b{b}" for b in batches.split(",")) + " (default, fast set, "
             + ("torch eager)" if dry else "torch.compile)"),
             [*py, "benchmarks.gpu.bench", *d, "--batches", batches,
              "--eager-batches", batches if dry else "", "--medium-batch", "0", "--variants", ",".join(variants),
              "--steps", "5" if dry else "20", "--budget-s", "{timeout_s}",
              "--row-budget-s", ",".join(f"{v}@{b}={s}" for v, b, s, _ in rows)],
             bench_s, f"its rows + {BENCH_OVERHEAD_S:.1f} s of the bench's own (2026-11-26)", cap_s=1.25 * bench_s,
             rows=tuple((f"{v} b{b}", s, why) for v, b, s, why in rows)),
        Step(f"profile b{b64}: the fast set", [*py, "benchmarks.gpu.profile", *d, "--batch", str(b64), "--steps",
                                           "2" if dry else "4", "--variant", fastset.VARIANT],
             round(PROFILE_S + PALLAS_COMPILE_S, 1),
             f"the default's profile ({PROFILE_S} s) + {PALLAS_COMPILE_S:.0f} s for the Pallas compiles"),
        Step(f"profile b{b64}: the default", [*py, "benchmarks.gpu.profile", *d, "--batch", str(b64), "--steps",
                                          "2" if dry else "4"],
             PROFILE_S, "the default's b64 process less its timed steps, plus 4 traced steps and the trace's writing"),
        Step("recipe data: tiny Shakespeare x 3", [sys.executable, "-c", _TRIPLE, str(text), str(texts)], 5.0,
             "a copy", cap_s=15.0),
        Step("recipe shards", [*py, "jaxgpt.data", "--input", *(str(texts / f"ts-{i}.txt") for i in range(3)),
                               "--out", str(shards), "--quiet"], DATA_S, "2.3 s on the 2-core AMD EPYC", cap_s=60.0),
        Step(f"recipe: the fast set, {2 if dry else 10} steps", recipe_args(dry, shards, work / "run-fast", True),
             round(RECIPE_S + PALLAS_COMPILE_S, 1),
             f"the default's recipe ({RECIPE_S} s) + {PALLAS_COMPILE_S:.0f} s for the Pallas compiles"),
        Step(f"recipe: the default, {2 if dry else 10} steps", recipe_args(dry, shards, work / "run-default", False), RECIPE_S,
             "63.7 s wall (2026-11-26) + 13 s start-up", required=False),
        Step("profile b64: torch.compile" if not dry else "profile b2: torch eager",
             [*py, "benchmarks.gpu.torch_profile", *d, "--batch", str(b64), "--steps", "2" if dry else "3"],
             TORCH_PROFILE_S, "its measured b64 process (2026-11-26) + the trace's export", required=False),
    ]


def plan_report(steps: list[Step], budget_s: float = BUDGET_S) -> tuple[bool, list[str]]:
    ok = budget.planned_s(steps) <= budget_s
    return ok, budget.plan_lines(steps, budget_s)


# ---- what the measurements say -------------------------------------------------------------------------------
def recipe_summary(metrics: list[dict]) -> dict[str, Any] | None:
    """The recipe's steps: the first (cold) and the median of the rest, ms per 524,288-token step."""
    train = [m for m in metrics if m.get("type") == "train" and m.get("step_time")]
    if not train:
        return None
    rest = [m["step_time"] for m in train[1:]] or [train[0]["step_time"]]
    return {"steps": len(train), "first_s": train[0]["step_time"], "median_ms": statistics.median(rest) * 1e3,
            "tokens_per_step": train[0].get("tokens"), "loss_last": train[-1].get("loss")}


def scores(bench: dict | None, recipes: dict[str, dict | None]) -> list[dict[str, Any]]:
    """Per program and micro-batch: the step time, jaxgpt's speed-up over torch.compile at the same micro-batch
    (torch's time / jaxgpt's: > 1 is faster), and, for the fast set, issue 32's target; a row that was not
    measured says why."""
    out = []
    rows = (bench or {}).get("rows", [])
    torch_ms = {r["batch"]: r["step_ms"]["median"] for r in rows  # torch.compile (--dry: torch eager)
                if r["variant"].startswith("torch") and "error" not in r}
    for r in rows:
        if r["variant"].startswith("torch"):
            continue
        rec = {"program": "fast set" if r["variant"] == fastset.VARIANT else "default", "variant": r["variant"],
               "batch": r["batch"]}
        if "error" in r:
            rec["not_measured"] = budget.one_line_error(r["error"])
        else:
            ms = r["step_ms"]["median"]
            rec.update(ms=ms, vs_torch_compile=torch_ms[r["batch"]] / ms if r["batch"] in torch_ms else None)
        target = TARGETS_MS.get(f"b{r['batch']}") if rec["program"] == "fast set" else None
        if target is not None:
            rec.update(target_ms=target, met=rec["ms"] <= target if "ms" in rec else None)
        out.append(rec)
    for label, s in recipes.items():
        tokens = f"{s['tokens_per_step']:,} tokens" if s and s.get("tokens_per_step") else "-"
        rec = {"program": label, "variant": "the recipe, configs/gpt2-124m.yaml", "batch": tokens}
        if s is None:
            rec["not_measured"] = "no steps recorded"
        else:
            rec["ms"] = s["median_ms"]
        if label == "fast set":
            rec.update(target_ms=TARGETS_MS["recipe"], met=rec["ms"] <= TARGETS_MS["recipe"] if "ms" in rec else None)
        out.append(rec)
    return out


def score_lines(table: list[dict[str, Any]]) -> list[str]:
    out = ["| program | micro-batch | step ms | vs torch.compile | issue 32 target |", "|---|---|---:|---:|---|"]
    for r in table:
        if "ms" not in r:
            out.append(f"| {r['program']} ({r['variant']}) | {r['batch']} | not measured: {r['not_measured']} | | |")
            continue
        vs = f"{r['vs_torch_compile']:.2f}x" if r.get("vs_torch_compile") else "-"
        tgt = "" if "target_ms" not in r else f"<= {r['target_ms']:,.1f} ms: " + ("met" if r["met"] else "NOT met")
        out.append(f"| {r['program']} ({r['variant']}) | {r['batch']} | {r['ms']:,.1f} | {vs} | {tgt} |")
    return out


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()] if path.is_file() else []


def gather(run_dir: Path, work: Path) -> dict[str, Any]:
    """Scores, the recipes' steps and the Pallas GEMMs' tiles from what the steps wrote so far (the recipes' metrics
    are copied into the run directory as ``recipe-<fast|default>-metrics.jsonl``)."""
    recipes = {}
    for label, key in (("fast set", "fast"), ("default", "default")):
        src = work / f"run-{key}" / "metrics.jsonl"
        if src.is_file():
            shutil.copyfile(src, run_dir / f"recipe-{key}-metrics.jsonl")
        if (run_dir / f"recipe-{key}-metrics.jsonl").is_file():
            recipes[label] = recipe_summary(_jsonl(run_dir / f"recipe-{key}-metrics.jsonl"))
    bench = next((_read(p) for p in sorted(run_dir.glob("train_step-gpu-*.json"))), None)
    tiles = {r["variant"] + f" b{r['batch']}": r.get("pallas_kernels") for r in (bench or {}).get("rows", [])
             if r.get("pallas_kernels")}
    for p in sorted(run_dir.glob("profile-gpu-*.json")):
        prof = _read(p)
        if prof and prof.get("pallas_kernels"):
            tiles[p.stem] = prof["pallas_kernels"]
    return {"scores": scores(bench, recipes), "recipes": recipes, "pallas_kernels": tiles}


def run(*, dry: bool, out: Path, text: Path | None, command: str, budget_s: float = BUDGET_S,
        steps: list[Step] | None = None, work: Path | None = None, log=print) -> int:
    """Run the plan (or ``steps``); 0 when every required step ran ok. The run directory and its tar: see the
    module's docstring; ``command``: the session's, recorded in ``run.json``; ``work``: the scratch directory
    (default: a new one under the scratch space)."""
    meta = results.metadata(command, dry=dry)
    work = work or common.TMP / f"compare-{int(time.time())}"
    run_dir = work / meta["run"]
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = steps if steps is not None else plan(dry=dry, text=text, work=work)
    ok, lines = plan_report(steps, budget_s)
    log("\n".join(["The plan:", *lines]))
    summary = {"part": "compare", "dry": dry, "budget_s": budget_s, "run": meta["run"], "git": meta["git"],
               "fast_set": fastset.SETTINGS, "plan": [{"step": s.name, "budget_s": s.budget_s, "why": s.why,
                                                       "required": s.required, "rows": s.rows} for s in steps],
               "plan_fits": ok, "steps": []}
    path = out / "session-compare.json"

    def save(rec=None):
        if rec is not None:
            summary["steps"].append(rec)
        summary.update(gather(run_dir, work))
        (run_dir / "session-compare.json").write_text(json.dumps(summary, indent=1, default=str))
        results.write_meta(run_dir, meta)
        shutil.copyfile(run_dir / "session-compare.json", path)
        results.pack(run_dir, out / f"{meta['run']}.tar")

    if not ok:
        log(f"the plan does not fit {budget_s:.0f} s: nothing run")
        summary["steps"] = [{"step": s.name, "status": budget.NOT_MEASURED, "seconds": 0.0} for s in steps]
        save()
        return 2
    env = {**os.environ, "JAXGPT_BENCH_RESULTS": str(run_dir), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(common.ROOT)]))}
    if dry:
        env["JAX_PLATFORMS"] = "cpu"
    save()
    budget.run_budgeted(steps, budget_s=budget_s, env=env, log_dir=run_dir, log=log, after=save, margin_s=MARGIN_S)
    log("\n| step | status | seconds | budget s |\n|---|---|---:|---:|")
    for r in summary["steps"]:
        log(f"| {r['step']} | {r['status']}{': ' + r['error'] if r.get('error') else ''} | {r['seconds']:.0f} | "
            f"{r['budget_s']:.0f} |")
    bench = next((_read(p) for p in sorted(run_dir.glob("train_step-gpu-*.json"))), None)
    for r in (bench or {}).get("rows", []):
        if "error" in r:
            log(f"  bench row {r['variant']} b{r['batch']}: {budget.one_line_error(r['error'])}")
    log("\n" + "\n".join(score_lines(summary["scores"])))
    for name, kernels in summary["pallas_kernels"].items():
        from benchmarks.gpu.pallas_tiles import gemm_tiles

        log(f"Pallas GEMM tiles of {name}: " + ("; ".join(gemm_tiles(kernels)) or "none"))
    log(f"\n{sum(r['seconds'] for r in summary['steps']):.0f} s of the {budget_s:.0f} s budget; results: "
        f"{path} and {out / (meta['run'] + '.tar')} (python -m benchmarks.gpu.results unpack FILE.tar)")
    return 0 if all(r["status"] == "ok" for r in summary["steps"] if r.get("required", True)) else 1
