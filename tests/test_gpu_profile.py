"""The profile summariser on the real H100 trace: one step of ``profile-gpu-h100-b64`` (every kernel ran inside a
CUDA-graph command buffer) mapped to the HLO instructions of the committed optimized module, the table it makes,
the per-instruction list calibrations read, and the trimming that made the test trace."""

from __future__ import annotations

import collections
import copy
import gzip
import json

import pytest

from benchmarks import common
from benchmarks.gpu import hlo_trace
from benchmarks.gpu import profile as gpu_profile

HLO = common.ROOT / "benchmarks" / "results" / "h100-2026-11-26" / "profile-gpu-h100-b64.hlo.txt.gz"
TRACE = common.ROOT / "tests" / "data" / "profile-gpu-h100-b64-one-step.trace.json.gz"
FULL = common.ROOT.parent / "shared" / "gpu" / "h100-2026-11-26" / "profile-gpu-h100-b64.trace.json.gz"


@pytest.fixture(scope="module")
def hlo() -> str:
    with gzip.open(HLO, "rt") as f:
        return f.read()


@pytest.fixture(scope="module")
def trace() -> dict:
    with gzip.open(TRACE, "rt") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def instrs(trace, hlo) -> dict[str, dict]:
    return {i["name"]: i for i in gpu_profile.instruction_times(trace, hlo)}


def test_every_kernel_maps_to_an_instruction_as_often_as_the_schedule_runs_it(trace, hlo, instrs):
    mod = hlo_trace.parse(hlo)
    sched = collections.Counter(la.instr.name for la in hlo_trace.schedule(mod) if not la.optional)
    gpu = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {e["args"]["hlo_op"] for e in gpu} == {"command_buffer_1", "command_buffer_251", "command_buffer_273"}
    assert set(instrs) == set(sched)  # every launching instruction, nothing else
    for name, i in instrs.items():
        assert i["executions_mapped_per_step"] == i["executions_per_step"] == sched[name], i
        if i["opcode"] == "custom-call":  # a library call: its kernels, helpers and memsets
            assert i["launches_per_step"] >= i["executions_per_step"], i
        else:  # a fusion or a copy: one kernel (or memcpy) per run
            assert i["launches_per_step"] == i["executions_per_step"], i
    assert sum(i["launches_per_step"] for i in instrs.values()) == len(gpu)
    assert sum(i["ms_per_step"] for i in instrs.values()) == pytest.approx(sum(e["dur"] for e in gpu) / 1e3)
    # the loss chunks: a 13-trip while loop, its cuBLAS logits GEMM (memset + nvjet) and its fusions
    logits = instrs["custom-call.156"]
    assert logits["executions_per_step"] == 13 and logits["launches_per_step"] == 26
    assert instrs["fusion-start"]["kernels"] == {"memcpy32_post": 13}  # the chunk's dynamic slice


def test_known_instructions_land_in_their_categories(instrs):
    cat = {n: i["category"] for n, i in instrs.items()}
    for name in ("custom-call.156", "custom-call.157", "cublas-lt-matmul.2"):  # logits, d(hidden), d(wte)
        assert cat[name] == "cross-entropy GEMMs (lm_head)", name
    for name in ("gemm_fusion_dot_general.75", "input_reduce_fusion", "loop_convert_fusion", "fusion-start"):
        assert cat[name] == "cross-entropy elementwise", name  # softmax pieces and casts (no dot inside)
    bwd = [i for i in instrs.values() if i["kind"] == "__cudnn$fmhaSoftmaxBackward"]
    fwd = [i for i in instrs.values() if i["kind"] == "__cudnn$fmhaSoftmax"]
    assert len(bwd) == len(fwd) == 12
    assert all(i["category"] == "attention bwd" and i["launches_per_step"] == 4
               and any("flash_bprop" in k for k in i["kernels"]) for i in bwd)
    assert all(i["category"] == "attention fwd" and any("flash_fprop" in k for k in i["kernels"]) for i in fwd)
    gemms = [i for i in instrs.values() if i["kind"] == "__cublas$lt$matmul" and i["scope"] == ""]
    assert gemms and all(i["category"] == ("matmuls bwd" if "transpose(jvp(" in i["op_name"] else "matmuls fwd")
                         for i in gemms)
    assert {i["category"] for i in gemms} == {"matmuls fwd", "matmuls bwd"}
    assert cat["loop_add_fusion.35"] == "GELU bwd" and cat["fusion.1258"] == "LayerNorm bwd"
    assert cat["loop_convert_fusion.1"] == "GELU fwd"  # the op is a cast; its fused ops are GELU's
    opt = [i for i in instrs.values() if "/optimizer/" in i["op_name"]]
    assert len(opt) > 100 and all(i["category"] == "optimizer" for i in opt)
    adds = [i for i in instrs.values() if i["op_name"] == "jit(step)/jvp()/add"]
    assert len(adds) == 23 and all(i["category"] == "residual adds, converts fwd" for i in adds)  # 24th: in ln_f


