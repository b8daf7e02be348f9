"""The benchmark harness's quick mode, as CI runs it: small config, jaxgpt bf16 vs torch_ref eager bf16, in one
invocation, alternating subprocesses. It fails only on a gross regression (jaxgpt below 0.8x torch eager bf16 in
the same run) -- a ratio, never an absolute time -- or if the harness itself breaks."""

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
    for v in ("jax_bf16", "torch_eager_bf16"):
        assert "error" not in rows[v], f"{v} failed:\n{rows[v].get('error')}\n{proc.stderr[-3000:]}"
    # the measurement is what we think it is: the project's train step, same batch, both training
    assert rows["jax_bf16"]["sources"]["train_step"] in ("jaxgpt.step", "benchmarks stand-in")
    assert abs(rows["jax_bf16"]["loss_first"] - rows["torch_eager_bf16"]["loss_first"]) < 0.05
    ratio = rows["jax_bf16"]["tokens_per_s"]["median"] / rows["torch_eager_bf16"]["tokens_per_s"]["median"]
    assert proc.returncode == 0, f"ratio {ratio:.2f}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert ratio >= 0.8, f"jaxgpt bf16 is {ratio:.2f}x torch_ref eager bf16 (must be >= 0.8x)"


def test_report_helpers():
    """Summaries and Markdown render from a synthetic result without running anything."""
    from benchmarks import train_step

    def run(v, tps):
        return {"variant": v, "tokens_per_step": 2048, "step_times_s": [2048 / tps] * 3, "cold_first_step_s": 5.0,
                "peak_rss_mib": 1000.0, "loss_first": 10.9, "loss_last": 10.8, "loadavg_start": [1.0, 1, 1],
                "train_step": "jaxgpt.step", "optimizer": "x"}
    runs = {"jax_bf16": [run("jax_bf16", 3000)], "torch_compile_bf16": [run("torch_compile_bf16", 2000)]}
    gemm = [{"framework": "jax", "fp32_gflops": 200.0, "bf16_gflops": 400.0}]
    res = train_step.summarize("small", "small", 256, 8, list(runs), runs, gemm, rounds=1, steps=3, warmup=1,
                               allocator="tuned", env={}, started=0.0, load_start=[1.0, 1, 1])
    assert res["fastest_torch"] == "torch_compile_bf16"
    assert res["variants"]["jax_bf16"]["vs_fastest_torch"] == pytest.approx(1.5)
    assert 0 < res["variants"]["jax_bf16"]["fraction_of_peak"] < 1
    md = train_step.markdown(res)
    assert "| **jax_bf16** | 3,000 |" in md
    ok, msg = train_step.quick_check({"variants": {"jax_bf16": res["variants"]["jax_bf16"],
                                                   "torch_eager_bf16": res["variants"]["torch_compile_bf16"]}})
    assert ok, msg
