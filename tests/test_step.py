"""jaxgpt.step: gradient accumulation, donation, determinism, dropout keys, eval, batch checks, and data
parallelism over 4 virtual CPU devices (in a subprocess: the device count is fixed when JAX starts)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, TokenError
from jaxgpt.optim import OptimConfig, lr_schedule, make_optimizer
from jaxgpt.precision import Policy
from jaxgpt.step import (TrainState, check_batch, init_train_state, jit_grads, make_eval_step,
                         make_train_step)

CFG = GPTConfig.preset("tiny", vocab_size=512)
POLICY = Policy(matmul_precision="highest")
OPTIM = OptimConfig(lr=1e-3, warmup_steps=2, decay_steps=8)
REPO = Path(__file__).resolve().parents[1]


@functools.lru_cache
def build(cfg: GPTConfig = CFG, seed: int = 0) -> GPT:
    """A GPT with GPT-2-like random parameters drawn in numpy (no eager JAX ops, which compile one by one on
    CPU, and no init compile); cached, since nothing here changes it (train states hold copies)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(cfg, policy=POLICY, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(state):
        shape, name = var.get_value().shape, path[-1]
        if name in ("kernel", "embedding"):
            value = rng.normal(0.0, 0.02, shape)
        else:  # LayerNorm scale 1, biases 0, each with a little noise so nothing is symmetric
            value = (name == "scale") + rng.normal(0.0, 0.02, shape)
        var.set_value(jnp.asarray(value, jnp.float32))
    return nnx.merge(graphdef, state)


def batch(micro_steps: int, micro_batch: int, seq: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CFG.vocab_size, (micro_steps, micro_batch, seq + 1)).astype(np.int32)
    return x[..., :-1], x[..., 1:]


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def train_step():
    """One compiled train step (micro_steps=4, no dropout) shared by the tests below."""
    model = build()
    optimizer = make_optimizer(OPTIM)
    graphdef, _ = init_train_state(model, optimizer)
    return model, optimizer, make_train_step(graphdef, optimizer, micro_steps=4)


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def global_norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(v, np.float64))) for v in jax.tree.leaves(tree))))


def test_grad_accumulation_equals_full_batch():
    model = build()
    graphdef, params = nnx.split(model, nnx.Param)
    x, y = batch(4, 4)
    loss4, grads4 = jit_grads(graphdef, params, x, y)  # mean over 4 micro-batches of 4
    loss1, grads1 = jit_grads(graphdef, params, x.reshape(1, 16, -1), y.reshape(1, 16, -1))  # one batch of 16
    assert abs(float(loss4) - float(loss1)) <= 1e-6
    assert max_abs_diff(grads4, grads1) <= 1e-6
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads4))
    assert global_norm(grads1) > 0.1  # a real gradient, not zeros


