"""The GPU benchmark harness's CPU paths: the dry mode of ``benchmarks.gpu.bench`` (real workers,
tiny shapes), its batch growth, out-of-memory rows, MFU and targets (fake workers reporting an H100), the
profile summariser on a CPU trace and on a synthetic GPU trace, the end-to-end check and the runbook."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from benchmarks import common
from benchmarks.gpu import bench as gpu_bench
from benchmarks.gpu import e2e_check
from benchmarks.gpu import profile as gpu_profile
from benchmarks.gpu import session as gpu_session
from benchmarks.gpu.worker import is_oom

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return tmp_path


def test_dry_mode_runs_the_gpu_code_path_on_the_cpu(results):
    res = gpu_bench.run(dry=True, batches=[2], eager_batches=[2], medium_batch=None, steps=5, budget_s=600,
                        variants=["jax_bf16"], log=lambda s: None)
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"jax_bf16", "torch_eager_bf16"} and not any("error" in r for r in rows.values()), rows
    j, t = rows["jax_bf16"], rows["torch_eager_bf16"]
    assert j["tokens_per_s"] > 0 and t["tokens_per_s"] > 0 and j["cold_first_step_s"] > 0
    assert j["details"]["attention"] == "einsum" and j["details"]["policy"].startswith("Policy(compute_dtype='bfloat16'")
    assert t["details"]["optimizer_class"] == "AdamW(fused=True)"
    assert j["loss_first"] == pytest.approx(t["loss_first"], abs=2e-2)  # same init, same batch, bf16 both
    assert j["mfu"] is None and "no peak for 'cpu'" in j["peak_source"]  # no CPU entry in the GPU peak table
    saved = json.loads((results / "train_step-gpu-dry.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(res["rows"]))
    md = (results / "train_step-gpu-dry.md").read_text()
    assert "| gpt2 | **jax_bf16** | 2 |" in md and "Targets" in md
    for r in (j, t):  # every timed call's host time: one window of 5 calls (steps=5)
        h = r["host_call_ms"]
        assert h["window"] == 5 and 0 < h["median"] and 0 < h["first"] <= 5 * r["step_ms"]["max"], h  # in its window
    assert "Host time of one step call" in md and f"jax_bf16 b2 {j['host_call_ms']['median']:.1f} / " in md


def test_host_calls_are_summarised_per_window():
    calls = [[0.030, 0.002, 0.004], [0.020, 0.003, 0.001], [0.040, 0.002, 0.002]]
    assert gpu_bench.host_calls(calls) == pytest.approx({"median": 3.0, "first": 30.0, "window": 3})
    assert gpu_bench.host_calls(None) is None and gpu_bench.host_calls([[]]) is None
    row = {"variant": "jax_bf16", "batch": 16, "host_call_ms": gpu_bench.host_calls(calls)}
    (line,) = [s for s in gpu_bench.host_lines([row, {"variant": "x", "batch": 1, "error": "e"}]) if s]
    assert "jax_bf16 b16 3.0 / 30.0 ms (~10.0 ms per step)" in line
    assert gpu_bench.host_lines([{"variant": "torch_compile_bf16", "batch": 16, "host_call_ms": None}]) == []
    (line,) = [s for s in gpu_bench.host_lines([{**row, "variant": "torch_compile_bf16"}]) if s]
    assert "torch_compile_bf16 b16 3.0 / 30.0 ms;" not in line and "torch_compile_bf16 b16 3.0 / 30.0 ms." in line


def test_every_opt_in_variant_names_a_policy_the_gpu_worker_can_build():
    """What the slow dry run below checks, without running: each of bench's opt-in variants is a GPU worker variant
    whose precision and extra Policy fields make a valid policy (an invalid pairing, e.g. gelu: pallas under
    bf16-autocast, raises here before a lent GPU's minutes are spent on it)."""
    from benchmarks.gpu.worker import GPU_VARIANTS, VARIANT_POLICY
    from jaxgpt.precision import Policy

    for variant in gpu_bench.OPT_IN_VARIANTS:
        framework, precision, compiled = GPU_VARIANTS[variant]
        policy = Policy.named(precision, **VARIANT_POLICY.get(variant, {}))
        assert framework == "jax" and compiled, variant
        assert policy.compute_dtype == "bfloat16", (variant, policy)
    assert set(VARIANT_POLICY) <= set(gpu_bench.OPT_IN_VARIANTS)


@pytest.mark.slow  # ~3.5 min on 2 cores (12 variants trained through the worker); the default variant's dry run covers
def test_the_opt_in_variants_run_the_gpu_code_path_with_their_policies(results):  # the same worker code path
    """Issues 32/33's programs (bf16-autocast, + fused LayerNorm, fp8, bf16 with each op's Pallas kernels) run
    through the GPU worker (dry: the CPU, a tiny batch), so the next lent GPU measures them beside jax_bf16 with
    `benchmarks.gpu.bench --variants ...`."""
    res = gpu_bench.run(dry=True, batches=[2], eager_batches=[], medium_batch=None, steps=5, budget_s=600,
                        variants=gpu_bench.OPT_IN_VARIANTS, log=lambda s: None)
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == set(gpu_bench.OPT_IN_VARIANTS) and not any("error" in r for r in rows.values()), rows
    policy = {v: r["details"]["policy"] for v, r in rows.items()}
    assert "gemm_output='bfloat16'" in policy["jax_bf16_autocast"] and "layer_norm=xla" in policy["jax_bf16_autocast"]
    assert "gemm_output='bfloat16'" in policy["jax_autocast_fused_ln"] and "layer_norm=fused" in policy["jax_autocast_fused_ln"]
    assert "fp8='all'" in policy["jax_fp8"]
    assert "mlp=xla" in policy["jax_bf16_autocast"]
    assert "compute_dtype='bfloat16'" in policy["jax_bf16_ln_pallas"] and "layer_norm=pallas" in policy["jax_bf16_ln_pallas"]
    assert "logits_dtype='bfloat16'" in policy["jax_bf16_fast"] and "logits_dtype='float32'" in policy["jax_bf16_ln_pallas"]
    assert "mlp=pallas-gemm" in policy["jax_bf16_gelu_gemm"] and "layer_norm=xla" in policy["jax_bf16_gelu_gemm"]
    assert "gelu_h_dtype='bfloat16'" in policy["jax_bf16_fast"] and "layer_norm=pallas" in policy["jax_bf16_fast"]
    assert policy["jax_bf16_fast_h32"] == policy["jax_bf16_fast"].replace("gelu_h_dtype='bfloat16'",
                                                                          "gelu_h_dtype='float32'")
    assert "qkv=pallas" in policy["jax_bf16_fast"] and "mlp=pallas-gemm" in policy["jax_bf16_fast"]
    assert "qkv=pallas" in policy["jax_bf16_qkv_pallas"] and "mlp=xla" in policy["jax_bf16_qkv_pallas"]
    assert "loss=pallas" in policy["jax_bf16_lm_head_pallas"] and "loss=pallas" in policy["jax_bf16_fast"]
    assert "mlp=pallas-recompute" in policy["jax_bf16_gelu_recompute"]
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["loss_first"]) for r in rows.values())


