"""Muon parity: jaxgpt's optax-assembled Muon (``jaxgpt/muon.py``) against ``torch.optim.Muon`` in torch_ref.

float64 is the referee throughout: a numpy float64 Newton-Schulz with torch's normalisation for (a), and a
torch_ref run in float64 with ``torch.optim.Muon``'s Newton-Schulz swapped for the same iteration in float64 (torch
hard-codes bf16; the swap keeps every other line of torch's Muon) for (b) and (c).

(a) the orthogonalisation alone, GPT-2-shaped matrices: bf16 distances of both sides from float64 compared
    (jaxgpt's <= ``NS_BF16_VS_TORCH`` x torch's), fp32 jaxgpt within ``NS_FP32_REL`` of float64;
(b) optimizer steps from the same grads and state, both parts;
(c) 20 train steps through ``make_train_step`` against torch_ref's loop: bf16 within the bound that torch's own
    bf16 noise (against the referee, its envelope over the same run) gives, as (a) shows both sides' noise alike; fp32
    against the float64 referee within ``MUON_TRAIN_FP32_LOSS_REL``;
(d) routing on both sides;
(e) gradient accumulation (here) and data-parallel / FSDP meshes (``test_muon_on_meshes``, slow) give the same step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from jaxgpt.muon import muon_labels, orthogonalize
from jaxgpt.optim import OptimConfig, make_optimizer
from jaxgpt.step import data_mesh, init_train_state, jit_grads, make_train_step
from jaxgpt.weights import params_to_ref
from torch_ref import train as ref_train

from conftest import on_device
from test_train_parity import CFG, MICRO_STEPS, SEQ, batches, build, jax_device, torch_model, without_key_bias
from tolerances import (MUON_ADAMW_PART_REL, MUON_STEP_FP32_REL, MUON_TRAIN_FP32_LOSS_REL, NS_BF16_REL,
                        NS_BF16_VS_TORCH, NS_FP32_REL, TRAIN_LOSS_ABS, TRAIN_PARAM_REL, muon_bf16_loss_bound)

COEFFS = (3.4445, -4.7750, 2.0315)
# c_proj, c_fc, mlp.c_proj, fused c_attn: GPT-2 124M's (slow: float64 numpy and bf16 torch take ~20 s on one core)
# and the mini preset's (C = 128), the default suite's
GPT2_SHAPES = [(768, 768), (768, 3072), (3072, 768), (768, 2304)]
MINI_SHAPES = [(128, 128), (128, 512), (512, 128), (128, 384)]
SHAPES = MINI_SHAPES + [pytest.param(s, marks=pytest.mark.slow) for s in GPT2_SHAPES]


def ns_float64(x: np.ndarray, steps: int = 5, eps: float = 1e-7, coeffs=COEFFS) -> np.ndarray:
    """torch.optim.Muon's Newton-Schulz, line for line, in float64 numpy: the referee."""
    a, b, c = coeffs
    g = np.asarray(x, np.float64)
    tall = g.shape[0] > g.shape[1]
    if tall:
        g = g.T
    g = g / max(np.linalg.norm(g), eps)
    for _ in range(steps):
        gram = g @ g.T
        g = a * g + (b * gram + c * gram @ gram) @ g
    return g.T if tall else g


def torch_ns_float64(grad, ns_coefficients, ns_steps, eps):
    """Stand-in for ``torch.optim._muon._zeropower_via_newtonschulz`` in the referee runs: the same iteration in
    float64 (torch's casts to bf16)."""
    return torch.from_numpy(ns_float64(grad.detach().cpu().numpy(), ns_steps, eps, ns_coefficients)).to(grad)