def test_step_metrics_eval_and_donation(train_step):
    model, optimizer, step = train_step
    graphdef, params = nnx.split(model, nnx.Param)
    x, y = batch(4, 4)
    want_loss, want_grads = jit_grads(graphdef, params, x, y)  # the same compile as the test above
    _, state = init_train_state(model, optimizer)
    eval_loss = make_eval_step(graphdef)(state.params, x.reshape(16, -1), y.reshape(16, -1))
    assert abs(float(eval_loss) - float(want_loss)) <= 1e-6

    old = state
    state, metrics = step(state, x, y)
    assert set(metrics) == {"loss", "grad_norm", "lr"}
    assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())
    assert float(metrics["loss"]) == pytest.approx(float(want_loss), abs=1e-6)
    assert float(metrics["grad_norm"]) == pytest.approx(global_norm(want_grads), rel=1e-5)
    assert float(metrics["lr"]) == pytest.approx(float(lr_schedule(OPTIM)(0)), rel=1e-7)
    state, metrics = step(state, x, y)
    assert float(metrics["lr"]) == pytest.approx(float(lr_schedule(OPTIM)(1)), rel=1e-7)
    assert int(state.step) == 2 and isinstance(state, TrainState)

    # The old state was donated: its buffers are gone (params and optimizer moments alike) ...
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old.params))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old.opt_state) if leaf.ndim)  # moments
    assert old.step.is_deleted()
    # ... but the model the state was made from is untouched (the state holds copies).
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_returned_state_is_not_placed_again(train_step, monkeypatch):
    """The state a step returned goes straight back into the next call (no device_put walk over its leaves); any
    other state (a fresh one, a replaced one) is placed first. Both paths give the same numbers bit for bit."""
    import jaxgpt.step as step_lib

    model, optimizer, step = train_step
    x, y = batch(4, 4)
    placed = []
    real = step_lib.shard_state
    monkeypatch.setattr(step_lib, "shard_state", lambda s, m=None: placed.append(1) or real(s, m))
    _, state = init_train_state(model, optimizer)
    state, _ = step(state, x, y)
    assert len(placed) == 1  # a state the step never returned
    state, fast = step(state, x, y)
    assert len(placed) == 1  # its own output: not placed again
    replaced = state.replace(step=state.step + 0)
    _, again = step(replaced, x, y)
    assert len(placed) == 2  # a new object: placed
    _, state = init_train_state(model, optimizer)  # the same two steps, each call placing its state
    state, _ = step(state, x, y)
    state = state.replace(step=state.step + 0)
    _, slow = step(state, x, y)
    for k in fast:
        np.testing.assert_array_equal(np.asarray(fast[k]), np.asarray(slow[k]), err_msg=k)


def test_deterministic(train_step):
    """Two runs of the same 3 steps from the same init: bit-identical on CPU (and on a GPU with
    ``XLA_FLAGS=--xla_gpu_deterministic_ops=true``); equal to fp32 rounding on a GPU without it."""
    model, optimizer, step = train_step
    x, y = batch(4, 4, seed=3)
    runs = []
    for _ in range(2):
        _, state = init_train_state(build(), optimizer)
        losses = []
        for _ in range(3):
            state, metrics = step(state, x, y)
            losses.append(float(metrics["loss"]))
        runs.append((losses, state.params))
    if jax.default_backend() == "cpu" or "xla_gpu_deterministic_ops=true" in os.environ.get("XLA_FLAGS", ""):
        assert runs[0][0] == runs[1][0]  # bit-identical
        assert max_abs_diff(runs[0][1], runs[1][1]) == 0.0
    else:  # a GPU's scatter-add (the wte gradient) uses atomics: equal to rounding, not to the bit
        np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
        assert max_abs_diff(runs[0][1], runs[1][1]) < 1e-6
    assert runs[0][0][0] != runs[0][0][2]  # and it did train


def test_dropout_key_changes_losses():
    cfg = CFG.replace(dropout=0.1)
    optimizer = make_optimizer(OPTIM)
    graphdef, _ = init_train_state(build(cfg), optimizer)
    step = make_train_step(graphdef, optimizer, micro_steps=4, dropout=True)
    x, y = batch(4, 4)

    def loss_with(key):
        _, state = init_train_state(build(cfg), optimizer)
        return float(step(state, x, y, key)[1]["loss"])

    key = functools.partial(jax.random.key, impl="rbg")  # threefry dropout compiles ~3x slower on CPU
    a, a_again, b = loss_with(key(1)), loss_with(key(1)), loss_with(key(2))
    assert a == a_again
    assert a != b
    with pytest.raises(ValueError, match="pass a PRNG key"):
        step(init_train_state(build(cfg), optimizer)[1], x, y)


