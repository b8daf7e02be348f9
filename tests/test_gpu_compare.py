"""The one command that measures the fast set on a GPU (benchmarks.gpu.compare, issue 43), its budgets
(benchmarks.gpu.budget), the kernels part (benchmarks.gpu.kernel_check), the Pallas tiles a row records
(benchmarks.gpu.pallas_tiles) and results as measured (benchmarks.gpu.results): the plan and the bookkeeping in
the default suite, the whole part rehearsed on the CPU in the slow one."""

from __future__ import annotations

import functools
import json
import sys
import tarfile

import pytest

from benchmarks import common
from benchmarks.gpu import budget, compare, fastset, kernel_check
from benchmarks.gpu import results as runs
from benchmarks.gpu import session as gpu_session
from tests.test_kernels_on_device import SETTINGS
from benchmarks.gpu.budget import Step


def test_the_plan_fits_540_s_by_the_measured_process_times_in_the_order_of_value(tmp_path, capsys):
    """`compare --plan` (the dry mode's plan, nothing run): b64 then b16 rows of the default, the fast set and
    torch.compile, the fast set's profile, the default's, the fast set's recipe, all required and within 540 s by
    the 2026-11-26 process times; the default's recipe and torch's profile only if time is left."""
    assert gpu_session.main(["compare", "--plan"]) == 0
    shown = capsys.readouterr().out
    steps = compare.plan(dry=False, text=tmp_path / "t.txt", work=tmp_path)
    assert [(s.name, s.required) for s in steps] == [
        ("bench: b64 then b16 (default, fast set, torch.compile)", True), ("profile b64: the fast set", True),
        ("profile b64: the default", True), ("recipe data: tiny Shakespeare x 3", True), ("recipe shards", True),
        ("recipe: the fast set, 10 steps", True), ("recipe: the default, 10 steps", False),
        ("profile b64: torch.compile", False)]
    bench = steps[0]
    assert [r[0] for r in bench.rows] == ["jax_bf16 b64", f"{fastset.VARIANT} b64", "torch_compile_bf16 b64",
                                          "jax_bf16 b16", f"{fastset.VARIANT} b16", "torch_compile_bf16 b16"]
    # the measured rows' budgets are the measured process times; the bench's is its rows and its own overhead
    assert dict((r[0], r[1]) for r in bench.rows)["torch_compile_bf16 b64"] == 62.68
    assert bench.budget_s == pytest.approx(sum(r[1] for r in bench.rows) + 191.22 - 183.48, abs=0.1)
    argv = bench.argv
    assert argv[argv.index("--variants") + 1] == f"jax_bf16,{fastset.VARIANT},torch_compile_bf16"
    assert argv[argv.index("--budget-s") + 1] == "{timeout_s}" and "torch_compile_bf16@16=53.58" in argv[-1]
    assert all(f in steps[5].argv for f in fastset.train_flags()) and "--max_steps=10" in steps[5].argv
    assert not any(f in steps[6].argv for f in fastset.train_flags())
    assert steps[1].argv[-2:] == ["--variant", fastset.VARIANT]
    assert budget.planned_s(steps) <= compare.BUDGET_S == 540.0
    for s in steps:
        assert f"{s.name:<44}{s.budget_s:>9.1f}" in shown
    assert "of the 540 s budget: fits" in shown and "(if time is left)" in shown
    assert gpu_session.main(["kernels", "--plan"]) == 0 and "of the 300 s budget: fits" in capsys.readouterr().out
    # a plan over its budget says so and exits 1
    assert "DOES NOT FIT" in budget.plan_lines(steps, 100.0)[-1]


def test_budgeted_steps_set_aside_the_later_required_steps_and_record_every_step(tmp_path):
    py = [sys.executable, "-c"]
    env = dict(gpu_session.os.environ)

    def step(name, code, b, required=True, cap=None):
        return Step(name, [*py, code], b, "test", required=required, cap_s=cap)

    slow = "import time; time.sleep(30)"
    steps = [step("quick", "print('hello')", 3), step("slow", slow, 1, cap=30.0),
             step("fails", "raise ValueError('boom: the one line')", 3), step("too big", "pass", 100, required=False),
             step("last", "print('{timeout_s}')", 3)]
    recs = budget.run_budgeted(steps, budget_s=20, env=env, log_dir=tmp_path, log=lambda s: None, margin_s=1)
    by = {r["step"]: r for r in recs}
    assert by["quick"]["status"] == "ok" and (tmp_path / by["quick"]["log"]).read_text() == "hello\n"
    # "slow" may run until the later required steps' budgets and slack begin: 20 - 3 - 3 - 2 x 2 = 10 s
    assert by["slow"]["status"] == "timed out" and by["slow"]["timeout_s"] == pytest.approx(10, abs=0.3)
    assert by["fails"]["status"] == "failed" and by["fails"]["error"] == "ValueError: boom: the one line"
    assert by["too big"]["status"] == budget.NOT_MEASURED and "budget is 100 s" in by["too big"]["error"]
    assert by["last"]["status"] == "ok" and 3 <= by["last"]["timeout_s"]
    assert (tmp_path / by["last"]["log"]).read_text().strip() == f"{by['last']['timeout_s'] - 1:.0f}"


