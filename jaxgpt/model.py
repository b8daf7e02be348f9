"""GPT-2 in Flax NNX.

Read it side by side with ``torch_ref/model.py``: the same classes in the same order with the same names
(LayerNorm, Linear, CausalSelfAttention, MLP, Block, GPT) and the same parameter names, so one file is a
translation table for the other. Shapes use named axes:

    batch (B), seq (T), embed (C), heads (N), head_dim (D, C = N * D), vocab (V, padded rows Vp >= V)

Numerics follow GPT-2 exactly: pre-LayerNorm blocks with eps 1e-5, the tanh approximation of GELU, a fused
qkv projection, a causal softmax attention scaled by 1/sqrt(D), and an lm_head tied to the token embedding.
Dtypes are decided by one :class:`~jaxgpt.precision.Policy` passed in at construction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxgpt import ops
from jaxgpt.kernels import loss as fused_loss, gelu, mlp as gelu_gemm, layer_norm as norm
from jaxgpt.kernels import qkv as qkv_gemms
from jaxgpt.config import GPTConfig
from jaxgpt.precision import GELU_IN_GEMMS, Policy

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


def dropout(x: Array, rate: float, key: jax.Array | None) -> Array:
    """Inverted dropout; a no-op when ``key`` is None (evaluation) or the rate is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def _split(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    return [None] * n if key is None else list(jax.random.split(key, n))


class KVCache(NamedTuple):
    """Keys and values of every layer for incremental decoding, in the policy's compute dtype."""

    # heads before positions: each decode step reads a layer's (batch, heads, max_seq, head_dim) block as is
    # (with positions before heads XLA transposed the layer's cache every step: ~10% slower decoding measured
    # at 8 prompts x 144 positions)
    k: Float[Array, "layer batch heads max_seq head_dim"]
    v: Float[Array, "layer batch heads max_seq head_dim"]


def attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch kv_seq heads head_dim"],
    v: Float[Array, "batch kv_seq heads head_dim"],
    *,
    policy: Policy,
    mask: Float[Array, "batch 1 seq kv_seq"] | None = None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """softmax(q k^T / sqrt(D) + causal mask) v. Without ``mask`` the attention is causal over one sequence;
    with it (incremental decoding), ``mask[b, 0, t, s]`` says whether query t may see key s."""
    impl = policy.attention_impl()
    if dropout_key is not None and dropout_rate > 0.0:
        impl = "reference"  # the fused kernels have no dropout on the probabilities
    if impl == "reference":
        return reference_attention(q, k, v, policy=policy, mask=mask, dropout_rate=dropout_rate,
                                   dropout_key=dropout_key)
    if mask is not None and impl in ("cudnn", "einsum"):
        impl = "xla"  # an explicit mask (the model's own decoding uses cached_attention) takes XLA's path
    if impl == "einsum":  # the output rounded as the policy's GEMM outputs (Policy.gemm_output), as SDPA's
        y = ops.causal_attention(q, k, v, dtype=policy.dtype, precision=policy.lax_precision)
        return y.astype(policy.out_dtype)
    y = jax.nn.dot_product_attention(policy.cast(q), policy.cast(k), policy.cast(v), mask=mask,
                                     is_causal=mask is None, implementation=impl)
    return y.astype(policy.out_dtype)


def reference_attention(q, k, v, *, policy: Policy, mask=None, dropout_rate=0.0, dropout_key=None):
    """The same attention written out as plain einsums (the oracle for the fused path, and dropout)."""
    T, S = q.shape[1], k.shape[1]
    scores = policy.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])  # fp32
    if mask is None:
        mask = jnp.tril(jnp.ones((T, S), dtype=bool))[None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)  # fp32
    probs = dropout(probs, dropout_rate, dropout_key)
    return policy.einsum("bhts,bshd->bthd", probs, v)