def test_the_table_sums_to_the_busy_time_with_little_other(trace, hlo):
    s = gpu_profile.summarise(trace, hlo)
    ms = {r["category"]: r["ms_per_step"] for r in s["rows"]}
    assert s["steps"] == 1 and s["mapping"] == "command buffers walked along the HLO schedule"
    busy = s["device_busy_ms_per_step"]
    assert 160 < busy < 175  # the measured step: 169.9 ms, 169.1 busy
    assert sum(v for c, v in ms.items() if c != "host gaps (device idle)") == pytest.approx(busy, rel=1e-9)
    assert sum(ms.values()) == pytest.approx(s["step_ms"], rel=1e-9)
    assert ms["other"] <= 0.05 * busy and s["other_share_of_busy"] <= 0.05
    # the categories the issue names all hold time; the GEMMs split forward/backward
    for c in gpu_profile.CATEGORIES:
        if c not in ("other", "copies", "host gaps (device idle)"):
            assert ms[c] > 0.1, (c, ms)
    assert ms["matmuls bwd"] > 1.5 * ms["matmuls fwd"] and ms["attention bwd"] > 2 * ms["attention fwd"]
    assert 15 < ms["cross-entropy GEMMs (lm_head)"] < 30 and 15 < ms["cross-entropy elementwise"] < 30
    assert "| cross-entropy GEMMs (lm_head) |" in gpu_profile.markdown({"summary": s})


def test_a_kernel_out_of_place_fails_the_walk_and_is_reported(trace, hlo):
    broken = copy.deepcopy(trace)
    ev = next(e for e in broken["traceEvents"] if e.get("name") == "loop_add_fusion_35")
    ev["name"] = "some_other_kernel"
    with pytest.raises(hlo_trace.MappingError, match="expected loop_add_fusion.35"):
        hlo_trace.align(hlo_trace.gpu_events(broken), hlo_trace.parse(hlo))
    s = gpu_profile.summarise(broken, hlo, steps=1)
    assert s["mapping"].startswith("command-buffer walk failed") and "loop_add_fusion.35" in s["mapping"]
    assert s["other_share_of_busy"] > 0.3  # only fusions named like their instruction were found


def test_the_cli_writes_the_table_and_the_instruction_list(tmp_path, capsys):
    meta = tmp_path / "run.json"
    meta.write_text(json.dumps({"device_kind": "NVIDIA H100 80GB HBM3", "mfu": 0.311, "batch": 64}))
    out = tmp_path / "p.json"
    assert gpu_profile.main(["--summarise", str(TRACE), "--hlo", str(HLO), "--meta", str(meta),
                             "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device_kind"] == "NVIDIA H100 80GB HBM3" and res["summary"]["steps"] == 1
    assert res["ceiling_mfu"] > res["mfu"] and len(res["instructions"]) > 1000
    assert {"name", "opcode", "kind", "scope", "category", "launches_per_step", "ms_per_step",
            "kernels"} <= set(res["instructions"][0])
    assert "| matmuls bwd |" in out.with_suffix(".md").read_text() and "| matmuls bwd |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such file"):
        gpu_profile.main(["--summarise", str(TRACE), "--hlo", str(tmp_path / "missing.txt")])


def test_trimming_keeps_one_step_and_is_reproducible(tmp_path, trace, hlo):
    again = tmp_path / "again.trace.json.gz"
    kept = hlo_trace.trim_to_one_step(trace, hlo, again)  # a one-step trace trims to itself
    assert kept["of_steps"] == 1 and again.read_bytes() == TRACE.read_bytes()
    if not FULL.exists():
        pytest.skip(f"{FULL} (the whole 4-step trace, not in the repository) is absent")
    with gzip.open(FULL, "rt") as f:
        kept = hlo_trace.trim_to_one_step(json.load(f), hlo, again)
    assert kept["of_steps"] == 4 and again.read_bytes() == TRACE.read_bytes()


def test_the_report_renders_the_committed_h100_results():
    from benchmarks import report

    text = "\n".join(report.gpu_section())
    for figure in ("flax 0.12.10", "jax / jaxlib 0.11.2 / 0.11.2", "176.6 ms, 371,044 tok/s, 32.1% MFU, 29.1 GiB",
                   "163.6 ms, 400,507 tok/s, 34.6% MFU, 53.0 GiB", "| 0.93x |", "| 0.80x |",
                   "1,389-1,406 ms per step", "first step 17.0 s", "305,615 tok/s (steady)",
                   "jaxgpt MFU >= 50% (full T x T attention count): NOT met",
                   "### Where the step's time goes (`profile-gpu-h100-b64`)", "| other | 0.00 | 0.0% |"):
        assert figure in text, figure
    assert "Not yet measured" not in text
    compiled = "\n".join(report.prediction_vs_measured())
    assert "took a median 1,399 ms per step" in compiled and "1.54x the prediction" in compiled
    # BENCHMARKS.md and docs/benchmark-history.md are the report of the committed results (python -m benchmarks.report)
    benchmarks_md = (common.ROOT / "BENCHMARKS.md").read_text()
    history_md = (common.ROOT / "docs" / "benchmark-history.md").read_text()
    assert all(line in benchmarks_md for line in text.splitlines())
    assert all(line in history_md for line in compiled.splitlines())