def test_check_batch_and_shapes(train_step):
    _, _, step = train_step
    x, y = batch(4, 4)
    check_batch(x, y, CFG)
    check_batch(x[0], y[0], CFG)  # (batch, seq) too
    bad = y.copy()
    bad[1, 2, 3] = CFG.vocab_size
    with pytest.raises(TokenError, match=r"y holds token ids outside \[0, 512\)"):
        check_batch(x, bad, CFG)
    with pytest.raises(TokenError, match=r"x holds token ids outside"):
        check_batch(-np.ones_like(x), y, CFG)
    with pytest.raises(TokenError, match="same shape"):
        check_batch(x, y[:, :2], CFG)
    with pytest.raises(TokenError, match="block_size"):
        check_batch(np.zeros((1, 2, 65), np.int32), np.zeros((1, 2, 65), np.int32), CFG)
    with pytest.raises(TokenError, match="integer token ids"):
        check_batch(x.astype(np.float32), y, CFG)
    with pytest.raises(TokenError, match="shape"):
        check_batch(x[0, 0], y[0, 0], CFG)
    with pytest.raises(TokenError, match="built for micro_steps = 4"):
        step(None, x[:1], y[:1])
    with pytest.raises(TokenError, match=r"\(micro_steps, micro_batch, seq\)"):
        step(None, x[0], y[0])


DATA_PARALLEL = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jaxgpt.model import TokenError
    from jaxgpt.optim import make_optimizer
    from jaxgpt.step import data_mesh, init_train_state, make_train_step
    from tests.test_step import OPTIM, build

    assert len(jax.devices()) == 4, jax.devices()
    batches = np.load(sys.argv[1])  # (steps, x|y, micro_steps, micro_batch, seq)
    mesh = data_mesh()
    with jax.default_matmul_precision("highest"):
        opt = make_optimizer(OPTIM)
        graphdef, state = init_train_state(build(), opt, mesh=mesh)
        step = make_train_step(graphdef, opt, micro_steps=4, mesh=mesh)
        losses, norms = [], []
        for x, y in batches:
            state, m = step(state, x, y)
            losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
    devices = sorted({len(leaf.sharding.device_set) for leaf in jax.tree.leaves(state)})
    try:
        step(state, batches[0, 0, :, :3], batches[0, 1, :, :3])  # refused before any compile
        error = None
    except TokenError as e:
        error = str(e)
    print("RESULT", json.dumps(dict(losses=losses, norms=norms, devices=devices, error=error)))
""")


def test_data_parallel_4_devices_matches_1_device(train_step, tmp_path):
    """6 steps of the tiny config on 4 virtual CPU devices (a subprocess) against the same 6 steps on one
    device (this process, the shared compiled step): per-step losses agree to 1e-6, gradient norms to 1e-5
    relative."""
    model, optimizer, step = train_step
    batches = np.stack([np.stack(batch(4, 4, seed=10 + i)) for i in range(6)])
    np.save(tmp_path / "batches.npy", batches)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", DATA_PARALLEL, str(tmp_path / "batches.npy")], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # the one-device run, meanwhile
        _, state = init_train_state(model, optimizer)
        one, one_norms = [], []
        for x, y in batches:
            state, metrics = step(state, x, y)
            one.append(float(metrics["loss"]))
            one_norms.append(float(metrics["grad_norm"]))
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    four = json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert four["devices"] == [4]  # the state really lives on 4 devices
    assert len(four["losses"]) == 6 and one[0] != one[-1]
    print(f"\n4 devices vs 1: max loss |diff| {np.abs(np.subtract(four['losses'], one)).max():.2e}, max grad-norm "
          f"rel diff {np.abs(np.subtract(four['norms'], one_norms) / np.asarray(one_norms)).max():.2e}")
    np.testing.assert_allclose(four["losses"], one, rtol=0, atol=1e-6)
    # Gradient scale too (Adam would hide a gradient off by the device count from the losses):
    np.testing.assert_allclose(four["norms"], one_norms, rtol=1e-5)
    assert "micro_batch = 3 must be divisible by the number of devices in the mesh (4)" in four["error"]
