"""GPT-2 in Flax NNX.

Read it side by side with ``torch_ref/model.py``: the same classes in the same order with the same names
(LayerNorm, Linear, CausalSelfAttention, MLP, Block, GPT) and the same parameter names, so one file is a
translation table for the other. Shapes use named axes:

    batch (B), seq (T), embed (C), heads (N), head_dim (D, C = N * D), vocab (V, padded rows Vp >= V)

Numerics follow GPT-2 exactly: pre-LayerNorm blocks with eps 1e-5, the tanh approximation of GELU, a fused
qkv projection, a causal softmax attention scaled by 1/sqrt(D), and an lm_head tied to the token embedding.
Dtypes are decided by one :class:`~jaxgpt.precision.Policy` passed in at construction, and so is which implementation
each op runs: the layers call the kernel layer's ops (:mod:`jaxgpt.kernels`: the residual add + LayerNorm, the q, k, v
projections, attention, the MLP, the loss), whose reference is the plain expression torch_ref writes out. A Block
takes and returns ``(hidden, residual)``, the residual add left to the LayerNorm after it, on every platform.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxgpt.config import GPTConfig
from jaxgpt.kernels import attention, layer_norm, loss, mlp, qkv
from jaxgpt.kernels.loss import cross_entropy  # noqa: F401 (jaxgpt.model.cross_entropy: the parity tests' reference)
from jaxgpt.ops import dropout
from jaxgpt.precision import Policy

INIT_STD = 0.02  # GPT-2's initializer_range


class TokenError(ValueError):
    """Token ids or a sequence that the model cannot take (out of vocabulary, too long, wrong shape)."""


def check_tokens(idx, config: GPTConfig, *, name: str = "idx") -> None:
    """Refuse what the model would otherwise silently clamp or mis-index.

    Shape and length are static and always checked; the id range is checked whenever the values are
    concrete (numpy arrays, or jax arrays outside ``jit``). Inside ``jit`` the caller checks its batches.
    """
    shape = tuple(getattr(idx, "shape", ()))
    if len(shape) != 2:
        raise TokenError(f"{name} must have shape (batch, seq), got {shape}")
    if shape[1] > config.block_size:
        raise TokenError(f"{name} has sequence length {shape[1]} but block_size is {config.block_size}; "
                         f"crop the input to its last {config.block_size} tokens")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TokenError(f"{name} must hold integer token ids, got dtype {idx.dtype}")
    if isinstance(idx, jax.core.Tracer) or idx.size == 0:
        return
    values = np.asarray(idx)
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= config.vocab_size:
        bad = values[(values < 0) | (values >= config.vocab_size)]
        raise TokenError(f"{name} holds token ids outside [0, {config.vocab_size}): e.g. {bad[:5].tolist()} "
                         f"(min {lo}, max {hi}); ids must come from the GPT-2 tokenizer")


def check_cache_positions(pos, seq: int, cache_len: int, config: GPTConfig) -> None:
    """Refuse decoding past the KV cache or the position table, which would otherwise go wrong silently
    (``dynamic_update_slice`` clamps the write index; ``wpe`` returns NaN rows). Checked when ``pos`` is
    concrete (outside ``jit``)."""
    if isinstance(pos, jax.core.Tracer):
        return
    pos, limit = int(pos), min(cache_len, config.block_size)
    if pos < 0 or pos + seq > limit:
        raise TokenError(f"decoding {seq} token(s) at position {pos} needs positions [{pos}, {pos + seq}), but the "
                         f"KV cache holds {cache_len} and block_size is {config.block_size}: positions must lie "
                         f"in [0, {limit})")


def _split(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    return [None] * n if key is None else list(jax.random.split(key, n))


class KVCache(NamedTuple):
    """Keys and values of every layer for incremental decoding, in the policy's compute dtype."""

    # heads before positions: each decode step reads a layer's (batch, heads, max_seq, head_dim) block as is
    # (with positions before heads XLA transposed the layer's cache every step: ~10% slower decoding measured
    # at 8 prompts x 144 positions)
    k: Float[Array, "layer batch heads max_seq head_dim"]
    v: Float[Array, "layer batch heads max_seq head_dim"]


