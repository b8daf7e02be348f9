"""BENCHMARKS.md's GPU parts and docs/benchmark-history.md, rendered from what is under ``benchmarks/results/``:

* measured: every GPU run's directory (``<device>-<date>/``, :mod:`benchmarks.gpu.results`), newest first: the
  headline (device, date, versions, the commands; jaxgpt against torch.compile per micro-batch, the fast set's
  scores, the recipe), then its tables (the bench, where the step's time goes, the kernel checks, the Pallas tiles);
  and how far the speed model's calibrated prediction sits from what the H100 measured;
* predicted: one table, the calibrated (or roofline) predictions of the programs no GPU has run yet;
* history (docs/benchmark-history.md): the change-by-change predictions and hand-written analyses
  (``analysis-gpu-*.md``) and the compiled-only section (``gpu-compiled.md``).

``benchmarks.report`` puts them together; nothing here is edited by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.gpu import results

NOT_YET = ("**Not yet measured**: no GPU run lies under `benchmarks/results/<device>-<date>/`. On a GPU, `python -m "
           "benchmarks.gpu.session compare` measures jaxgpt's default, the fast set and torch.compile at micro-batch "
           "64 and 16, their profiles and the gpt2-124m recipe in one budgeted command, and `python -m "
           "benchmarks.gpu.session kernels` checks the Pallas kernels on the device; docs/gpu.md says how to bring "
           "the files back.")


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _load(name: str) -> dict[str, Any] | None:
    return _read(common.RESULTS / f"{name}.json")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()] if path.is_file() else []


# ---- one run ---------------------------------------------------------------------------------------------------
def e2e_result(run_dir: Path) -> dict[str, Any] | None:
    """A run's end-to-end training run (``e2e-gpu-<device>.json`` and the metrics.jsonl it names), if any."""
    meta = next(iter(sorted(run_dir.glob("e2e-gpu-*.json"))), None)
    if meta is None:
        return None
    res = json.loads(meta.read_text())
    res["train"] = [r for r in _jsonl(run_dir / res["metrics_file"]) if r.get("type") == "train"]
    log = run_dir / res.get("log_file", "-")
    done = [ln for ln in log.read_text().splitlines() if ln.startswith("done:")] if log.is_file() else []
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


def device_line(run: dict[str, Any]) -> list[str]:
    """Where, when and with what a run measured: the heading and one line of software and commands."""
    g, v = run["device"], run["versions"]
    plugin = next((f"{k} {v[k]}" for k in results.PLUGINS if k in v and k.startswith("jax-cuda")), None)
    cmds = "; ".join(f"`{c['command']}`" for c in run["commands"])
    facts = ", ".join(x for x in (g.get("driver") and f"driver {g['driver']}", g.get("memory")) if x)
    name = (g.get("name") or "GPU (unnamed: nvidia-smi gave no name)") + (f" ({facts})" if facts else "")
    return [f"### {name}, {run['date']}: `benchmarks/results/{run['dir'].name}/`", "",
            f"Measured on one {name}, {run['date']}, git "
            f"{run['git']}, with that machine's software: python {v.get('python')}, jax / jaxlib {v.get('jax')} / "
            f"{v.get('jaxlib')}" + (f" ({plugin})" if plugin else "") + f", flax {v.get('flax')}, optax "
            f"{v.get('optax')}, torch {v.get('torch')}, transformers {v.get('transformers')}, numpy {v.get('numpy')} "
            f"(not the pinned versions of docs/install.md). Commands: {cmds}.", ""]


