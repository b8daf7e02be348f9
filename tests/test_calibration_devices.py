"""A calibration per device (issue 43): jaxgpt's Pallas kernels fitted as classes of their own from a trace that
holds them, and a fit that never writes one device's rates into another's file; ``--target h200`` saying in its
JSON and text whether it is calibrated. (The H100's own calibration and its accuracy: tests/test_calibration.py.)

The trace + HLO pair here is synthetic: a program of XLA fusions, a cuBLAS GEMM, two Pallas GEMMs
(``gemm_nn_bias_gelu``) and two Pallas LayerNorm kernels, each kernel's time made from its class's chosen rate and
one launch latency, every kernel run inside a CUDA-graph command buffer as on the H100 (the second LayerNorm kernel
named ``__1``, as Triton names a second kernel of one name). The fit must give the chosen rates back.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import calibrate
from jaxgpt.compile import calibrated, hlo

ROOT = Path(__file__).resolve().parents[1]
LATENCY = 2e-6
RATES = {"kLoop": 2.0e12, "cublas": 600e12, "gemm_nn_bias_gelu": 400e12, "layer_norm_forward_residual": 1.5e12}
H200 = "NVIDIA H200"


def _program() -> str:
    """Two Pallas GEMMs and two Pallas LayerNorms of different sizes, a cuBLAS GEMM, two elementwise fusions."""
    lines = ["HloModule jit_step", "",
             "%fused_add (p0: f32[256,512], p1: f32[256,512]) -> f32[256,512] {",
             "  %p0 = f32[256,512]{1,0} parameter(0)", "  %p1 = f32[256,512]{1,0} parameter(1)",
             "  ROOT %add.1 = f32[256,512]{1,0} add(%p0, %p1)", "}", "",
             "%fused_neg (q0: f32[1024,512]) -> f32[1024,512] {", "  %q0 = f32[1024,512]{1,0} parameter(0)",
             "  ROOT %neg.1 = f32[1024,512]{1,0} negate(%q0)", "}", "",
             "ENTRY %main (x: bf16[256,128], w: bf16[128,512], b: f32[1,512], x2: bf16[1024,256], w2: bf16[256,512], "
             "r: f32[256,512], r2: f32[1024,512]) -> f32[256,512] {"]
    params = [("x", "bf16[256,128]"), ("w", "bf16[128,512]"), ("b", "f32[1,512]"), ("x2", "bf16[1024,256]"),
              ("w2", "bf16[256,512]"), ("r", "f32[256,512]"), ("r2", "f32[1024,512]")]
    lines += [f"  %{n} = {t}{{1,0}} parameter({i})" for i, (n, t) in enumerate(params)]

    def pallas(name, out, args, op):
        return (f"  %{name} = {out}{{1,0}} custom-call({args}), custom_call_target=\"__gpu$xla.gpu.triton\", "
                f"metadata={{op_name=\"jit(step)/jvp({op})/pallas_call\" scheduling_name=\"{name}\"}}, "
                f"backend_config={{debug = false, grid_x = 4 : i32, grid_y = 2 : i32, grid_z = 1 : i32, "
                f"name = \"{op}\", num_stages = 3 : i32, num_warps = 8 : i32}}")

    lines += ['  %custom-call.1 = (f32[256,512]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", '
              'metadata={op_name="jit(step)/jvp()/dot_general"}, backend_config={"gemm_backend_config":'
              '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}',
              "  %get-tuple-element.1 = f32[256,512]{1,0} get-tuple-element(%custom-call.1), index=0",
              pallas("pallas_call.2", "f32[256,512]", "%x, %w, %b", "gemm_nn_bias_gelu"),
              pallas("pallas_call.3", "f32[1024,512]", "%x2, %w2, %b", "gemm_nn_bias_gelu"),
              pallas("pallas_call.4", "f32[256,512]", "%get-tuple-element.1, %r", "layer_norm_forward_residual"),
              pallas("pallas_call.5", "f32[1024,512]", "%pallas_call.3, %r2", "layer_norm_forward_residual"),
              "  %loop_negate_fusion = f32[1024,512]{1,0} fusion(%pallas_call.5), kind=kLoop, calls=%fused_neg, "
              'metadata={op_name="jit(step)/neg"}',
              "  ROOT %loop_add_fusion = f32[256,512]{1,0} fusion(%pallas_call.2, %pallas_call.4), kind=kLoop, "
              'calls=%fused_add, metadata={op_name="jit(step)/add"}', "}", ""]
    return "\n".join(lines)


def _seconds(k: hlo.Kernel) -> float:
    """What the synthetic GPU takes for one launch of ``k`` (a Pallas GEMM: its GEMM and epilogue as one kernel)."""
    if k.pallas.startswith("gemm"):
        return LATENCY + k.flops / RATES[k.pallas]
    if k.pallas:
        return LATENCY + k.bytes / RATES[k.pallas]
    return LATENCY + (k.flops / RATES["cublas"] if k.gemm else k.bytes / RATES["kLoop"])


def _trace(text: str, steps: int = 3) -> dict:
    """``steps`` steps, every kernel inside a command buffer (``hlo_op`` names only the buffer)."""
    names = {"custom-call.1": ["nvjet_sm90_tst_128x128_64x4_NNT"], "pallas_call.2": ["gemm_nn_bias_gelu"],
             "pallas_call.3": ["gemm_nn_bias_gelu__1"], "pallas_call.4": ["layer_norm_forward_residual"],
             "pallas_call.5": ["layer_norm_forward_residual__1"], "loop_negate_fusion": ["loop_negate_fusion"],
             "loop_add_fusion": ["loop_add_fusion"]}
    kernels = [k for k in hlo.kernels(text)[0] if not hlo.is_epilogue(k)]
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
    ts = 1000.0
    for _ in range(steps):
        for k in kernels:
            dur = _seconds(k) * 1e6
            events.append({"ph": "X", "pid": 1, "tid": 7, "name": names[k.name][0], "ts": ts, "dur": dur,
                           "args": {"hlo_op": "command_buffer_1", "hlo_module": "jit_step"}})
            ts += dur + 0.5
        ts += 50.0
    return {"traceEvents": events}


@pytest.fixture(scope="module")
def pair() -> tuple[str, dict]:
    text = _program()
    return text, _trace(text)


def _profile(tmp: Path, pair, kind: str = H200) -> Path:
    """A profile's result JSON as benchmarks.gpu.profile writes it, with its HLO and trace beside it."""
    text, trace = pair
    (tmp / "p.hlo.txt").write_text(text)
    with gzip.open(tmp / "p.trace.json.gz", "wt") as f:
        json.dump(trace, f)
    meta = {"device_kind": kind, "hlo_file": "p.hlo.txt", "trace_file": "p.trace.json.gz", "batch": 64,
            "versions": {"jax": "0.11.2", "jaxlib": "0.11.2"}, "started": "2026-12-01 10:00:00", "git": "abc1234"}
    (tmp / "p.json").write_text(json.dumps(meta))
    return tmp / "p.json"