def momentum_like(shape, seed):
    """A gradient-like matrix: Gaussian with column scales over two decades (a spread spectrum)."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=shape) * 10.0 ** rng.uniform(-2, 0, size=shape[1])).astype(np.float32)


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# ---- (a) the orthogonalisation alone ---------------------------------------------------------------------------
# one jitted function for every shape and dtype (square matrices and their transposes share a compilation)
_orthogonalize = jax.jit(lambda v, dt: orthogonalize(v, OptimConfig(muon_ns_dtype=dt)), static_argnums=1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_newton_schulz_against_torch_and_float64(shape):
    x = momentum_like(shape, seed=shape[1])
    truth = ns_float64(x)
    torch_bf16 = torch.optim._muon._zeropower_via_newtonschulz(torch.from_numpy(x), COEFFS, 5, 1e-7).float().numpy()
    orth = _orthogonalize
    jax_bf16 = np.asarray(orth(jnp.asarray(x), "bfloat16"))
    jax_fp32 = np.asarray(orth(jnp.asarray(x), "float32"))
    d_torch, d_jax, d_fp32 = rel(torch_bf16, truth), rel(jax_bf16, truth), rel(jax_fp32, truth)
    print(f"\nNS {shape}: bf16 vs float64: torch {d_torch:.2e}, jaxgpt {d_jax:.2e}; jaxgpt fp32 {d_fp32:.2e}")
    assert jax_bf16.dtype == np.float32 and jax_bf16.shape == shape
    assert d_jax <= NS_BF16_VS_TORCH * d_torch
    assert d_torch <= NS_BF16_REL and d_jax <= NS_BF16_REL  # the noise (c)'s bound is derived from
    assert d_fp32 <= NS_FP32_REL
    # the orientation torch_ref relies on: NS(X^T) = NS(X)^T
    assert rel(np.asarray(orth(jnp.asarray(x.T), "float32")).T, truth) <= NS_FP32_REL


# ---- (b) optimizer steps from the same grads and state ----------------------------------------------------------
def reference_run(model, cfg, grads, *, float64: bool, monkeypatch):
    """torch_ref's Muon + AdamW on ``grads`` (a list of name -> array); float64: the referee (parameters, optimizer
    state and Newton-Schulz in float64)."""
    ref = torch_model(model, "cpu")
    with monkeypatch.context() as m:
        if float64:
            ref = ref.double()
            m.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", torch_ns_float64)
        opt = ref_train.make_optimizer(ref, cfg)
        for i, g in enumerate(grads):
            for name, p in ref.named_parameters():
                p.grad = torch.tensor(g[name], dtype=p.dtype)
            ref_train.update(ref, opt, cfg, i)
    return {k: v.detach().double().numpy() for k, v in ref.state_dict().items()}


def jax_run(model, cfg, grads):
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(cfg)

    @jax.jit
    def update(params, opt_state, g):
        updates, opt_state = optimizer.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = jax.jit(optimizer.init)(params)
    for g in grads:
        tree = jax.tree.map(jnp.zeros_like, params)
        flat = {k: v for k, v in nnx.to_flat_state(tree)}
        for path, var in flat.items():
            var.set_value(jax.device_put(g[ref_name(path)]))  # a copy: jnp.asarray compiles per shape
        params, opt_state = update(params, opt_state, nnx.from_flat_state(flat))
    return params_to_ref(params)


def ref_name(path) -> str:
    """jaxgpt path -> torch_ref state-dict name (kernel -> weight, scale -> weight, embedding -> weight)."""
    name = ".".join(str(k) for k in path)
    for a, b in ((".kernel", ".weight"), (".scale", ".weight"), (".embedding", ".weight")):
        name = name.replace(a, b)
    return name


def is_muon(name: str) -> bool:
    return ref_train.is_muon_matrix(name)


def fixed_grads(model, steps, seed=3):
    """Per step, gradients of a real loss scaled x(0.3, 3): clipping acts on some steps."""
    graphdef, params = nnx.split(model, nnx.Param)
    out = []
    for i, (x, y) in enumerate(batches(steps, seed=seed)):
        _, g = jit_grads(graphdef, params, x, y)
        out.append({k: np.asarray(v) * (3.0 if i % 2 else 0.3) for k, v in params_to_ref(g).items()})
    return out


@pytest.mark.parametrize("qkv", ["split", pytest.param("fused", marks=pytest.mark.slow)])
def test_optimizer_steps_on_fixed_gradients(qkv, monkeypatch):
    """3 steps (state from zero, then carried: momentum and Adam moments non-zero) with identical gradients:
    Muon matrices: each side's distance from the float64 referee, relative to the referee's movement; bf16 jaxgpt
    <= NS_BF16_VS_TORCH x torch's, fp32 jaxgpt <= MUON_STEP_FP32_REL. AdamW part: fp32 rounding of each other."""
    model = build()
    init = {k: np.asarray(v, np.float64) for k, v in params_to_ref(nnx.state(model, nnx.Param)).items()}
    grads = fixed_grads(model, 3)
    cfg = OptimConfig(name="muon", lr=3e-3, muon_lr=0.02, warmup_steps=1, decay_steps=3, weight_decay=0.1,
                      muon_weight_decay=0.1, grad_clip=1.0, muon_qkv=qkv)
    truth = reference_run(model, cfg, grads, float64=True, monkeypatch=monkeypatch)
    torch_bf16 = reference_run(model, cfg, grads, float64=False, monkeypatch=monkeypatch)
    jax_bf16 = jax_run(model, cfg, grads)
    jax_fp32 = jax_run(model, cfg.replace(muon_ns_dtype="float32"), grads)

    lines = []
    for name, t in truth.items():
        moved = np.linalg.norm(t - init[name])
        assert moved > 0, name
        d = {k: float(np.linalg.norm(v[name] - t) / moved)
             for k, v in (("torch", torch_bf16), ("jax", jax_bf16), ("fp32", jax_fp32))}
        lines.append(f"{name}: torch bf16 {d['torch']:.1e} jax bf16 {d['jax']:.1e} jax fp32 {d['fp32']:.1e}")
        if is_muon(name):
            assert d["jax"] <= NS_BF16_VS_TORCH * d["torch"], (name, d)
            assert d["fp32"] <= MUON_STEP_FP32_REL, (name, d)
        else:  # AdamW: no Newton-Schulz; all three agree to fp32 rounding of the parameters
            r = {k: float(np.abs(without_key_bias(name, v[name] - t)).max() / np.abs(t).max())
                 for k, v in (("torch", torch_bf16), ("jax", jax_bf16), ("fp32", jax_fp32))}
            assert max(r.values()) <= MUON_ADAMW_PART_REL, (name, r)
    print(f"\nmuon steps [{qkv}] distance / movement:\n  " + "\n  ".join(lines))