def test_the_compare_part_records_each_step_scores_and_packs_its_run(tmp_path, monkeypatch):
    """compare.run with stand-in steps: the bench writes its rows (one not measured: budget, one failed with its
    line), a recipe its metrics; the summary scores the fast set against torch.compile and issue 32's targets, and
    $OUT holds only the summary and one tar of the run directory, which unpacks under results/<run>/."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    monkeypatch.setattr(common, "TMP", scratch)

    def row(variant, batch, ms=None, error=None):
        base = {"shape": "gpt2", "variant": variant, "batch": batch}
        return {**base, "error": error, "skipped": True} if error else {**base, "step_ms": {"median": ms}}

    bench = {"rows": [row("jax_bf16", 64, 170.0), row(fastset.VARIANT, 64, 128.0), row("torch_compile_bf16", 64, 160.0),
                      row("jax_bf16", 16, error="not measured: budget (10 s of 300 s left, the row's budget is 31 s)"),
                      row(fastset.VARIANT, 16, error="worker exited 1: Traceback ...\nRuntimeError: Triton failed"),
                      row("torch_compile_bf16", 16, 43.0)]}
    metrics = [{"type": "train", "step": 1, "step_time": 20.0, "tokens": 524288},
               *({"type": "train", "step": s, "step_time": 0.95, "tokens": 524288 * s} for s in range(2, 11))]
    write = ("import json, os, pathlib, sys; d = pathlib.Path(os.environ['JAXGPT_BENCH_RESULTS']); "
             "(d / sys.argv[1]).write_text(sys.argv[2])")
    run_fast = scratch / "metrics-src"
    run_fast.mkdir(parents=True)
    (run_fast / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    work = scratch / "work"
    steps = [Step("bench", [sys.executable, "-c", write, "train_step-gpu-h200.json", json.dumps(bench)], 5, "test"),
             Step("fails", [sys.executable, "-c", "raise SystemExit('error: no such file')"], 5, "test"),
             # the recipe's run directory, where compare.gather finds its metrics
             Step("recipe", [sys.executable, "-c", "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2])",
                             str(run_fast), str(work / "run-fast")], 5, "test"),
             Step("too big", [sys.executable, "-c", "pass"], 999, "test", required=False)]
    rc = compare.run(dry=True, out=out, text=None, command="python -m benchmarks.gpu.session compare (test)",
                     budget_s=60, steps=steps, work=work, log=lambda s: None)
    assert rc == 1  # "fails" failed
    names = sorted(p.name for p in out.iterdir())
    run = json.loads((out / "session-compare.json").read_text())["run"]
    assert names == [f"{run}.tar", "session-compare.json"] and run.startswith("dry-")
    s = json.loads((out / "session-compare.json").read_text())
    assert [(r["step"], r["status"]) for r in s["steps"]] == [("bench", "ok"), ("fails", "failed"), ("recipe", "ok"),
                                                              ("too big", budget.NOT_MEASURED)]
    assert s["steps"][1]["error"] == "error: no such file"
    scores = {(r["program"], r["batch"]): r for r in s["scores"]}
    fast64 = scores[("fast set", 64)]
    assert fast64["vs_torch_compile"] == pytest.approx(160 / 128) and fast64["met"] is True  # 128 <= 131 ms
    assert scores[("default", 16)]["not_measured"].startswith("not measured: budget")
    assert scores[("fast set", 16)]["not_measured"] == "RuntimeError: Triton failed" and scores[("fast set", 16)]["met"] is None
    recipe = scores[("fast set", "524,288 tokens")]
    assert recipe["ms"] == pytest.approx(950.0) and recipe["met"] is True  # <= 1,050 ms
    lines = "\n".join(compare.score_lines(s["scores"]))
    assert "| fast set (jax_bf16_fast) | 64 | 128.0 | 1.25x | <= 131.0 ms: met |" in lines
    with tarfile.open(out / f"{run}.tar") as tar:
        members = sorted(m.name for m in tar.getmembers())
    assert f"{run}/run.json" in members and f"{run}/train_step-gpu-h200.json" in members
    assert f"{run}/recipe-fast-metrics.jsonl" in members and f"{run}/fails.log" in members
    meta = json.loads(tarfile.open(out / f"{run}.tar").extractfile(f"{run}/run.json").read())
    assert meta["commands"][0]["command"] == "python -m benchmarks.gpu.session compare (test)"
    assert "train_step-gpu-h200.json" in meta["commands"][0]["files"] and meta["git"] and meta["versions"]["jax"]
    dest = runs.unpack(out / f"{run}.tar", tmp_path / "results")
    assert (dest / "train_step-gpu-h200.json").is_file()
    with pytest.raises(SystemExit, match="already under"):  # never over a run already there
        runs.unpack(out / f"{run}.tar", tmp_path / "results")
    # the report renders such a run (a dry one is left out of it: made a GPU's here)
    from benchmarks.gpu import report

    meta = json.loads((dest / "run.json").read_text())
    (dest / "run.json").write_text(json.dumps({**meta, "dry": False, "device": {"name": "NVIDIA H200"}}))
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    text = "\n".join(report.gpu_headlines())
    assert f"### NVIDIA H200, {meta['date']}: `benchmarks/results/{run}/`" in text
    assert "| fast set (jax_bf16_fast) | 64 | 128.0 | 1.25x | <= 131.0 ms: met |" in text
    assert "fails: failed (error: no such file)" in text and "too big: not measured: budget" in text


def test_a_worker_row_survives_an_error_in_its_prediction(monkeypatch):
    """worker.py's prediction comes after the measurement: an exception there is one line beside the row."""
    import numpy as np

    from benchmarks.gpu import worker

    def runner(spec, cfg, precision, compiled, x, y, init):
        def predicted_s():
            raise KeyError("compiled_text")
        return {"step": lambda: {"loss": 1.0}, "sync": lambda: None, "value": lambda m: 1.0, "peak_mib": lambda: None,
                "info": {"device_kind": "cpu"}, "predicted_s": predicted_s}

    monkeypatch.setattr(worker, "_jax", runner)
    x = np.zeros((1, 2, 4), np.int32)
    res = worker.run_train_gpu({"variant": "jax_bf16", "windows": 2, "window": 2, "warmup": 1}, None,
                               ("jax", "bf16", True), x, x, None)
    assert len(res["step_times_s"]) == 2 and res["predicted_step_s"] is None
    assert res["predicted_error"] == "KeyError: 'compiled_text'" and res["pallas_kernels"] == []