def fake_worker(fits: dict[str, int], step_s: dict[str, float]):
    """A run_worker stand-in: a variant fits up to micro-batch fits[variant]; steps take step_s x batch / 16."""
    calls = []

    def run_worker(spec, env, timeout=0, module="benchmarks.worker"):
        assert module == gpu_bench.WORKER, module
        calls.append(spec)
        v, b = spec["variant"], spec["batch"]
        if b > fits[v]:
            return {"error": "does not fit: RESOURCE_EXHAUSTED: Out of memory while trying to allocate",
                    "does_not_fit": True}
        t = step_s[v] * b / 16
        return {"variant": v, "tokens_per_step": b * spec["seq"], "step_times_s": [t, t * 1.01, t * 0.99, t],
                "cold_first_step_s": 30.0 + b, "loss_first": 10.9, "loss_last": 10.5, "peak_device_mib": 2000.0 * b,
                "device_kind": H100}
    return run_worker, calls


def test_batches_grow_until_one_does_not_fit_and_targets_are_judged(results, monkeypatch):
    worker, calls = fake_worker({"jax_bf16": 64, "torch_compile_bf16": 32, "torch_eager_bf16": 16},
                                {"jax_bf16": 0.05, "torch_compile_bf16": 0.06, "torch_eager_bf16": 0.1})
    monkeypatch.setattr(common, "run_worker", worker)
    monkeypatch.setattr(common, "ensure_init", lambda preset, overrides=None: results / "init.npz")
    res = gpu_bench.run(dry=False, batches=[16, 32, 64, 128], eager_batches=[16], medium_batch=16, steps=20,
                        budget_s=600, log=lambda s: None)
    ran = [(c["config"], c["variant"], c["batch"]) for c in calls]
    # torch.compile stops after its first out-of-memory batch (64): 128 is never tried; jax tries 128 and stops
    assert ("gpt2", "torch_compile_bf16", 128) not in ran and ("gpt2", "jax_bf16", 128) in ran
    assert ("gpt2-medium", "jax_bf16", 16) in ran and ("gpt2", "torch_eager_bf16", 32) not in ran
    rows = {(r["shape"], r["variant"], r["batch"]): r for r in res["rows"]}
    assert rows["gpt2", "torch_compile_bf16", 64]["does_not_fit"]
    assert rows["gpt2", "torch_compile_bf16", 128]["error"] == "not run: a smaller micro-batch did not fit"
    j32 = rows["gpt2", "jax_bf16", 32]
    full, _ = gpu_bench.flops("gpt2", 32, 1024)
    assert j32["mfu"] == pytest.approx(full / 0.1 / 989.4e12) and j32["mfu_causal_halved"] < j32["mfu"]
    assert j32["peak_device_gib"] == pytest.approx(2000 * 32 / 1024) and "H100" in j32["peak_source"]
    mfu, speed, cold, fit = res["targets"]
    # tokens/s are equal at every batch here (step time ~ batch): the first best one, 16, is judged
    assert mfu["batch"] == 16 and mfu["measured"] == pytest.approx(rows["gpt2", "jax_bf16", 16]["mfu"])
    assert mfu["met"] is (mfu["measured"] >= 0.5)
    assert speed["measured"] == pytest.approx(0.06 / 0.05) and speed["met"]
    assert cold["measured"] == 46.0 and cold["met"]
    assert fit["met"] and fit["measured"] == pytest.approx(62.5)
    md = gpu_bench.markdown(res)
    assert "does not fit (out of memory)" in md and "| gpt2-medium | **jax_bf16** | 16 |" in md
    assert "989.4 TFLOP/s" in md


