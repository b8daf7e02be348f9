"""jaxgpt.optim: the build-nanogpt schedule, the weight-decay mask, every optimizer, config validation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxgpt.config import ConfigError, GPTConfig
from jaxgpt.model import GPT
from jaxgpt.optim import OPTIMIZERS, OptimConfig, current_lr, decay_mask, lr_schedule, make_optimizer

CFG = GPTConfig.preset("tiny", vocab_size=512)


def nanogpt_get_lr(it: int, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """build-nanogpt train_gpt2.py's get_lr, verbatim."""
    if it < warmup_steps:
        return max_lr * (it + 1) / warmup_steps
    if it > max_steps:
        return min_lr
    decay_ratio = (it - warmup_steps) / (max_steps - warmup_steps)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (max_lr - min_lr)


# ---- schedule --------------------------------------------------------------------------------------------
def test_schedule_is_build_nanogpt():
    cfg = OptimConfig()  # lr 6e-4, min 6e-5, warmup 715, decay 19073: build-nanogpt's numbers
    sched = lr_schedule(cfg)
    steps = np.array([0, 1, 357, 713, 714, 715, 716, 5000, 9894, 19072, 19073, 19074, 25000])
    steps = np.concatenate([steps, np.arange(0, 20000, 101)])
    got = np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(steps)))
    want = np.array([nanogpt_get_lr(int(s), 6e-4, 6e-5, 715, 19073) for s in steps])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    assert float(sched(0)) == pytest.approx(6e-4 / 715, rel=1e-6)  # warmup starts at lr / warmup, not 0
    assert float(sched(714)) == pytest.approx(6e-4, rel=1e-6)  # the last warmup step reaches the peak
    assert float(sched(715)) == pytest.approx(6e-4, rel=1e-6)  # the cosine starts at the peak
    assert float(sched(19073)) == pytest.approx(6e-5, rel=1e-6)  # ends at 10% of the max
    assert float(sched(10**6)) == pytest.approx(6e-5, rel=1e-6)  # and stays there
    tail = got[13:][steps[13:] >= 715]
    assert np.all(np.diff(tail) <= 1e-12)  # non-increasing after warmup


def test_schedule_variants():
    const = lr_schedule(OptimConfig(schedule="constant", lr=1e-3, warmup_steps=10))
    assert [float(const(s)) for s in (0, 9, 10, 10**5)] == pytest.approx([1e-4, 1e-3, 1e-3, 1e-3])
    no_warmup = lr_schedule(OptimConfig(lr=1e-3, warmup_steps=0, decay_steps=100, min_lr_ratio=0.0))
    assert [float(no_warmup(s)) for s in (0, 50, 100)] == pytest.approx([1e-3, 5e-4, 0.0], abs=1e-9)


# ---- weight-decay mask -----------------------------------------------------------------------------------
DECAYED = {"wte.embedding", "wpe.embedding"} | {
    f"h.{i}.{m}.kernel" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


@pytest.fixture(scope="module")
def tiny():
    """The tiny GPT's graph and GPT-2-like parameters drawn in numpy (no eager JAX ops, no init compile)."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    for path, var in nnx.to_flat_state(params):
        shape, name = var.get_value().shape, path[-1]
        var.set_value(jnp.asarray(rng.normal(0.0, 0.02, shape) + (name == "scale"), jnp.float32))
    return graphdef, params


def _names(tree) -> dict[str, object]:
    return {".".join(str(k) for k in path): v.get_value() for path, v in nnx.to_flat_state(tree)}


def test_decay_mask_is_exactly_the_matrices(tiny):
    _, params = tiny
    mask = _names(decay_mask(params))
    assert {k for k, v in mask.items() if v} == DECAYED
    not_decayed = {k for k, v in mask.items() if not v}
    assert not_decayed and all(k.endswith((".bias", ".scale")) for k in not_decayed)
    assert len(not_decayed) == 2 * 8 + 2  # per block: 4 Linear biases + 2 LayerNorms x (scale, bias); ln_f


def first_update(opt, grads, params):
    """The first update of ``opt`` (jitted: one compile instead of hundreds of eager ops)."""
    return jax.jit(lambda g, p: opt.update(g, opt.init(p), p)[0])(grads, params)


def test_adamw_decays_only_masked_params(tiny):
    """Zero gradient: AdamW's update is the decoupled decay alone, -lr * wd * p on the mask, 0 elsewhere."""
    _, params = tiny
    cfg = OptimConfig(lr=1e-2, weight_decay=0.5, warmup_steps=0, decay_steps=10)
    updates = first_update(make_optimizer(cfg), jax.tree.map(jnp.zeros_like, params), params)
    upd, par = _names(updates), _names(params)
    for k in par:
        want = -1e-2 * 0.5 * par[k] if k in DECAYED else np.zeros_like(par[k])
        np.testing.assert_allclose(upd[k], want, rtol=1e-6, atol=1e-12, err_msg=k)


def test_grad_clip_by_global_norm():
    params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,))}
    cfg = OptimConfig(name="sgd", lr=1.0, momentum=0.0, weight_decay=0.0, schedule="constant", warmup_steps=0,
                      grad_clip=1.0)
    big = jax.tree.map(lambda p: jnp.full(p.shape, 3.0), params)
    updates = first_update(make_optimizer(cfg), big, params)
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-5)
    small = jax.tree.map(lambda p: jnp.full(p.shape, 1e-5), params)
    updates = first_update(make_optimizer(cfg), small, params)
    np.testing.assert_allclose(np.asarray(jax.tree.leaves(updates)[0]), -1e-5, rtol=1e-6)  # untouched
    updates = first_update(make_optimizer(cfg.replace(grad_clip=0.0)), big, params)
    assert float(optax.tree.norm(updates)) == pytest.approx(float(optax.tree.norm(big)), rel=1e-5)


