"""The jit-compiled decoder: :func:`run_decoder` samples a prompt's continuation in one compiled program (jitted
with the train step's XLA options, checked against the GPU's memory before it runs).

How it runs (``use_cache=True``, the default): one jit-compiled pure function per (batch, prompt length,
max_new_tokens) shape and ``top_k`` (static: it sets the shape of ``lax.top_k``), cached across calls; the
seed and the temperature (0 = greedy included) are traced, so changing them does not recompile:

1. prefill: the prompt (its last ``block_size`` tokens) goes through the model once, filling a KV cache;
2. decode: a ``fori_loop`` feeds each new token through ``GPT.decode``-style incremental steps at its
   absolute position, attending to the cache: O(T) work per token;
3. past ``block_size``: once the sequence is longer than the context window, nanoGPT crops it to the last
   ``block_size`` tokens, whose absolute positions restart at 0, so every token's position embedding
   shifts and cached keys/values are stale. Each further token is therefore a full forward pass over the
   last ``block_size`` tokens, O(block_size^2) attention per token, exactly as nanoGPT (and as
   ``use_cache=False``, which shares this code path and gives the same tokens bit for bit).

``use_cache=False`` is the plain recompute oracle: every token is a full causal forward pass over the
current (cropped) context. To compile once, the context is laid out in a fixed window of
``min(block_size, total length)`` slots with not-yet-generated slots holding id 0; causal attention means
those slots cannot influence the logits read at the last real position.

Randomness: ``key = jax.random.key(seed)`` is split into one key per new token (``jax.random.split(key,
max_new_tokens)[i]`` samples token ``i`` of every row, :func:`jaxgpt.generate.sampling.sample_logits`), so the
same seed, shapes and settings give the same tokens, with or without the cache.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgpt import ops
from jaxgpt.generate.sampling import sample_logits
from jaxgpt.model import GPT

__all__ = ["run_decoder", "trace_count"]

# How many times the jitted generation function has been traced (= compiled), per use_cache mode.
_TRACES: collections.Counter = collections.Counter()


def trace_count() -> int:
    """Number of times a generation function has been traced so far (tests use it to check the cache)."""
    return sum(_TRACES.values())


def _matmul_weights_in_compute_dtype(graphdef, state):
    """``state`` with every Linear kernel already in the policy's compute dtype. Each kernel is only ever a
    matmul operand, which the policy casts anyway, so the tokens are bit-identical; but the cast happens once
    per generate call instead of once per decoded token (a decode step is bound by reading the weights)."""
    dtype = nnx.merge(graphdef, state).policy.dtype
    if dtype == jnp.float32:
        return state

    def cast(path, x):
        return x.astype(dtype) if any(getattr(k, "key", None) == "kernel" for k in path) else x

    return jax.tree_util.tree_map_with_path(cast, state)


_STATIC = ("graphdef", "n_new", "top_k", "use_cache")


def _generate_traced(graphdef, state, ctx, key, temperature, *, n_new: int, top_k: int | None, use_cache: bool):
    """Tokens (batch, T0 + n_new): ``ctx`` (batch, T0 <= block_size) followed by ``n_new`` new tokens."""
    _TRACES["cached" if use_cache else "uncached"] += 1  # runs only while tracing
    model = nnx.merge(graphdef, _matmul_weights_in_compute_dtype(graphdef, state))
    head = model.policy.cast(model.wte.embedding[...])  # the tied lm_head, cast once for every token
    B, T0 = ctx.shape
    block_size = model.config.block_size
    L = T0 + n_new
    keys = jax.random.split(key, n_new)
    buf = jnp.zeros((B, L), jnp.int32).at[:, :T0].set(ctx)

    def sample(logits, i):
        return sample_logits(logits, keys[i], temperature, top_k=top_k)

    def put(buf, i, tok):  # new token i sits at absolute index T0 + i of the sequence
        return jax.lax.dynamic_update_slice(buf, tok[:, None], (0, T0 + i))

    def recompute_logits(buf, n, width):
        """Next-token logits after the first ``n`` tokens of ``buf``, from a full forward pass over a window
        of ``width`` tokens holding the last min(width, n) of them (not-yet-generated slots after them)."""
        start = jnp.maximum(n - width, 0)
        window = jax.lax.dynamic_slice(buf, (0, start), (B, width))  # positions restart at 0
        h, _ = model.hidden(window)
        h_last = jax.lax.dynamic_slice_in_dim(h, n - 1 - start, 1, axis=1)  # the last real token
        return model.logits(h_last, head=head)[:, 0]

    if not use_cache:
        width = min(block_size, L)

        def step(i, buf):
            return put(buf, i, sample(recompute_logits(buf, T0 + i, width), i))

        return jax.lax.fori_loop(0, n_new, step, buf)

    # Token i sees T0 + i tokens: its logits come from the cache while T0 + i <= block_size. After sampling
    # token i, the logits of token i+1 come from the cache while i+1 < n_cached, then (past block_size) from
    # nanoGPT's cropped recompute; the last token needs none. Two plain loops rather than one loop with a
    # switch between the regimes: passing the KV cache through a conditional made XLA copy it on every token
    # (with the argmax below, 76 -> 57 ms per batch-8 gpt2 decode step, measured A/B).
    n_cached = min(n_new, block_size - T0 + 1)
    cache = model.init_cache(B, T0 + n_cached - 1)  # the last cached step writes position T0+n_cached-2
    h, cache = model.hidden(ctx, cache=cache, pos=0)  # prefill
    logits = model.logits(h[:, -1:], head=head)[:, 0]

    def decode_step(i, carry):  # sample token i, then token i+1's logits against the cache: O(T)
        buf, cache, logits = carry
        tok = sample(logits, i)
        h, cache = model.hidden(tok[:, None], cache=cache, pos=T0 + i)
        return put(buf, i, tok), cache, model.logits(h, head=head)[:, 0]

    def recompute_step(i, carry):  # past block_size: nanoGPT's cropped recompute (positions shift)
        buf, logits = carry
        buf = put(buf, i, sample(logits, i))
        return buf, recompute_logits(buf, T0 + i + 1, block_size)

    buf, _, logits = jax.lax.fori_loop(0, n_cached - 1, decode_step, (buf, cache, logits))
    if n_cached < n_new:
        buf, logits = jax.lax.fori_loop(n_cached - 1, n_new - 1, recompute_step, (buf, logits))
    return put(buf, n_new - 1, sample(logits, n_new - 1))


_generate_compiled = jax.jit(_generate_traced, static_argnames=_STATIC)  # XLA's default options


@functools.lru_cache(maxsize=None)
def _generate_with_options(options: tuple[tuple[str, Any], ...]):
    return jax.jit(_generate_traced, static_argnames=_STATIC, compiler_options=dict(options))


def _generate_program(graphdef):
    """The jitted generation function for ``graphdef``'s model on the platform it is traced for: with the XLA
    options the train and eval steps get (jaxgpt.step.platform_compiler_options: under precision fp8 on GPUs,
    cuBLASLt fp8 GEMMs), else :data:`_generate_compiled`. The options change which kernels run, not the numbers."""
    from jaxgpt.step import platform_compiler_options

    options = platform_compiler_options(graphdef, ops.platform())
    return _generate_with_options(tuple(sorted(options.items()))) if options else _generate_compiled


def run_decoder(model: GPT, ctx: np.ndarray, *, n_new: int, temperature: float, top_k: int | None, seed: int,
                use_cache: bool, num_samples: int) -> jax.Array:
    """Tokens (batch, T0 + n_new): the checked context ``ctx`` (batch, T0 <= block_size; each prompt's
    ``num_samples`` rows in a row) followed by ``n_new`` >= 1 tokens sampled by the compiled program."""
    graphdef, state = nnx.split(model)
    args = (graphdef, state, jnp.asarray(ctx), jax.random.key(seed), jnp.float32(temperature))
    static = dict(n_new=int(n_new), top_k=None if top_k is None else int(top_k), use_cache=bool(use_cache))
    _check_memory(args, static, rows=len(ctx) // num_samples, num_samples=num_samples)
    return _generate_program(graphdef)(*args, **static)


def _check_memory(args: tuple, static: dict, *, rows: int, num_samples: int) -> None:
    """On a GPU: the generation program against JAX's memory pool; one that does not fit raises
    :class:`~jaxgpt.memory_fit.DeviceMemoryError` naming the largest ``num_samples`` that does
    (:mod:`jaxgpt.memory_fit`). On the CPU: nothing. The program is compiled as the call will run it (cached)."""
    from jaxgpt import memory_fit

    pool = memory_fit.device_pool(jax.local_devices()[:1])
    if pool is None:
        return
    graphdef, state, ctx, key, temperature = args

    def measure(n: int) -> int:
        c = ctx if n == num_samples else jax.ShapeDtypeStruct((rows * n, ctx.shape[1]), ctx.dtype)
        return memory_fit.program_bytes(_generate_program(graphdef).lower(graphdef, state, c, key, temperature,
                                                                          **static).compile())

    memory_fit.check_batch(f"generating {num_samples} sample(s) of {static['n_new']} tokens", measure(num_samples),
                           pool, num_samples, measure, option="num_samples (--num-samples)")