def test_a_trace_with_pallas_kernels_fits_each_as_a_class_of_its_own(pair):
    from benchmarks.gpu.profile import instruction_times

    text, trace = pair
    times = instruction_times(trace, text)
    assert {t["name"] for t in times} == {"custom-call.1", "pallas_call.2", "pallas_call.3", "pallas_call.4",
                                          "pallas_call.5", "loop_negate_fusion", "loop_add_fusion"}
    kernel_s = sum(t["ms_per_step"] for t in times) / 1e3
    cal = calibrate.fit(times, text, kernel_s + 1e-3, "h200", {})
    gemm, norm = cal.rates[("pallas-gemm", "gemm_nn_bias_gelu")], cal.rates[("pallas", "layer_norm_forward_residual")]
    assert (gemm.samples, norm.samples) == (2, 2)
    assert gemm.flops_per_s == pytest.approx(RATES["gemm_nn_bias_gelu"], rel=1e-3) and gemm.bytes_per_s is None
    assert norm.bytes_per_s == pytest.approx(RATES["layer_norm_forward_residual"], rel=1e-3)
    assert cal.rates[("fusion", "kLoop")].bytes_per_s == pytest.approx(RATES["kLoop"], rel=1e-3)
    assert cal.rates[("gemm", "bf16->f32 NN")].flops_per_s == pytest.approx(RATES["cublas"], rel=1e-3)
    assert cal.step_overhead_s == pytest.approx(1e-3, rel=1e-6)
    # the estimate at these rates: every kernel calibrated, a Pallas GEMM's epilogue folded into its class's time
    est = calibrated.estimate(hlo.kernels(text)[0], cal)
    assert all(k.calibrated for k in est.kernels) and est.uncalibrated_s == 0
    assert all(k.time_s == 0 for k in est.kernels if hlo.is_epilogue(k.kernel))
    assert est.time_s == pytest.approx(kernel_s + 1e-3, rel=1e-3)
    # the H100's calibration never saw them: stand-ins, marked uncalibrated, under the kinds whose rates they take
    h100 = calibrated.estimate(hlo.kernels(text)[0], calibrated.for_target("h100-sxm"))
    stand_in = {(k.kernel.name, k.kind) for k in h100.kernels if not k.calibrated}
    assert ("pallas_call.2", "gemm") in stand_in and ("pallas_call.2 epilogue", "fusion") in stand_in
    assert ("pallas_call.4", "fusion") in stand_in
    assert "gemm: gemm_nn_bias_gelu" in h100.to_dict()["uncalibrated"]


