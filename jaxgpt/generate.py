"""Sampling text from a GPT: a jit-compiled KV-cache decoder with nanoGPT's semantics, and a CLI.

    >>> out = generate(model, [15496, 11], max_new_tokens=20, temperature=0.8, top_k=50, seed=1337)
    >>> out.shape  # (num_samples, prompt length + max_new_tokens)
    (1, 22)

Semantics (the same as ``torch_ref.GPT.generate``, nanoGPT's ``generate``): for each new token the model
sees the last ``block_size`` tokens of the sequence so far, takes the logits of the last position, divides
them by ``temperature``, keeps the logits >= the ``top_k``-th largest (ties kept), and samples from their
softmax. ``temperature == 0`` is greedy decoding (argmax). The model's logits cover the real vocabulary
only, so padded-vocabulary ids can never be sampled.

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
max_new_tokens)[i]`` samples token ``i`` of every row), so the same seed, shapes and settings give the
same tokens, with or without the cache. Each draw is :func:`categorical` (inverse CDF, two uniforms per row)
after :func:`kth_largest`'s exact top-k threshold: sampling a step's token costs 0.5 ms for one row of
50,257 logits on our 2-core CPU, where ``jax.random.categorical`` after a full-row bisection took 3.5 ms.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports below, so a Ctrl-C during them is one line too (jaxgpt.interrupt):
    from jaxgpt.interrupt import run_cli  # run_cli imports this file as jaxgpt.generate and runs its main

    run_cli("jaxgpt.generate:main", "jaxgpt.generate", left="the samples printed so far are complete",
            watch=True)

import argparse
import collections
import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgpt import ops
from jaxgpt.config import PRESETS, GPTConfig
from jaxgpt.fp8 import DEFAULT_GEMMS as DEFAULT_FP8_GEMMS
from jaxgpt.fp8 import GEMM_SETS
from jaxgpt.model import GPT, TokenError, check_tokens
from jaxgpt.precision import PRECISIONS, Policy

__all__ = ["GenerateError", "argmax", "categorical", "generate", "generate_text", "kth_largest", "load_model",
           "load_tokenizer", "generate_samples", "load_checkpoint", "main", "sample_logits", "trace_count"]


class GenerateError(ValueError):
    """Invalid generation arguments (the message names the argument, its value and what is allowed)."""


# How many times the jitted generation function has been traced (= compiled), per use_cache mode.
_TRACES: collections.Counter = collections.Counter()


def trace_count() -> int:
    """Number of times a generation function has been traced so far (tests use it to check the cache)."""
    return sum(_TRACES.values())


# ---- sampling ----------------------------------------------------------------------------------------------
_SIGN = 0x80000000  # the float32 sign bit


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of the float32 values of ``x`` whose unsigned order is the floats' order (NaN excepted),
    denormals included, which XLA:CPU's float comparisons flush to zero."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    sign = jnp.uint32(_SIGN)
    return jnp.where(bits >= sign, ~bits, bits | sign)


def _kth_largest_bisect(x: jax.Array, k: int) -> jax.Array:
    """The exact k-th largest value of each row (duplicates counted, as ``lax.top_k``), found by bisection
    over the floats' order-preserving uint32 keys: 32 compare-and-count passes over the row. On XLA:CPU this
    is ~10x faster than ``lax.top_k`` for a 50257-wide row (0.8 vs 9.7 ms of CPU per row, k=50)."""
    keys = _order_keys(x)
    sign = jnp.uint32(_SIGN)
    lo = jnp.zeros(x.shape[:-1] + (1,), jnp.uint32)  # invariant: count(keys >= lo) >= k; answer in [lo, hi]
    hi = jnp.full(x.shape[:-1] + (1,), 0xFFFFFFFF, jnp.uint32)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2  # upper middle, no overflow
        ok = jnp.sum(keys >= mid, axis=-1, keepdims=True) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    bits = jnp.where(lo >= sign, lo & ~sign, ~lo)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first index of the largest value; int32) for non-NaN ``x``, as a max
    and a min-index reduction: XLA:CPU's two-operand argmax reduction took 5 of 64 ms of a batch-8 gpt2 decode
    step (8 x 50,257 logits), these two take under 1."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)


GROUP = 128  # values per group in the two-level top-k threshold and sampler below


def _groups(x: jax.Array) -> jax.Array:
    """(..., V) -> (..., ceil(V / GROUP), GROUP), padded with -inf (never the k-th largest, never drawn)."""
    n = -(-x.shape[-1] // GROUP)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * GROUP - x.shape[-1])], constant_values=-jnp.inf)
    return x.reshape(*x.shape[:-1], n, GROUP)


def _kth_largest_grouped(x: jax.Array, k: int) -> jax.Array:
    """:func:`_kth_largest_bisect` on the k groups of GROUP values with the largest maxima only (k * GROUP
    values, not V). Exact: those groups hold k values >= the row's k-th largest t, because either every value
    >= t lies in them, or one lies outside and then each chosen group's maximum is >= it >= t."""
    if 2 * k * GROUP > x.shape[-1]:  # no saving
        return _kth_largest_bisect(x, k)
    g = _groups(x.astype(jnp.float32))
    signed_keys = jax.lax.bitcast_convert_type(_order_keys(g) ^ jnp.uint32(_SIGN), jnp.int32)
    _, top = jax.lax.top_k(jnp.max(signed_keys, axis=-1), k)  # (..., k) group indices, exact group maxima
    candidates = jnp.take_along_axis(g, top[..., None], axis=-2)  # (..., k, GROUP)
    return _kth_largest_bisect(candidates.reshape(*candidates.shape[:-2], -1), k)