def test_a_row_over_its_budget_is_recorded_not_measured_and_the_next_row_runs(tmp_path, monkeypatch):
    from benchmarks.gpu import bench

    calls = []

    def run_worker(spec, env, timeout=0, module=""):
        calls.append((spec["variant"], timeout))
        return {"variant": spec["variant"], "tokens_per_step": spec["batch"] * spec["seq"], "step_times_s": [0.1] * 4,
                "cold_first_step_s": 10.0, "loss_first": 10.9, "loss_last": 10.5, "device_kind": "NVIDIA H200",
                "pallas_kernels": [{"name": "gemm_nn_bias_gelu"}]}

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "run_worker", run_worker)
    monkeypatch.setattr(common, "ensure_init", lambda preset, overrides=None: tmp_path / "init.npz")
    res = bench.run(dry=False, batches=[64], eager_batches=[], medium_batch=None, steps=20, budget_s=100,
                    variants=["jax_bf16", fastset.VARIANT, "torch_compile_bf16"], log=lambda s: None,
                    row_budget_s={("jax_bf16", 64): 30, (fastset.VARIANT, 64): 500, ("torch_compile_bf16", 64): 60})
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows[fastset.VARIANT]["not_measured"] == "budget" and "not measured: budget" in rows[fastset.VARIANT]["error"]
    assert [v for v, _ in calls] == ["jax_bf16", "torch_compile_bf16"] and all(t <= 100 for _, t in calls)
    assert rows["jax_bf16"]["pallas_kernels"] == [{"name": "gemm_nn_bias_gelu"}]
    assert "not measured: budget" in bench.markdown(res)


