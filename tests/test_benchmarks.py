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

from tests.import_reader import imported_names

ROOT = Path(__file__).resolve().parent.parent


# A timed guard (50-90 s on an idle 2-core machine, 4 min at load average 8-9): in the slow set, since speed is
# measured by the benchmarks, not by the default suite; `pytest -m slow tests/test_benchmarks.py` runs it.
@pytest.mark.slow
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


def _gemm(fw, fp32, bf16):
    return {"framework": fw, "fp32_gflops": fp32, "bf16_gflops": bf16}


def test_unusable_precisions():
    """torch's bf16 GEMM at ~1 GFLOP/s (a CPU without avx512_bf16/AMX) is flagged; a slower-than-fp32 but real
    bf16 (XLA's 100 vs 150 GFLOP/s) is not; a failed probe decides nothing."""
    from benchmarks import common

    out = common.unusable_precisions([_gemm("jax", 150.0, 100.0), _gemm("torch", 140.0, 1.3),
                                      {"framework": "torch", "error": "boom"}])
    assert set(out) == {("torch", "bf16")}
    assert "1.3 GFLOP/s" in out[("torch", "bf16")] and "140" in out[("torch", "bf16")]
    assert common.unusable_precisions([_gemm("torch", 140.0, 120.0)]) == {}
    assert [common.framework_of(v) for v in ("jax_bf16", "torch_compile_bf16", "hf_eager_bf16")] == \
        ["jax", "torch", "torch"]
    assert common.failed({"error": "x"}) and not common.failed(common.skipped_row("why")) and not common.failed({})


def test_train_step_skips_unusable_precision(monkeypatch, tmp_path):
    """With torch's bf16 unusable, the torch bf16 variants are not launched (a step would take minutes) and show
    as 'not run' with the reason; the others run; the run is no failure, and the targets table says why the
    torch.compile bf16 row cannot be measured and what ratio the GEMM rate allows at most."""
    from benchmarks import common, report, train_step

    launched = []

    def fake_worker(spec, env, **kw):
        if spec["task"] == "gemm":
            return {**_gemm(spec["framework"], 150.0 if spec["framework"] == "jax" else 140.0,
                            100.0 if spec["framework"] == "jax" else 1.2), "loadavg_start": [0.5]}
        launched.append(spec["variant"])
        tps = {"jax_fp32": 1400, "jax_bf16": 950, "torch_eager_fp32": 1350, "torch_compile_fp32": 1250}
        return _run(spec["variant"], tps[spec["variant"]])

    monkeypatch.setattr(common, "run_worker", fake_worker)
    monkeypatch.setattr(common, "ensure_init", lambda preset: tmp_path / "init.npz")
    res = train_step.run("small", train_step.ALL_VARIANTS, rounds=2, steps=3, warmup=1, allocator="tuned",
                         log=lambda s: None)
    assert set(launched) == {"jax_fp32", "jax_bf16", "torch_eager_fp32", "torch_compile_fp32"}
    for v in ("torch_eager_bf16", "torch_compile_bf16", "hf_eager_bf16"):
        row = res["variants"][v]
        assert row["skipped"] and "1.2 GFLOP/s" in row["error"], row
        assert not common.failed(row)
    assert res["fastest_torch"] == "torch_eager_fp32"
    md = train_step.markdown(res)
    assert "| torch_compile_bf16 | not run: torch's bf16 GEMM runs at 1.2 GFLOP/s" in md
    res["default_jax_variant"] = "jax_fp32"
    rows = {a: (b, c) for a, b, c in report.targets({"small-tuned": res}, None)}
    assert rows["small: jaxgpt default (jax_fp32) >= 1.2x torch_ref torch.compile bf16"][1].startswith(
        "not measurable here")
    assert rows["small: jaxgpt default (jax_fp32) >= 1.2x the fastest torch variant here (torch_eager_fp32)"] == \
        ("1,400 / 1,350 tok/s = 1.04x", "NOT met")
    (ceil,) = [k for k in rows if "ceiling" in k]
    # 2,048 tokens x 150 GFLOP/s / 200.1 GFLOP per step (causal attention halved) = 1,535 tok/s at most: 1.14x
    # torch, so 1.2x is out of reach
    assert res["flops_per_step_causal"] == pytest.approx(200.1e9, rel=1e-3)
    assert "150 GFLOP/s" in ceil and rows[ceil] == ("1,535 / 1,350 tok/s = 1.14x",
                                                    "1.2x out of reach at the probe's GEMM rate")
    del res["flops_per_step_causal"]  # an older result: no causal count, so no ceiling row rather than a wrong one
    assert not [a for a, _, _ in report.targets({"small-tuned": res}, None) if "ceiling" in a]