def kth_largest(x: jax.Array, k: int) -> jax.Array:
    """The k-th largest value along the last axis, keepdims (torch.topk(x, k).values[..., -1:]).
    On CPU (where ``lax.top_k`` over a 50,257-wide row is slow) bisection over the values of the k groups of
    :data:`GROUP` with the largest maxima; ``lax.top_k`` elsewhere; the same values."""
    return jax.lax.platform_dependent(
        x, cpu=lambda x: _kth_largest_grouped(x, k), default=lambda x: jax.lax.top_k(x, k)[0][..., -1:])


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, the first index i with cumsum(weights)[i] > u * sum(weights) (so index i is drawn with
    probability weights[i] / sum, for u uniform in [0, 1)); never an index of weight 0, float rounding
    included (a u * sum that rounds up to the sum takes the last index of positive weight)."""
    c = jnp.cumsum(weights, axis=-1)
    i = jnp.sum(c <= (u * c[..., -1])[..., None], axis=-1)
    last = weights.shape[-1] - 1 - argmax(jnp.flip(weights, axis=-1) > 0)
    return jnp.minimum(i, last).astype(jnp.int32)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One index per row drawn from softmax(logits) (a -inf logit is never drawn), by inverse CDF in two
    levels: a group of :data:`GROUP` by the groups' probability masses, then an index within that group. The
    same distribution as ``jax.random.categorical`` (Gumbel-max), from two uniforms per row instead of Gumbel
    noise for every logit: on CPU, 0.2 instead of 2.1 ms per row of 50,257 logits (measured)."""
    g = _groups(logits.astype(jnp.float32))
    p = jnp.exp(g - jnp.max(g, axis=(-2, -1), keepdims=True))  # unnormalised softmax; -inf -> 0
    u = jax.random.uniform(key, (2, *logits.shape[:-1]))
    group = _inverse_cdf(jnp.sum(p, axis=-1), u[0])
    within = jnp.take_along_axis(p, group[..., None, None], axis=-2)[..., 0, :]  # (..., GROUP)
    return group * GROUP + _inverse_cdf(within, u[1])


