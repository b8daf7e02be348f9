"""jaxgpt.compile: the train step compiled for GPUs this machine does not have (compile-only CUDA topology).

Tests marked ``needs_plugin`` compile for H100s and skip, naming the install command, where JAX's CUDA plugin is
not installed (``.ci/run`` installs it). The rest check the pieces without it: kernel selection by the traced-for
devices, the HLO reader against FLOPs we count ourselves, targets, and the command's errors.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import ops
from jaxgpt.compile import hlo, targets
from jaxgpt.compile.targets import CompileError
from jaxgpt.precision import Policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_PROBLEM = targets.plugin_problem()
needs_plugin = pytest.mark.skipif(PLUGIN_PROBLEM is not None,
                                  reason=f"compile-only GPU tests need JAX's CUDA plugin: {PLUGIN_PROBLEM}")


# ---- without the plugin --------------------------------------------------------------------------------------
def _fake_devices(platform: str, n: int = 2):
    return [SimpleNamespace(platform=platform) for _ in range(n)]


def test_platform_follows_the_traced_for_devices_not_the_default_backend():
    assert ops.platform() == "cpu"
    with ops.traced_for(_fake_devices("gpu")):
        assert ops.platform() == "gpu"
        assert Policy.bf16().attention_impl() == "cudnn"
        assert Policy.fp32().attention_impl() == "xla"
    with ops.traced_for(_fake_devices("cuda")):  # compile-only devices may name the runtime
        assert ops.platform() == "gpu"
    assert ops.platform() == "cpu" and Policy.bf16().attention_impl() == "einsum"
    with pytest.raises(ValueError, match="share a platform"):
        ops.devices_platform([SimpleNamespace(platform="cpu"), SimpleNamespace(platform="gpu")])


def test_the_train_step_is_traced_for_its_mesh(monkeypatch):
    """make_train_step traces under its mesh: what ops.platform() answers inside the traced loss."""
    from flax import nnx

    from jaxgpt import step as step_lib
    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT
    from jaxgpt.optim import OptimConfig, make_optimizer

    seen = []
    real = ops.platform
    monkeypatch.setattr(ops, "platform", lambda: seen.append(real()) or real())
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64), rngs=nnx.Rngs(0))
    opt = make_optimizer(OptimConfig())
    graphdef, state = step_lib.init_train_state(model, opt)
    mesh = step_lib.data_mesh()
    with ops.traced_for(_fake_devices("gpu")):  # the caller's context must not leak into the mesh's step
        fn = step_lib.make_train_step(graphdef, opt, micro_steps=1, mesh=mesh)
        x = jnp.zeros((1, 2, 8), jnp.int32)
        fn(state, x, x)
    assert seen and set(seen) == {"cpu"}


def test_hlo_reader_counts_a_cpu_programs_gemm_flops_as_jaxgpt_flops():
    """The roll-up's FLOPs of an XLA-compiled forward equal the matmul FLOPs we count by hand (flops.py)."""
    from flax import nnx

    from jaxgpt.config import GPTConfig
    from jaxgpt.flops import count_flops
    from jaxgpt.model import GPT

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=96)
    model = GPT(cfg, policy=Policy.fp32(fast_kernels=False, kernels={"attention": "reference"}), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    idx = jnp.zeros((2, 16), jnp.int32)
    fwd = jax.jit(lambda p, i: nnx.merge(graphdef, p)(i))
    text = fwd.lower(params, idx).compile().as_text()
    kernels, unknown = hlo.kernels(text)
    assert unknown == 0 and kernels
    gemm = sum(k.flops * k.count for k in kernels if k.matmul_dtype is not None)
    assert gemm == count_flops(cfg, 16, batch_size=2).forward_per_micro_step


def test_hlo_reader_multiplies_loop_bodies_by_their_trip_count():
    def f(x):
        return jax.lax.fori_loop(0, 7, lambda i, c: jnp.tanh(c @ c), x)

    text = jax.jit(f).lower(jnp.ones((32, 32))).compile().as_text()
    kernels, unknown = hlo.kernels(text)
    dots = [k for k in kernels if k.matmul_dtype]
    assert unknown == 0 and sum(k.count * k.flops for k in dots) == 7 * 2 * 32**3
    assert all(k.loop_depth == 1 for k in dots)


def test_targets_and_their_target_configs():
    assert targets.get_target("h100").name == "h100-sxm" and targets.get_target("A100").name == "a100-sxm-80gb"
    for name, t in targets.TARGETS.items():
        text = t.target_config()
        assert f"core_count: {t.core_count}" in text and f'"{t.device_kind}"' in text
        assert t.peak_bf16 > 1e14 and t.memory_bandwidth > 1e12
    with pytest.raises(CompileError, match="unknown target 'h300'.*h100-sxm"):
        targets.get_target("h300")


def test_plugin_problems_name_the_install_command(monkeypatch):
    import importlib.metadata

    import jaxlib

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert f"jax-cuda12-plugin[with-cuda]=={jaxlib.__version__}" in targets.plugin_problem()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1")
    msg = targets.plugin_problem()
    assert "0.0.1 does not match jaxlib" in msg and "pip install" in msg
    with pytest.raises(CompileError, match="does not match"):
        targets.topology_devices(targets.get_target("h100"), 1)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxgpt.compile", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.parametrize("args, message", [
    (["--target", "h300"], "unknown target 'h300'"),
    (["--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
    (["--set", "batch_size"], "expected FIELD=VALUE"),
    (["--set", "optim.name=nope"], "OptimConfig.name = 'nope'"),
    (["--mem-fraction", "2"], "--mem-fraction 2.0: must be in (0, 1]"),
])
def test_cli_errors_are_one_line_exit_2(args, message):
    r = _cli("--no-search", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


# ---- compiled for H100 -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _compiled(config: str, micro_batch: int | None, devices: int, sets: tuple[str, ...] = ()):
    from jaxgpt.compile import inspect, predict
    from jaxgpt.compile.cli import describe, load_config
    from jaxgpt.compile.program import compile_train_step

    target = targets.get_target("h100")
    cfg = load_config(os.path.join(ROOT, config), list(sets))
    cs = compile_train_step(cfg, targets.topology_devices(target, devices), micro_batch=micro_batch)
    report = describe(cs, target, 0.75)
    return cs, report.data


# seq_len 64: unlike 32, not also the tiny model's n_embd, so a (seq, seq) buffer can only be attention's
TINY_BF16 = ("configs/tiny-test.yaml", ("precision=bf16", "seq_len=64", "total_batch_tokens=512"))


def _state_arrays(cs) -> tuple[int, int]:
    """(leaves, bytes per device) of the params and optimizer state arrays (scalars left out)."""
    from jaxgpt.compile.program import _abstract_state
    from jaxgpt.optim import make_optimizer

    _, state, _ = _abstract_state(cs.cfg, cs.policy, make_optimizer(cs.cfg.optim), cs.mesh)
    leaves = [x for x in jax.tree.leaves((state.params, state.opt_state)) if x.ndim]
    per_device = sum(x.sharding.shard_shape(x.shape) and
                     jnp.dtype(x.dtype).itemsize * int(np.prod(x.sharding.shard_shape(x.shape))) for x in leaves)
    return len(leaves), per_device


def _assert_gpu_program(cs, data, *, n_layer: int):
    st = data["structure"]
    assert data["fits"]
    assert st["cudnn_attention_fwd"] == n_layer and st["cudnn_attention_bwd"] == n_layer  # one loop body
    assert st["square_buffers"] == 0  # no (T, T) attention matrix anywhere
    assert set(st["gemms"]) == {"bf16 x bf16 -> f32"}, st["gemms"]
    assert st["fp8_gemms"] == {}
    assert set(st["loss_reductions"]) == {"f32"}
    n_arrays, state_bytes = _state_arrays(cs)
    assert st["donated_params"] >= n_arrays  # params and optimizer state all donated (aliased to the outputs)
    assert data["memory"]["alias"] >= state_bytes


@needs_plugin
def test_tiny_step_compiles_for_h100_with_cudnn_attention_bf16_gemms_and_donation():
    cs, data = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1])
    assert cs.policy.compute_dtype == "bfloat16" and cs.micro_steps == 2
    _assert_gpu_program(cs, data, n_layer=2)
    assert data["structure"]["collectives"] == {}