def test_gemm_probe_time_budget():
    """The GEMM probe measures 512^3 first and skips a size it projects past its time budget, so an emulated
    dtype cannot stall a benchmark for minutes; the rate it reports is the one it measured."""
    from benchmarks import worker

    res = worker.run_gemm({"framework": "jax", "sizes": [[1024, 1024, 1024]], "reps": 2, "use_library": False,
                           "budget_s": 1e-6})
    for dt in ("fp32", "bf16"):
        assert list(res[f"{dt}_by_size"]) == ["512x512x512"] and res[f"{dt}_skipped_sizes"] == ["1024x1024x1024"]
        assert res[f"{dt}_gflops"] == res[f"{dt}_by_size"]["512x512x512"] > 0
    res = worker.run_gemm({"framework": "jax", "sizes": [[768, 256, 512]], "reps": 2, "use_library": False,
                           "budget_s": 60})  # within the budget: measured, and counted in the best rate
    for dt in ("fp32", "bf16"):
        assert list(res[f"{dt}_by_size"]) == ["512x512x512", "768x256x512"] and f"{dt}_skipped_sizes" not in res
        assert res[f"{dt}_gflops"] == max(res[f"{dt}_by_size"].values())


def test_unusable_variants_probe_when_the_full_probe_is_missing(monkeypatch):
    """Without a full probe (``--no-probe``), or where a framework's full probe failed, a quick 512^3 probe of
    that framework decides; a framework whose full probe succeeded is not probed again, and nothing is probed
    when no bf16 variant is asked for."""
    from benchmarks import common

    probed = []

    def fake_worker(spec, env, **kw):
        probed.append((spec["framework"], spec["sizes"]))
        return _gemm(spec["framework"], 140.0, 1.1 if spec["framework"] == "torch" else 90.0)

    monkeypatch.setattr(common, "run_worker", fake_worker)
    log = lambda s: None  # noqa: E731
    skip = common.unusable_variants(["jax_bf16", "torch_eager_bf16", "torch_eager_fp32"], {}, None, log=log)
    assert set(skip) == {"torch_eager_bf16"} and sorted(probed) == [("jax", []), ("torch", [])]
    probed.clear()
    full = [_gemm("jax", 150.0, 100.0), {"framework": "torch", "error": "worker exited 1"}]
    assert set(common.unusable_variants(["jax_bf16", "hf_eager_bf16"], {}, full, log=log)) == {"hf_eager_bf16"}
    assert probed == [("torch", [])]
    probed.clear()
    assert common.unusable_variants(["jax_fp32", "torch_eager_fp32"], {}, None, log=log) == {} and not probed


def test_generate_with_every_variant_skipped(monkeypatch, tmp_path):
    """A generation run whose every variant is unusable here ends with 'not run' rows (no crash, no failure)."""
    from benchmarks import common, generate

    def fake_worker(spec, env, **kw):
        assert spec["task"] == "gemm", f"launched {spec}"
        return _gemm(spec["framework"], 140.0, 1.2)

    monkeypatch.setattr(common, "run_worker", fake_worker)
    monkeypatch.setattr(common, "ensure_init", lambda preset: tmp_path / "init.npz")
    res = generate.run(preset="tiny", prompt_counts=[1, 8], variants=["hf_bf16_cache"], new=4, prompt_len=4,
                       rounds=2, repeats=1, allocator="tuned", log=lambda s: None)
    assert set(res["rows"]) == {"hf_bf16_cache@1", "hf_bf16_cache@8"}
    assert all(r["skipped"] and not common.failed(r) for r in res["rows"].values())
    assert "| hf_bf16_cache | 1 | not run: torch's bf16 GEMM runs at 1.2 GFLOP/s" in generate.markdown(res)


