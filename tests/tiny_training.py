"""A tiny GPT's losses over a few AdamW steps on one fixed batch: what the Pallas kernels' tests (tests/kernels/test_gelu.py,
tests/kernels/test_layer_norm_kernel.py) train under a kernel policy and under the plain one to compare."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT
from jaxgpt.precision import Policy


def tiny_adamw_losses(policy: Policy, steps: int = 4, *, bias: bool = True) -> list[float]:
    """Losses of ``steps`` AdamW steps of the tiny GPT (a 256-token vocabulary: the blocks are what is tested, and
    the lm_head's 50,257 columns would triple the compile time; ``bias``: its layers' biases) on one fixed batch of
    2 x 16 tokens."""
    cfg = dataclasses.replace(GPTConfig.preset("tiny"), vocab_size=256, bias=bias)
    idx = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    tgt = jnp.roll(idx, -1, axis=1)
    model = GPT(cfg, policy=policy, rngs=nnx.Rngs(params=0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-2)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(idx, tgt))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = opt.init(params), []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return losses