def sample_logits(logits: jax.Array, key: jax.Array, temperature: jax.Array | float, *,
                  top_k: int | None) -> jax.Array:
    """One token per row from ``logits`` (batch, vocab), nanoGPT's way.

    ``temperature == 0``: argmax. Otherwise ``logits / temperature``, then (if ``top_k``) every logit below
    the ``top_k``-th largest is set to -inf (ties with it are kept), then a categorical draw from the
    softmax. ``temperature`` may be traced (greedy and sampling share one compiled function); ``top_k`` is
    static. Returns int32 (batch,).
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)

    def sample():
        scaled = logits / jnp.where(temperature == 0, 1.0, temperature)
        if top_k is not None:
            kth = kth_largest(scaled, min(top_k, scaled.shape[-1]))
            scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        return categorical(key, scaled)  # from softmax(scaled); -inf logits are never drawn

    def greedy():
        return argmax(logits)

    return jax.lax.cond(temperature == 0, greedy, sample)


# ---- the compiled generation function --------------------------------------------------------------------
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


# ---- the library entry points ---------------------------------------------------------------------------
def _check_int(name: str, value, *, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise GenerateError(f"{name} = {value!r}: expected an integer" + (" or None" if allow_none else ""))
    if value < minimum:
        raise GenerateError(f"{name} = {value!r}: must be >= {minimum}")


def _prompt_array(prompt_ids, config: GPTConfig) -> np.ndarray:
    """The prompt as an int (batch, T) array with every id checked against the vocabulary."""
    try:
        ids = np.asarray(prompt_ids)
    except (ValueError, TypeError) as e:
        raise GenerateError(f"prompt_ids must be a sequence of token ids: {e}") from e
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise GenerateError(f"prompt_ids must have shape (seq,) or (batch, seq), got {ids.shape}")
    if ids.size == 0:
        raise GenerateError(f"prompt_ids is empty (shape {ids.shape}); give at least one token, e.g. "
                            "the end-of-text token 50256 to sample unconditionally")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TokenError(f"prompt_ids must hold integer token ids, got dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        raise TokenError(f"prompt_ids holds token ids outside [0, {config.vocab_size}): e.g. "
                         f"{bad[:5].tolist()}; ids must come from the model's tokenizer")
    return ids.astype(np.int32)


def generate(
    model: GPT,
    prompt_ids,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    num_samples: int = 1,
    use_cache: bool = True,
) -> np.ndarray:
    """Sample ``max_new_tokens`` tokens after ``prompt_ids``.

    ``prompt_ids``: token ids, shape (seq,) or (batch, seq). Each prompt row is repeated ``num_samples``
    times (prompt-major), and every row is sampled independently. A prompt longer than ``block_size``
    keeps only its last ``block_size`` tokens as context (nanoGPT), but is returned whole.
    ``temperature``: 0 = greedy; ``top_k``: None or 0 = no top-k filtering.

    Returns an int32 array (batch * num_samples, seq + max_new_tokens): the prompt, then the new tokens.
    """
    config: GPTConfig = model.config
    _check_int("max_new_tokens", max_new_tokens, minimum=0)
    _check_int("num_samples", num_samples, minimum=1)
    _check_int("top_k", top_k, minimum=0, allow_none=True)
    _check_int("seed", seed, minimum=0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating, np.integer)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise GenerateError(f"temperature = {temperature!r}: must be a finite number >= 0 (0 = greedy)")
    if seed >= 2**32:
        raise GenerateError(f"seed = {seed}: must be < 2**32")
    prompt = np.repeat(_prompt_array(prompt_ids, config), num_samples, axis=0)
    ctx = prompt[:, -config.block_size:]
    check_tokens(ctx, config, name="prompt_ids")
    if max_new_tokens == 0:
        return prompt

    if not top_k or top_k >= config.vocab_size:
        top_k = None  # no filtering (and one compiled function for all of these)
    graphdef, state = nnx.split(model)
    args = (graphdef, state, jnp.asarray(ctx), jax.random.key(seed), jnp.float32(temperature))
    static = dict(n_new=int(max_new_tokens), top_k=None if top_k is None else int(top_k), use_cache=bool(use_cache))
    _check_memory(args, static, rows=len(ctx) // num_samples, num_samples=num_samples)
    out = _generate_program(graphdef)(*args, **static)
    new = np.asarray(out)[:, ctx.shape[1]:]
    return np.concatenate([prompt, new], axis=1)


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


def generate_text(
    model: GPT,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    num_samples: int = 1,
    use_cache: bool = True,
    allow_special: bool = False,
    tokenizer=None,
) -> list[str]:
    """``num_samples`` texts: ``prompt`` followed by its sampled continuation, through GPT-2's tokenizer.

    The prompt is encoded literally: a ``"<|endoftext|>"`` typed in it is seven ordinary tokens, unless
    ``allow_special`` makes each one the end-of-text token (50256), as between documents in training. An empty
    prompt samples unconditionally: the context starts with the end-of-text token, which is not returned.
    """
    return [text for text, _ in generate_samples(model, prompt, max_new_tokens=max_new_tokens,
                                                 temperature=temperature, top_k=top_k, seed=seed,
                                                 num_samples=num_samples, use_cache=use_cache,
                                                 allow_special=allow_special, tokenizer=tokenizer)]


def generate_samples(
    model: GPT,
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    num_samples: int = 1,
    use_cache: bool = True,
    allow_special: bool = False,
    tokenizer=None,
) -> list[tuple[str, list[int]]]:
    """Like :func:`generate_text`, with each sample's token ids (prompt + continuation); ``prompt`` may also be
    token ids (checked against the vocabulary), taken as they are. ``tokenizer``: the model's (a
    :class:`jaxgpt.chars.CharTokenizer` for a character model, see :func:`load_tokenizer`; None: GPT-2's BPE).
    A character vocabulary has no end-of-text token: an empty prompt then starts from id 0 (``"\n"`` in tiny
    Shakespeare's), which is not returned."""
    from jaxgpt import tokenizer as tokenizers

    tok = tokenizer if tokenizer is not None else tokenizers.GPT2BPE()
    if isinstance(prompt, str):
        if allow_special and tok.eot_token is None:
            raise GenerateError(f"allow_special: the {tok.vocab_size}-character vocabulary has no end-of-text token")
        try:
            ids = tok.encode(prompt, allow_eot=allow_special)
        except ValueError as e:  # a character outside the model's vocabulary
            raise GenerateError(f"prompt: {e}") from None
    elif isinstance(prompt, Sequence) and all(isinstance(i, (int, np.integer)) for i in prompt):
        ids = [int(i) for i in prompt]
    else:
        raise GenerateError(f"prompt = {prompt!r}: expected a string or a list of token ids")
    skip = 0
    if not ids:
        ids, skip = [tok.eot_token or 0], 1
    out = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                   seed=seed, num_samples=num_samples, use_cache=use_cache)
    return [(tok.decode(row[skip:].tolist()), row[skip:].tolist()) for row in out]