# ---- GEMM ceiling: the C microkernel against the libraries ------------------------------------------------------
def _gemm_ceiling_unsupported() -> str | None:
    from benchmarks import gemm_ceiling

    return gemm_ceiling.unsupported()


# runs wherever the C kernels can (x86-64 Linux with AVX2, FMA and gcc: CI and every machine of this project)
@pytest.mark.skipif(_gemm_ceiling_unsupported() is not None, reason=f"{_gemm_ceiling_unsupported()}")
def test_gemm_ceiling_kernel_is_exact_and_its_chains_are_not_merged():
    from benchmarks import gemm_ceiling

    # the C program's C = A B, computed by hand-fed numpy: exact, as every input is a small multiple of 1/8
    assert gemm_ceiling.expected_checksum() == 48958.375
    res = gemm_ceiling.run(repeats=1, mfma=20, libraries=False, log=lambda s: None)  # raises on a wrong C
    assert res["kernel_checksum"] == 48958.375
    cores = res["cores"]
    for key in ("fma_gflops_1t", f"fma_gflops_{cores}t", "kernel_gflops_1t", f"kernel_gflops_{cores}t"):
        assert res[key] > 0, (key, res[key])
    # 12 FMAs in the kernel's loop and 12 in the peak loop: a compiler that merges the peak loop's chains (it did,
    # when they started from one value) would overstate the peak 12x per instruction executed
    assert gemm_ceiling.fma_instructions() >= 24
    md = gemm_ceiling.markdown(res)
    assert "6x16 AVX2 GEMM microkernel" in md and "FMA units" in md


def test_gemm_ceiling_rejects_a_wrong_kernel_and_skips_where_it_cannot_run(monkeypatch):
    from benchmarks import gemm_ceiling, report

    if gemm_ceiling.unsupported() is None:
        monkeypatch.setattr(gemm_ceiling, "expected_checksum", lambda: 1.0)
        with pytest.raises(RuntimeError, match="the kernel is wrong"):
            gemm_ceiling.run(repeats=1, mfma=1, libraries=False, log=lambda s: None)
        monkeypatch.undo()
    monkeypatch.setenv("CC", "/nonexistent/cc")  # a compiler that cannot run: a recorded skip, not a crash
    if gemm_ceiling.unsupported() is None:
        res = gemm_ceiling.run(repeats=1, mfma=1, libraries=False, log=lambda s: None)
        assert "cannot run the C compiler '/nonexistent/cc'" in res["skipped"]
    monkeypatch.setattr(gemm_ceiling.platform, "machine", lambda: "aarch64")
    res = gemm_ceiling.run(repeats=1, mfma=1, libraries=False, log=lambda s: None)
    assert "aarch64" in res["skipped"]
    assert "Not run: the kernels are x86-64 AVX2 code" in gemm_ceiling.markdown(res)
    assert report.ceiling_section(res, {})[0] == "## GEMM ceiling: what this CPU allows"


def test_report_ceiling_section_relates_the_step_to_the_kernel():
    from benchmarks import report

    ceil = {"cores": 2, "fma_gflops_1t": 150.0, "fma_gflops_2t": 300.0, "kernel_gflops_1t": 95.0,
            "kernel_gflops_2t": 190.0, "loadavg_start": [0.5], "started": "now", "git": "abc", "command": "cmd",
            "libraries": {"jax": {"fp32_gflops": 171.0, "fp32_by_size": {}}, "torch": {"error": "boom"}}}
    small = {"seq": 256, "batch": 8, "flops_per_step_causal": 200e9, "fastest_torch": "torch_eager_fp32",
             "variants": {"jax_fp32": {"step_s": {"median": 2.0}},
                          "torch_eager_fp32": {"tokens_per_s": {"median": 1000.0}}}}
    text = "\n".join(report.ceiling_section(ceil, {"small-tuned": small}))
    assert "| jax fp32 matmul 2048^3 (XLA:CPU, YNNPACK) | | 171 | 57% | 90% |" in text
    assert "failed: boom" in text
    # 200 GFLOP in 2 s = 100 GFLOP/s = 53% of 190; at 190 GFLOP/s: 2,048 tokens / 1.053 s = 1,946 tok/s = 1.95x
    assert "at 100 GFLOP/s = 53% of the microkernel" in text and "1,946 tok/s, 1.95x torch_eager_fp32" in text


