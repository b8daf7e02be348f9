"""Muon for jaxgpt, assembled from optax's own Muon pieces to torch.optim.Muon's update rule.

Muon (Keller Jordan, modded-nanogpt): momentum SGD whose update of each hidden weight matrix is orthogonalised by a
few Newton-Schulz iterations; AdamW stays on the embeddings, the (tied) head, the biases and the LayerNorms.

**Routing** (:func:`muon_labels`): ``h.{i}.attn.c_attn.kernel``, ``h.{i}.attn.c_proj.kernel``, ``h.{i}.mlp.c_fc.kernel``
and ``h.{i}.mlp.c_proj.kernel`` go to Muon; everything else (``wte``, ``wpe``, biases, LayerNorm) to AdamW with
GPT-2's betas and decay on the >= 2-D leaves (:func:`jaxgpt.optim.decay_mask`). torch_ref routes the same tensors.

**The fused qkv matrix** (``muon_qkv``): ``split`` (default) orthogonalises c_attn's (C, 3C) kernel as its three
(C, C) blocks q, k, v, as the speedrun does (its qkv weight is stacked (3, C, C)); here through optax's own batch
axis (``MuonDimensionNumbers(reduction_axis=0, output_axis=2)`` on the (C, 3, C) view). ``fused``: one (C, 3C).

**Non-square scaling** (``muon_lr_adjust``): ``original`` multiplies the update by ``sqrt(max(1, fan_out / fan_in))``
(Keller Jordan's; optax's ``scale_by_shape`` without ``consistent_rms``: 2 for c_fc (C, 4C), 1 for the others, and 1
for each split q/k/v block, 3**0.5 for a fused c_attn); ``match_rms_adamw`` by ``0.2 sqrt(max(fan_in, fan_out))``
(Moonshot's; optax's ``consistent_rms=0.2``).

The Muon part, per matrix, with ``g`` the clipped gradient, ``m`` = ``muon_momentum``, ``lr_t`` the scheduled
``muon_lr``::

    b = m b + g                       optax.trace(m, nesterov)        [state: one buffer per matrix]
    u = g + m b  (nesterov) | b
    u = (1 - m) u                     optax.scale(1 - m)
    O = NS_k(u) in muon_ns_dtype      optax.contrib's orthogonalize_via_newton_schulz (frobenius); in bf16 the
                                      same iteration at torch's rounding points (difference 8)
    O = s(shape) O                    optax.contrib's scale_by_shape
    p -= lr_t (O + wd p)              optax.add_decayed_weights, optax.scale_by_learning_rate

Why not ``optax.contrib.muon`` itself: built as it is in optax 0.2.8 it is another rule than torch.optim.Muon's, in
ways no argument changes. Each difference, and how it is bridged here:

1. *Momentum*. torch keeps an EMA without bias correction, ``buf = m buf + (1-m) g``, and its Nesterov step is
   ``g.lerp(buf, m) = (1-m) g + m buf``; optax's ``scale_by_muon`` bias-corrects both terms,
   ``m mu/(1-m^(t+1)) + (1-m) g/(1-m^t)``, which is another *direction* in the first steps. optax's ``trace`` (the
   undamped buffer ``b = buf / (1-m)``) times ``1 - m`` is torch's vector exactly: ``(1-m)(g + m b) = (1-m) g + m buf``.
2. *The normalisation's eps*. torch divides by ``max(|u|_F, 1e-7)``, optax by ``|u|_F + eps``: optax's eps shrinks
   every update by the relative amount eps / |u|_F (with optax's default eps = 1e-8 that is 0.7% on the tiny test
   model's key block, whose momentum has |u|_F ~ 1.5e-6; 6% at 1e-7), torch's floor does nothing once |u|_F >= 1e-7. So optax's eps is set to
   ``NS_EPS`` = 1e-30 (still > 0: a zero matrix stays 0, not NaN), which makes optax's ``u / (|u| + eps)`` equal
   torch's ``u / max(|u|, 1e-7)`` for every |u|_F >= 1e-7; below that (a matrix whose momentum is < 1e-7 in norm)
   torch shrinks the update and optax does not. The ``1 - m`` above keeps |u| at torch's scale, so that this
   threshold is met at the same momentum in both.
3. *Newton-Schulz dtype*. torch runs it in bf16 (hard-coded in ``_zeropower_via_newtonschulz``); optax in its input's
   dtype. The input is cast to ``muon_ns_dtype`` (bf16 by default, as torch and the speedrun; float32; float64 for
   tests under ``jax.enable_x64``) and the result cast back to the parameter's dtype.
4. *Shape scaling*. torch reads ``(A, B) = param.shape`` as nn.Linear's ``(out, in)`` and scales by
   ``sqrt(max(1, A/B))``; our weights are HF Conv1D ``(in, out)``, so torch_ref hands torch.optim.Muon the transposed
   view, and optax's ``sqrt(max(1, fan_out/fan_in))`` with reduction axis 0 (in) and output axis 1 (out) is the same
   number. ``match_rms_adamw`` = ``consistent_rms=0.2``.
5. *Weight decay*. torch: ``p *= 1 - lr wd`` with the unadjusted lr, then ``p -= lr s O``; here ``-lr (s O + wd p)``:
   the same, as optax.contrib.muon also does (``add_decayed_weights`` after ``scale_by_shape``).
6. *The other parameters*. optax.contrib.muon's Adam part is NAdam whenever Muon is Nesterov, uses Muon's eps and
   decays every non-Muon leaf; torch_ref uses torch.optim.AdamW, so here it is ``optax.adamw`` with GPT-2's betas,
   ``OptimConfig.eps`` and decay on ``decay_mask`` (wte, wpe), the rule jaxgpt's ``adamw`` already matches.
7. *Routing*. optax.contrib.muon sends every 2-D leaf to Muon (wte and wpe too) unless given dimension numbers;
   here :func:`muon_labels` names the four block matrices, passed to ``optax.partition`` (what optax.contrib.muon
   builds on).
8. *bf16 Newton-Schulz's roundings*. optax casts the coefficients to the iteration's dtype, and in bf16 that is
   another polynomial: (3.4445, -4.7750, 2.0315) becomes (3.4375, -4.78125, 2.03125); and it rounds every product,
   scaled product and sum to bf16 separately, where ``a X`` and ``B X`` nearly cancel. torch's iteration is two
   ``addmm``s per step that take the exact coefficients, accumulate ``beta M + alpha P Q`` in fp32 and round once.
   optax's iteration in bf16 measured 3-4x torch's distance from a float64 Newton-Schulz (GPT-2 shapes), and no
   argument of optax's changes where it rounds. So in bf16 (only) jaxgpt runs :func:`newton_schulz_bf16`: the same
   iteration written with torch's rounding points (bf16 operands, fp32 accumulation and coefficients, one rounding
   per ``addmm``, the norm floor ``NS_NORM_FLOOR`` as torch's ``clamp``), 0.99-1.02x torch's distance. fp32 and
   float64 use optax's function, whose coefficient cast is exact to 1e-7 there.

optax 0.2.8 does not re-export ``orthogonalize_via_newton_schulz`` and ``scale_by_shape`` from ``optax.contrib``; they
are taken from ``optax.contrib._muon``, the module ``optax.contrib.muon`` is made of. ``tests/test_optim.py`` checks
that, where the two rules coincide (no Nesterov, fp32), this chain and ``optax.contrib.muon`` give the same step.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers
from optax.contrib import _muon as optax_muon

MUON_MATRIX = re.compile(r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.kernel$")
QKV = re.compile(r"^h\.\d+\.attn\.c_attn\.kernel$")
NS_DTYPE = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float64": jnp.float64}
NS_EPS = 1e-30  # optax's eps in |u|_F + eps: negligible (difference 2 in the module docstring); a normal number in bf16
NS_NORM_FLOOR = 1e-7  # torch.optim.Muon's eps: u / max(|u|_F, 1e-7) (difference 2), in the bf16 iteration


def path_name(path: tuple) -> str:
    """'h.0.attn.c_attn.kernel' for a key path into an nnx.State (or a dict of dicts); nnx's trailing '.value'
    attribute is dropped."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":
                parts.append(k.name)
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return ".".join(parts)