# ---- loading a model ------------------------------------------------------------------------------------
def load_checkpoint(path: str | Path, *, policy: Policy, step: int | None = None) -> GPT:
    """The model of a jaxgpt training run (``jaxgpt.checkpoint``): ``path`` is the run directory (or its
    ``checkpoints/`` subdirectory); ``step`` defaults to the newest intact checkpoint."""
    from jaxgpt import checkpoint

    path = Path(path)
    if path.name == checkpoint.CHECKPOINT_SUBDIR and not (path / checkpoint.CHECKPOINT_SUBDIR).is_dir():
        path = path.parent
    try:
        return checkpoint.load_model(path, step=step, policy=policy)
    except checkpoint.CheckpointDamaged as e:  # --step N named a damaged step (no fallback then)
        raise GenerateError(f"--init-from {str(path)!r} --step {step}: {e}; leave out --step to use the newest "
                            "intact step") from e
    except (OSError, ValueError) as e:  # NoCheckpointError, CheckpointMismatchError, unreadable files
        if (path / checkpoint.CHECKPOINT_SUBDIR).is_dir():  # a run directory: its checkpoints are the problem
            raise GenerateError(f"--init-from {str(path)!r}: {e}") from e
        raise GenerateError(f"--init-from {str(path)!r}: not a Hugging Face GPT-2 directory (no config.json), "
                            f"and no jaxgpt training checkpoint could be loaded from it: {e}") from e