@needs_plugin
def test_tiny_step_with_precision_fp8_has_cublaslt_fp8_gemms_for_every_linear_layer():
    """precision: fp8 (jaxgpt.kernels.fp8): each layer's forward Linear GEMMs take e4m3 operands in the compiled H100 step:
    q, k, v (at the tiny width XLA's dot merger joins the three GEMMs of one input into one; gpt2-124m keeps 3 x 12),
    attn.c_proj, c_fc, mlp.c_proj; and the lm_head's logits GEMM (one, in the fused loss's chunk loop); everything
    else stays bf16 x bf16 -> f32. Every e4m3 GEMM is a cuBLASLt fp8 call (``__cublas$lt$matmul$f8``), none a Triton
    GEMM fusion or an XLA-emitted dot; the scales are its scale operands (a, b, a_scale, b_scale: no pass over its
    fp32 result multiplies them in), with fp32 accumulation (HIGHEST: no fast accumulation); and the calibrated
    prediction prices these unmeasured calls at the least efficient measured GEMM rate, marked uncalibrated."""
    from jaxgpt.compile import calibrated
    from jaxgpt.compile.hlo import Module

    cs, data = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1] + ("precision=fp8", "fp8_gemms=all"))
    st = data["structure"]
    gemms, n = st["gemms"], 4 * 2 + 1
    assert cs.policy.fp8 == "all" and gemms.get("f8e4m3fn x f8e4m3fn -> f32") == n, gemms
    assert set(gemms) == {"bf16 x bf16 -> f32", "f8e4m3fn x f8e4m3fn -> f32"}, gemms
    assert st["fp8_gemms"] == {"cublaslt": n}, st["fp8_gemms"]  # a fallback to Triton or to a bf16 GEMM fails
    m = Module(cs.hlo_text())
    calls = [i for instrs in m.computations.values() for i in instrs
             if i.opcode == "custom-call" and '"__cublas$lt$matmul$f8"' in i.attrs]
    assert len(calls) == n
    for call in calls:
        cfg = call.backend_config()["gemm_backend_config"]
        assert len(call.operands) == 4 and cfg["precision_config"]["operand_precision"] == ["HIGHEST", "HIGHEST"]
        assert cfg["epilogue"] == "DEFAULT" and call.shapes[0].dtype == "f32"
    cal = calibrated.for_target("h100-sxm")
    worst = min((r for r in cal.rates.values() if r.kind == "gemm" and r.efficiency() > 0),
                key=calibrated.Rate.efficiency)
    pred = data["prediction"]["calibrated"]
    assert {c for c in pred["uncalibrated"] if "f8" in c} == {"gemm: f8e4m3fn->f32 NN", "gemm: f8e4m3fn->f32 NT"}
    assert pred["by_class"].get(f"gemm: {worst.name} (uncalibrated)", 0) > 0, pred["by_class"]


