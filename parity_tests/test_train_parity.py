"""Training parity: jaxgpt's optax chains + jitted train step against torch_ref's torch.optim loop.

Same initial weights (jaxgpt's, copied with ``jaxgpt.weights.to_torch_state_dict``), same batches, fp32 with
matmul precision "highest" in both (conftest). Measured:

* per-step loss, absolute difference (``TRAIN_LOSS_ABS``);
* final parameters, per tensor: ``max|jax - torch| / max|torch|`` (``TRAIN_PARAM_REL``);
* gradients (accumulated over micro-steps vs one batch), max absolute difference (``GRAD_ACCUM_ABS``).

One coordinate set is left out of the parameter comparison: the *key* bias (``c_attn.bias[C:2C]``). Its
gradient is zero in exact arithmetic (q . b_k adds the same number to every score of a query, and softmax
is shift invariant), so both frameworks compute roundoff (~1e-12) there, and Adam-type optimizers, which
divide by the gradient's own scale, turn that roundoff into lr-sized steps of arbitrary sign. The key bias
never changes the loss; ``test_key_bias_gradient_is_roundoff`` checks the premise.

The update rules themselves are compared without any model in ``test_update_rule_on_fixed_gradients``:
identical gradients go into both optimizers, so only the rule can differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT
from jaxgpt.optim import OptimConfig, make_optimizer
from jaxgpt.precision import Policy
from jaxgpt.step import data_mesh, init_train_state, jit_grads, make_train_step
from jaxgpt.weights import params_to_ref, to_torch_state_dict
from torch_ref import train as ref_train
from torch_ref.model import GPT as RefGPT

from conftest import on_device
from tolerances import GRAD_ACCUM_ABS, TRAIN_LOSS_ABS, TRAIN_PARAM_REL

CFG = GPTConfig.preset("tiny", vocab_size=512)  # 2 layers, 2 heads, C = 32, block 64
POLICY = Policy(matmul_precision="highest")
C = CFG.n_embd
MICRO_STEPS, MICRO_BATCH, SEQ = 4, 4, 32


def build(seed: int = 0, policy: Policy = POLICY) -> GPT:
    """GPT-2-like random parameters drawn in numpy (no eager JAX ops); biases and LayerNorm scales get a
    little noise so that no parameter starts at exactly 0 or 1."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(CFG, policy=policy, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(state):
        shape, name = var.get_value().shape, path[-1]
        value = rng.normal(0.0, 0.02, shape) + (name == "scale")
        var.set_value(jax.device_put(np.asarray(value, np.float32)))  # no eager op compiled per shape
    return nnx.merge(graphdef, state)