def test_fp8_variant_mfu_is_against_the_blended_peak():
    """jax_fp8's MFU: its e4m3 GEMMs' FLOPs (jaxgpt.flops, fp8_gemms all: 28.9% of gpt2's) over the fp8 peak plus the
    rest over the bf16 peak, divided by the step time; jax_bf16's plain over the bf16 peak."""
    res = {"step_times_s": [0.2] * 5, "tokens_per_step": 64 * 1024, "device_kind": "NVIDIA H100 80GB HBM3",
           "cold_first_step_s": 30.0, "loss_first": 11.0, "loss_last": 10.0}
    full, causal = gpu_bench.flops("gpt2", 64, 1024)
    e4m3 = gpu_bench.e4m3_flops("jax_fp8", "gpt2", 64, 1024)
    assert e4m3 == 64 * 1024 * (56_623_104 + 113_246_208 + 2 * 768 * 50304)  # attn projections, MLP, padded lm_head
    assert gpu_bench.e4m3_flops("jax_bf16", "gpt2", 64, 1024) == 0
    fp8 = gpu_bench.row_of(res, "gpt2", "gpt2", 1024, 64, "jax_fp8")
    bf16 = gpu_bench.row_of(res, "gpt2", "gpt2", 1024, 64, "jax_bf16")
    assert bf16["mfu"] == pytest.approx(full / 0.2 / 989.4e12)
    assert fp8["mfu"] == pytest.approx((e4m3 / 1978.9e12 + (full - e4m3) / 989.4e12) / 0.2)
    assert full / 0.2 / 1978.9e12 < fp8["mfu"] < bf16["mfu"]  # neither deflated nor inflated
    assert fp8["mfu_causal_halved"] == pytest.approx((e4m3 / 1978.9e12 + (causal - e4m3) / 989.4e12) / 0.2)
    assert fp8["peak_flops"] == pytest.approx(full / (fp8["mfu"] * 0.2)) and "fp8 variant" in fp8["peak_source"]