@needs_plugin
def test_the_roofline_bound_prices_fp8_gemms_at_the_dense_fp8_peak():
    """The roofline bound (jaxgpt.compile.predict) is a lower bound: the fp8 step's e4m3 GEMMs take the H100's dense
    fp8 peak (jaxgpt.devices, twice bf16's), not the fp32 vector rate of a dtype it did not know, so the bound stays
    under the calibrated estimate (which keeps pricing these unmeasured GEMMs at the least efficient measured GEMM
    rate: unchanged)."""
    from jaxgpt.compile import predict
    from jaxgpt.devices import peak_flops

    cs, data = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1] + ("precision=fp8", "fp8_gemms=all"))
    for name in ("h100-sxm", "h100-pcie"):
        peaks = predict.gpu_peaks(targets.get_target(name))
        assert peaks.matmul_peak("f8e4m3fn") == peak_flops(name, "fp8")
        assert peaks.matmul_peak("f8e4m3fn") == pytest.approx(2 * peak_flops(name, "bf16"), rel=1e-3)  # rounding
    peaks = predict.gpu_peaks(targets.get_target("h100"))
    e4m3 = [k for k in hlo.kernels(cs.hlo_text())[0] if k.matmul_dtype == "f8e4m3fn"]
    assert sum(k.count for k in e4m3) == cs.micro_steps * (4 * 2 + 1)  # per micro-step: 4 per layer + the lm_head
    for k in e4m3:
        assert predict.kernel_time(k, peaks)[0] == pytest.approx(k.flops / 1978.9e12)
    assert data["prediction"]["bound_s"] <= data["prediction"]["time_s"]