def is_muon_matrix(name: str) -> bool:
    return MUON_MATRIX.match(name) is not None


def muon_labels(params: Any) -> Any:
    """'muon' for the blocks' hidden matrices (attention qkv and projection, MLP fc and projection kernels),
    'adamw' for everything else; same structure as ``params``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "muon" if is_muon_matrix(path_name(path)) else "adamw", params)


def _map_named(fn, updates: Any) -> Any:
    """``fn(name, leaf)`` over the leaves (optax.partition's MaskedNode placeholders have none)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: fn(path_name(path), x), updates)


def _to_ns_layout(split_qkv: bool) -> optax.GradientTransformation:
    """c_attn's (C, 3C) -> (C, 3, C) when split: q, k, v become a batch axis of optax's Newton-Schulz."""

    def fn(name, x):
        if split_qkv and QKV.match(name):
            c = x.shape[0]
            if x.shape != (c, 3 * c):
                raise ValueError(f"{name}: expected a (C, 3C) kernel to split into q, k, v; got {x.shape}")
            return x.reshape(c, 3, c)
        return x

    return optax.stateless(lambda updates, params=None: _map_named(fn, updates))


def _from_ns_layout() -> optax.GradientTransformation:
    def fn(name, x):
        return x.reshape(x.shape[0], -1) if x.ndim == 3 else x

    return optax.stateless(lambda updates, params=None: _map_named(fn, updates))


def dimension_numbers(updates: Any) -> Any:
    """Reduction axis 0 (in), output axis the last (out); the middle axis of a split qkv is a batch axis."""
    return jax.tree.map(lambda x: MuonDimensionNumbers(reduction_axis=0, output_axis=x.ndim - 1), updates)


def orthogonalize(x: jax.Array, cfg, dim_nums: MuonDimensionNumbers | None = None) -> jax.Array:
    """The Newton-Schulz orthogonalisation (Frobenius preconditioning) of ``x`` computed in ``cfg.muon_ns_dtype``,
    returned in ``x``'s dtype: optax's function in fp32/float64, :func:`newton_schulz_bf16` in bf16 (difference 8).
    ``x``: (in, out), or (in, 3, out) for a split qkv (the middle axis a batch axis); ``dim_nums`` names the in
    (reduction) and out axes of another layout, every other axis a batch axis."""
    dtype = NS_DTYPE[cfg.muon_ns_dtype]
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:  # jax would silently compute in float32
        from jaxgpt.config import ConfigError

        raise ConfigError("OptimConfig.muon_ns_dtype = 'float64' needs 64-bit jax: run inside "
                          "`with jax.enable_x64(True):` (float64 is for tests), or use 'float32'")
    dim_nums = dim_nums or MuonDimensionNumbers(0, x.ndim - 1)
    if dtype == jnp.bfloat16:  # difference 8
        batch = [i for i in range(x.ndim) if i not in (dim_nums.reduction_axis, dim_nums.output_axis)]
        order = [*batch, dim_nums.reduction_axis, dim_nums.output_axis]  # (batch..., in, out)
        out = newton_schulz_bf16(jnp.transpose(x, order), tuple(cfg.muon_ns_coeffs), cfg.muon_ns_steps)
        return jnp.transpose(out, np.argsort(order)).astype(x.dtype)
    coeffs = jnp.asarray(cfg.muon_ns_coeffs, dtype)
    out = optax_muon.orthogonalize_via_newton_schulz(
        x.astype(dtype), coeffs, cfg.muon_ns_steps, "frobenius", jnp.asarray(NS_EPS, dtype), dim_nums)
    return out.astype(x.dtype)


def _addmm(m: jax.Array, p: jax.Array, q: jax.Array, *, beta: float, alpha: float = 1.0) -> jax.Array:
    """torch.addmm(m, p, q, beta=beta, alpha=alpha) of (stacks of) bf16 matrices: ``beta m + alpha (p @ q)`` accumulated in fp32
    with the scalars in fp32, rounded to bf16 once."""
    f32 = jnp.float32
    return (beta * m.astype(f32) + alpha * jnp.matmul(p, q, preferred_element_type=f32)).astype(jnp.bfloat16)


def newton_schulz_bf16(x: jax.Array, coeffs: tuple[float, float, float], steps: int) -> jax.Array:
    """torch.optim.Muon's bf16 Newton-Schulz (``_zeropower_via_newtonschulz``) at torch's rounding points, for ``x``
    of shape (..., in, out) (leading axes: a batch of matrices, each orthogonalised on its own); returns bf16. The
    iteration is optax's (and the speedrun's); only where it rounds, and the exact coefficients, differ from optax's
    bf16 run of it (module docstring, difference 8)."""
    a, b, c = coeffs
    u = x.astype(jnp.bfloat16)
    tall = u.shape[-2] > u.shape[-1]
    if tall:  # the Gram matrix of the short side
        u = jnp.swapaxes(u, -1, -2)
    norm = jnp.linalg.norm(u.astype(jnp.float32), axis=(-2, -1), keepdims=True).astype(jnp.bfloat16)
    norm = jnp.maximum(norm, jnp.bfloat16(NS_NORM_FLOOR))
    u = (u.astype(jnp.float32) / norm.astype(jnp.float32)).astype(jnp.bfloat16)
    for _ in range(steps):
        gram = jnp.matmul(u, jnp.swapaxes(u, -1, -2), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        update = _addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A A
        u = _addmm(u, update, u, beta=a)  # a X + (b A + c A A) X
    return jnp.swapaxes(u, -1, -2) if tall else u


def _as_matrices(x: jax.Array) -> jax.Array:
    """A Muon leaf as a stack of (in, out) matrices: (in, out) -> (1, in, out); a split qkv (in, 3, out) ->
    (3, in, out)."""
    return x[None] if x.ndim == 2 else jnp.moveaxis(x, 1, 0)


def _from_matrices(m: jax.Array, like: jax.Array) -> jax.Array:
    return m[0] if like.ndim == 2 else jnp.moveaxis(m, 0, 1)


def orthogonalize_all(xs: list[jax.Array], cfg) -> list[jax.Array]:
    """:func:`orthogonalize` of every Muon leaf, the matrices of one shape stacked into one batched call (each still
    orthogonalised on its own): one set of 3 x ``muon_ns_steps`` batched GEMMs per shape instead of one per matrix
    (GPT-2: 4 shapes instead of 72 matrices), which is what the small GEMMs' launch and dispatch cost asks for."""
    groups: dict[tuple, list[int]] = {}
    mats = [_as_matrices(x) for x in xs]
    for i, m in enumerate(mats):
        groups.setdefault((m.shape[1:], m.dtype), []).append(i)
    out: list[jax.Array | None] = [None] * len(xs)
    for idx in groups.values():
        stacked = jnp.concatenate([mats[i] for i in idx]) if len(idx) > 1 else mats[idx[0]]
        done = orthogonalize(stacked, cfg, MuonDimensionNumbers(reduction_axis=1, output_axis=2))
        parts = jnp.split(done, np.cumsum([mats[i].shape[0] for i in idx])[:-1]) if len(idx) > 1 else [done]
        for i, part in zip(idx, parts):
            out[i] = _from_matrices(part, xs[i])
    return out


def _orthogonalize_all(cfg) -> optax.GradientTransformation:
    def update(updates, params=None):
        leaves, treedef = jax.tree.flatten(updates)
        return jax.tree.unflatten(treedef, orthogonalize_all(leaves, cfg))

    return optax.stateless(update)


def muon_part(cfg, learning_rate) -> optax.GradientTransformation:
    """The Muon rule (module docstring) for the leaves :func:`muon_labels` routes to it."""
    m = cfg.muon_momentum
    return optax.chain(
        optax.trace(decay=m, nesterov=cfg.muon_nesterov),  # b = m b + g; u = g + m b (difference 1)
        optax.scale(1.0 - m),  # (1 - m) u: torch's EMA-form vector, exactly (differences 1, 2)
        _to_ns_layout(cfg.muon_qkv == "split"),
        _orthogonalize_all(cfg),  # in muon_ns_dtype (difference 3)
        optax_muon.scale_by_shape(  # difference 4
            weight_dimension_numbers=dimension_numbers,
            consistent_rms=0.2 if cfg.muon_lr_adjust == "match_rms_adamw" else None),
        _from_ns_layout(),
        optax.add_decayed_weights(cfg.muon_weight_decay),  # difference 5
        optax.scale_by_learning_rate(learning_rate),
    )


def muon_transform(cfg, learning_rate, muon_learning_rate, *, decay_mask) -> optax.GradientTransformation:
    """``clip_by_global_norm`` (all grads together, as torch's clip_grad_norm_ over the model) -> partition:
    Muon on :func:`muon_labels`' matrices, AdamW on the rest, weight decay where ``decay_mask`` (a function of the
    params, :func:`jaxgpt.optim.decay_mask`: passed in, so this module does not import jaxgpt.optim back)."""
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.partition(
        {"muon": muon_part(cfg, muon_learning_rate),
         "adamw": optax.adamw(learning_rate, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,  # difference 6
                              weight_decay=cfg.weight_decay, mask=decay_mask)},
        muon_labels))
    return optax.chain(*parts)
