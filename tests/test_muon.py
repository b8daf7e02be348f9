"""jaxgpt.muon / OptimConfig(name='muon'): config checks, the chain is optax.contrib.muon where the two rules
coincide, it trains, the q/k/v split, accounting (memory and Newton-Schulz FLOPs), and resume refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from jaxgpt import account as acc
from jaxgpt.config import ConfigError, GPTConfig
from jaxgpt.flops import muon_matrix_params, newton_schulz_flops, nonmatmul_flops
from jaxgpt.model import GPT
from jaxgpt.muon import is_muon_matrix, muon_labels
from jaxgpt.optim import OptimConfig, current_lr, lr_schedule, make_optimizer
from jaxgpt.train.changes import classify, optimizer_state_differs
from jaxgpt.config import to_dict

CFG = GPTConfig.preset("tiny", vocab_size=512)


@pytest.fixture(scope="module")
def params():
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    for path, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(rng.normal(0, 0.02, var.get_value().shape) + (path[-1] == "scale"), jnp.float32))
    return state


def grads_like(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(0, 1e-2, p.shape), jnp.float32), params)


@pytest.mark.parametrize("field, value, msg", [
    ("muon_ns_dtype", "float16", "allowed values are"), ("muon_ns_coeffs", (1.0, 2.0), "three finite numbers"),
    ("muon_qkv", "three", "allowed values are"), ("muon_lr", 0.0, "> 0"), ("muon_momentum", 1.0, r"\[0, 1\)"),
    ("muon_ns_steps", 0, ">= 1"), ("muon_lr_adjust", "moonshot", "allowed values are")])
def test_config_errors(field, value, msg):
    with pytest.raises(ConfigError, match=f"OptimConfig.{field} = .*{msg}"):
        OptimConfig(name="muon", **{field: value})


def test_float64_newton_schulz_needs_x64():
    from jaxgpt.muon import orthogonalize

    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
    with pytest.raises(ConfigError, match="needs 64-bit jax"):
        orthogonalize(x, OptimConfig(muon_ns_dtype="float64"))
    with jax.enable_x64(True):
        y = orthogonalize(x.astype(jnp.float64), OptimConfig(muon_ns_dtype="float64"))
        z = orthogonalize(x.astype(jnp.float64), OptimConfig(muon_ns_dtype="float32"))
        assert y.dtype == jnp.float64 and 1e-9 < float(jnp.abs(y - z).max()) < 1e-4  # fp32's rounding, no more


def test_yaml_style_dict_round_trip():
    cfg = OptimConfig.from_dict({"name": "muon", "muon_ns_coeffs": [3.0, -4.0, 2.0], "muon_lr": 0.05})
    assert cfg.muon_ns_coeffs == (3.0, -4.0, 2.0) and OptimConfig.from_dict(to_dict(cfg)) == cfg


def test_routing_names():
    assert is_muon_matrix("h.11.attn.c_attn.kernel") and is_muon_matrix("h.0.mlp.c_proj.kernel")
    for name in ("wte.embedding", "wpe.embedding", "h.0.attn.c_attn.bias", "h.0.ln_1.scale", "lm_head.kernel"):
        assert not is_muon_matrix(name)


def test_equals_optax_contrib_muon_where_the_rules_coincide(params):
    """No Nesterov, fused qkv, fp32, no decay, no clipping, constant lr: optax.contrib.muon's bias-corrected EMA
    points where torch's uncorrected one does (Newton-Schulz normalises the scale away), its Adam part is plain
    AdamW, and our routing given as its dimension numbers: the two chains give the same updates."""
    lr, muon_lr, eps = 1e-3, 0.02, 1e-30
    cfg = OptimConfig(name="muon", lr=lr, muon_lr=muon_lr, muon_nesterov=False, muon_qkv="fused",
                      muon_ns_dtype="float32", weight_decay=0.0, muon_weight_decay=0.0, grad_clip=0.0,
                      schedule="constant", warmup_steps=0, eps=eps)
    dims = jax.tree.map(lambda label: MuonDimensionNumbers(0, 1) if label == "muon" else None, muon_labels(params))
    theirs = optax.contrib.muon(muon_lr, beta=cfg.muon_momentum, eps=eps, nesterov=False, adam_b1=cfg.beta1,
                                adam_b2=cfg.beta2, adam_learning_rate=lr, muon_weight_dimension_numbers=dims)
    ours = make_optimizer(cfg)

    def run(opt):
        @jax.jit
        def go(p):
            s, out = opt.init(p), []
            for i in range(3):
                u, s = opt.update(grads_like(p, i), s, p)
                out.append(u)
            return out
        return go(params)

    for u1, u2 in zip(run(ours), run(theirs)):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(u1), jax.tree.leaves(u2)):
            b = np.asarray(b)  # fp32 rounding of the two orders of work: 1e-5 of the update's scale
            np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-5 * np.abs(b).max(),
                                       err_msg=jax.tree_util.keystr(path))
    # and with Nesterov (the default) they differ: optax.contrib's bias-corrected Nesterov is another direction
    ours_n = make_optimizer(cfg.replace(muon_nesterov=True))
    theirs_n = optax.contrib.muon(muon_lr, beta=cfg.muon_momentum, eps=eps, nesterov=True, adam_b1=cfg.beta1,
                                  adam_b2=cfg.beta2, adam_learning_rate=lr, muon_weight_dimension_numbers=dims)
    a, b = run(ours_n)[1], run(theirs_n)[1]  # the second step: the first is the same direction in both
    k = ("h", 0, "mlp", "c_fc", "kernel")
    a, b = dict(nnx.to_flat_state(a))[k].get_value(), dict(nnx.to_flat_state(b))[k].get_value()
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-2 * np.abs(np.asarray(b)).max()


def test_split_and_fused_differ_only_on_c_attn(params):
    g = grads_like(params, 0)
    up = {}
    for qkv in ("split", "fused"):
        opt = make_optimizer(OptimConfig(name="muon", muon_qkv=qkv, muon_ns_dtype="float32", warmup_steps=0))
        up[qkv] = dict(nnx.to_flat_state(jax.jit(lambda p: opt.update(g, opt.init(p), p)[0])(params)))
    for path in up["split"]:
        a, b = np.asarray(up["split"][path].get_value()), np.asarray(up["fused"][path].get_value())
        if path[-2:] == ("c_attn", "kernel"):
            assert not np.allclose(a, b, rtol=1e-2)
            C = a.shape[0]  # split: each of q, k, v is an orthogonalised (C, C) block, -lr x NS(...)
            for i in range(3):
                s = np.linalg.svd(a[:, i * C:(i + 1) * C], compute_uv=False) / 0.02  # lr: muon_lr, no warmup
                assert 0.5 < np.median(s) and s.max() < 1.6  # Newton-Schulz's singular values (~U(0.5, 1.5))
            s = np.linalg.svd(b, compute_uv=False) / (0.02 * 3 ** 0.5)  # fused: one (C, 3C), scaled sqrt(3C / C)
            assert 0.5 < np.median(s) and s.max() < 1.6
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_orthogonalisation_is_each_matrix_on_its_own(dtype):
    """orthogonalize_all stacks the matrices of one shape into one batched Newton-Schulz: the same result as each
    matrix alone (a split qkv's q, k and v included), for both shapes' orientations (wide and tall)."""
    from jaxgpt.muon import orthogonalize, orthogonalize_all

    cfg = OptimConfig(name="muon", muon_ns_dtype=dtype)
    rng = np.random.default_rng(0)
    C = 32
    xs = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((C, 3, C), (C, C), (C, 4 * C), (4 * C, C),
                                                                   (C, 3, C), (C, C), (C, 4 * C), (4 * C, C))]
    stacked = jax.jit(lambda v: orthogonalize_all(v, cfg))(xs)
    for x, y in zip(xs, stacked, strict=True):
        alone = orthogonalize(x, cfg) if x.ndim == 2 else jnp.stack(
            [orthogonalize(x[:, i], cfg) for i in range(3)], axis=1)
        assert y.shape == x.shape
        if dtype == "float32":  # both within NS_FP32_REL (64 ulps) of float64 Newton-Schulz; the batched GEMM sums
            # in another order, so they differ by fp32 rounding: measured up to 1.0e-6 at an element of 0.40 on an
            # AVX2-only AMD EPYC (17 fp32 ulps of the largest element, 0.52; atol 1e-6 failed there), under 1e-6 on
            # a Zen 4. The bound: 64 ulps of the largest element, NS_FP32_REL's 64 ulps.
            ulp = float(np.spacing(np.abs(np.asarray(alone)).max()))
            np.testing.assert_allclose(np.asarray(y), np.asarray(alone), rtol=0, atol=64 * ulp)
        else:  # a batched GEMM sums in another order: a bf16 rounding that flips to the other neighbour then
            # propagates through the iterations, so the two are two draws of bf16 Newton-Schulz noise (~1e-2,
            # parity_tests/tolerances.py NS_BF16_REL), not equal bits
            d = np.linalg.norm(np.asarray(y) - np.asarray(alone)) / np.linalg.norm(np.asarray(alone))
            assert d <= 2.5e-2, d


def test_trains_and_reports_both_learning_rates(params):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, CFG.vocab_size, (4, 32)), jnp.int32)
    y = jnp.roll(x, -1, axis=1)
    cfg = OptimConfig(name="muon", lr=3e-3, muon_lr=0.02, warmup_steps=2, decay_steps=20)
    opt = make_optimizer(cfg)

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(x, y))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p, s = params, jax.jit(opt.init)(params)
    losses = []
    for i in range(8):
        p, s, loss = step(p, s)
        losses.append(float(loss))
        assert float(current_lr(s)) == pytest.approx(float(lr_schedule(cfg)(i)), rel=1e-6)
        assert float(s.hyperparams["muon_learning_rate"]) == pytest.approx(float(lr_schedule(cfg)(i)) * 0.02 / 3e-3,
                                                                           rel=1e-5)
    assert losses[-1] < losses[0] - 0.5, losses


# ---- accounting --------------------------------------------------------------------------------------------------
def test_account_muon_state_and_newton_schulz_flops(params):
    n = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    n_muon = muon_matrix_params(CFG)
    assert n_muon == sum(int(np.prod(v.get_value().shape)) for path, v in nnx.to_flat_state(params)
                         if is_muon_matrix(".".join(map(str, path))))
    # the state optax actually builds: one buffer per Muon element, two per AdamW element (+ scalars)
    opt_state = jax.eval_shape(make_optimizer(OptimConfig(name="muon")).init, params)
    elements = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(opt_state) if x.ndim >= 1)
    assert elements == acc.optimizer_state_elements(CFG, "muon", n) == n_muon + 2 * (n - n_muon)
    gpt2 = GPTConfig.preset("gpt2")
    m = acc.estimate_memory(gpt2, batch_size=4, optimizer="muon")
    big_n = acc.count_params(gpt2).total
    assert m.optimizer_state == 4 * (12 * 12 * 768 ** 2 + 2 * (big_n - 12 * 12 * 768 ** 2))
    assert m.optimizer_state < acc.estimate_memory(gpt2, batch_size=4, optimizer="adamw").optimizer_state
    # Newton-Schulz FLOPs: 300 C^3 per layer for 5 split steps (matmuls); fused c_attn: 14 C^3 instead of 18 C^3
    C = 768
    assert newton_schulz_flops(gpt2)["matmul"] == 12 * 300 * C ** 3
    assert newton_schulz_flops(gpt2, split_qkv=False)["matmul"] == 12 * (300 - 5 * 4) * C ** 3
    nm = nonmatmul_flops(gpt2, 1024, optimizer="muon")["optimizer"]
    assert nm > newton_schulz_flops(gpt2)["matmul"] > 0


def test_account_time_includes_newton_schulz():
    """Newton-Schulz takes time: at the same assumed matmul efficiency Muon's step is longer by its FLOPs' share,
    and the MFU proper (model FLOPs only) lower; AdamW's figures are unchanged."""
    gpt2 = GPTConfig.preset("gpt2")
    a = acc.account(gpt2, batch_size=8, optimizer="adamw", mfu=0.4)
    m = acc.account(gpt2, batch_size=8, optimizer="muon", mfu=0.4)
    share = newton_schulz_flops(gpt2)["matmul"] / a.flops_per_step
    assert a.optimizer_flops_per_step == 0 and a.model_flops_utilization == pytest.approx(0.4)
    assert a.step_time_s == pytest.approx(a.flops_per_step / (a.peak_flops * 0.4))
    assert m.step_time_s == pytest.approx(a.step_time_s * (1 + share))
    assert m.train_time_s == pytest.approx(a.train_time_s * (1 + share))
    assert m.model_flops_utilization == pytest.approx(0.4 / (1 + share))
    assert "MFU, model FLOPs only: 32.4%" in m.table() and "Newton-Schulz" not in a.table()


def test_newton_schulz_flops_match_xla():
    """XLA's count of jaxgpt's Newton-Schulz (the orthogonalisation alone, lowered) equals the analytic one."""
    from jaxgpt.muon import orthogonalize

    cfg = OptimConfig(name="muon", muon_ns_dtype="float32")
    C = CFG.n_embd
    total = 0
    for shape, dims in (((C, 3, C), MuonDimensionNumbers(0, 2)), ((C, C), None), ((C, 4 * C), None),
                        ((4 * C, C), None)):
        lowered = jax.jit(lambda x: orthogonalize(x, cfg, dims)).lower(jax.ShapeDtypeStruct(shape, jnp.float32))
        total += lowered.cost_analysis()["flops"]
    ns = newton_schulz_flops(CFG)
    assert total == pytest.approx((ns["matmul"] + ns["elementwise"]) / CFG.n_layer, rel=0.02)  # one layer's


# ---- resume --------------------------------------------------------------------------------------------------
def test_resuming_adamw_as_muon_is_refused_with_the_fix():
    saved, requested = {"optim": to_dict(OptimConfig())}, {"optim": to_dict(OptimConfig(name="muon"))}
    refused, allowed = classify(saved, requested)
    assert any(r.startswith("optim.name: 'adamw' -> 'muon'") and "use --optim.name=adamw" in r for r in refused)
    # a Muon run: its lrs, decay, coefficients, q/k/v split and the Newton-Schulz dtype change nothing in the state
    base = OptimConfig(name="muon")
    for change in (dict(muon_lr=0.05), dict(muon_qkv="fused"), dict(muon_ns_dtype="float32"),
                   dict(muon_weight_decay=0.1), dict(muon_nesterov=False), dict(lr=1e-3)):
        assert not optimizer_state_differs(to_dict(base), to_dict(base.replace(**change))), change
    assert optimizer_state_differs(to_dict(base), to_dict(base.replace(grad_clip=0.0)))


# ---- the train CLI: a Muon run, SIGKILLed and resumed bit for bit ------------------------------------------------
@pytest.mark.slow
def test_cli_muon_run_sigkill_resume_bit_identical(tmp_path, tmp_path_factory):
    import os
    import subprocess

    from tests.runs import checkpoint_then_two_steps, sigkill_when
    from tests.test_train import REPO, losses, read_metrics, run, train_cmd

    cache = tmp_path_factory.mktemp("xla_cache_muon")
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_PLATFORMS": "cpu"}
    muon = ["--optim.name=muon", "--optim.muon_lr=0.02"]
    ref = tmp_path / "ref"
    proc = run(train_cmd(ref, "--sample_interval=0", *muon), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in read_metrics(ref) if r["type"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] and len(train) == 12

    out = tmp_path / "killed"
    slow = {**env, "JAXGPT_DEBUG_STEP_SLEEP": "0.25"}
    p = subprocess.Popen(train_cmd(out, *muon), cwd=REPO, env=slow, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    sigkill_when(p, checkpoint_then_two_steps(out))
    assert max(r["step"] for r in read_metrics(out) if r["type"] == "train") < 12
    resumed = run(train_cmd(out, "--resume=must", *muon), env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(out) == losses(ref)  # Muon's momentum and AdamW's moments came back exactly
    # and resuming the Muon run as AdamW is refused, naming the field and the fix
    again = run(train_cmd(out, "--resume=must", "--max_steps=14"), env)
    assert again.returncode == 2 and "optim.name: 'muon' -> 'adamw'" in again.stderr
    assert "use --optim.name=muon" in again.stderr and "Traceback" not in again.stderr
    # the Muon-trained run is evaluated as any other (HellaSwag scoring reads the params only)
    from jaxgpt.eval import cli
    from tests.test_eval import write_items

    items = write_items(tmp_path / "items.jsonl", 4)
    assert cli.main(["--task", "hellaswag", "--init-from", str(out), "--data", str(items), "--json",
                     str(tmp_path / "hs.json")]) == 0
    import json

    scores = json.loads((tmp_path / "hs.json").read_text())
    assert scores["n"] == 4 and 0 <= scores["acc_norm"] <= 1, scores


@pytest.mark.slow
def test_divergence_guard_rolls_a_muon_run_back(tmp_path):
    """The loss-spike guard on a Muon run: an exploding lr diverges, the rollback restores checkpoint 4 (Muon's
    momentum and AdamW's moments with it) and skips the bad batches, and the rollbacks are bounded."""
    from jaxgpt.train import read_metrics
    from tests.test_train_safety import run

    out = tmp_path / "run"
    muon = ["--optim.name=muon"]
    assert run(out, "--max_steps=4", "--checkpoint_interval=1", "--keep_checkpoints=2", *muon) == 0
    assert run(out, "--max_steps=10", "--checkpoint_interval=1", "--optim.lr=1e6", "--optim.muon_lr=1e6",
               "--optim.warmup_steps=0", "--on_divergence=rollback", "--max_rollbacks=1", *muon) == 3
    records = read_metrics(out)
    rollbacks = [r for r in records if r["type"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] >= 4
    assert [r["type"] for r in records if r["type"] in ("divergence", "rollback")][:2] == ["divergence", "rollback"]


@pytest.mark.slow
def test_tiny_muon_step_compiles_for_h100():
    """The train step with Muon compiled for an H100 (compile-only, JAX's CUDA plugin): cuDNN attention, bf16
    GEMMs, params and both parts' optimizer state donated; Newton-Schulz's matmuls in the optimizer's kernels."""
    from tests.test_compile import PLUGIN_PROBLEM, TINY_BF16, _compiled, _state_arrays

    if PLUGIN_PROBLEM is not None:
        pytest.skip(f"compile-only GPU tests need JAX's CUDA plugin: {PLUGIN_PROBLEM}")
    cs, data = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1] + ("optim.name=muon",))
    assert cs.cfg.optim.name == "muon" and data["fits"]
    st = data["structure"]
    assert st["cudnn_attention_fwd"] == st["cudnn_attention_bwd"] == 2 and st["square_buffers"] == 0
    # the model's GEMMs as with AdamW, plus Newton-Schulz's: bf16 operands accumulated in fp32 as torch's addmm
    # (rounded to bf16 after the coefficients are applied), one batched GEMM per shape of matrix (q, k, v and
    # c_proj (C, C) of both layers; c_fc (C, 4C); mlp.c_proj (4C, C)) x 5 steps x 3 products
    _, adamw = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1])
    assert set(st["gemms"]) == set(adamw["structure"]["gemms"]) == {"bf16 x bf16 -> f32"}, st["gemms"]
    assert st["gemms"]["bf16 x bf16 -> f32"] - adamw["structure"]["gemms"]["bf16 x bf16 -> f32"] == 3 * 5 * 3
    n_arrays, state_bytes = _state_arrays(cs)
    assert st["donated_params"] >= n_arrays and data["memory"]["alias"] >= state_bytes


@pytest.mark.slow
def test_benchmark_runs_end_to_end(tmp_path):
    """benchmarks/muon.py on a few steps: the sweep, the seeds, the interleaved timing, the JSON, table and plot."""
    import json

    from benchmarks import muon as bench

    assert bench.main(["--steps", "8", "--warmup", "2", "--eval-every", "4", "--adamw-lrs", "3e-3,6e-3",
                       "--muon-lrs", "0.02", "--seeds", "0,1", "--timing-pairs", "2", "--eval-windows", "8",
                       "--core", "-1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "muon.json").read_text())
    s = res["summary"]
    assert len(res["runs"]) == 2 + 1 + 2 and len(s["adamw_final"]) == len(s["muon_final"]) == 2
    assert s["adamw_step_ms"] > 0 and s["muon_step_ms"] > 0 and s["budget_tokens"] == 8 * 16 * 128
    assert set(s["update_ms"]) == {"adamw", "muon", "muon_ns_fp32"} and min(s["update_ms"].values()) > 0
    assert s["muon_ns_fp32_step_ms"] > 0 and 0 < s["ns_matmul_flops"] < s["model_flops_per_step"]
    md = (tmp_path / "muon.md").read_text()
    assert "| median step time" in md and "the optimizer update alone takes" in md
    assert (tmp_path / "muon.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