# ---- every optimizer trains ------------------------------------------------------------------------------
LRS = {"adamw": 3e-3, "adam": 3e-3, "sgd": 0.5, "adagrad": 3e-2, "rmsprop": 1e-3, "muon": 3e-3}  # muon: its AdamW part


@pytest.fixture(scope="module")
def memorise(tiny):
    """A batch to memorise and its jitted loss-and-gradient (one compile shared by every optimizer)."""
    graphdef, params = tiny
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, CFG.vocab_size, (4, 32)), jnp.int32)
    y = jnp.roll(x, -1, axis=1)
    return jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(x, y)))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_reduces_loss(tiny, memorise, name):
    _, params = tiny
    cfg = OptimConfig(name=name, lr=LRS[name], warmup_steps=2, decay_steps=20)
    opt = make_optimizer(cfg)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = jax.jit(opt.init)(params)
    assert float(current_lr(opt_state)) == pytest.approx(float(lr_schedule(cfg)(0)))
    losses = []
    for i in range(8):
        loss, grads = memorise(params)
        params, opt_state = update(params, opt_state, grads)
        assert float(current_lr(opt_state)) == pytest.approx(float(lr_schedule(cfg)(i)), rel=1e-6)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.05, losses


# ---- validation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, field", [
    (dict(name="lion"), "name"),
    (dict(lr=0.0), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(warmup_steps=100, decay_steps=100), "decay_steps"),
    (dict(schedule="linear"), "schedule"),
    (dict(beta1=1.0), "beta1"),
    (dict(beta2=-0.1), "beta2"),
    (dict(eps=0.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(momentum=1.0), "momentum"),
    (dict(nesterov=True), "nesterov"),  # adamw has no nesterov here
    (dict(name="sgd", momentum=0.0, nesterov=True), "nesterov"),
    (dict(rmsprop_alpha=1.0), "rmsprop_alpha"),
    (dict(adagrad_initial_accumulator=-1.0), "adagrad_initial_accumulator"),
    (dict(grad_clip=-1.0), "grad_clip"),
])
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=rf"OptimConfig\.{field} = "):
        OptimConfig.from_dict(changes)
    with pytest.raises(ConfigError, match=rf"OptimConfig\.{field} = "):
        OptimConfig(**changes)


def test_from_dict_types_and_keys():
    cfg = OptimConfig.from_dict(dict(name="sgd", lr=1, warmup_steps=0, decay_steps=10, nesterov=True))
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.nesterov
    with pytest.raises(ConfigError, match="unknown key.*'learning_rate'"):
        OptimConfig.from_dict(dict(learning_rate=1e-3))
    with pytest.raises(ConfigError, match=r"OptimConfig\.warmup_steps = 1.5: expected an integer"):
        OptimConfig.from_dict(dict(warmup_steps=1.5))
    with pytest.raises(ConfigError, match=r"OptimConfig\.nesterov = 'yes': expected true or false"):
        OptimConfig.from_dict(dict(nesterov="yes"))
    assert OptimConfig().replace(lr=1e-3).lr == 1e-3


