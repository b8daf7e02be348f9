"""Generation parity: the KV-cached path against the uncached recompute path, and jaxgpt against torch_ref's
nanoGPT ``generate`` from the same weights, fp32 with matmul precision pinned to "highest" (conftest).

The configs include odd shapes (3 heads, 1 head without biases and with a padded vocabulary, block sizes
that are not powers of 2) and, per config, a prompt below, above and exactly at block_size, with enough
new tokens to run past block_size (where nanoGPT crops the context and positions restart at 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxgpt.config import GPTConfig
from jaxgpt.generate import generate, sample_logits
from jaxgpt.model import GPT
from jaxgpt.precision import Policy
from torch_ref.model import GPT as RefGPT

# name -> (config, prompt length, new tokens)
CASES = {
    "3heads-bs23-dropout": (GPTConfig(block_size=23, vocab_size=101, n_layer=2, n_head=3, n_embd=48,
                                      dropout=0.1), 5, 30),
    "1head-nobias-padded-bs10": (GPTConfig(block_size=10, vocab_size=50, padded_vocab_size=64, n_layer=1,
                                           n_head=1, n_embd=16, bias=False), 13, 12),  # prompt > block_size
    "4heads-bs17": (GPTConfig(block_size=17, vocab_size=257, n_layer=3, n_head=4, n_embd=32), 17, 8),
}
SEEDS = {"3heads-bs23-dropout": 0, "1head-nobias-padded-bs10": 0, "4heads-bs17": 0}


def jax_device(device: str):
    return jax.default_device(jax.devices("gpu" if device == "cuda" else "cpu")[0])


def sharpened_model(config: GPTConfig, seed: int) -> GPT:
    """A GPT with O(1) activations and peaked logits (GPT-2's 0.02 init gives near-uniform next-token
    distributions, whose greedy choices would hinge on float rounding and whose context barely matters).
    Drawn in numpy into an abstract model: no eager JAX ops, which compile one by one on CPU."""
    abstract = nnx.eval_shape(lambda: GPT(config, policy=Policy.fp32(), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(state):
        shape, name = var.get_value().shape, path[-1]
        if name == "kernel":
            v = rng.normal(0.0, 2.0 / np.sqrt(shape[0]), shape)
        elif name == "embedding" and path[0] == "wte":
            v = rng.normal(0.0, 0.3, shape)
            v[config.vocab_size:] = rng.normal(0.0, 30.0, v[config.vocab_size:].shape)  # padded rows:
            # they would dominate the logits if they were not excluded
        elif name == "embedding":
            v = rng.normal(0.0, 0.3, shape)
        elif name == "scale":
            v = 1.0 + rng.normal(0.0, 0.1, shape)
        else:
            v = rng.normal(0.0, 0.1, shape)
        var.set_value(jax.device_put(np.asarray(v, np.float32)))  # numpy cast + copy: no eager op compiled per shape
    return nnx.merge(graphdef, state)


def torch_copy(model: GPT, device: str) -> RefGPT:
    from jaxgpt.weights import to_torch_state_dict

    ref = RefGPT(model.config)
    ref.load_state_dict(to_torch_state_dict(model), strict=True)
    return ref.to(device).eval()


def prompts(config: GPTConfig, length: int) -> np.ndarray:
    return np.random.default_rng(length).integers(0, config.vocab_size, size=(2, length))


_MODELS: dict = {}


@pytest.fixture(params=list(CASES))
def case(request, device):
    config, T, n_new = CASES[request.param]
    key = (request.param, device)
    if key not in _MODELS:
        with jax_device(device):
            _MODELS[key] = sharpened_model(config, seed=SEEDS[request.param])
    return _MODELS[key], prompts(config, T), n_new


def test_cached_matches_uncached(case, device):
    model, prompt, n_new = case
    with jax_device(device):
        for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=11), dict(temperature=0.6, seed=12)):
            cached = generate(model, prompt[0], max_new_tokens=n_new, top_k=None, num_samples=2, **kw)
            uncached = generate(model, prompt[0], max_new_tokens=n_new, top_k=None, num_samples=2,
                                use_cache=False, **kw)
            np.testing.assert_array_equal(cached, uncached, err_msg=str(kw))
            assert cached.max() < model.config.vocab_size
        assert len(np.unique(cached[:, -n_new:])) > 3  # sampling at 0.6 is not a constant sequence


def test_greedy_matches_torch_ref(case, device):
    model, prompt, n_new = case
    ref = torch_copy(model, device)
    with jax_device(device):
        ours = generate(model, prompt, max_new_tokens=n_new, temperature=0.0, top_k=None)
    theirs = ref.generate(torch.from_numpy(prompt).to(device), n_new, temperature=0.0).cpu().numpy()
    np.testing.assert_array_equal(ours, theirs)
    assert len(np.unique(ours[:, -n_new:])) > 1


@pytest.mark.parametrize("temperature, top_k", [(0.7, 4), (1.5, None), (1.0, 1)])
def test_sampling_distribution_matches_torch_ref(temperature, top_k, device):
    """sample_logits draws from torch_ref's distribution: logits / temperature, keep >= the k-th largest
    (ties with it kept), softmax."""
    V, n = 40, 40_000
    logits = np.random.default_rng(0).normal(0.0, 1.5, V).astype(np.float32)
    order = np.argsort(-logits)
    logits[order[4]] = logits[order[3]]  # a tie at the 4th largest: both are kept by top_k=4
    # torch_ref.GPT.generate's sampling, on the same logits
    t = torch.from_numpy(logits)[None] / temperature
    if top_k is not None:
        v, _ = torch.topk(t, min(top_k, t.size(-1)))
        t[t < v[:, [-1]]] = -float("inf")
    probs = torch.softmax(t, dim=-1)[0].numpy()

    with jax_device(device):
        draw = jax.jit(functools.partial(sample_logits, top_k=top_k))
        tokens = np.asarray(draw(jnp.broadcast_to(jnp.asarray(logits), (n, V)), jax.random.key(3),
                                 jnp.float32(temperature)))
    freq = np.bincount(tokens, minlength=V) / n
    assert set(np.flatnonzero(freq)) == set(np.flatnonzero(probs))  # same support
    np.testing.assert_allclose(freq, probs, atol=5 * np.sqrt(0.25 / n))  # 5 sigma at worst
