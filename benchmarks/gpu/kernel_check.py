"""The kernels part: every opt-in Pallas kernel checked on the GPU against XLA's path, values and gradients within
the bounds their CPU tests use, and the tile configuration of every Pallas kernel built, in one command of at most
:data:`BUDGET_S` seconds (``python -m benchmarks.gpu.session kernels``).

1. The kernels' own tests (:data:`KERNEL_TESTS`: each kernel against the fp64 truth and XLA's expression, each
   custom VJP against autodiff of the plain path), which on a CPU run the kernels in Pallas' interpreter: loaded
   with this module as a pytest plugin (``-p benchmarks.gpu.kernel_check``), every ``pallas_call`` that asks for
   the interpreter gets the compiled Triton kernel instead, so the same bounds now hold the GPU's kernels. The
   tests that assume a CPU's path (a policy's XLA fallback compared bit for bit, the compile-only H100 programs,
   the policy fields) are left out (:data:`DESELECT`).
2. tests/test_kernels_on_device.py: a tiny GPT under each opt-in setting and the fast set against XLA's path on
   the device: loss, every gradient, 3 AdamW steps.

The plugin writes ``kernel-tiles.json`` (every distinct Pallas kernel configuration the tests built,
:mod:`benchmarks.gpu.pallas_tiles`); pytest's JUnit XML holds each case. Budgets are allowances (no GPU has run
these yet): what the 2026-11-26 parity run took per CUDA case (about 10 s, 24 cases in 250 s) for the model-level
cases, and :data:`KERNEL_CASE_S` per kernel test (one small kernel's compiles and run). Results land as the compare part's do
(:mod:`benchmarks.gpu.results`): ``$OUT/<device>-<date>-kernels.tar`` and ``$OUT/session-kernels.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.gpu import budget, results
from benchmarks.gpu.budget import Step

BUDGET_S = 300.0
KERNEL_TESTS = ("tests/kernels/test_gemm.py", "tests/kernels/test_mlp.py", "tests/kernels/test_gelu.py",
                "tests/kernels/test_loss_kernel.py", "tests/kernels/test_layer_norm_kernel.py")
DESELECT = "not trains and not policy_field and not h100 and not decoding"
DEVICE_TESTS = "tests/test_kernels_on_device.py"
PARITY_CASE_S = 10.0  # a CUDA parity case on the H100, 2026-11-26 (24 cases in 250 s: parity.log)
KERNEL_CASES = 64  # what KERNEL_TESTS -k DESELECT collected on 2026-11-29 after the kernel layer (pytest --collect-only)
KERNEL_CASE_S = 1.5  # an allowance per case: one small kernel's Triton and XLA compiles and a run
DEVICE_CASES = 8  # tests/test_kernels_on_device.py: its SETTINGS and the fast set
# kernels: auto's search on the device, bounded by its own --budget-s (the rest of the part's 300 s): the recipe's
# model and micro-batch there (a choice file to commit under jaxgpt/kernels/tuned/), the tiny config in the rehearsal
TUNE_CONFIG = {False: "configs/gpt2-124m.yaml", True: "configs/tiny-test.yaml"}
TUNE_BUDGET_S = {False: 75.0, True: 8.0}
TUNE_START_S = 15.0  # python, jax and the CUDA plugin starting (an allowance)
DRY_TESTS = ("tests/kernels/test_gemm.py::test_sum_kernel_against_the_truth",)
TILES = "kernel-tiles.json"

_recording = None


def pytest_configure(config) -> None:  # the plugin: compiled kernels on a GPU, recorded either way
    global _recording
    import jax

    from benchmarks.gpu import pallas_tiles

    try:
        gpu = len(jax.devices("gpu")) > 0
    except RuntimeError:
        gpu = False
    _recording = (pallas_tiles.recording(compiled=gpu), gpu)
    config._pallas_seen = _recording[0].__enter__()


def pytest_unconfigure(config) -> None:
    global _recording
    if _recording is None:
        return
    ctx, gpu = _recording
    seen = list(getattr(config, "_pallas_seen", []))
    ctx.__exit__(None, None, None)
    _recording = None
    out = Path(os.environ.get("JAXGPT_BENCH_RESULTS") or common.RESULTS) / TILES
    prior = json.loads(out.read_text())["kernels"] if out.is_file() else []
    kernels = prior + [k for k in seen if k not in prior]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"compiled_on_gpu": gpu, "kernels": kernels}, indent=1, default=str) + "\n")


def plan(*, dry: bool, run_dir: Path) -> list[Step]:
    py = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.gpu.kernel_check", "-rfEs"]
    tests = list(DRY_TESTS) if dry else [*KERNEL_TESTS, "-k", DESELECT]
    return [
        Step("the kernels' own tests, compiled", [*py, *tests, "--junitxml", str(run_dir / "kernels-junit.xml")],
             round(KERNEL_CASES * KERNEL_CASE_S, 1),
             f"{KERNEL_CASES} cases at {KERNEL_CASE_S} s each (one small kernel each; an allowance)"),
        Step("a tiny GPT per setting against XLA's path", [*py, DEVICE_TESTS, "--junitxml",
                                                            str(run_dir / "device-junit.xml")],
             DEVICE_CASES * PARITY_CASE_S,
             f"{DEVICE_CASES} cases at a 2026-11-26 parity case's 10 s each (an allowance)"),
        Step("kernels: auto on the device (jaxgpt.tune; its choice file for jaxgpt/kernels/tuned/)",
             [sys.executable, "-m", "jaxgpt.tune", "--config", TUNE_CONFIG[dry], "--force", "--no-progress",
              "--budget-s", str(TUNE_BUDGET_S[dry]), "--out", str(run_dir)],
             TUNE_BUDGET_S[dry] + TUNE_START_S,
             f"the search's own bound (--budget-s {TUNE_BUDGET_S[dry]:.0f}: the default program first, then as many "
             f"candidates as fit) and {TUNE_START_S:.0f} s to start (an allowance)", required=False),
    ]


def junit(path: Path) -> dict[str, Any]:
    """Counts and the failures (case, one line) of a JUnit XML report."""
    if not path.is_file():
        return {"report": None}
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    out = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for c in cases:
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        if bad is not None:
            out["failed"] += 1
            msg = (bad.get("message") or bad.text or "").strip()
            out["failures"].append(f"{c.get('classname')}::{c.get('name')}: {budget.one_line_error(msg)}")
        elif c.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def run(*, dry: bool, out: Path, command: str, budget_s: float = BUDGET_S, log=print) -> int:
    meta = results.metadata(command, dry=dry)
    work = common.TMP / f"kernels-{int(time.time())}"
    run_dir = work / meta["run"]
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = plan(dry=dry, run_dir=run_dir)
    ok = budget.planned_s(steps) <= budget_s
    log("\n".join(["The plan:", *budget.plan_lines(steps, budget_s)]))
    summary: dict[str, Any] = {"part": "kernels", "dry": dry, "budget_s": budget_s, "run": meta["run"],
                               "git": meta["git"], "plan_fits": ok, "steps": []}
    path = out / "session-kernels.json"

    def save(rec=None):
        if rec is not None:
            summary["steps"].append(rec)
        summary["kernel_tests"] = junit(run_dir / "kernels-junit.xml")
        summary["device_tests"] = junit(run_dir / "device-junit.xml")
        tiles = run_dir / TILES
        summary["tiles"] = json.loads(tiles.read_text()) if tiles.is_file() else None
        (run_dir / "session-kernels.json").write_text(json.dumps(summary, indent=1, default=str))
        results.write_meta(run_dir, meta)
        path.write_text((run_dir / "session-kernels.json").read_text())
        results.pack(run_dir, out / f"{meta['run']}-kernels.tar")

    env = {**os.environ, "JAXGPT_BENCH_RESULTS": str(run_dir), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(common.ROOT)]))}
    if dry:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
    save()
    if not ok:
        log(f"the plan does not fit {budget_s:.0f} s: nothing run")
        return 2
    budget.run_budgeted(steps, budget_s=budget_s, env=env, log_dir=run_dir, log=log, after=save)
    for key in ("kernel_tests", "device_tests"):
        j = summary[key]
        if j.get("report") is None and "passed" not in j:
            log(f"{key}: no report")
            continue
        log(f"{key}: {j['passed']} passed, {j['failed']} failed, {j['skipped']} skipped"
            + "".join(f"\n  FAILED {f}" for f in j["failures"]))
    from benchmarks.gpu.pallas_tiles import gemm_tiles

    if summary["tiles"]:
        log("Pallas GEMM tiles built: " + ("; ".join(gemm_tiles(summary["tiles"]["kernels"])) or "none"))
    log(f"results: {path} and {out / (meta['run'] + '-kernels.tar')}")
    return 0 if all(r["status"] == "ok" for r in summary["steps"]) else 1