# ---- the grouped global norm (OptimConfig.grad_norm = "grouped") -----------------------------------------
def _gpt_like_grads(seed: int = 0) -> dict:
    """Leaves on both sides of SMALL_LEAF: matrices, biases, LayerNorm scales, at different magnitudes, so a
    dropped or doubled leaf changes the norm by far more than rounding does."""
    r = np.random.default_rng(seed)
    shapes = {"wte": ((256, 256), 0.3), "c_fc": ((256, 512), 0.1), "bias": ((1024,), 1.0), "ln_scale": ((256,), 3.0),
              "ln_bias": ((256,), 2.0), "tiny": ((3,), 30.0)}  # sums of squares ~5,900 / 1,300 / 1,000 / 2,300 / ...
    return {k: jnp.asarray(scale * r.standard_normal(s), jnp.float32) for k, (s, scale) in shapes.items()}


def test_grouped_norm_matches_optax_norm():
    """Both sums of squares of the same N fp32 numbers in a different order: each is within gamma_N (N u /
    (1 - N u), u = 2^-24) of the exact sum of squares, so the norms differ by at most gamma_N relatively (sqrt
    halves the relative error, the final rounding adds u). Checked against the float64 norm too."""
    from jaxgpt.optim import SMALL_LEAF, grouped_norm

    grads = _gpt_like_grads()
    assert {jnp.size(g) < SMALL_LEAF for g in grads.values()} == {True, False}
    n = sum(int(jnp.size(g)) for g in grads.values())
    u = 2.0 ** -24
    bound = n * u / (1 - n * u) + u
    exact = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads.values()))
    for fn in (grouped_norm, optax.tree.norm):
        got = float(jax.jit(fn)(grads))
        assert abs(got - exact) <= bound * exact, fn
    for leaf in ("wte", "ln_scale"):  # the bound can tell a missing leaf, big or small
        dropped = float(grouped_norm({k: v for k, v in grads.items() if k != leaf}))
        assert abs(dropped - exact) > 4 * bound * exact, leaf
    assert float(grouped_norm({})) == 0.0


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_grouped_norm_clips_as_optax_does(name):
    """The grouped clip against optax.clip_by_global_norm in the same chain: the clip factor max_norm / |g| differs
    by the norms' relative difference (<= gamma_N + u, above), so every update does too, up to the optimizer's
    own rounding of that scaled gradient: rtol 2 (gamma_N + u) + 8 u. The state has the same structure (a
    checkpoint written under one resumes under the other) and, unclipped, the updates are the same bit for bit."""
    params = _gpt_like_grads(seed=1)
    grads = jax.tree.map(lambda g: 50.0 * g, _gpt_like_grads(seed=2))  # well above the clip
    n = sum(int(jnp.size(g)) for g in grads.values())
    u = 2.0 ** -24
    rtol = 2 * (n * u / (1 - n * u) + u) + 8 * u
    cfg = OptimConfig(name=name, schedule="constant", warmup_steps=0, grad_clip=1.0)
    plain, grouped = make_optimizer(cfg), make_optimizer(cfg.replace(grad_norm="grouped"))
    s_plain, s_grouped = plain.init(params), grouped.init(params)
    assert jax.tree.structure(s_plain) == jax.tree.structure(s_grouped)
    for g, exact in ((grads, False), (jax.tree.map(lambda g: 1e-6 * g, grads), True)):
        u_plain, _ = jax.jit(plain.update)(g, s_plain, params)
        u_grouped, _ = jax.jit(grouped.update)(g, s_grouped, params)
        for k in params:
            if exact:  # below the clip: the select passes the gradient through, the norm's bits do not matter
                np.testing.assert_array_equal(np.asarray(u_grouped[k]), np.asarray(u_plain[k]), err_msg=k)
            else:
                np.testing.assert_allclose(np.asarray(u_grouped[k]), np.asarray(u_plain[k]), rtol=rtol, atol=0,
                                           err_msg=k)


def test_grad_norm_config_is_validated():
    with pytest.raises(ConfigError, match=r"OptimConfig.grad_norm = 'fast'.*\['per-leaf', 'grouped'\]"):
        OptimConfig(grad_norm="fast")
    from jaxgpt.optim import global_norm_fn, grouped_norm

    assert global_norm_fn(OptimConfig()) is optax.tree.norm  # the default program is unchanged
    assert global_norm_fn(OptimConfig(grad_norm="grouped")) is grouped_norm