def test_out_of_memory_errors_are_recognised():
    class OutOfMemoryError(RuntimeError):
        pass

    assert is_oom(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 81.2GiB"))
    assert not is_oom(ValueError("shapes (2, 3) and (4,) do not match"))


def test_the_budget_and_a_failed_row_are_reported(results, monkeypatch):
    monkeypatch.setattr(common, "run_worker", lambda spec, env, **kw: {"error": "worker exited 1: boom"})
    monkeypatch.setattr(common, "ensure_init", lambda preset, overrides=None: results / "init.npz")
    res = gpu_bench.run(dry=False, batches=[16], eager_batches=[], medium_batch=None, steps=5, budget_s=600,
                        log=lambda s: None)
    assert [r["error"] for r in res["rows"]] == ["worker exited 1: boom"] * 2
    assert res["targets"][0]["met"] is False and "boom" in gpu_bench.markdown(res)
    res = gpu_bench.run(dry=False, batches=[16], eager_batches=[], medium_batch=None, steps=5, budget_s=-1,
                        log=lambda s: None)
    assert all("time budget" in r["error"] for r in res["rows"])


GPU_HLO = """HloModule jit_step
%fused_ln (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%p0, %p0)
}
ENTRY %main (a: bf16[4,4]) -> f32[4] {
  %a = bf16[4,4]{1,0} parameter(0)
  %gemm.1 = (bf16[4,4]{1,0}, s8[0]{0}) custom-call(%a, %a), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/jvp()/dot_general"}
  %gemm.2 = (bf16[4,4]{1,0}, s8[0]{0}) custom-call(%a, %a), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %fmha.3 = (bf16[4,4]{1,0}) custom-call(%a, %a, %a), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/jvp(attention)/dot_product_attention"}
  %fmha.4 = (bf16[4,4]{1,0}) custom-call(%a, %a, %a), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={op_name="jit(step)/transpose(jvp(attention))/dot_product_attention"}
  %loop_fusion.5 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_ln, metadata={op_name="jit(step)/jvp(layer_norm)/mul"}
  %input_fusion.6 = f32[4]{0} fusion(%a), kind=kInput, calls=%fused_ln, metadata={op_name="jit(step)/jvp(cross_entropy)/cross_entropy/while/body/closed_call/reduce_max"}
  ROOT %loop_fusion.7 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_ln, metadata={op_name="jit(step)/optimizer/add"}
}
"""


def gpu_trace() -> dict:
    """Two steps of a made-up GPU trace: kernels on one stream, named by XLA's hlo_op argument."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    kernels = [("sm90_xmma_gemm_bf16", "gemm.1", 100), ("nvjet_tst_128x256", "gemm.2", 200),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "fmha.3", 50),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "fmha.4", 120),
               ("loop_multiply_fusion", "loop_fusion.5", 30), ("input_reduce_fusion", "input_fusion.6", 60),
               ("loop_add_fusion", "loop_fusion.7", 40), ("Memcpy HtoD (Pageable to Device)", "", 10)]
    events, ts = list(meta), 1000.0
    for _step in range(2):
        for name, op, dur in kernels:
            events.append({"ph": "X", "pid": 1, "tid": 7, "name": name, "ts": ts, "dur": dur,
                           "args": {"hlo_op": op, "hlo_module": "jit_step"} if op else {}})
            ts += dur
        ts += 90  # the host gap between steps
        events.append({"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction(step)", "ts": ts - 700, "dur": 600})
    return {"traceEvents": events}


def test_the_summariser_sorts_a_gpu_trace_into_categories():
    s = gpu_profile.summarise(gpu_trace(), GPU_HLO, steps=2)
    ms = {r["category"]: r["ms_per_step"] for r in s["rows"]}
    assert s["source"] == "GPU kernels" and s["events"] == 16
    assert ms["matmuls fwd"] == pytest.approx(0.1) and ms["matmuls bwd"] == pytest.approx(0.2)
    assert ms["attention fwd"] == pytest.approx(0.05) and ms["attention bwd"] == pytest.approx(0.12)
    assert ms["LayerNorm fwd"] == pytest.approx(0.03) and ms["cross-entropy elementwise"] == pytest.approx(0.06)
    assert ms["optimizer"] == pytest.approx(0.04) and ms["copies"] == pytest.approx(0.01) and ms["other"] == 0
    # window: first kernel start to last kernel end = 2 x 610 + one 90 us gap between the steps
    assert s["step_ms"] == pytest.approx((2 * 610 + 90) / 2 / 1e3) and ms["host gaps (device idle)"] == pytest.approx(0.045)
    assert sum(r["share"] for r in s["rows"]) == pytest.approx(1.0)
    assert gpu_profile.ceiling(s, 0.40) == pytest.approx(0.40 * s["step_ms"] / 0.47)
    md = gpu_profile.markdown({"summary": s})
    assert "| attention bwd | 0.12 |" in md


def test_a_pallas_gemm_is_profiled_as_a_matmul():
    """jaxgpt.kernels.gemm's kernels (GELU or the bias add in a GEMM's epilogue) are GEMMs in the profile's table, in the
    direction their scope says; another Pallas kernel is not."""
    from benchmarks.gpu.hlo_trace import Instr

    def pallas(op_name):
        return Instr("pallas_call.1", "custom-call", "main", op_name=op_name, kind="__gpu$xla.gpu.triton")

    assert gpu_profile.categorize("gemm_nt_gelu_backward", pallas(
        "jit(step)/transpose(jvp(gelu))/gemm_nt_gelu_backward/pallas_call")) == "matmuls bwd"
    assert gpu_profile.categorize("gemm_nn_bias_cast", pallas("jit(step)/jvp()/gemm_nn_bias_cast/pallas_call")) \
        == "matmuls fwd"
    assert not gpu_profile.categorize("layer_norm_forward_residual", pallas(
        "jit(step)/jvp(layer_norm)/layer_norm/layer_norm_forward_residual/pallas_call")).startswith("matmuls")


def test_the_profile_runs_and_summarises_on_the_cpu(results):
    res = gpu_profile.profile(dry=True, batch=2, steps=2)
    ms = {r["category"]: r["ms_per_step"] for r in res["summary"]["rows"]}
    events = {r["category"]: r["events_per_step"] for r in res["summary"]["rows"]}
    assert res["summary"]["source"] == "XLA:CPU thunks"
    # each kind of kernel is found and classified; its time may be 0: XLA:CPU runs independent thunks on several
    # threads, and a category gets only the time no earlier kernel covered (once, under load, the backward
    # matmuls ran wholly beside the lm_head's GEMM: 0 ms)
    for c in ("matmuls fwd", "matmuls bwd", "cross-entropy GEMMs (lm_head)", "LayerNorm fwd", "LayerNorm bwd",
              "GELU fwd", "GELU bwd", "optimizer", "attention fwd", "attention bwd"):
        assert events[c] > 0 and ms[c] >= 0, (c, events, ms)
    assert ms["cross-entropy GEMMs (lm_head)"] > 0 and ms["optimizer"] > 0, ms
    # the classified time is most of the step (nothing large left as "other")
    assert ms["other"] < 0.25 * sum(ms.values())
    with gzip.open(results / res["hlo_file"], "rt") as f:
        assert "HloModule" in f.read(200)
    with gzip.open(results / res["trace_file"]) as t, gzip.open(results / res["hlo_file"], "rt") as h:
        again = gpu_profile.summarise(json.load(t), h.read(), 2)
    assert again["rows"] == res["summary"]["rows"]


def write_run(tmp_path, tok_s: list[float], mfu: float | None = 0.5):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"type": "train", "step": 10 * (i + 1), "tokens_per_s": t, "mfu": mfu} for i, t in enumerate(tok_s)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_end_to_end_check_compares_a_run_with_the_harness(tmp_path, capsys):
    harness = tmp_path / "h.json"
    harness.write_text(json.dumps({"rows": [
        {"shape": "gpt2", "variant": "jax_bf16", "batch": 32, "micro_steps": 4, "tokens_per_s": 1000.0, "mfu": 0.5},
        {"shape": "gpt2", "variant": "jax_bf16", "batch": 32, "micro_steps": 1, "tokens_per_s": 900.0, "mfu": 0.45}]}))
    run = write_run(tmp_path, [10.0, 500.0, 990.0, 1010.0, 1030.0], mfu=0.51)
    assert e2e_check.main([str(run), str(harness), "--out", str(tmp_path / "c.json")]) == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["run"]["tokens_per_s"] == 1010.0 and c["tokens_per_s_ratio"] == pytest.approx(1.01) and c["ok"]
    assert e2e_check.main([str(run), str(harness), "--micro-steps", "1"]) == 1  # 1010 vs 900: 12% off
    assert "DIFFERENT" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no jax_bf16 gpt2 row at micro-batch 16"):
        e2e_check.main([str(run), str(harness), "--batch", "16"])


def test_the_runbook_parts_fit_the_device_limits(tmp_path):
    for part in gpu_session.PARTS:
        cmds = gpu_session.commands(part, dry=False, out=tmp_path, text=tmp_path / "t.txt")
        assert cmds and all(isinstance(c, list) for c in cmds)
    table = gpu_session.commands("table", dry=False, out=tmp_path, text=None)[0]
    assert table[table.index("--batches") + 1] == "16,32,64,128" and table[2] == "benchmarks.gpu.bench"
    train = next(c for c in gpu_session.commands("profile", dry=False, out=tmp_path, text=tmp_path / "t.txt")
                 if "jaxgpt.train" in c)
    assert "--total_batch_tokens=131072" in train and "--batch_size=32" in train  # 4 micro-steps of 32 x 1024
    with pytest.raises(SystemExit, match="needs a text file"):
        gpu_session.commands("profile", dry=False, out=tmp_path, text=None)


@pytest.mark.slow
def test_the_runbook_profile_part_rehearses_on_the_cpu(tmp_path, monkeypatch):
    """The whole profile part (trace, shards, harness row, training run, check) at tiny shapes (~70 s)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_session.main(["profile", "--dry", "--text", str(common.ROOT / "README.md")]) == 0
    check = json.loads((tmp_path / "e2e-check.json").read_text())
    assert check["tokens_per_s_ratio"] > 0 and (tmp_path / "e2e-metrics.jsonl").stat().st_size > 0
    assert len(list(tmp_path.iterdir())) <= 8  # the device tool brings back at most 8 files