# ---- (c) 20 training steps --------------------------------------------------------------------------------------
TRAIN_CFG = OptimConfig(name="muon", lr=1e-3, muon_lr=0.02, warmup_steps=5, decay_steps=15, weight_decay=0.1,
                        muon_weight_decay=0.05, grad_clip=0.5)


def jax_train(model, cfg, data, device, micro_steps=MICRO_STEPS):
    with on_device(device):
        mesh = data_mesh([jax_device(device)])
        optimizer = make_optimizer(cfg)
        graphdef, state = init_train_state(model, optimizer, mesh=mesh)
        step = make_train_step(graphdef, optimizer, micro_steps=micro_steps, mesh=mesh)
        losses, lrs = [], []
        for x, y in data:
            state, m = step(state, x, y)
            losses.append(float(m["loss"]))
            lrs.append(float(m["lr"]))
    return losses, lrs, state


def test_muon_20_steps_bf16_newton_schulz(device, monkeypatch):
    """The default config (Newton-Schulz in bf16 on both sides): losses within the bound that torch's own bf16 noise,
    measured over the run against a float64-Newton-Schulz referee, gives (its envelope, not its running maximum:
    tolerances.py), both from torch's bf16 losses and from the referee's; a 10% larger Muon lr on the jaxgpt side
    must break that bound (it has teeth)."""
    data = batches(20)
    model = build()
    jax_losses, lrs, _ = jax_train(model, TRAIN_CFG, data, device)
    ref_losses = ref_train.train_steps(torch_model(model, device), data, TRAIN_CFG)
    with monkeypatch.context() as m:
        m.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", torch_ns_float64)
        referee = ref_train.train_steps(torch_model(model, "cpu"), data, TRAIN_CFG)
    np.testing.assert_allclose(lrs, [ref_train.get_lr(TRAIN_CFG, i) for i in range(20)], rtol=1e-6)
    assert jax_losses[-1] < jax_losses[0] - 0.1  # it learns
    bounds = muon_bf16_loss_bound(ref_losses, referee)
    diffs = [abs(a - b) for a, b in zip(jax_losses, ref_losses, strict=True)]
    from_referee = [abs(a - b) for a, b in zip(jax_losses, referee, strict=True)]
    envelope = max(abs(a - b) for a, b in zip(ref_losses, referee))
    print(f"\nmuon bf16 20 steps [{device}]: max loss |diff| {max(diffs):.2e}, jaxgpt's from the referee "
          f"{max(from_referee):.2e}, torch's bf16 noise (envelope) {envelope:.2e}, ratios "
          f"{max(diffs) / max(envelope, 1e-12):.2f} / {max(from_referee) / max(envelope, 1e-12):.2f}, bound "
          f"{bounds[-1]:.2e}; loss {jax_losses[0]:.3f} -> {jax_losses[-1]:.3f}")
    assert all(d <= b for d, b in zip(diffs, bounds)), list(zip(diffs, bounds))
    assert all(d <= b for d, b in zip(from_referee, bounds)), list(zip(from_referee, bounds))
    wrong, _, _ = jax_train(model, TRAIN_CFG.replace(muon_lr=1.1 * TRAIN_CFG.muon_lr), data, device)
    assert any(abs(a - b) > c for a, b, c in zip(wrong, ref_losses, bounds)), "the bound cannot tell a 10% lr error"