def batches(steps: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """Arithmetic progressions mod V (x_{t+1} = x_t + 3): learnable, so losses fall and gradients carry signal."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, CFG.vocab_size, (MICRO_STEPS, MICRO_BATCH, 1))
        seq = (start + 3 * np.arange(SEQ + 1)) % CFG.vocab_size
        out.append((seq[..., :-1].astype(np.int32), seq[..., 1:].astype(np.int32)))
    return out


def torch_model(model: GPT, device: str) -> RefGPT:
    ref = RefGPT(CFG)
    ref.load_state_dict(to_torch_state_dict(model))
    return ref.to(device)


def jax_device(device: str):
    return jax.devices("gpu" if device == "cuda" else "cpu")[0]


def without_key_bias(name: str, a: np.ndarray) -> np.ndarray:
    return np.concatenate([a[:C], a[2 * C:]]) if name.endswith("attn.c_attn.bias") else a


def param_rel_diffs(jax_params, ref: RefGPT) -> dict[str, float]:
    """Per tensor: max|jax - torch| / max|torch| (key bias left out, see the module docstring)."""
    mine = params_to_ref(jax_params)
    out = {}
    for name, t in ref.state_dict().items():
        a = without_key_bias(name, mine[name])
        b = without_key_bias(name, t.detach().cpu().numpy())
        out[name] = float(np.abs(a - b).max() / np.abs(b).max())
    return out


def report(label: str, loss_diffs, rel: dict[str, float]) -> None:
    worst = max(rel, key=rel.get)
    print(f"\n{label}: max loss |diff| {max(loss_diffs):.2e}; max param rel diff {rel[worst]:.2e} ({worst})")


# ---- AdamW through the full train step ---------------------------------------------------------------------
def test_adamw_20_steps(device):
    """20 AdamW steps (4 micro-steps each) through ``make_train_step``: warmup, cosine and the floor of the
    schedule, decoupled decay on the >= 2-D params, and clipping active on some steps."""
    cfg = OptimConfig(name="adamw", lr=1e-3, warmup_steps=5, decay_steps=15, weight_decay=0.1, grad_clip=0.5)
    data = batches(20)
    model = build()
    ref = torch_model(model, device)
    with on_device(device):
        mesh = data_mesh([jax_device(device)])
        optimizer = make_optimizer(cfg)
        graphdef, state = init_train_state(model, optimizer, mesh=mesh)
        step = make_train_step(graphdef, optimizer, micro_steps=MICRO_STEPS, mesh=mesh)
        jax_losses, norms, lrs = [], [], []
        for x, y in data:
            state, m = step(state, x, y)
            jax_losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
            lrs.append(float(m["lr"]))
    ref_losses = ref_train.train_steps(ref, data, cfg)

    np.testing.assert_allclose(lrs, [ref_train.get_lr(cfg, i) for i in range(20)], rtol=1e-6)
    assert any(n > cfg.grad_clip for n in norms) and any(n < cfg.grad_clip for n in norms), norms
    assert jax_losses[-1] < jax_losses[0] - 0.1  # it learns
    loss_diffs = [abs(a - b) for a, b in zip(jax_losses, ref_losses, strict=True)]
    rel = param_rel_diffs(state.params, ref)
    report(f"adamw 20 steps [{device}]", loss_diffs, rel)
    assert max(loss_diffs) <= TRAIN_LOSS_ABS, loss_diffs
    assert max(rel.values()) <= TRAIN_PARAM_REL, {k: v for k, v in rel.items() if v > TRAIN_PARAM_REL}


# ---- AdamW in bf16: each framework's distance from its own fp32 run ------------------------------------------------
ADAMW_20 = OptimConfig(name="adamw", lr=1e-3, warmup_steps=5, decay_steps=15, weight_decay=0.1, grad_clip=0.5)


def jax_adamw_run(policy: Policy, data, device: str) -> tuple[list[float], dict[str, np.ndarray]]:
    """The 20 AdamW steps of test_adamw_20_steps under ``policy``: each step's loss and the final parameters."""
    with on_device(device):
        mesh = data_mesh([jax_device(device)])
        optimizer = make_optimizer(ADAMW_20)
        graphdef, state = init_train_state(build(policy=policy), optimizer, mesh=mesh)
        step = make_train_step(graphdef, optimizer, micro_steps=MICRO_STEPS, mesh=mesh)
        losses = []
        for x, y in data:
            state, m = step(state, x, y)
            losses.append(float(m["loss"]))
    return losses, params_to_ref(state.params)


def torch_adamw_run(data, device: str, *, bf16: bool) -> tuple[list[float], dict[str, np.ndarray]]:
    """The same steps in torch_ref from the same weights, the forward under torch.autocast(bf16) when ``bf16`` (the
    forward only, as torch's AMP recipe has it: with the optimizer step inside autocast too, CPU autocast moved
    torch's 20-step losses from its fp32 run by up to 7.2e-2, against 8.4e-5 forward-only)."""
    ref = torch_model(build(), device)
    if bf16:
        forward = ref.forward

        def autocast_forward(*args, **kwargs):
            with torch.autocast(device, dtype=torch.bfloat16):
                return forward(*args, **kwargs)
        ref.forward = autocast_forward
    losses = ref_train.train_steps(ref, data, ADAMW_20)
    return losses, {k: t.detach().cpu().numpy() for k, t in ref.state_dict().items()}


def max_param_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """The largest per-tensor max|a - b| / max|b| (key bias left out, see the module docstring)."""
    return max(float(np.abs(without_key_bias(k, a[k]) - without_key_bias(k, b[k])).max()
                     / np.abs(without_key_bias(k, b[k])).max()) for k in b)


@pytest.fixture(scope="module")
def adamw_fp32_runs():
    """The fp32 runs both frameworks' bf16 runs are measured from (per device), computed once."""
    cache = {}

    def get(device):
        if device not in cache:
            data = batches(20)
            cache[device] = dict(data=data, jax=jax_adamw_run(POLICY, data, device),
                                 torch=torch_adamw_run(data, device, bf16=False),
                                 torch_bf16=torch_adamw_run(data, device, bf16=True))
        return cache[device]
    return get


@pytest.mark.slow  # ~2-3 min on 2 cores: four 20-step runs
# bf16-logits: bf16 with bf16 logits; bf16-gelu-bf16h: bf16 with gelu_h_dtype: bfloat16 (h kept in bf16)
@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast", "bf16-logits", "bf16-gelu-bf16h"])
def test_adamw_20_steps_bf16_within_torch_autocast_noise(device, precision, adamw_fp32_runs, parity_report):
    """20 AdamW steps (those of test_adamw_20_steps) under a bf16 policy move jaxgpt's losses and parameters from
    its own fp32 run by no more than torch.autocast moves torch_ref's from torch's fp32 run, up to
    tolerances.BF16_TRAIN_NOISE_FACTOR (the envelope of torch's per-step loss distance: see there); and jaxgpt's
    bf16 losses sit within the same bound of torch's autocast losses."""
    from tolerances import BF16_TRAIN_NOISE_FACTOR, bf16_train_loss_bound

    runs = adamw_fp32_runs(device)
    (j32, p_j32), (t32, p_t32), (t16, p_t16) = runs["jax"], runs["torch"], runs["torch_bf16"]
    named = {"bf16-logits": ("bf16", {"logits_dtype": "bfloat16"}),
             "bf16-gelu-bf16h": ("bf16", {"kernels": {"mlp": "pallas-gemm"}, "gelu_h_dtype": "bfloat16"})}.get(precision, (precision, {}))
    policy = Policy.named(named[0], matmul_precision="highest", **named[1])
    j16, p_j16 = jax_adamw_run(policy, runs["data"], device)
    bound = bf16_train_loss_bound(t32, t16)
    own = [abs(a - b) for a, b in zip(j16, j32, strict=True)]  # jaxgpt bf16 from jaxgpt fp32
    torch_own = [abs(a - b) for a, b in zip(t16, t32, strict=True)]
    vs_torch = [abs(a - b) for a, b in zip(j16, t16, strict=True)]  # jaxgpt bf16 from torch autocast
    rel_own, rel_torch = max_param_rel(p_j16, p_j32), max_param_rel(p_t16, p_t32)
    rel_vs_torch = max_param_rel(p_j16, p_t16)
    parity_report(f"adamw20/{precision}/{device}", loss_from_own_fp32=max(own), torch_loss_from_fp32=max(torch_own),
                  loss_from_torch_autocast=max(vs_torch), param_rel_from_own_fp32=rel_own,
                  torch_param_rel_from_fp32=rel_torch, param_rel_from_torch_autocast=rel_vs_torch,
                  loss_envelope_ratio=max(own) / max(torch_own), param_ratio=rel_own / rel_torch)
    print(f"\nadamw 20 steps {precision} [{device}]: loss from own fp32 {max(own):.2e} (torch {max(torch_own):.2e}), "
          f"from torch autocast {max(vs_torch):.2e}; params from own fp32 {rel_own:.2e} (torch {rel_torch:.2e}), "
          f"from torch autocast {rel_vs_torch:.2e}")
    assert j16[-1] < j16[0] - 0.1  # it learns
    assert all(d <= b for d, b in zip(own, bound)), [(d, b) for d, b in zip(own, bound)]
    assert all(d <= b for d, b in zip(vs_torch, bound)), [(d, b) for d, b in zip(vs_torch, bound)]
    assert rel_own <= BF16_TRAIN_NOISE_FACTOR * rel_torch + TRAIN_PARAM_REL, (rel_own, rel_torch)


# ---- every other optimizer: the train step's pieces (jit_grads + the optax chain) ------------------------------
# Learning rates: big enough to move every parameter by > 1e-3 in 5 steps, small enough that the differences
# stay well inside TRAIN_PARAM_REL. They grow with lr (adam: 8.8e-6 / 2.7e-5 / 8.8e-5 at lr 1e-3 / 3e-3 / 1e-2;
# adagrad 8e-6 at 1e-2 but 9e-4 at 3e-2, where its first steps of lr * sign(g) swamp 0.02-scale weights) and
# are largest for RMSprop, whose first steps are lr / sqrt(1 - alpha) = 10 lr and which divides small
# gradients by their own (roundoff-affected) RMS: 4e-5 at lr 3e-4, 6e-5 at 5e-4 and 1e-3.
OTHERS = {
    "adam": OptimConfig(name="adam", lr=3e-3),
    "sgd": OptimConfig(name="sgd", lr=0.5, momentum=0.9),
    "sgd-nesterov": OptimConfig(name="sgd", lr=0.5, momentum=0.9, nesterov=True),
    "adagrad": OptimConfig(name="adagrad", lr=1e-2),
    "rmsprop": OptimConfig(name="rmsprop", lr=3e-4),
}


@pytest.mark.parametrize("which", list(OTHERS))
def test_optimizer_5_steps(device, which):
    cfg = OTHERS[which].replace(warmup_steps=2, decay_steps=4, weight_decay=0.1, grad_clip=1.0)
    data = batches(5)
    model = build()
    ref = torch_model(model, device)
    with on_device(device):
        graphdef, params = nnx.split(model, nnx.Param)  # uncommitted: placed by on_device
        optimizer = make_optimizer(cfg)

        @jax.jit
        def update(params, opt_state, grads):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        opt_state = jax.jit(optimizer.init)(params)
        jax_losses = []
        for x, y in data:
            loss, grads = jit_grads(graphdef, params, x, y)
            params, opt_state = update(params, opt_state, grads)
            jax_losses.append(float(loss))
    ref_losses = ref_train.train_steps(ref, data, cfg)

    loss_diffs = [abs(a - b) for a, b in zip(jax_losses, ref_losses, strict=True)]
    rel = param_rel_diffs(params, ref)
    report(f"{which} 5 steps [{device}]", loss_diffs, rel)
    moved = max(np.abs(v - w).max() for v, w in zip(params_to_ref(params).values(), params_to_ref(model).values()))
    assert moved > 1e-3  # the steps were big enough to mean something
    assert max(loss_diffs) <= TRAIN_LOSS_ABS, loss_diffs
    assert max(rel.values()) <= TRAIN_PARAM_REL, {k: v for k, v in rel.items() if v > TRAIN_PARAM_REL}


# ---- gradients ---------------------------------------------------------------------------------------------
def test_grad_accumulation(device):
    """Mean of 4 micro-batch gradients == the full-batch gradient: jax vs jax, and torch_ref's accumulation
    loop vs jax's full batch."""
    (x, y), = batches(1, seed=7)
    model = build()
    graphdef, params = nnx.split(model, nnx.Param)
    with on_device(device):
        _, acc = jit_grads(graphdef, params, x, y)
        _, full = jit_grads(graphdef, params, x.reshape(1, -1, SEQ), y.reshape(1, -1, SEQ))
    acc, full = params_to_ref(acc), params_to_ref(full)
    ref = torch_model(model, device)
    ref_train.accumulate_grads(ref, torch.as_tensor(x, device=device, dtype=torch.long),
                               torch.as_tensor(y, device=device, dtype=torch.long))
    ref_grads = {k: p.grad.detach().cpu().numpy() for k, p in ref.named_parameters()}
    jj = max(np.abs(acc[k] - full[k]).max() for k in full)
    tj = max(np.abs(ref_grads[k] - full[k]).max() for k in full)
    print(f"\ngrad accumulation [{device}]: jax 4x4 vs 1x16 {jj:.2e}; torch 4x4 vs jax 1x16 {tj:.2e}; "
          f"max |grad| {max(np.abs(g).max() for g in full.values()):.2e}")
    assert jj <= GRAD_ACCUM_ABS
    assert tj <= GRAD_ACCUM_ABS


def test_key_bias_gradient_is_roundoff(device):
    """The premise for leaving the key bias out of the parameter comparison: its gradient is ~0 in both."""
    (x, y), = batches(1, seed=7)
    model = build()
    graphdef, params = nnx.split(model, nnx.Param)
    with on_device(device):
        _, grads = jit_grads(graphdef, params, x, y)
    grads = params_to_ref(grads)
    ref = torch_model(model, device)
    ref_train.accumulate_grads(ref, torch.as_tensor(x, device=device, dtype=torch.long),
                               torch.as_tensor(y, device=device, dtype=torch.long))
    for i in range(CFG.n_layer):
        name = f"h.{i}.attn.c_attn.bias"
        for g in (grads[name], ref.get_parameter(name).grad.cpu().numpy()):
            assert np.abs(g[C:2 * C]).max() <= 1e-6 * np.abs(g).max()  # key part: roundoff
            assert np.abs(g[:C]).max() > 1e-3 * np.abs(g).max()  # query part: a real gradient


# ---- the update rules alone ----------------------------------------------------------------------------------
RULES = {
    "adamw": OptimConfig(name="adamw", lr=1e-2),
    "adam": OptimConfig(name="adam", lr=1e-2),
    "sgd": OptimConfig(name="sgd", lr=0.1),
    "sgd-nesterov": OptimConfig(name="sgd", lr=0.1, nesterov=True),
    "sgd-plain": OptimConfig(name="sgd", lr=0.1, momentum=0.0),
    "adagrad": OptimConfig(name="adagrad", lr=1e-2),
    "adagrad-init": OptimConfig(name="adagrad", lr=1e-2, adagrad_initial_accumulator=0.1),
    "rmsprop": OptimConfig(name="rmsprop", lr=1e-3),
}


class TwoParams(torch.nn.Module):
    def __init__(self, weight: np.ndarray, bias: np.ndarray):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(weight))
        self.bias = torch.nn.Parameter(torch.tensor(bias))