def test_a_fit_writes_the_file_of_the_device_its_trace_ran_on(tmp_path, pair, monkeypatch, capsys):
    monkeypatch.setattr(calibrated, "HERE", tmp_path)
    monkeypatch.setattr(calibrated, "CALIBRATIONS", {n: calibrated.path_for(n) for n in calibrated.CALIBRATIONS})
    prof = _profile(tmp_path, pair)
    assert calibrate.main(["--profile", str(prof), "--step-ms", "5"]) == 0
    written = json.loads((tmp_path / "calibration-h200.json").read_text())
    assert written["device"] == "h200" and written["provenance"]["device_kind"] == H200
    assert written["provenance"]["measured"] == "2026-12-01" and "0.11.2" in written["provenance"]["jax"]
    assert ("pallas-gemm", "gemm_nn_bias_gelu") in calibrated.for_target("h200").rates
    st = calibrated.status("h200")
    assert st["calibrated"] and st["trace"] == "p.trace.json.gz" and st["file"].endswith("calibration-h200.json")
    # without its trace the profile's per-instruction list fits the same rates
    from benchmarks.gpu.profile import instruction_times

    meta = json.loads(prof.read_text())
    meta["instructions"] = instruction_times(tmp_path / "p.trace.json.gz", pair[0])
    prof.write_text(json.dumps(meta))
    (tmp_path / "p.trace.json.gz").unlink()
    (tmp_path / "calibration-h200.json").unlink()
    assert calibrate.main(["--profile", str(prof), "--step-ms", "5"]) == 0
    again = json.loads((tmp_path / "calibration-h200.json").read_text())
    assert again["rates"] == written["rates"]


def test_a_fit_from_one_devices_trace_cannot_overwrite_anothers(tmp_path, pair, monkeypatch):
    monkeypatch.setattr(calibrated, "HERE", tmp_path)
    monkeypatch.setattr(calibrated, "CALIBRATIONS", {n: calibrated.path_for(n) for n in calibrated.CALIBRATIONS})
    h100 = tmp_path / "calibration-h100.json"
    shutil.copyfile(ROOT / "jaxgpt" / "compile" / "calibration-h100.json", h100)
    before = h100.read_bytes()
    prof = _profile(tmp_path, pair)  # an H200's trace
    for args, message in (
            (["--device", "h100-sxm"], "--device h100-sxm, but the trace ran on NVIDIA H200 (h200)"),
            (["--out", str(h100)], "that is h100-sxm's calibration file"),
            (["--out", str(tmp_path / "elsewhere" / "calibration-h100.json")], "that is h100-sxm's calibration file")):
        with pytest.raises(SystemExit, match="python -m benchmarks.gpu.calibrate: error: ") as e:
            calibrate.main(["--profile", str(prof), "--step-ms", "5", *args])
        assert message in str(e.value) and "\n" not in str(e.value)
    other = tmp_path / "mine.json"
    other.write_text(h100.read_text())  # another name, but the H100's rates inside
    with pytest.raises(SystemExit, match="holds h100-sxm's rates"):
        calibrate.main(["--profile", str(prof), "--step-ms", "5", "--out", str(other)])
    assert h100.read_bytes() == before and not (tmp_path / "calibration-h200.json").exists()
    with pytest.raises(SystemExit, match="which GPU ran the trace is unknown"):
        calibrate.main(["--profile", str(_profile(tmp_path, pair, kind="")), "--step-ms", "5"])
    # a file that holds another device's rates is refused where it lies, not read as this device's
    (tmp_path / "calibration-h200.json").write_text(h100.read_text())
    with pytest.raises(calibrated.CalibrationError, match="calibration-h200.json holds h100-sxm's rates"):
        calibrated.for_target("h200")


def test_target_h200_says_in_its_json_and_text_whether_it_is_calibrated(tmp_path):
    hlo_file = ROOT / "tests" / "data" / "hlo" / "gpt2-b16-h100-jax0.10.2.hlo.txt.gz"
    for target, calibrated_ in (("h200", False), ("h100", True)):
        out = tmp_path / f"{target}.json"
        r = subprocess.run([sys.executable, "-m", "jaxgpt.compile", "--hlo", str(hlo_file), "--target", target,
                            "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        st = json.loads(out.read_text())["prediction"]["calibration"]
        assert st["calibrated"] is calibrated_
        if calibrated_:
            assert st["trace"] == "profile-gpu-h100-b64.trace.json.gz" and st["measured"] == "2026-11-26"
            assert "jaxgpt/compile/calibration-h100.json" in r.stdout
        else:
            assert "no calibration-h200.json" in st["why"] and st["file"] is None
            assert "not calibrated for h200: no calibration-h200.json" in r.stdout