def load_tokenizer(init_from: str, *, step: int | None = None):
    """The tokenizer of the model ``load_model(init_from)`` loads: a training run's checkpoint records it, an
    export records it in ``jaxgpt_export.json``; Hugging Face models and ``random:`` presets use GPT-2's BPE."""
    from jaxgpt import tokenizer

    path = Path(init_from)
    record = None
    if path.is_dir() and not _is_hf_dir(path):
        from jaxgpt import checkpoint

        if path.name == checkpoint.CHECKPOINT_SUBDIR and not (path / checkpoint.CHECKPOINT_SUBDIR).is_dir():
            path = path.parent
        record = checkpoint.saved_tokenizer(path, step=step)
    elif path.is_dir():
        from jaxgpt.exportdir import export_tokenizer

        record = export_tokenizer(path)
    return tokenizer.from_record(record)


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or any((path / f).is_file() for f in
                                                   ("model.safetensors", "pytorch_model.bin"))


def load_model(init_from: str, *, policy: Policy, seed: int = 0, step: int | None = None) -> GPT:
    """A GPT from ``init_from``: ``random:PRESET`` (random init with ``seed``), a directory (a Hugging Face
    GPT-2 directory if it holds config.json or weights, else a jaxgpt training run directory, whose
    checkpoint ``step`` is loaded, default the latest), or a Hugging Face model name ("gpt2", ...)."""
    path = Path(init_from)
    is_run_dir = path.is_dir() and not _is_hf_dir(path)
    if step is not None and not is_run_dir:
        raise GenerateError(f"--step {step}: only a training run directory has steps; "
                            f"--init-from {init_from!r} is not one")
    if init_from.startswith("random:"):
        preset = init_from.split(":", 1)[1]
        if preset not in PRESETS:
            raise GenerateError(f"--init-from {init_from!r}: unknown preset {preset!r}; "
                                f"valid presets are {sorted(PRESETS)}")
        return GPT(GPTConfig.preset(preset), policy=policy, rngs=nnx.Rngs(seed))
    if is_run_dir:
        return load_checkpoint(path, policy=policy, step=step)
    try:
        from jaxgpt.weights import from_hf
    except ImportError as e:
        raise GenerateError(f"--init-from {init_from!r}: loading Hugging Face weights needs "
                            f"jaxgpt.weights, which is not available ({e})") from e
    try:
        return from_hf(init_from, policy=policy)
    except (OSError, ValueError) as e:  # missing files, no network, not GPT-2, ...
        hint = (f" (for a randomly initialised {init_from!r} model use --init-from random:{init_from})"
                if init_from in PRESETS and not init_from.startswith("gpt2") else "")
        raise GenerateError(f"--init-from {init_from!r}: could not load Hugging Face weights{hint}: {e}") from e