def test_pallas_calls_are_recorded_with_their_tiles():
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from benchmarks.gpu import pallas_tiles

    def kernel(x_ref, o_ref, *, bk):
        o_ref[...] = x_ref[...] * bk

    x = jnp.ones((32, 32), jnp.float32)
    def call():  # as jaxgpt's kernels do: pl.pallas_call looked up when the kernel is built
        return pl.pallas_call(functools.partial(kernel, bk=4), out_shape=x, grid=(2, 2),
                              in_specs=[pl.BlockSpec((16, 16), lambda i, j: (i, j))],
                              out_specs=pl.BlockSpec((16, 16), lambda i, j: (i, j)), interpret=True,
                              name="gemm_nn_test")
    real = pl.pallas_call
    with pallas_tiles.recording() as seen:
        y = call()(x)
        call()(x)  # the same configuration again: recorded once
    assert float(y.sum()) == 4 * 32 * 32 and len(seen) == 1
    d = seen[0]
    assert (d["name"], d["grid"], d["out_blocks"], d["kernel_args"]) == ("gemm_nn_test", [2, 2], [[16, 16]], {"bk": 4})
    assert pallas_tiles.gemm_tiles(seen) == ["gemm_nn_test 16 x 16 x 4, default warps, default stages, grid [2, 2]"]
    assert pl.pallas_call is real  # restored after the block


def test_the_kernels_part_checks_every_kernel_test_file_and_reads_junit(tmp_path):
    steps = kernel_check.plan(dry=False, run_dir=tmp_path)
    argv = steps[0].argv
    assert all(f in argv for f in kernel_check.KERNEL_TESTS) and argv[argv.index("-k") + 1] == kernel_check.DESELECT
    assert "benchmarks.gpu.kernel_check" in argv and kernel_check.DEVICE_TESTS in steps[1].argv
    assert budget.planned_s(steps) <= kernel_check.BUDGET_S == 300.0
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_gemm" name="a"/>'
                   '<testcase classname="tests.test_gemm" name="b"><failure message="AssertionError: 3 ulps">x'
                   '</failure></testcase><testcase classname="c" name="d"><skipped/></testcase></testsuite></testsuites>')
    assert kernel_check.junit(xml) == {"passed": 1, "failed": 1, "skipped": 1,
                                       "failures": ["tests.test_gemm::b: AssertionError: 3 ulps"]}


def test_the_kernels_part_rehearses_on_the_cpu(tmp_path, monkeypatch):
    """`kernels --dry` (~30 s on the 2-core AMD EPYC): one kernel test through the plugin (interpreted here, its
    tiles recorded), the device tests skipped without a GPU, kernels: auto's search on the tiny config (its choice
    file in the tar); the summary and one tar in $OUT."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setattr(common, "TMP", tmp_path / "scratch")
    assert gpu_session.main(["kernels", "--dry"]) == 0
    s = json.loads((out / "session-kernels.json").read_text())
    assert s["kernel_tests"]["passed"] == 1 and s["device_tests"]["skipped"] == len(SETTINGS) + 1  # no GPU here
    assert s["tiles"]["compiled_on_gpu"] is False and [k["name"] for k in s["tiles"]["kernels"]] == [
        "gemm_ntsum_split_input_grad"]
    assert sorted(p.name for p in out.iterdir()) == [f"{s['run']}-kernels.tar", "session-kernels.json"]
    tune = next(r for r in s["steps"] if r["step"].startswith("kernels: auto"))  # jaxgpt.tune, its file in the tar
    assert tune["status"] == "ok", tune
    with tarfile.open(out / f"{s['run']}-kernels.tar") as tar:
        assert any("_2L32C_b4x32_" in n and n.endswith(".json") for n in tar.getnames()), tar.getnames()


@pytest.mark.slow  # ~5 min on 2 cores: 3 bench workers, 3 profiles, 2 tiny recipes; the tests above cover its parts
def test_the_compare_part_rehearses_on_the_cpu(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setattr(common, "TMP", tmp_path / "scratch")
    assert gpu_session.main(["compare", "--dry", "--text", str(common.ROOT / "README.md")]) == 0
    s = json.loads((out / "session-compare.json").read_text())
    assert all(r["status"] == "ok" for r in s["steps"] if r["required"])
    with tarfile.open(out / f"{s['run']}.tar") as tar:
        names = {m.name.split("/")[1] for m in tar.getmembers()}
        rows = json.loads(tar.extractfile(f"{s['run']}/train_step-gpu-dry.json").read())["rows"]
    assert {"profile-gpu-dry-b2.json", f"profile-gpu-dry-b2-{fastset.VARIANT}.json", "recipe-fast-metrics.jsonl",
            "run.json", "train_step-gpu-dry.json"} <= names
    assert {r["variant"] for r in rows} == {"jax_bf16", fastset.VARIANT, "torch_eager_bf16"}
    fast = next(r for r in rows if r["variant"] == fastset.VARIANT)["details"]["policy"]
    assert all(f"{k}='{v}'" in fast for k, v in fastset.policy_fields().items())
    assert s["recipes"]["fast set"]["steps"] == 2