class LayerNorm(nnx.Module):
    """The residual add and LayerNorm over the last axis (statistics in fp32, optional bias; GPT-2: eps 1e-5, with
    bias): ``(hidden, residual) -> (residual + hidden, ln(residual + hidden), ...)``, torch_ref's ``x = x + a`` and
    ``ln(x)`` as one op of the kernel layer (jaxgpt.kernels.layer_norm.add_layer_norm), one copy of ln(x) per GEMM
    that reads it (``copies``)."""

    def __init__(self, dim: int, *, bias: bool, eps: float, policy: Policy | None = None):
        policy = policy or Policy()
        self.scale = nnx.Param(jnp.ones((dim,), policy.param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), policy.param_dtype)) if bias else None
        self.eps = eps
        self.policy = policy

    def __call__(self, hidden: Float[Array, "batch seq embed"], residual: Float[Array, "batch seq embed"] | None = None,
                 *, copies: int = 1, keep_residual: bool = True) -> tuple[Float[Array, "batch seq embed"], ...]:
        bias = None if self.bias is None else self.bias[...]
        return layer_norm.add_layer_norm(hidden, residual, self.scale[...], bias, eps=self.eps, copies=copies,
                                         impl=self.policy.kernel("layer_norm"), dtype=self.policy.dtype,
                                         keep_residual=keep_residual)