# ---- the command line ----------------------------------------------------------------------------------------
def int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum`` (also the eval command's)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be >= {minimum}")
        return v
    return parse


def _temperature(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{s} must be a finite number >= 0 (0 = greedy)")
    return v


def _token_ids(s: str) -> list[int]:
    parts = [p for p in s.replace(",", " ").split() if p]
    if not parts:
        raise argparse.ArgumentTypeError("no token ids given (e.g. --prompt-ids 15496,11,995)")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: token ids are integers, comma- or space-separated") from None
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{s!r}: token ids are >= 0")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxgpt.generate",
        description="Sample text from a GPT-2 model (KV-cached, jit-compiled).",
    )
    p.add_argument("--init-from", default="gpt2",
                   help="a Hugging Face model name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a Hugging Face "
                        "GPT-2 directory, a jaxgpt training run directory, or random:PRESET for a random "
                        f"model (presets: {', '.join(sorted(PRESETS))}) (default: gpt2)")
    p.add_argument("--step", type=int_at_least(0), default=None,
                   help="with a training run directory: the checkpoint step, an error if it is damaged "
                   "(default: the newest intact step)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="",
                        help="the text to continue (default: empty = unconditional). Taken literally: a typed "
                             "<|endoftext|> is seven ordinary tokens unless --allow-special")
    prompt.add_argument("--prompt-ids", type=_token_ids, default=None, metavar="IDS",
                        help="the prompt as GPT-2 token ids, comma- or space-separated (e.g. '15496,11,995')")
    p.add_argument("--allow-special", action="store_true",
                   help="<|endoftext|> in --prompt is the special end-of-text token 50256 (the document separator "
                        "the model was trained with), not seven ordinary tokens")
    p.add_argument("--print-ids", action="store_true",
                   help="after each sample's text, print its token ids (prompt + new tokens) as one JSON line: "
                        '{"sample": i, "ids": [...]}')
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=100)
    p.add_argument("--temperature", type=_temperature, default=1.0, help="0 = greedy (default: 1.0)")
    p.add_argument("--top-k", type=int_at_least(0), default=50, help="0 = no top-k filtering (default: 50)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--num-samples", type=int_at_least(1), default=1)
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="matmul operand dtype; bf16-autocast: torch.autocast's bf16 (default: fp32)")
    p.add_argument("--fp8-gemms", choices=[g for g in GEMM_SETS if g != "none"], default=None,
                   help="with --precision fp8: which forward GEMMs take e4m3 operands, as the run's fp8_gemms "
                        f"(default: {DEFAULT_FP8_GEMMS})")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole context for every token (slow; the reference path)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.seed >= 2**32:
            raise GenerateError(f"--seed {args.seed}: must be < 2**32")
        policy = Policy.named(args.precision, fp8_gemms=args.fp8_gemms)
        model = load_model(args.init_from, policy=policy, step=args.step)
        tok = load_tokenizer(args.init_from, step=args.step)
        t0 = time.perf_counter()
        if args.allow_special and args.prompt_ids is not None:
            raise GenerateError("--allow-special applies to --prompt text; --prompt-ids are taken as they are")
        samples = generate_samples(model, args.prompt if args.prompt_ids is None else args.prompt_ids,
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   top_k=args.top_k or None, seed=args.seed, num_samples=args.num_samples,
                                   use_cache=not args.no_cache, allow_special=args.allow_special, tokenizer=tok)
        dt = time.perf_counter() - t0
    except (ValueError, OSError, ImportError) as e:  # GenerateError, ConfigError, TokenError, DeviceMemoryError, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # XLA's RESOURCE_EXHAUSTED while running (another process on the GPU, fragmentation)
        from jaxgpt.memory_fit import report_out_of_memory

        return report_out_of_memory(e, smaller="--num-samples")
    for i, (text, ids) in enumerate(samples):
        if i:
            print("-" * 40)
        print(text)
        if args.print_ids:
            print(json.dumps({"sample": i, "ids": ids}))
    n = args.max_new_tokens * args.num_samples
    print(f"[{n} tokens in {dt:.2f} s including compilation: {n / max(dt, 1e-9):.1f} tokens/s]",
          file=sys.stderr)
    return 0