# ---- the layout of benchmarks/: no import cycles, the GPU tools in benchmarks/gpu/ ------------------------------
def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``module -> modules of ``package`` it imports``, for every ``.py`` under ``root / package``, read with ast.
    Every import counts, a function's lazy one too (both cycles this test was written for were lazy), and importing
    ``a.b.c`` counts as importing the packages ``a`` and ``a.b`` as well (Python runs their ``__init__`` first).
    Names passed to ``importlib`` or ``-m`` in a subprocess are not imports of this process and are not read."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = imported_names(path, here)
        with_parents = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 2)}
        # a module's own packages count only when it names them (they are being imported when it runs)
        graph[name] = {t for t in with_parents
                       if t in files and t != name and (t in targets or not name.startswith(t + "."))}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle of ``graph`` once, as the path ``[a, b, ..., a]`` (strongly connected components of more
    than one module, each shown by one cycle through it)."""
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []

    def visit(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in sccs:  # a shortest way back to the component's first module, for the message
        start = min(comp)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = sorted(w for w in graph[path[-1]] if w in comp)
            if start in nxt:
                cycles.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return cycles


def test_the_import_cycle_finder_finds_lazy_and_package_cycles(tmp_path):
    """The checker below can fail: a lazy import inside a function closes a cycle, and so does a package whose
    ``__init__`` imports a module that imports the package back; relative imports resolve."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("import pkg.b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import d\n")
    (pkg / "sub" / "d.py").write_text("from ..sub import e\n")
    (pkg / "sub" / "e.py").write_text("from .. import c\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.c"] == {"pkg.b"} and graph["pkg.sub.e"] == {"pkg", "pkg.c"}  # its own package: only named
    assert graph["pkg.sub.d"] == {"pkg.sub", "pkg.sub.e"}
    assert sorted(import_cycles(graph)) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.sub", "pkg.sub.d", "pkg.sub"]]
    (pkg / "b.py").write_text("def f():\n    import os\n")  # the lazy import gone: that cycle gone
    assert import_cycles(import_graph(tmp_path, "pkg")) == [["pkg.sub", "pkg.sub.d", "pkg.sub"]]


def test_benchmarks_have_no_import_cycle():
    """No module of benchmarks/ imports one that imports it back, directly or through others, lazily or not
    (gpu_bench <-> train_step and worker <-> worker_gpu were two such circles)."""
    graph = import_graph(ROOT, "benchmarks")
    assert {"benchmarks.train_step", "benchmarks.worker", "benchmarks.gpu.bench", "benchmarks.gpu.worker"} <= set(graph)
    assert "benchmarks.common" in graph["benchmarks.gpu.bench"]  # the graph sees imports (a guard on the guard)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles under benchmarks/: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_gpu_tools_live_in_benchmarks_gpu_and_the_cpu_side_does_not_need_them():
    """The GPU-only tools are the modules of benchmarks.gpu; of the CPU side only train_step (``--device gpu``
    hands over to benchmarks.gpu.bench) and report (BENCHMARKS.md's GPU section) import them, and the shared
    base (common, impl, worker) imports nothing of theirs."""
    graph = import_graph(ROOT, "benchmarks")
    assert {m for m in graph if m.startswith("benchmarks.gpu.")} >= {
        f"benchmarks.gpu.{m}" for m in ("bench", "worker", "profile", "session", "carry", "e2e_check", "scaling")}
    assert not list((ROOT / "benchmarks").glob("gpu_*.py")) and not (ROOT / "benchmarks" / "worker_gpu.py").exists()
    users = {m for m, deps in graph.items() if not m.startswith("benchmarks.gpu")
             and any(d == "benchmarks.gpu" or d.startswith("benchmarks.gpu.") for d in deps)}
    assert users <= {"benchmarks.train_step", "benchmarks.report"}, users