class Linear(nnx.Module):
    """y = x @ kernel + bias, with ``kernel`` stored (in, out) like Hugging Face's Conv1D. ``gemm``: the layer's
    kind for ``Policy.fp8`` ("attn" or "mlp")."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, std: float, policy: Policy, rngs: nnx.Rngs,
                 gemm: str = "attn"):
        pdt = jnp.dtype(policy.param_dtype)  # float32 (float64 only under Policy.fp64, the parity tests' truth)
        self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), (d_in, d_out), pdt))
        self.bias = nnx.Param(jnp.zeros((d_out,), pdt)) if bias else None
        self.policy = policy
        self.gemm = gemm

    def __call__(self, x: Float[Array, "... d_in"]) -> Float[Array, "... d_out"]:
        y = self.policy.matmul(x, self.kernel[...], gemm=self.gemm)  # fp32 accumulation
        return y + self.bias[...] if self.bias is not None else y

    def params(self) -> tuple[Float[Array, "d_in d_out"], Float[Array, " d_out"] | None]:
        return self.kernel[...], None if self.bias is None else self.bias[...]


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, *, policy: Policy, rngs: nnx.Rngs):
        C = config.n_embd
        resid_std = INIT_STD / math.sqrt(2 * config.n_layer)  # GPT-2: scale residual projections
        self.c_attn = Linear(C, 3 * C, bias=config.bias, std=INIT_STD, policy=policy, rngs=rngs)
        self.c_proj = Linear(C, C, bias=config.bias, std=resid_std, policy=policy, rngs=rngs)
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.policy = policy

    @property
    def inputs(self) -> int:
        """How many GEMMs read the attention's input (jaxgpt.kernels.qkv.gemms): ln_1 hands one copy to each."""
        return qkv.gemms(self.policy.kernel("qkv"), self.policy.dtype)

    def __call__(
        self,
        x: Sequence[Float[Array, "batch seq embed"]],
        *,
        cache: KVCache | None = None,
        layer: int = 0,
        pos: Int[Array, ""] | int = 0,
        dropout_key: jax.Array | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVCache | None]:
        """``x``: one copy of the input per GEMM that reads it (:attr:`inputs`)."""
        attn_key, resid_key = _split(dropout_key, 2)
        qkv_ = qkv.project(list(x), *self.c_attn.params(), policy=self.policy, impl=self.policy.kernel("qkv"),
                           decoding=cache is not None)
        q, k, v = (rearrange(t, "b t (h d) -> b t h d", h=self.n_head) for t in qkv_)
        if cache is not None:  # write this step's keys/values at [pos, pos+T) of layer `layer`, in place
            at = (layer, 0, 0, pos, 0)
            heads_first = lambda a: rearrange(a, "b t h d -> b h t d")[None].astype(cache.k.dtype)  # noqa: E731
            cache = KVCache(jax.lax.dynamic_update_slice(cache.k, heads_first(k), at),
                            jax.lax.dynamic_update_slice(cache.v, heads_first(v), at))
            k, v = cache.k[layer], cache.v[layer]  # (B, H, S, D): attend to [0, pos+t]
            T, S = q.shape[1], k.shape[2]
            mask = (jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None])[None, None]
            y = attention.cached_attention(q, k, v, policy=self.policy, mask=mask, dropout_rate=self.dropout,
                                           dropout_key=attn_key)
        else:
            with jax.named_scope("attention"):
                y = attention.attention(q, k, v, policy=self.policy, dropout_rate=self.dropout, dropout_key=attn_key)
        y = rearrange(y, "b t h d -> b t (h d)")  # re-assemble the heads side by side
        return dropout(self.c_proj(y), self.dropout, resid_key), cache


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, *, policy: Policy, rngs: nnx.Rngs):
        C = config.n_embd
        resid_std = INIT_STD / math.sqrt(2 * config.n_layer)
        self.c_fc = Linear(C, 4 * C, bias=config.bias, std=INIT_STD, policy=policy, rngs=rngs, gemm="mlp")
        self.c_proj = Linear(4 * C, C, bias=config.bias, std=resid_std, policy=policy, rngs=rngs, gemm="mlp")
        self.dropout = config.dropout
        self.policy = policy

    def __call__(self, x: Float[Array, "batch seq embed"], *, dropout_key=None) -> Float[Array, "batch seq embed"]:
        """c_proj(gelu(c_fc(x))), GPT-2's tanh GELU in fp32 (jaxgpt.kernels.mlp.apply)."""
        y = mlp.apply(x, *self.c_fc.params(), *self.c_proj.params(), policy=self.policy,
                      impl=self.policy.kernel("mlp"))
        return dropout(y, self.dropout, dropout_key)


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, *, policy: Policy, rngs: nnx.Rngs):
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias, eps=eps, policy=policy)
        self.attn = CausalSelfAttention(config, policy=policy, rngs=rngs)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias, eps=eps, policy=policy)
        self.mlp = MLP(config, policy=policy, rngs=rngs)

    def __call__(self, hidden: Float[Array, "batch seq embed"], residual: Float[Array, "batch seq embed"] | None, *,
                 cache=None, layer=0, pos=0, dropout_key=None
                 ) -> tuple[Float[Array, "batch seq embed"], Float[Array, "batch seq embed"], KVCache | None]:
        """torch_ref's ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`` with each add inside the LayerNorm after it:
        ``(hidden, residual)`` in, ``(mlp's output, the residual stream before it)`` out; the next ln_1 (or ln_f)
        adds them."""
        attn_key, mlp_key = _split(dropout_key, 2)
        residual, *h = self.ln_1(hidden, residual, copies=self.attn.inputs)
        a, cache = self.attn(h, cache=cache, layer=layer, pos=pos, dropout_key=attn_key)
        residual, h = self.ln_2(a, residual)  # the residual stream stays fp32
        return self.mlp(h, dropout_key=mlp_key), residual, cache


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, *, policy: Policy | None = None, rngs: nnx.Rngs):
        policy = policy or Policy()
        self.config = config
        self.policy = policy
        pdt = jnp.dtype(policy.param_dtype)
        wte = INIT_STD * jax.random.normal(rngs.params(), (config.vocab_rows, config.n_embd), pdt)
        wte = wte.at[config.vocab_size:].set(0.0)  # padded rows: never a target, never sampled
        self.wte = nnx.Embed(config.vocab_rows, config.n_embd, embedding_init=lambda *_: wte, param_dtype=pdt,
                             rngs=rngs)
        self.wpe = nnx.Embed(config.block_size, config.n_embd, embedding_init=nnx.initializers.normal(INIT_STD),
                             param_dtype=pdt, rngs=rngs)
        self.h = nnx.List([Block(config, policy=policy, rngs=rngs) for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias, eps=config.layer_norm_epsilon, policy=policy)

    # ---- the forward pass, in pieces --------------------------------------------------------------------
    def hidden(
        self,
        idx: Int[Array, "batch seq"],
        *,
        cache: KVCache | None = None,
        pos: Int[Array, ""] | int = 0,
        dropout_key: jax.Array | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVCache | None]:
        """Final hidden states (after ln_f), fp32 (under kernels.layer_norm: pallas on GPUs, its kernel writes them in
        the GEMMs' dtype, bf16 where they compute in it, as every reader rounds them); with a cache, tokens sit at
        positions [pos, pos+T)."""
        check_tokens(idx, self.config)
        T = idx.shape[1]
        if cache is not None:
            check_cache_positions(pos, T, cache.k.shape[3], self.config)
        keys = _split(dropout_key, self.config.n_layer + 1)
        positions = pos + jnp.arange(T)
        with jax.named_scope("embed"):
            x = self.wte(idx) + self.wpe(positions)[None]  # (B, T, C)
        x, residual = dropout(x, self.config.dropout, keys[-1]), None
        for i, block in enumerate(self.h):
            x, residual, cache = block(x, residual, cache=cache, layer=i, pos=pos, dropout_key=keys[i])
        (h,) = self.ln_f(x, residual, keep_residual=False)
        return h, cache

    def logits(self, h: Float[Array, "batch seq embed"], *, head: Float[Array, "vocab_rows embed"] | None = None
               ) -> Float[Array, "batch seq vocab"]:
        """The tied lm_head: h @ wte^T, fp32, over the real vocabulary only (padded columns dropped). ``head``:
        wte already cast to the compute dtype (the decoder casts it once, not once per token)."""
        head = self.wte.embedding[...] if head is None else head
        if self.policy.fp8_on("lm_head"):  # e4m3 operands (jaxgpt.kernels.fp8), fp32 accumulation, then logits_dtype
            logits = self.policy.matmul(h, head.T, gemm="lm_head")
            return self.policy.round_logits(logits)[..., : self.config.vocab_size]
        return self.policy.round_logits(self.policy.einsum("btc,vc->btv", h, head))[..., : self.config.vocab_size]

    def __call__(self, idx: Int[Array, "batch seq"], *, dropout_key=None) -> Float[Array, "batch seq vocab"]:
        h, _ = self.hidden(idx, dropout_key=dropout_key)
        return self.logits(h)

    def loss(self, idx: Int[Array, "batch seq"], targets: Int[Array, "batch seq"], *, dropout_key=None
             ) -> Float[Array, ""]:
        """Mean next-token cross-entropy in fp32 (padded vocabulary columns excluded)."""
        check_tokens(targets, self.config, name="targets")  # never gathered out of range or wrapped
        h, _ = self.hidden(idx, dropout_key=dropout_key)
        with jax.named_scope("cross_entropy"):  # the lm_head matmul and the loss
            return loss.apply(h, self.wte.embedding[...], targets, self.logits, vocab_size=self.config.vocab_size,
                              policy=self.policy, impl=self.policy.kernel("loss"))

    def token_losses(self, idx: Int[Array, "batch seq"], targets: Int[Array, "batch seq"]
                     ) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"]]:
        """Each position's next-token cross-entropy in fp32 (no dropout), and whether its target is the greedy
        (largest-logit) token: what evaluation sums, averages and checks."""
        check_tokens(targets, self.config, name="targets")
        h, _ = self.hidden(idx)
        return loss.token_cross_entropy(h, self.wte.embedding[...], targets, vocab_size=self.config.vocab_size,
                                       logits_dtype=self.policy.logits_dtype,
                                       dtype=self.policy.dtype, precision=self.policy.lax_precision,
                                       fp8=self.policy.fp8_on("lm_head"))

    # ---- incremental decoding -------------------------------------------------------------------------
    def init_cache(self, batch: int, max_seq: int | None = None) -> KVCache:
        cfg = self.config
        shape = (cfg.n_layer, batch, cfg.n_head, max_seq or cfg.block_size, cfg.head_dim)
        return KVCache(jnp.zeros(shape, self.policy.dtype), jnp.zeros(shape, self.policy.dtype))

    def decode(self, idx: Int[Array, "batch seq"], cache: KVCache, pos: Int[Array, ""] | int
               ) -> tuple[Float[Array, "batch seq vocab"], KVCache]:
        """Logits of tokens placed at positions [pos, pos+T), attending to the cache; returns the new cache."""
        h, cache = self.hidden(idx, cache=cache, pos=pos)
        return self.logits(h), cache