def test_committed_fp8_programs_bound_below_their_estimate_and_above_bf16_by_bytes_alone():
    """The committed gpt2 124M b64 H100 programs (benchmarks/results, compiled by jaxgpt.compile): each fp8
    program's roofline bound is under its calibrated estimate, the forward GEMMs' bound under bf16's where all are
    e4m3, and its whole bound above the bf16 program's by no more than the time its extra bytes take at HBM
    bandwidth: the fp8 GEMMs cost no more compute than bf16's. (The cuBLAS-only fp8 program runs the epilogues
    Triton fused into the bf16 GEMMs as kernels of their own: 20-50 GB more per step, so its bound is not below
    bf16's.) Priced at the fp32 vector rate, the fp8 GEMMs gave a bound over the estimate (356 ms against 190.6)."""
    from benchmarks.gpu.changes import load

    def fwd_gemms(p):
        return {r["category"]: r["time_s"] for r in p["rows"]}["matmuls fwd"]

    bf16 = load("baseline-b64")["prediction"]
    bandwidth = bf16["peaks"]["bandwidth"]
    assert fwd_gemms(load("fp8-b64")["prediction"]) < fwd_gemms(bf16)  # every forward GEMM in e4m3
    for stem in ("fp8-b64", "fp8-lm_head-b64", "fp8-mlp_lm_head-b64"):
        p = load(stem)["prediction"]
        assert p["peaks"]["matmul"]["f8"] == 1978.9e12
        assert p["bound_s"] <= p["time_s"], stem
        assert p["bound_s"] - bf16["bound_s"] <= (p["bytes"] - bf16["bytes"]) / bandwidth, stem


@needs_plugin
def test_tiny_step_on_8_h100s_all_reduces_once_per_optimizer_step():
    cs, data = _compiled(TINY_BF16[0], 1, 8, TINY_BF16[1] + ("total_batch_tokens=2048",))
    assert cs.n_devices == 8 and cs.micro_steps == 4
    _assert_gpu_program(cs, data, n_layer=2)
    coll = data["structure"]["collectives"]
    assert set(coll) == {"all-reduce"} and set(coll["all-reduce"]) == {0}, coll  # none inside the loop


@needs_plugin
def test_tiny_step_on_an_fsdp_mesh_of_h100s():
    """FSDP (data 2 x fsdp 4), fsdp_reduce=micro_step (the default): the sharded weights are all-gathered and their
    gradients reduce-scattered inside every micro-step (the accumulator stays sharded); the replicated leaves'
    gradients are all-reduced once per optimizer step, outside the loop."""
    cs, data = _compiled(TINY_BF16[0], 1, 8, TINY_BF16[1] + ("total_batch_tokens=2048", "mesh=data=2,fsdp=4"))
    assert dict(cs.mesh.shape) == {"data": 2, "fsdp": 4} and cs.micro_steps == 4
    _assert_gpu_program(cs, data, n_layer=2)
    coll = data["structure"]["collectives"]
    assert set(coll["all-gather"]) == {1} and set(coll["reduce-scatter"]) == {1}, coll  # inside the loop
    assert set(coll["all-reduce"]) == {0}, coll


@needs_plugin
def test_tiny_step_on_an_fsdp_mesh_with_one_gradient_reduction_per_step():
    """fsdp_reduce=step: the weights are gathered once, each device sums its full gradients over the micro-steps,
    and every gradient reduction (the sharded leaves' reduce-scatter, the rest's all-reduce) runs once per
    optimizer step, outside the accumulation loop; nothing collective runs inside it."""
    cs, data = _compiled(TINY_BF16[0], 1, 8, TINY_BF16[1] + ("total_batch_tokens=2048", "mesh=data=2,fsdp=4",
                                                              "fsdp_reduce=step"))
    assert dict(cs.mesh.shape) == {"data": 2, "fsdp": 4} and cs.micro_steps == 4
    _assert_gpu_program(cs, data, n_layer=2)
    coll = data["structure"]["collectives"]
    assert {"all-gather", "reduce-scatter", "all-reduce"} <= set(coll), coll
    assert all(set(by) == {0} for by in coll.values()), coll


def test_async_collectives_are_read_as_collectives_and_counted_once():
    """An async collective (XLA:GPU's "-start"/"-done" pairs) is one collective kernel: its "-start" moves the
    data (operands in, outputs out; the operands its tuple result repeats are not counted again), its "-done"
    is only the wait."""
    text = """HloModule m

ENTRY %main (p: f32[8,4]) -> f32[2,4] {
  %p = f32[8,4]{1,0} parameter(0)
  %rs = ((f32[8,4]{1,0}), f32[2,4]{1,0}) reduce-scatter-start(%p), dimensions={0}
  %ag = (f32[8,4]{1,0}, f32[32,4]{1,0}) all-gather-start(%p), dimensions={0}
  %agd = f32[32,4]{1,0} all-gather-done(%ag)
  ROOT %rsd = f32[2,4]{1,0} reduce-scatter-done(%rs)
}
"""
    kernels, _ = hlo.kernels(text)
    assert [(k.opcode, k.category, k.bytes) for k in kernels] == [
        ("reduce-scatter-start", "collectives", (32 + 8) * 4), ("all-gather-start", "collectives", (32 + 128) * 4)]