def fixed_gradients(steps: int) -> list[dict[str, np.ndarray]]:
    """Gradients spanning 1e-9 .. 1 in magnitude, some exactly 0, scaled so that clipping acts on some steps."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(steps):
        g = {k: (rng.normal(size=s) * 10.0 ** rng.uniform(-9, 0, size=s)).astype(np.float32)
             for k, s in (("weight", (16, 8)), ("bias", (8,)))}
        g["weight"][0] = 0.0
        g = {k: v * (3.0 if i % 2 else 0.3) for k, v in g.items()}
        out.append(g)
    return out


@pytest.mark.parametrize("which", list(RULES))
def test_update_rule_on_fixed_gradients(which):
    """Identical gradients into both optimizers for 10 steps: the parameters agree to float rounding."""
    cfg = RULES[which].replace(warmup_steps=3, decay_steps=8, weight_decay=0.1, grad_clip=1.0)
    rng = np.random.default_rng(1)
    init = {"weight": rng.normal(0, 0.5, (16, 8)).astype(np.float32),
            "bias": rng.normal(0, 0.5, (8,)).astype(np.float32)}
    grads = fixed_gradients(10)

    optimizer = make_optimizer(cfg)
    params = {k: jnp.asarray(v) for k, v in init.items()}
    opt_state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    for g in grads:
        updates, opt_state = update({k: jnp.asarray(v) for k, v in g.items()}, opt_state, params)
        params = optax.apply_updates(params, updates)

    module = TwoParams(init["weight"], init["bias"])
    ref_opt = ref_train.make_optimizer(module, cfg)
    for i, g in enumerate(grads):
        for name, p in module.named_parameters():
            p.grad = torch.tensor(g[name])
        ref_train.update(module, ref_opt, cfg, i)

    rel = {}
    for name, p in module.named_parameters():
        ref = p.detach().numpy()
        rel[name] = float(np.abs(np.asarray(params[name]) - ref).max() / np.abs(ref).max())
        assert np.abs(ref - init[name]).max() > 1e-3  # it moved
    print(f"\nrule {which}: max param rel diff {max(rel.values()):.2e}")
    assert max(rel.values()) <= 1e-6, rel


def test_library_defaults_differ():
    """The defaults the docstring table of jaxgpt.optim warns about: optax's and torch's Adagrad and RMSprop
    are different rules out of the box, which is why both are configured explicitly."""
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(64,)).astype(np.float32)
    grads = [(rng.normal(size=(64,)) * 10.0 ** rng.uniform(-6, 0, size=64)).astype(np.float32) for _ in range(5)]

    def run_optax(opt):
        w, state = jnp.asarray(w0), opt.init(jnp.asarray(w0))
        for g in grads:
            u, state = opt.update(jnp.asarray(g), state, w)
            w = w + u
        return np.asarray(w)

    def run_torch(cls, **kw):
        w = torch.nn.Parameter(torch.tensor(w0))
        opt = cls([w], lr=1e-2, **kw)
        for g in grads:
            w.grad = torch.tensor(g)
            opt.step()
        return w.detach().numpy()

    for optax_w, torch_w in [(run_optax(optax.adagrad(1e-2)), run_torch(torch.optim.Adagrad)),
                             (run_optax(optax.rmsprop(1e-2)), run_torch(torch.optim.RMSprop))]:
        assert np.abs(optax_w - torch_w).max() > 1e-3


# ---- a character model: nanoGPT's shakespeare_char recipe, step by step --------------------------------------------
def test_char_model_nanogpt_recipe_20_steps(device, tmp_path):
    """configs/shakespeare-char-cpu.yaml's model (4 layers, C = 128, 65 characters, no biases) from jaxgpt's own
    initialisation, on the recipe's real batches of tiny Shakespeare characters (jaxgpt.data's loader), with its
    optimizer (AdamW lr 1e-3, beta2 0.99, decay 0.1, clip 1.0; warmup 5 and a cosine to 1e-4 at step 20 so the
    20 steps see the whole schedule): every step's loss and the final parameters agree with torch_ref."""
    import os
    from pathlib import Path

    from jaxgpt import data as data_lib
    from jaxgpt.train import TrainConfig
    from jaxgpt.train.run import build_model
    from tolerances import CHAR_TRAIN_PARAM_REL

    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
    text = Path(os.environ.get("JAXGPT_SHAKESPEARE", shared))
    if not text.is_file():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"tiny Shakespeare not at {text}")
    recipe = TrainConfig.load(Path(__file__).resolve().parents[1] / "configs" / "shakespeare-char-cpu.yaml")
    shards = data_lib.prepare([str(text)], tmp_path / "char", tokenizer="char", name="shakespeare", verbose=False)
    loader = data_lib.DataLoader(shards, "train", recipe.batch_size, recipe.seq_len, mode="random", seed=recipe.seed)
    data = [tuple(a.reshape(1, recipe.batch_size, recipe.seq_len) for a in loader.next_batch()) for _ in range(20)]
    cfg = recipe.optim.replace(warmup_steps=5, decay_steps=20)
    model = build_model(recipe, POLICY)  # jaxgpt's init of the recipe's seed, as a run starts
    assert model.config.vocab_rows == 65 and not model.config.bias
    ref = RefGPT(model.config)
    ref.load_state_dict(to_torch_state_dict(model))
    ref = ref.to(device)
    with on_device(device):
        mesh = data_mesh([jax_device(device)])
        optimizer = make_optimizer(cfg)
        graphdef, state = init_train_state(model, optimizer, mesh=mesh)
        step = make_train_step(graphdef, optimizer, micro_steps=1, mesh=mesh)
        jax_losses = []
        for x, y in data:
            state, m = step(state, x, y)
            jax_losses.append(float(m["loss"]))
    ref_losses = ref_train.train_steps(ref, data, cfg)

    assert jax_losses[0] > 4.0 and jax_losses[-1] < 3.0  # from ln 65 = 4.17 down: it learns characters
    loss_diffs = [abs(a - b) for a, b in zip(jax_losses, ref_losses, strict=True)]
    mine = params_to_ref(state.params)
    rel = {k: float(np.abs(mine[k] - t.detach().cpu().numpy()).max() / np.abs(t.detach().cpu().numpy()).max())
           for k, t in ref.state_dict().items()}
    report(f"char model 20 steps [{device}]", loss_diffs, rel)
    assert max(loss_diffs) <= TRAIN_LOSS_ABS, loss_diffs
    assert max(rel.values()) <= CHAR_TRAIN_PARAM_REL, {k: v for k, v in rel.items() if v > CHAR_TRAIN_PARAM_REL}