def gpu_summary(res: dict[str, Any], e2e: dict[str, Any] | None) -> list[str]:
    """A bench's headline: jaxgpt's default against torch.compile per micro-batch, the training run, the targets."""
    rows = {(r["batch"], r["variant"]): r for r in res["rows"] if "error" not in r and r["shape"] == "gpt2"}
    out = ["| gpt2 124M, T=1024 | jaxgpt (default policy) | torch_ref: torch.compile + bf16 autocast + flash SDPA + "
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
        notes.append(f"The training run, on {e2e['data']}"
                     + (f"; outside the range: {', '.join(outliers)}" if outliers else "") + "."
                     + (f" Its summary line said \"{e2e['summary_line'].split(', ')[-2]}\"." if e2e.get("summary_line")
                        else "") + (f" {e2e['note']}" if e2e.get("note") else ""))
    verdicts = [f"{t['target']}: " + ("not run" if t["measured"] is None else "met" if t["met"] else "NOT met")
                for t in res.get("targets", [])]
    notes.append("Targets (the bench's table below): " + "; ".join(verdicts) + ".")
    return out + [""] + [n + "\n" for n in notes]


def compare_headline(s: dict[str, Any]) -> list[str]:
    """The compare session's scores: each program per micro-batch against torch.compile and issue 32's targets,
    what was not measured and why."""
    from benchmarks.gpu.compare import score_lines

    out = [f"The fast set: `{' '.join(f'{k}={v}' for k, v in s['fast_set'].items())}` (its bench rows without the "
           "grouped norm, an optimizer setting). Step times are medians; \"vs torch.compile\" is torch.compile's step "
           "over jaxgpt's at the same micro-batch (above 1: jaxgpt faster).", "", *score_lines(s["scores"]), ""]
    missed = [r for r in s["steps"] if r["status"] != "ok"]
    if missed:
        out += ["Not measured or failed: " + "; ".join(f"{r['step']}: {r['status']}"
                                                         + (f" ({r['error']})" if r.get("error") else "")
                                                         for r in missed) + ".", ""]
    return out


def kernels_headline(s: dict[str, Any]) -> list[str]:
    def count(j):
        return "no report" if "passed" not in j else f"{j['passed']} passed, {j['failed']} failed, {j['skipped']} skipped"

    out = [f"The Pallas kernels compiled on the GPU against XLA's path (`python -m benchmarks.gpu.session kernels`): "
           f"their own tests {count(s['kernel_tests'])}; a tiny GPT per setting {count(s['device_tests'])}."]
    fails = s["kernel_tests"].get("failures", []) + s["device_tests"].get("failures", [])
    return out + ([f"Failed: {'; '.join(fails)}."] if fails else []) + [""]


def run_headline(run: dict[str, Any]) -> list[str]:
    d = run["dir"]
    out = device_line(run)
    bench = next((_read(p) for p in sorted(d.glob("train_step-gpu-*.json"))), None)
    if (s := _read(d / "session-compare.json")) is not None:
        out += compare_headline(s)
    elif bench is not None:
        out += gpu_summary(bench, e2e_result(d))
    if (k := _read(d / "session-kernels.json")) is not None:
        out += kernels_headline(k)
    return out


def run_details(run: dict[str, Any]) -> list[str]:
    """A run's full tables: the bench, where each profiled step's time goes, the compare session's steps, the Pallas
    kernels' tiles."""
    from benchmarks.gpu import bench, profile
    from benchmarks.gpu.pallas_tiles import gemm_tiles

    d, out = run["dir"], []
    for p in sorted(d.glob("train_step-gpu-*.json")):
        res = json.loads(p.read_text())
        out += [f"### `{p.stem}` ({d.name})", "", bench.markdown(res), "", f"Command: `{res['command']}`", ""]
    for p in sorted(d.glob("profile-gpu-*.json")):
        md = p.with_suffix(".md")
        one = common.ROOT / "tests" / "data" / f"{p.stem}-one-step.trace.json.gz"
        out += [f"### Where the step's time goes (`{p.stem}`)", "",
                md.read_text().rstrip() if md.is_file() else profile.markdown(json.loads(p.read_text())), "",
                f"Summarised from the run's trace and its optimized HLO (`benchmarks/results/{d.name}/{p.stem}"
                f".hlo.txt.gz`) by `python -m benchmarks.gpu.profile --summarise TRACE --hlo HLO --meta RUN.json --json "
                f"OUT`; `{p.name}` also holds every HLO instruction's time, scope and kernels."
                + (f" The raw trace is not in the repository; one step of it is `{one.relative_to(common.ROOT)}` "
                   "(`--trim-to-one-step`), which the tests read." if one.exists() else ""), ""]
    for p in sorted(d.glob("torch-profile-gpu-*.json")):
        res = json.loads(p.read_text())
        out += [f"### Where torch.compile's step goes (`{p.stem}`)", "", res["markdown"].rstrip(), ""]
    if (s := _read(d / "session-compare.json")) is not None:
        out += [f"### The compare session's steps ({d.name})", "", "| step | status | seconds | budget s |",
                "|---|---|---:|---:|"]
        out += [f"| {r['step']} | {r['status']}{': ' + r['error'] if r.get('error') else ''} | {r['seconds']:.0f} | "
                f"{r.get('budget_s', 0):.0f} |" for r in s["steps"]] + [""]
        for name, kernels in s.get("pallas_kernels", {}).items():
            out += [f"Pallas GEMM tiles of {name} (bm x bn x bk, warps, stages, grid): "
                    + ("; ".join(gemm_tiles(kernels)) or "none") + ".", ""]
    if (k := _read(d / "session-kernels.json")) is not None and k.get("tiles"):
        out += [f"Pallas GEMM tiles the kernel checks built ({d.name}): "
                + ("; ".join(gemm_tiles(k["tiles"]["kernels"])) or "none") + ".", ""]
    return out


# ---- BENCHMARKS.md's GPU parts ------------------------------------------------------------------------------------
def gpu_headlines() -> list[str]:
    runs = results.runs()
    out = ["## Measured on GPUs", ""]
    if not runs:
        return out + [NOT_YET, ""]
    for run in reversed(runs):
        out += run_headline(run)
    return out


def gpu_details() -> list[str]:
    out = []
    for run in reversed(results.runs()):
        out += run_details(run)
    if cal := _load("calibration-h100"):  # python -m benchmarks.gpu.calibrate --check
        from benchmarks.gpu import calibrate

        out += calibrate.markdown(cal)
    return out


def gpu_section() -> list[str]:
    """Everything measured on GPUs (BENCHMARKS.md puts the headlines first, the tables after the CPU's)."""
    return gpu_headlines() + gpu_details()


def predictions_section() -> list[str]:
    """The one table of predictions: programs no GPU has run, by ``python -m jaxgpt.compile`` (the calibrated
    estimate where the target has a calibration, else the roofline bound), compiled here."""
    from benchmarks.gpu import changes, fastset
    from jaxgpt.compile import calibrated

    def cell(rec, key="time_s"):
        if rec is None:
            return "-"
        t = rec["prediction"][key] * 1e3
        unc = (rec["prediction"].get("calibrated") or {}).get("uncalibrated_s", 0) * 1e3
        return f"{t:,.1f}" + (f" ({unc:,.1f} uncal.)" if unc >= 0.5 else "")

    h100 = calibrated.status("h100-sxm")
    how = f"calibrated ({h100['device_kind']} trace, {h100['measured']})"
    out = ["## Predicted (not measured)", "",
           "**Predictions, not measurements**: `python -m jaxgpt.compile`'s step time for programs compiled here "
           "(compile-only, jax 0.10.2; no GPU ran them). \"calibrated\": every kernel at the rate its class ran in a "
           "GPU's trace (the parts of classes the trace never saw, e.g. jaxgpt's Pallas kernels, at the least "
           "efficient measured rate of their kind: \"uncal.\" ms); \"roofline\": a lower bound, for a target without a "
           "calibration of its own (no device's rates stand in for another's). How far the calibrated estimate sat "
           "from what the H100 measured: \"The calibrated prediction\" under \"GPU tables\" above.",
           "", "| program | GPU | b64, one step (ms) | b16 (ms) | configs/gpt2-124m.yaml step, 524,288 tokens (ms) "
           "| memory at b64 (GiB) | how |", "|---|---|---:|---:|---:|---:|---|"]
    rows = (("jaxgpt's default", changes.files_of("default (GPUs)")),
            (f"the fast set (`{fastset.shown()}`)", changes._stems(fastset.PREDICTED)),
            (f"the fast set before the kernel layer (`{changes.FASTEST}`; c_proj: pallas, since removed, saved "
             "0.7 ms of it at b64)", changes.files_of(changes.FASTEST)))
    for label, files in rows:
        recs = {p: changes.load(stem) for p, stem in files.items()}
        if recs.get("b64") is None:
            continue
        gib = recs["b64"]["memory"]["total"] / 2**30 if recs.get("b64") else None
        out.append(f"| {label} | H100 SXM | {cell(recs.get('b64'))} | {cell(recs.get('b16'))} | "
                   f"{cell(recs.get('yaml'))} | {gib:.2f} | {how} |")
    for target, name in (("h200", "H200"), ("a100-sxm-80gb", "A100 SXM 80GB")):
        rec = _load(f"compile-gpt2-124m-{target.split('-')[0]}")
        if rec is None:
            continue
        st = calibrated.status(target)
        b64 = rec.get("search", {}).get("tried", {}).get("64")
        way = "calibrated" if st["calibrated"] else f"roofline lower bound: {st['why'].split(':')[0]}"
        out.append(f"| jaxgpt's default | {name} | - | - | {cell(rec)} (b{rec['micro_batch']} x {rec['micro_steps']}) "
                   f"| {b64 / 2**30:.2f} | {way} |" if b64 else
                   f"| jaxgpt's default | {name} | - | - | {cell(rec)} | - | {way} |")
    return out + [""]


# ---- docs/benchmark-history.md ------------------------------------------------------------------------------------
def prediction_vs_measured() -> list[str]:
    """The compiled H100 prediction of configs/gpt2-124m.yaml beside the step the H100 measured, where both exist."""
    run = next((r for r in results.runs() if r["dir"].name.startswith("h100")), None)
    pred, e2e = _load("compile-gpt2-124m-h100"), e2e_result(run["dir"]) if run else None
    if not (pred and e2e and e2e["train"][1:]):
        return []
    times = sorted(r["step_time"] for r in e2e["train"][1:])
    med = times[len(times) // 2]
    p = pred["prediction"]
    bound = p.get("bound_s")
    what = (f"predicted {1e3 * p['time_s']:,.0f} ms (calibrated) and {1e3 * bound:,.0f} ms (roofline bound)" if bound
            else f"predicted {1e3 * p['time_s']:,.0f} ms (the roofline lower bound, MFU "
                 f"{100 * pred['predicted_mfu']:.1f}%)")
    return [f"Measured since, on one {e2e['device']} ({e2e['date']}, BENCHMARKS.md \"Measured on GPUs\"): "
            f"`{pred['config']}` (b{pred['micro_batch']} x {pred['micro_steps']} micro-steps) took a median "
            f"{1e3 * med:,.0f} ms per step; {what} for the program compiled here with jax {pred['jax']}: the GPU took "
            f"{med / p['time_s']:.2f}x the prediction. The per-micro-step figures of this section are predictions "
            "of the same kind.", ""]


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


def history() -> str:
    """docs/benchmark-history.md: the predictions and analyses made change by change before a GPU measured them."""
    out = ["# Benchmark history: predictions and analyses, change by change", "",
           "What was predicted and analysed for GPUs, in the order it was done, kept for the record: every figure here "
           "is a **prediction** (`python -m jaxgpt.compile`, compiled on a CPU-only machine) or an analysis of the "
           "one measured trace, not a measurement. The measured results and the current predictions are in "
           "[BENCHMARKS.md](../BENCHMARKS.md); both files are written by `python -m benchmarks.report` from "
           "`benchmarks/results/`.", "", "## GPU: analyses and predicted changes (issue 32)", ""]
    for md in sorted(common.RESULTS.glob("analysis-gpu-*.md")):  # by hand from a profile, or benchmarks.gpu.changes
        out += [md.read_text().rstrip(), ""]
    out += gpu_compiled_section()
    return "\n".join(out)