@pytest.mark.slow  # 29-38 s on 2 cores; the tiny steps above compile the same code paths for the H100
@needs_plugin
def test_gpt2_124m_b16_on_h100_fits_lowers_as_intended_and_meets_the_predicted_floor():
    cs, data = _compiled("configs/gpt2-124m.yaml", 16, 1)
    assert cs.micro_steps == 32 and cs.policy.compute_dtype == "bfloat16"
    _assert_gpu_program(cs, data, n_layer=12)
    mem = data["memory"]
    assert 6 * 2**30 < mem["total"] < 12 * 2**30  # 8.95-9.75 GiB measured (BENCHMARKS.md)
    # regression floor of the traffic cuts (BENCHMARKS.md "GPU, compiled"): main as it was predicted 26.0% MFU
    # and 171 GB per b16 micro-step, 42.6% / 99.9 GB with the platform fix alone; now 49.1% / 84.9 GB
    assert data["bound_mfu"] >= 0.48 and data["predicted_bytes_per_micro_step"] <= 86e9


@pytest.mark.slow  # gpt2 b16 x 32 compiled for the H100 (35 s on 2 cores): the tiny program's account beside XLA's is
@needs_plugin       # test_compile_prints_the_accounts_memory_estimate_beside_xlas, the terms by hand tests/test_account.py
def test_account_memory_model_against_xla_gpu(request):
    """jaxgpt.account's analytic temp (activations, grads, accumulator, weight copies) against XLA:GPU's."""
    from jaxgpt import account

    cs, data = _compiled("configs/gpt2-124m.yaml", 16, 1)
    est = account.estimate_memory(cs.cfg.model, batch_size=16, seq_len=1024, precision="bf16", grad_accum=32,
                                  attention="cudnn", device="h100-sxm")
    xla = data["memory"]["temp"]
    assert abs(est.xla_temp - xla) / xla < 0.05, (est.xla_temp / 2**30, xla / 2**30)  # 8.37 vs 8.35 GiB measured


@needs_plugin
def test_compile_prints_the_accounts_memory_estimate_beside_xlas():
    """jaxgpt.compile prints jaxgpt.account's analytic memory beside XLA's (what `python -m jaxgpt.account
    --compiled` did before the accountant stopped importing jaxgpt.compile)."""
    from jaxgpt.compile.cli import memory_lines

    _, data = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1])
    est, mem = data["account_memory"], data["memory"]
    assert 0.5 < est["total"] / mem["total"] < 2.0, (est, mem)
    lines = memory_lines(mem, est)
    assert "jaxgpt.account's analytic estimate" in lines[0]
    assert lines[-1].split()[0] == "total" and float(lines[-1].split()[-1]) == pytest.approx(
        est["total"] / mem["total"], abs=0.005)


def test_account_compiled_names_the_command_that_moved_it(capsys):
    from jaxgpt.account.cli import main

    assert main(["--model", "tiny", "--device", "h100", "--compiled"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--compiled moved to python -m jaxgpt.compile" in err
    assert "--target h100" in err


def test_benchmarks_gpu_compiled_section_renders_the_committed_results():
    """BENCHMARKS.md's "GPU, compiled (not run)" section is rendered from committed JSON (no plugin needed)."""
    from benchmarks.gpu import compiled

    md = compiled.markdown()
    rows = json.loads(compiled.AB.read_text())
    assert rows and "main as it was" in rows[0]["label"]
    assert "| h100-sxm |" in md and "predictions" in md and "Target, predicted MFU >= 60%" in md
    assert f"{rows[-1]['bytes_per_micro_step'] / 1e9:.1f}" in md


@needs_plugin
def test_cli_a_config_that_does_not_fit_is_exit_2_with_the_need_and_the_pool(tmp_path):
    out = tmp_path / "r.json"
    r = _cli("--config", "configs/tiny-test.yaml", "--set", "precision=bf16", "--mem-fraction", "0.000001",
             "--no-search", "--json", str(out))
    assert r.returncode == 2, r.stderr
    assert "does not fit: the step needs" in r.stderr and "JAX's pool on h100-sxm" in r.stderr
    assert "Traceback" not in r.stderr and "DOES NOT FIT" in r.stdout
    assert json.loads(out.read_text())["fits"] is False