def test_train_step_device_gpu_is_the_gpu_bench_and_commands_name_their_module(monkeypatch, capsys):
    from benchmarks import common, train_step

    with pytest.raises(SystemExit) as e:
        train_step.main(["--device", "gpu", "--help"])
    assert e.value.code == 0 and "usage: python -m benchmarks.gpu.bench" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "gpu" / "bench.py"), "ab", "--dry"])
    assert common.command_line() == "python -m benchmarks.gpu.bench ab --dry"
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "train_step.py"), "--quick"])
    assert common.command_line() == "python -m benchmarks.train_step --quick"


def test_issue_32s_table_of_changes_reads_the_committed_predictions_and_is_in_benchmarks_md():
    """benchmarks.gpu.changes: every row's programs come from committed `jaxgpt.compile --json` files, each compared
    with the same command's baseline; the markdown in results is what the script writes and BENCHMARKS.md holds it."""
    from benchmarks.gpu import changes

    table = changes.rows()
    base = table[0]
    assert base["b64"]["ms"] == pytest.approx(166.6, abs=0.05) and base["b64"]["vs_baseline"] == 0.0
    assert all("b64" in r for r in table), [r["change"] for r in table if "b64" not in r]
    fp8 = next(r for r in table if r["setting"] == "precision=fp8")
    assert fp8["b64"]["vs_baseline"] > 0  # fp8 is predicted slower: the table must show it, not hide it
    text = changes.markdown(table)
    assert text == changes.OUT.read_text(), "rerun: python -m benchmarks.gpu.changes"
    # the change-by-change history: docs/benchmark-history.md, not BENCHMARKS.md (issue 46)
    assert text.strip().splitlines()[0] in (ROOT / "docs" / "benchmark-history.md").read_text()
    assert text.strip().splitlines()[0] not in (ROOT / "BENCHMARKS.md").read_text()
    met = [(r, p) for r in table for p in changes.TARGETS_MS if p in r and r[p]["ms"] <= changes.TARGETS_MS[p]]
    assert ("**Not met by any row.**" in text) == (not met)
    rows = {r["change"]: ln for r in table for ln in text.splitlines() if ln.startswith(f"| {r['change']} |")}
    assert sum(ln.count("**met**") for ln in rows.values()) == len(met)  # each cell that meets its target, marked
    assert f"b64 by {sum(1 for _, p in met if p == 'b64')} row" in text


def test_issue_32s_micro_batch_split_reads_the_measured_bench_and_shows_the_fixed_cost():
    """changes.scaling_rows (item 3): step(b) = b x per-row + fixed through the measured b16 and b64 steps of the
    committed H100 bench, per variant: the line passes through both points, and jaxgpt's b16 gap to torch.compile
    is its fixed cost (13.9 against 3.4 ms) while the per-row costs are within 2%."""
    from benchmarks.gpu import changes

    assert changes.scale_fit((16, 10.0), (64, 34.0)) == {"per_row": 0.5, "fixed": 2.0}
    rows = {label.split(",")[0]: (steps, fit) for label, steps, fit in changes.scaling_rows()}
    jax_steps, jax_fit = rows["jaxgpt bf16"]
    torch_fit = rows["torch_ref torch.compile bf16"][1]
    assert jax_steps == pytest.approx({16: 54.6, 64: 176.6}, abs=0.05)
    for steps, fit in (rows["jaxgpt bf16"], rows["torch_ref torch.compile bf16"], rows["jaxgpt baseline"]):
        for b in (16, 64):
            assert b * fit["per_row"] + fit["fixed"] == pytest.approx(steps[b])
    assert round(jax_fit["fixed"], 1) == 13.9 and round(torch_fit["fixed"], 1) == 3.4
    assert abs(jax_fit["per_row"] / torch_fit["per_row"] - 1) < 0.02
    assert "| jaxgpt bf16, measured (H100, 2026-11-26) | 54.6 | 176.6 | 40.7 | 13.9 |" in changes.OUT.read_text()