def test_the_scaling_projection_follows_its_stated_model(tmp_path, capsys):
    from benchmarks.gpu import scaling

    g = scaling.grad_bytes()
    assert g == 4 * 124_475_904  # gpt2 with wte padded to 50,304 rows, fp32
    p = scaling.project(micro_step_s=0.07, batch=32, gpus=8, grad_bytes=g, busbw=360e9, alpha_s=10e-6)
    t_ar = 2 * 7 / 8 * g / 360e9 + 14 * 10e-6
    assert p.micro_steps == 2 and p.allreduce_s == pytest.approx(t_ar)
    assert p.tokens_per_s_per_gpu == pytest.approx(65536 / (0.14 + t_ar)) and p.tokens_per_s == 8 * p.tokens_per_s_per_gpu
    assert scaling.project(micro_step_s=0.07, batch=32, gpus=1, grad_bytes=g).efficiency == 1.0
    with pytest.raises(ValueError, match="not a multiple"):
        scaling.project(micro_step_s=0.07, batch=48, gpus=8, grad_bytes=g)
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"rows": [{"shape": "gpt2", "variant": "jax_bf16", "batch": 32,
                                           "step_ms": {"median": 70.0}}]}))
    assert scaling.main(["--from", str(table)]) == 0
    assert "tok/s per GPU" in capsys.readouterr().out


