"""The benchmark harness's quick mode, as CI runs it: small config, jaxgpt at its default precision (``precision:
auto`` on this CPU) vs torch_ref eager at the same precision, in one invocation, alternating subprocesses. It fails
only on a gross regression (jaxgpt below 0.8x torch eager in the same run) -- a ratio, never an absolute time --
or if the harness itself breaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# In the default suite, so CI runs it: 50 s on an idle 2-core machine (4 min at load average 8-9).
def test_quick_benchmark_ratio(tmp_path):
    out = "quick"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.train_step", "--quick", "--out", out], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "JAXGPT_BENCH_RESULTS": str(tmp_path)})
    print(proc.stdout[-4000:])
    assert (tmp_path / f"{out}.json").exists(), f"no result written:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    res = json.loads((tmp_path / f"{out}.json").read_text())
    rows = res["variants"]
    from benchmarks.train_step import default_jax_variant, eager_twin
    from jaxgpt.precision import default_compute

    jv = f"jax_{default_compute('cpu')}"  # what `precision: auto` trains with on this CPU
    assert default_jax_variant() == jv
    tv = eager_twin(jv)
    assert res["default_jax_variant"] == jv and set(rows) == {jv, tv}
    for v in (jv, tv):
        assert "error" not in rows[v], f"{v} failed:\n{rows[v].get('error')}\n{proc.stderr[-3000:]}"
    # the measurement is what we think it is: the project's train step, same batch, both training
    assert rows[jv]["sources"]["train_step"] == "jaxgpt.step"
    assert abs(rows[jv]["loss_first"] - rows[tv]["loss_first"]) < 0.05
    ratio = rows[jv]["tokens_per_s"]["median"] / rows[tv]["tokens_per_s"]["median"]
    assert proc.returncode == 0, f"ratio {ratio:.2f}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert ratio >= 0.8, f"jaxgpt {jv} is {ratio:.2f}x torch_ref {tv} (must be >= 0.8x)"


def _run(v, tps):
    """A worker's train-step result for variant ``v`` at ``tps`` tokens/s (2,048 tokens per step)."""
    return {"variant": v, "tokens_per_step": 2048, "step_times_s": [2048 / tps] * 3, "cold_first_step_s": 5.0,
            "peak_rss_mib": 1000.0, "loss_first": 10.9, "loss_last": 10.8, "loadavg_start": [1.0, 1, 1],
            "train_step": "jaxgpt.step", "optimizer": "x"}


def test_report_helpers():
    """Summaries and Markdown render from a synthetic result without running anything."""
    from benchmarks import train_step

    runs = {"jax_bf16": [_run("jax_bf16", 3000)], "torch_compile_bf16": [_run("torch_compile_bf16", 2000)]}
    gemm = [{"framework": "jax", "fp32_gflops": 200.0, "bf16_gflops": 400.0}]
    res = train_step.summarize("small", "small", 256, 8, list(runs), runs, gemm, rounds=1, steps=3, warmup=1,
                               allocator="tuned", env={}, started=0.0, load_start=[1.0, 1, 1])
    assert res["fastest_torch"] == "torch_compile_bf16"
    assert res["variants"]["jax_bf16"]["vs_fastest_torch"] == pytest.approx(1.5)
    assert 0 < res["variants"]["jax_bf16"]["fraction_of_peak"] < 1
    from jaxgpt.precision import default_compute

    assert res["default_jax_variant"] == f"jax_{default_compute('cpu')}"
    res["default_jax_variant"] = "jax_bf16"  # as on a machine where bf16 is the default (the bold row)
    md = train_step.markdown(res)
    assert "| **jax_bf16** | 3,000 |" in md
    ok, msg = train_step.quick_check({"default_jax_variant": "jax_bf16",
                                      "variants": {"jax_bf16": res["variants"]["jax_bf16"],
                                                   "torch_eager_bf16": res["variants"]["torch_compile_bf16"]}})
    assert ok, msg
    slow = {**res["variants"]["jax_bf16"], "tokens_per_s": {"median": 1000.0}}
    ok, msg = train_step.quick_check({"default_jax_variant": "jax_bf16",
                                      "variants": {"jax_bf16": slow, "torch_eager_bf16": res["variants"]["torch_compile_bf16"]}})
    assert not ok and "0.50" in msg, msg
    ok, msg = train_step.quick_check({"default_jax_variant": "jax_fp32", "variants": res["variants"]})
    assert not ok and "jax_fp32" in msg, msg  # the default variant missing from the run is a failure, not a pass


def test_report_targets():
    """The target rows: jaxgpt's default (whichever precision it is) vs torch.compile bf16, vs the fastest torch
    variant where that is another one, and the fraction of the faster GEMM probe."""
    from benchmarks import report, train_step

    tps = {"jax_fp32": 1700, "jax_bf16": 1200, "torch_eager_fp32": 1900, "torch_compile_bf16": 1000}
    runs = {v: [_run(v, t)] for v, t in tps.items()}
    gemm = [{"framework": "jax", "fp32_gflops": 300.0, "bf16_gflops": 150.0}]
    res = train_step.summarize("small", "small", 256, 8, list(runs), runs, gemm, rounds=1, steps=3, warmup=1,
                               allocator="tuned", env={}, started=0.0, load_start=[1.0, 1, 1])
    res["default_jax_variant"] = "jax_fp32"  # as `precision: auto` picks on a CPU with slow bf16 GEMMs
    rows = {a: (b, c) for a, b, c in report.targets({"small-tuned": res}, None)}
    assert rows["small: jaxgpt default (jax_fp32) >= 1.2x torch_ref torch.compile bf16"] == \
        ("1,700 / 1,000 tok/s = 1.70x", "met")
    assert rows["small: jaxgpt default (jax_fp32) >= 1.2x the fastest torch variant here (torch_eager_fp32)"] == \
        ("1,700 / 1,900 tok/s = 0.89x", "NOT met")
    (peak_row,) = [k for k in rows if "GEMM peak" in k]
    assert "fp32" in peak_row and rows[peak_row][0].endswith("169 of 300 GFLOP/s = 56%") and rows[peak_row][1] == "NOT met"