def test_issue_32s_budget_splits_the_baseline_prediction_into_what_stays_and_what_must_shrink():
    """changes.budget: the baseline's FLOP-priced kernels (GEMMs, cuDNN attention) + host + the memory-bound rest is
    its whole prediction, the rest summed the other way (its fusion and copy classes), and the cut is the share of
    that rest the target removes: b64 asks half of the 71.7 ms of memory-bound kernels to go."""
    from benchmarks.gpu import changes

    for program in ("b64", "b16", "yaml"):
        b = changes.budget(program)
        cal = changes.load(changes.CHANGES[0][2][program])["prediction"]["calibrated"]
        rest = sum(v for k, v in cal["by_class"].items() if k.split(":")[0] in ("fusion", "copy")) * 1e3
        assert b["rest"] == pytest.approx(rest, rel=1e-9) and b["flops"] + b["host"] + b["rest"] == pytest.approx(
            b["total"])
        assert b["allowed"] == pytest.approx(changes.TARGETS_MS[program] - b["flops"] - b["host"])
        assert b["cut"] == pytest.approx((b["rest"] - b["allowed"]) / b["rest"]) and 0 < b["cut"] < 1
    b64 = changes.budget("b64")
    assert (round(b64["flops"], 1), round(b64["rest"], 1), round(b64["cut"], 2)) == (87.6, 71.7, 0.50)
    assert "| b64, 1 micro-step | 166.6 | 87.6 | 7.4 | 71.7 | 131.0 | 36.0 | 50% |" in changes.OUT.read_text()
    # the fastest set's own prediction read the same way: what is left to cut after the changes
    # (the latest row with the fastest set's setting: the program as the code compiles it now)
    assert changes.files_of(changes.FASTEST)["b64"] == "combined-fast-bf16h-b64"
    fast = changes.budget("b64", changes.files_of(changes.FASTEST))
    assert fast["total"] == pytest.approx(changes.figures(changes.load("combined-fast-bf16h-b64"))[0])
    assert fast["rest"] < b64["rest"] and round(fast["cut"], 2) == -0.11
    # a target the prediction meets needs no cut: all three by the fastest set's (127.7 <= 131 ms, 39.4 <= 39.5 ms,
    # 960.2 <= 1,050 ms)
    assert "| b64, 1 micro-step, the fastest set | 127.7 | 91.4 | 7.4 | 28.9 | 131.0 | 32.2 | none (met) |" in \
        changes.OUT.read_text()
    assert changes.budget("yaml", changes.files_of(changes.FASTEST))["cut"] < 0
    assert changes.budget("b16", changes.files_of(changes.FASTEST))["cut"] < 0
    assert ("| gpt2-124m.yaml, b64 x 8, the fastest set | 960.2 | 731.3 | 7.4 | 221.6 | 1,050.0 | 311.4 | "
            "none (met) |") in changes.OUT.read_text()
    assert "| b16, 1 micro-step, the fastest set | 39.4 | 23.0 | 7.4 | 9.0 | 39.5 | 9.1 | none (met) |" in \
        changes.OUT.read_text()
    assert changes.budget("b64", {"b16": "baseline-b16"}) is None  # a row without that program
    # what the Pallas GEMMs' prediction leaves out, bounded: the epilogues' special-function work, none overlapped
    sfu_ms = sum(changes.EPILOGUE_SFU.values()) / changes.SFU_PER_S * 1e3
    assert 3 < sfu_ms < 5 and changes.epilogue_lines()[0] in changes.OUT.read_text()
    assert f"predict {fast['total'] + sfu_ms:.1f} ms at b64" in changes.OUT.read_text()