def test_the_report_shows_gpu_tables_or_says_they_are_missing(results, monkeypatch):
    """A GPU run is a directory of results/ with its run.json (benchmarks.gpu.results); the report renders each one's
    tables, and says so where there is none."""
    from benchmarks import report
    from benchmarks.gpu import results as runs

    assert "**Not yet measured**" in "\n".join(report.gpu_section())
    worker, _ = fake_worker({"jax_bf16": 32, "torch_compile_bf16": 32, "torch_eager_bf16": 16},
                            {"jax_bf16": 0.05, "torch_compile_bf16": 0.06, "torch_eager_bf16": 0.1})
    monkeypatch.setattr(common, "run_worker", worker)
    monkeypatch.setattr(common, "ensure_init", lambda preset, overrides=None: results / "init.npz")
    run_dir = results / "gpu-2026-11-29"
    run_dir.mkdir()
    monkeypatch.setattr(common, "RESULTS", run_dir)
    res = gpu_bench.run(dry=False, batches=[16], eager_batches=[16], medium_batch=None, steps=20, budget_s=600,
                        log=lambda s: None)
    assert gpu_bench.result_name(res) == "train_step-gpu-other"  # nvidia-smi absent here: no GPU name
    runs.write_meta(run_dir, runs.metadata("python -m benchmarks.gpu.bench", dry=False))
    monkeypatch.setattr(common, "RESULTS", results)
    text = "\n".join(report.gpu_section())
    assert "### `train_step-gpu-other` (gpu-2026-11-29)" in text and "| gpt2 | torch_compile_bf16 | 16 |" in text
    assert "`benchmarks/results/gpu-2026-11-29/`" in text and "Commands: `python -m benchmarks.gpu.bench`" in text