@pytest.mark.slow
def test_muon_20_steps_fp32_against_float64_referee(monkeypatch):
    """jaxgpt with Newton-Schulz in fp32 against torch_ref's fp32 training with torch.optim.Muon's Newton-Schulz in
    float64 (torch_ref's LayerNorm computes in fp32, so its model cannot run in float64; the referee is the
    orthogonalisation, the part that jaxgpt computes in fp32 and torch in bf16): the bound the other optimizers
    meet."""
    data = batches(20)
    model = build()
    jax_losses, _, state = jax_train(model, TRAIN_CFG.replace(muon_ns_dtype="float32"), data, "cpu")
    ref = torch_model(model, "cpu")
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", torch_ns_float64)
    ref_losses = ref_train.train_steps(ref, data, TRAIN_CFG)
    rels = [abs(a - b) / b for a, b in zip(jax_losses, ref_losses, strict=True)]
    print(f"\nmuon fp32 20 steps vs float64 referee: max loss rel diff {max(rels):.2e}")
    assert max(rels) <= MUON_TRAIN_FP32_LOSS_REL, rels


# ---- (d) routing ------------------------------------------------------------------------------------------------
MUON_NAMES = {f"h.{i}.{m}.weight" for i in range(CFG.n_layer)
              for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


def test_routing_both_sides():
    """Exactly the blocks' four hidden matrices go to Muon on both sides (wte, wpe, biases, LayerNorms to AdamW),
    and torch's Muon holds views of exactly those weights (split: three per c_attn)."""
    model = build()
    params = nnx.state(model, nnx.Param)
    labels = {ref_name(p): v.get_value() if hasattr(v, "get_value") else v
              for p, v in nnx.to_flat_state(muon_labels(params))}
    assert {k for k, v in labels.items() if v == "muon"} == MUON_NAMES
    assert {k for k, v in labels.items() if v == "adamw"} >= {"wte.weight", "wpe.weight", "ln_f.weight"}
    # jaxgpt's state: a momentum buffer for each Muon matrix, Adam moments for the rest, nothing else
    opt_state = jax.eval_shape(make_optimizer(OptimConfig(name="muon")).init, params)
    leaves = [(jax.tree_util.keystr(p), x.shape) for p, x in jax.tree_util.tree_leaves_with_path(opt_state)]
    n_muon = sum(1 for _ in MUON_NAMES)
    n_adam = len(labels) - n_muon
    assert sum(1 for p, s in leaves if "'muon'" in p and len(s) == 2) == n_muon
    assert sum(1 for p, s in leaves if "'adamw'" in p and len(s) >= 1) == 2 * n_adam
    for qkv, per_attn in (("split", 3), ("fused", 1)):
        ref = torch_model(model, "cpu")
        opt = ref_train.make_optimizer(ref, OptimConfig(name="muon", muon_qkv=qkv))
        weights = dict(ref.named_parameters())
        assert set(opt.muon_names) == MUON_NAMES
        held = [(n, w) for v, w, _ in opt.views for n, p in weights.items() if p is w]
        assert sorted({n for n, _ in held}) == sorted(MUON_NAMES)
        assert len(opt.views) == len(MUON_NAMES) + (per_attn - 1) * CFG.n_layer
        for view, w, cols in opt.views:  # each view aliases its weight's storage, transposed
            assert view.data_ptr() == w[:, cols].data_ptr() and view.shape == w[:, cols].T.shape
        adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
        assert adamw == {id(p) for n, p in weights.items() if n not in MUON_NAMES}


def test_routing_test_would_catch_wte_in_muon(monkeypatch):
    """The routing checks above fail when wte is sent to Muon (on either side)."""
    import jaxgpt.muon as jm

    monkeypatch.setattr(jm, "MUON_MATRIX", __import__("re").compile(r"^(wte\.embedding|h\.\d+\.mlp\.c_fc\.kernel)$"))
    monkeypatch.setattr(ref_train, "MUON_MATRICES", ("mlp.c_fc.weight",))
    with pytest.raises(AssertionError):
        test_routing_both_sides()


# ---- (e) gradient accumulation ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_muon_grad_accumulation_matches_one_batch():
    """4 micro-steps of 4 sequences and 1 step of 16 give the same Muon training (fp32 Newton-Schulz: bf16
    would round the two sides' 1e-7 gradient differences to different bf16 neighbours)."""
    data = batches(5, seed=11)
    full = [(x.reshape(1, -1, SEQ), y.reshape(1, -1, SEQ)) for x, y in data]
    cfg = TRAIN_CFG.replace(muon_ns_dtype="float32")
    acc, _, s_acc = jax_train(build(), cfg, data, "cpu")
    one, _, s_one = jax_train(build(), cfg, full, "cpu", micro_steps=1)
    diffs = [abs(a - b) for a, b in zip(acc, one)]
    pa, po = params_to_ref(s_acc.params), params_to_ref(s_one.params)
    prel = max(float(np.abs(without_key_bias(k, pa[k] - po[k])).max() / np.abs(po[k]).max()) for k in po)
    print(f"\nmuon 4x4 vs 1x16, 5 steps: max loss |diff| {max(diffs):.2e}, max param rel {prel:.2e}")
    assert max(diffs) <= TRAIN_LOSS_ABS and prel <= TRAIN_PARAM_REL


@pytest.mark.slow
def test_muon_on_meshes(tmp_path):
    """data=2,fsdp=2 and fsdp=4 on 4 host devices: the same losses and gradient norms as one device, Muon's
    momentum sharded like its matrix (tests/mesh_worker.py with MESH_WORKER_OPTIM)."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from tests import mesh_worker

    optim = dict(name="muon", lr=1e-2, muon_lr=0.02, warmup_steps=2, decay_steps=10, muon_ns_dtype="float32")
    np.save(tmp_path / "batches.npy", mesh_worker.batches(10))
    env = dict(os.environ, MESH_WORKER_OPTIM=json.dumps(optim), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-m", "tests.mesh_worker", "layouts", str(tmp_path / "batches.npy"), "-",
                          "data=1@1", "data=4", "data=2,fsdp=2", "fsdp=4"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    layouts = json.loads(line[-1].removeprefix("RESULT "))["layouts"]
    one = layouts.pop("data=1@1")
    assert one["losses"][-1] < one["losses"][0] - 0.5
    for name, v in layouts.items():
        print(f"\nmuon {name}: max loss |diff| vs 1 device {np.max(np.abs(np.subtract(v['losses'], one['losses']))):.1e}")
        np.testing.assert_allclose(v["losses"], one["losses"], rtol=0, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(v["norms"], one["norms"], rtol=1e-4, err_msg=name)
        assert v["bad"] == [], (name, v["bad"][:5])