def cached_attention(q: Float[Array, "batch seq heads head_dim"], k: Float[Array, "batch heads kv_seq head_dim"],
                     v: Float[Array, "batch heads kv_seq head_dim"], *, policy: Policy,
                     mask: Float[Array, "batch 1 seq kv_seq"], dropout_rate: float = 0.0,
                     dropout_key: jax.Array | None = None) -> Float[Array, "batch seq heads head_dim"]:
    """Incremental decoding: queries against a KV cache held heads-first; ``mask[b, 0, t, s]`` says whether
    query t may see key s. The same einsums as :func:`reference_attention`."""
    scores = policy.einsum("bthd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])  # fp32
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    probs = dropout(probs, dropout_rate, dropout_key)
    return policy.einsum("bhts,bhsd->bthd", probs, v)


class Residual(NamedTuple):
    """The residual stream ``x`` with a block's MLP output ``add`` not added yet (``Policy.layer_norm = "pallas"``,
    where its kernels run): the next block's ln_1 adds it in its kernel (:meth:`LayerNorm.branch`'s ``add``), as ln_2
    adds the attention's, where XLA would add it in a pass of its own; ln_f's kernel adds the last block's."""

    x: Float[Array, "batch seq embed"]
    add: Float[Array, "batch seq embed"]


@dataclasses.dataclass(frozen=True)
class Projection:
    """A Linear's output not computed yet (``Policy.c_proj = "pallas"``): its input and the layer.
    :meth:`LayerNorm.branch` computes it inside its kernels' custom VJP (jaxgpt.kernels.layer_norm's ``proj``); calling it computes
    ``layer(x)``."""

    x: Float[Array, "... d_in"]
    layer: Linear

    def __call__(self) -> Float[Array, "... d_out"]:
        return self.layer(self.x)


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis, statistics in fp32, optional bias (GPT-2: eps 1e-5, with bias). ``impl``:
    Policy.layer_norm ("fused": the same function with jaxgpt.kernels.layer_norm's two-pass backward; "pallas": ``branch`` with
    one-kernel forward and backward on GPUs). ``branch(x)`` is ``(x, ln(x))``: what a Block's residual branch takes;
    under "pallas" the GPU's kernel writes ln(x) in ``gemm_dtype``, the operand dtype of the GEMMs that read it."""

    def __init__(self, dim: int, *, bias: bool, eps: float, param_dtype=jnp.float32, impl: str = "plain",
                 gemm_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype)) if bias else None
        self.eps = eps
        self.impl = impl
        self.gemm_dtype = jnp.dtype(gemm_dtype)

    def __call__(self, x: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        lead = x.shape[:-1]
        with jax.named_scope("layer_norm"):  # named scopes label the profile's fusions (benchmarks.gpu.profile)
            # as (rows, embed): with a leading batch of 1, XLA:CPU ran the backward's sum over rows for d(scale)
            # ~7x slower on the 3-D (1, T, C) array (6-7 ms per LayerNorm at gpt2's T=1024, 25 per step)
            x = x.reshape(-1, x.shape[-1]).astype(jnp.promote_types(x.dtype, jnp.float32))  # fp32 (fp64 stays)
            if self.impl in ("fused", "pallas"):  # pallas: ln_f where no kernel runs (CPUs) takes fused's backward
                bias = self.bias[...] if self.bias is not None else None
                return norm.layer_norm(x, self.scale[...], bias, eps=self.eps).reshape(*lead, x.shape[-1])
            mean = x.mean(axis=-1, keepdims=True)
            var = jnp.square(x - mean).mean(axis=-1, keepdims=True)  # biased, as torch.nn.LayerNorm
            y = (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...]
            y = y + self.bias[...] if self.bias is not None else y
            return y.reshape(*lead, x.shape[-1])

    def branch(self, x: Float[Array, "... embed"], copies: int = 1,
               add: Float[Array, "... embed"] | Projection | None = None, residual: bool = True
               ) -> tuple[Float[Array, "... embed"], ...]:
        """``(x, ln(x), ...)`` with ``copies`` copies of ln(x), one per GEMM that reads it, of ``x + add`` if ``add``
        is given (a residual branch's output); under "pallas" one custom VJP (jaxgpt.kernels.layer_norm) whose forward makes the
        sum and ln(x) in one pass on GPUs, and whose backward also adds x's residual gradient and sums the copies'
        gradients itself. ``add`` may be a :class:`Projection` (the attention's c_proj under ``Policy.c_proj =
        "pallas"``): under "pallas" the VJP then computes it too, and its backward kernel writes what the projection's
        backward reads (its bf16 output gradient, its bias gradient's partial sums). ``residual=False``: no x in the
        result (ln_f, which no block adds to), and under "pallas" no residual gradient read by the backward kernel."""
        kernels = self.impl == "pallas" and x.dtype == jnp.float32
        proj = add if isinstance(add, Projection) and kernels else None
        if isinstance(add, Projection):
            add = None if kernels else add()
        if not kernels:
            x = x if add is None else x + add
            return ((x,) if residual else ()) + (self(x),) * copies
        if add is not None and add.dtype != jnp.float32:  # a bf16 branch (autocast's c_proj without a bias): XLA adds
            x, add = x + add, None  # it, as before: x + a promotes, and autodiff rounds a's gradient its own way
        with jax.named_scope("layer_norm"):
            bias = self.bias[...] if self.bias is not None else None
            rows = (-1, x.shape[-1])
            linear = None if proj is None else (proj.x.reshape(-1, proj.x.shape[-1]), proj.layer.kernel[...],
                                                None if proj.layer.bias is None else proj.layer.bias[...])
            outs = norm.layer_norm_branch(
                x.reshape(rows), self.scale[...], bias, eps=self.eps, copies=copies,
                add=None if add is None else add.reshape(rows), proj=linear,
                dtype=self.gemm_dtype if proj is None else proj.layer.policy.dtype,
                precision=None if proj is None else proj.layer.policy.lax_precision, residual=residual)
            return tuple(o.reshape(x.shape) for o in outs)  # ([x + add,] ln(x + add), ...), each (rows, embed)


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

    def deferred(self, x: Float[Array, "... d_in"]) -> Projection:
        """``self(x)``, to be computed by the LayerNorm branch that adds it to the residual stream (:class:`Projection`)."""
        return Projection(x, self)

    def split(self, x: Float[Array, "... d_in"] | Sequence[Float[Array, "... d_in"]], n: int
              ) -> list[Float[Array, "... d_out/n"]]:
        """The same ``x @ kernel + bias`` as n equal column blocks, one GEMM each: each block comes out dense. ``x``
        may be n copies of the input, one per block's GEMM (LayerNorm.branch's copies)."""
        xs = list(x) if isinstance(x, (list, tuple)) else [x] * n
        if len(xs) != n:
            raise ValueError(f"Linear.split: {len(xs)} inputs for {n} column blocks: pass one input, or one per block")
        w, b = jnp.split(self.kernel[...], n, axis=-1), [None] * n
        if self.bias is not None:
            b = jnp.split(self.bias[...], n)
        return [self.policy.matmul(xi, wi, gemm=self.gemm) + (0 if bi is None else bi)
                for xi, wi, bi in zip(xs, w, b, strict=True)]


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
    def gemms(self) -> int:
        """How many GEMMs read the attention's input: the one c_attn GEMM on CPUs, q, k and v's three on GPUs (one
        op, jaxgpt.kernels.qkv's, under Policy.qkv = "pallas")."""
        return 1 if ops.platform() == "cpu" or self._qkv_kernels else 3

    @property
    def _qkv_kernels(self) -> bool:
        return self.policy.qkv == "pallas" and qkv_gemms.applies(self.policy.dtype)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"] | Sequence[Float[Array, "batch seq embed"]],
        *,
        cache: KVCache | None = None,
        layer: int = 0,
        pos: Int[Array, ""] | int = 0,
        dropout_key: jax.Array | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVCache | None]:
        """``x``: the input, or one copy of it per GEMM that reads it (:attr:`gemms`; LayerNorm.branch's copies)."""
        attn_key, resid_key = _split(dropout_key, 2)
        if self._qkv_kernels and cache is None:  # bias + bf16 in the GEMMs, one GEMM for dx (jaxgpt.kernels.qkv)
            p, c = self.policy, self.c_attn
            qkv = qkv_gemms.projections(x[0] if isinstance(x, (list, tuple)) else x, c.kernel[...],
                                        None if c.bias is None else c.bias[...], 3, dtype=p.dtype,
                                        precision=p.lax_precision)
        elif self.gemms == 1 and not self._qkv_kernels:
            qkv = self.c_attn(x[0] if isinstance(x, (list, tuple)) else x)  # (B, T, 3C)
            # split, not a (three, ...) unpack: split's backward is one concatenate of dq, dk, dv, an unpack's is
            # three zero-padded copies of the whole qkv gradient (150 ms of a 6 s gpt2 124M step on 2 cores)
            qkv = jnp.split(qkv, 3, axis=-1)
        else:
            # GPUs: one GEMM per projection (the weight's column blocks), so q, k and v come out dense as cuDNN
            # takes them; splitting one (B, T, 3C) output was 36 copy kernels forward and 24 concatenates backward
            # in the compiled H100 step (BENCHMARKS.md, "GPU, compiled"); decoding under Policy.qkv = "pallas" too
            qkv = self.c_attn.split(x[0] if self.gemms == 1 and isinstance(x, (list, tuple)) else x, 3)
        q, k, v = (rearrange(t, "b t (h d) -> b t h d", h=self.n_head) for t in qkv)
        mask = None
        if cache is not None:  # write this step's keys/values at [pos, pos+T) of layer `layer`, in place
            at = (layer, 0, 0, pos, 0)
            heads_first = lambda a: rearrange(a, "b t h d -> b h t d")[None].astype(cache.k.dtype)  # noqa: E731
            cache = KVCache(jax.lax.dynamic_update_slice(cache.k, heads_first(k), at),
                            jax.lax.dynamic_update_slice(cache.v, heads_first(v), at))
            k, v = cache.k[layer], cache.v[layer]  # (B, H, S, D): attend to [0, pos+t]
            T, S = q.shape[1], k.shape[2]
            mask = (jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None])[None, None]
            y = cached_attention(q, k, v, policy=self.policy, mask=mask, dropout_rate=self.dropout,
                                 dropout_key=attn_key)
        else:
            with jax.named_scope("attention"):
                y = attention(q, k, v, policy=self.policy, dropout_rate=self.dropout, dropout_key=attn_key)
        y = rearrange(y, "b t h d -> b t (h d)")  # re-assemble the heads side by side
        if self.policy.c_proj == "pallas" and cache is None and (resid_key is None or self.dropout == 0.0):
            return self.c_proj.deferred(y), cache  # ln_2's kernels compute it (LayerNorm.branch)
        return dropout(self.c_proj(y), self.dropout, resid_key), cache


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, *, policy: Policy, rngs: nnx.Rngs):
        C = config.n_embd
        resid_std = INIT_STD / math.sqrt(2 * config.n_layer)
        self.c_fc = Linear(C, 4 * C, bias=config.bias, std=INIT_STD, policy=policy, rngs=rngs, gemm="mlp")
        self.c_proj = Linear(4 * C, C, bias=config.bias, std=resid_std, policy=policy, rngs=rngs, gemm="mlp")
        self.dropout = config.dropout

    def __call__(self, x: Float[Array, "batch seq embed"], *, dropout_key=None) -> Float[Array, "batch seq embed"]:
        fc = self.c_fc
        if (fc.policy.gemm_output != "float32" or fc.policy.fp8_on("mlp")) and fc.bias is not None:
            # bf16 GEMM output (or the fp8 GEMM's fp32 one, a cuBLASLt call on GPUs that fuses nothing after it):
            # the backward keeps it (and the bias) and recomputes bias + GELU from it, the same values; else XLA
            # kept the fp32 tanh as well, 805 MB per layer at gpt2 b64 (memory and traffic)
            y = fc.policy.matmul(x, fc.kernel[...], gemm=fc.gemm)
            with jax.named_scope("gelu"):
                h = jax.checkpoint(_bias_gelu)(y, fc.bias[...])
        elif fc.policy.gelu in GELU_IN_GEMMS:  # GELU in the GEMMs' epilogues (the same values; bf16h: a bf16 h kept)
            return dropout(self._gelu_in_gemms(x), self.dropout, dropout_key)
        elif fc.policy.gelu == "pallas":  # the same values; GELU's backward one Pallas kernel on GPUs (jaxgpt.kernels.gelu)
            p = fc.policy
            h = gelu.fc_gelu(x, fc.kernel[...], None if fc.bias is None else fc.bias[...], dtype=p.dtype,
                             precision=p.lax_precision, out_dtype=p.out_dtype)
        else:
            h = fc(x)
            with jax.named_scope("gelu"):
                h = jax.nn.gelu(h, approximate=True)  # GPT-2's tanh GELU, in fp32
        return dropout(self.c_proj(h), self.dropout, dropout_key)

    def _gelu_in_gemms(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        """c_proj(gelu(c_fc(x))) as jaxgpt.kernels.mlp computes it (Policy.gelu = "pallas-gemm"; "pallas-recompute": h
        not kept, recomputed in the backward; "pallas-gemm-bf16h": h kept in bf16); c_proj's bias added here, as Linear
        adds it (or in the VJP, under Policy.c_proj = "pallas")."""
        fc, proj, p = self.c_fc, self.c_proj, self.c_fc.policy
        fold = p.c_proj == "pallas"  # c_proj's bias and its gradient's rounding and sum in the GEMMs too
        bias = None if proj.bias is None else proj.bias[...]
        y = gelu_gemm.mlp(x, fc.kernel[...], None if fc.bias is None else fc.bias[...], proj.kernel[...],
                          dtype=p.dtype, precision=p.lax_precision, out_dtype=p.out_dtype,
                          b_proj=bias if fold else None, fold=fold, recompute=p.gelu == "pallas-recompute",
                          h_dtype=jnp.bfloat16 if p.gelu == "pallas-gemm-bf16h" else jnp.float32)
        return y + bias if bias is not None and not fold else y


def _bias_gelu(y: Float[Array, "... d"], bias: Float[Array, " d"]) -> Float[Array, "... d"]:
    """GPT-2's tanh GELU of ``y + bias`` (fp32: a bf16 ``y`` is promoted by the fp32 bias, as in torch_ref)."""
    return jax.nn.gelu(y + bias, approximate=True)


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, *, policy: Policy, rngs: nnx.Rngs):
        eps = config.layer_norm_epsilon
        # the GEMMs' operand dtype: what layer_norm: pallas's forward kernel writes ln(x) in (they cast it to that)
        gemm = policy.dtype
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias, eps=eps, param_dtype=policy.param_dtype,
                              impl=policy.layer_norm, gemm_dtype=gemm)
        self.attn = CausalSelfAttention(config, policy=policy, rngs=rngs)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias, eps=eps, param_dtype=policy.param_dtype,
                              impl=policy.layer_norm, gemm_dtype=gemm)
        self.mlp = MLP(config, policy=policy, rngs=rngs)

    def __call__(self, x: Float[Array, "batch seq embed"] | Residual, *, cache=None, layer=0, pos=0,
                 dropout_key=None) -> tuple[Float[Array, "batch seq embed"] | Residual, KVCache | None]:
        """``x + attn(ln_1(x))``, then ``+ mlp(ln_2(...))``; under layer_norm: pallas where its kernels run (GPUs) the
        last add is left to the next block's ln_1 (a :class:`Residual` in and out)."""
        attn_key, mlp_key = _split(dropout_key, 2)
        x, pending = (x.x, x.add) if isinstance(x, Residual) else (x, None)
        # branch(x) is (x, ln(x)): under layer_norm: pallas its backward also adds the residual stream's gradient
        # and ln_1 hands the attention one copy of ln(x) per GEMM that reads it, whose gradients its backward sums
        x, *h = self.ln_1.branch(x, copies=self.attn.gemms, add=pending)  # x + the previous block's MLP output
        a, cache = self.attn(h, cache=cache, layer=layer, pos=pos, dropout_key=attn_key)
        x, h = self.ln_2.branch(x, add=a)  # x + a: the residual stream stays fp32
        m = self.mlp(h, dropout_key=mlp_key)
        if self.ln_1.impl == "pallas" and norm.runs_kernels() and x.dtype == m.dtype == jnp.float32:
            return Residual(x, m), cache  # the next ln_1's forward kernel adds it (XLA's add elsewhere, as before)
        return x + m, cache


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
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias, eps=config.layer_norm_epsilon,
                              param_dtype=policy.param_dtype, impl=policy.layer_norm, gemm_dtype=policy.dtype)

    # ---- the forward pass, in pieces --------------------------------------------------------------------
    def hidden(
        self,
        idx: Int[Array, "batch seq"],
        *,
        cache: KVCache | None = None,
        pos: Int[Array, ""] | int = 0,
        dropout_key: jax.Array | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVCache | None]:
        """Final hidden states (after ln_f), fp32 (under layer_norm: pallas on GPUs, ln_f's kernel writes them in the
        GEMMs' dtype, bf16 where they compute in it, as every reader rounds them); with a cache, tokens sit at
        positions [pos, pos+T)."""
        check_tokens(idx, self.config)
        T = idx.shape[1]
        if cache is not None:
            check_cache_positions(pos, T, cache.k.shape[3], self.config)
        keys = _split(dropout_key, self.config.n_layer + 1)
        positions = pos + jnp.arange(T)
        with jax.named_scope("embed"):
            x = self.wte(idx) + self.wpe(positions)[None]  # (B, T, C)
        x = dropout(x, self.config.dropout, keys[-1])
        for i, block in enumerate(self.h):
            x, cache = block(x, cache=cache, layer=i, pos=pos, dropout_key=keys[i])
        if isinstance(x, Residual):  # the last block's MLP output, added by ln_f's forward kernel (layer_norm: pallas)
            (h,) = self.ln_f.branch(x.x, add=x.add, residual=False)
            return h, cache
        return self.ln_f(x), cache

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
            if self.policy.fast_kernels:  # same value, without materialising the fp32 logits twice
                return fused_loss.lm_head_cross_entropy(h, self.wte.embedding[...], targets,
                                                 vocab_size=self.config.vocab_size, dtype=self.policy.dtype,
                                                 logits_dtype=self.policy.logits_dtype,
                                                 precision=self.policy.lax_precision,
                                                 fp8=self.policy.fp8_on("lm_head"), lm_head=self.policy.lm_head)
            return cross_entropy(self.logits(h), targets)

    def token_losses(self, idx: Int[Array, "batch seq"], targets: Int[Array, "batch seq"]
                     ) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"]]:
        """Each position's next-token cross-entropy in fp32 (no dropout), and whether its target is the greedy
        (largest-logit) token: what evaluation sums, averages and checks."""
        check_tokens(targets, self.config, name="targets")
        h, _ = self.hidden(idx)
        return fused_loss.token_cross_entropy(h, self.wte.embedding[...], targets, vocab_size=self.config.vocab_size,
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


def cross_entropy(logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"]) -> Float[Array, ""]:
    """Mean of -log softmax(logits)[target], computed in fp32."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # fp32 (fp64 stays)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - target_logit)