def test_torch_profile_groups_kernels_by_kind():
    from benchmarks.gpu import torch_profile

    def k(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}

    events = [k("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 100), k("nvjet_tst_192x192", 100, 50),
              k("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 150, 80), k("flash_fwd_kernel", 230, 20),
              k("triton_red_fused__log_softmax_backward_data_nll_loss_backward_3", 250, 40),
              k("triton_per_fused_native_layer_norm_backward_7", 290, 30),
              k("triton_poi_fused_add_mul_tanh_5", 320, 10),
              k("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 330, 20), k("Memcpy HtoD", 350, 5),
              k("triton_poi_fused_view_9", 340, 20),  # overlaps AdamW's end (its 10 new us count) and the memcpy
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500, "pid": 1, "tid": 1}]
    s = torch_profile.summarise({"traceEvents": events}, steps=1, wall_s=400e-6)
    ms = {r["kind"]: r["ms_per_step"] for r in s["rows"]}
    assert s["source"] == "GPU kernels" and s["events"] == 10
    assert ms["GEMMs"] == pytest.approx(0.15) and ms["attention bwd"] == pytest.approx(0.08)
    assert ms["attention fwd"] == pytest.approx(0.02) and ms["cross-entropy"] == pytest.approx(0.04)
    assert ms["LayerNorm bwd"] == pytest.approx(0.03) and ms["GELU fwd"] == pytest.approx(0.01)
    assert ms["optimizer (fused AdamW, grad clip)"] == pytest.approx(0.02)
    assert ms["other Triton / inductor fusions"] == pytest.approx(0.01) and "copies / memsets" not in ms
    assert s["busy_ms_per_step"] == pytest.approx(0.36) and ms["host gaps (device idle)"] == pytest.approx(0.04)
    assert sum(r["share"] for r in s["rows"]) == pytest.approx(1.0)


def test_the_report_carries_the_hand_written_profile_analyses():
    """The analyses of the measured trace are history: docs/benchmark-history.md, which the report writes."""
    from benchmarks import report

    text = report.history()
    note = (common.ROOT / "benchmarks" / "results" / "analysis-gpu-h100-b64-layernorm-bwd.md").read_text().rstrip()
    assert note in text and "analysis of the measured trace" in note
    assert text == (common.ROOT / "docs" / "benchmark-history.md").read_text()
