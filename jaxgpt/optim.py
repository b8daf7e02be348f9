"""Optimizers: one frozen config, the build-nanogpt learning-rate schedule, and an optax chain per optimizer.

Every optimizer is ``clip_by_global_norm -> [L2 weight decay] -> optimizer -> scale by -lr``, wrapped in
``optax.inject_hyperparams`` so the learning rate used by each update sits in the optimizer state
(``opt_state.hyperparams["learning_rate"]``; the train step reports it as ``metrics["lr"]``).

The update rules, and how ``torch_ref/train.py`` configures torch.optim to the same rule (``g`` is the clipped
gradient, ``p`` a parameter, ``wd`` the weight decay on the decay set: >= 2-D parameters only):

========  ==========================================  =========================================================
name      rule (optax, as built here)                 torch.optim counterpart
========  ==========================================  =========================================================
adamw     Adam moments of g; p -= lr * (m_hat /       ``AdamW(betas, eps, weight_decay=wd)``: decoupled decay
          (sqrt(v_hat) + eps) + wd * p)               p *= 1 - lr * wd, the same rule
adam      g += wd * p (coupled L2), then Adam         ``Adam(weight_decay=wd)``: torch's Adam decay is L2
sgd       g += wd * p; b = momentum * b + g;          ``SGD(momentum, dampening=0, nesterov)``; torch's
          nesterov: u = g + momentum * b; p -= lr*u   ``weight_decay`` is the same coupled L2
adagrad   g += wd * p; a += g^2;                      ``Adagrad(initial_accumulator_value = init + eps,
          p -= lr * g / sqrt(a + eps)                 eps=0, lr_decay=0)``: same rule (eps moved into a)
rmsprop   g += wd * p; v = alpha v + (1-alpha) g^2;   ``RMSprop(alpha, eps, momentum=0, centered=False)``
          p -= lr * g / (sqrt(v) + eps)
muon      blocks' matrices: b = m b + g; u = (1-m)    ``Muon(muon_lr, momentum, nesterov, ns_coefficients,
          (g + m b); p -= lr_m (s NS_5(u) + wd_m p);  ns_steps, weight_decay)`` on transposed views, ``AdamW``
          the rest: adamw as above (jaxgpt/muon.py)   on the rest (torch_ref/train.py)
========  ==========================================  =========================================================

Where optax and torch differ *by default* (each is pinned above to one rule):

==========================  ======================================  ==============================================
setting                     optax                                   torch.optim
==========================  ======================================  ==============================================
Adam/AdamW betas, eps       (0.9, 0.999), 1e-8: the same            (0.9, 0.999), 1e-8 (GPT-2 uses b2 0.95: set)
AdamW weight decay          1e-4, on every param unless ``mask``    1e-2, on every param unless param groups
Adam / SGD / Adagrad /      no decay; decay is a separate           ``weight_decay`` = coupled L2 (added to the
RMSprop weight decay        ``add_decayed_weights`` transform       gradient before the update), default 0
                            placed wherever the chain puts it
SGD momentum                ``optax.sgd(momentum=None)``: off;      momentum=0: off; buffer b = m*b + (1-d)*g
                            trace b = m*b + g (no dampening)        with dampening d (default 0: identical)
Adagrad accumulator init    ``initial_accumulator_value=0.1``       0
Adagrad eps                 1e-7, *inside* the sqrt:                1e-10, *outside* the sqrt:
                            g / sqrt(a + eps)                       g / (sqrt(a) + eps)
RMSprop decay               ``decay=0.9``                           ``alpha=0.99``
RMSprop eps                 1e-8, *inside* the sqrt                 1e-8, *outside* the sqrt
                            (``eps_in_sqrt=True``)                  (optax: ``eps_in_sqrt=False`` matches)
RMSprop momentum            trace *after* the lr scaling (the       buffer of g / avg, scaled by lr after: differ
                            buffer holds lr * g / avg)              under a schedule; not offered here
Global-norm clipping        g * c / |g| when |g| >= c               g * min(1, c / (|g| + 1e-6)) (same to ~1e-6)
==========================  ======================================  ==============================================

So here: Adagrad and RMSprop use ``OptimConfig.eps`` in optax's place for Adagrad (inside the sqrt) and in
torch's place for RMSprop (outside); ``adagrad_initial_accumulator`` defaults to torch's 0.0;
``rmsprop_alpha`` to torch's 0.99; ``nesterov`` applies to SGD only (torch's Adam has none).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from jaxgpt.config import ConfigError, _require, from_dict, to_dict

OPTIMIZERS = ("adamw", "adam", "sgd", "adagrad", "rmsprop", "muon")
SCHEDULES = ("cosine", "constant")
NS_DTYPES = ("bfloat16", "float32", "float64")
MUON_QKV = ("split", "fused")
MUON_LR_ADJUST = ("original", "match_rms_adamw")
GRAD_NORMS = ("per-leaf", "grouped")
SMALL_LEAF = 1 << 16  # elements: a leaf below it joins the grouped norm's one concatenated reduction


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "adam", "sgd", "adagrad", "rmsprop", "muon"] = "adamw"
    lr: float = 6e-4  # max learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 715  # linear warmup: lr * (step + 1) / warmup_steps for step < warmup_steps
    decay_steps: int = 19073  # step at which the cosine reaches lr * min_lr_ratio (then constant)
    schedule: Literal["cosine", "constant"] = "cosine"  # constant: warmup, then lr
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # on >= 2-D params only; decoupled for adamw, coupled L2 for the others
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    rmsprop_alpha: float = 0.99  # rmsprop's decay of the squared-gradient average (torch's alpha)
    adagrad_initial_accumulator: float = 0.0
    grad_clip: float = 1.0  # global norm; 0 disables
    # how the global gradient norm (clipping and the grad_norm metric) is summed: "per-leaf" (optax.tree.norm: one
    # reduction per parameter, 148 for gpt2) or "grouped" (the < 65,536-element leaves, biases and LayerNorm scales,
    # concatenated into one reduction: on GPUs ~100 fewer kernel launches per step; the same norm to fp32 rounding)
    grad_norm: Literal["per-leaf", "grouped"] = "per-leaf"
    # ---- muon (name='muon'): Muon on the blocks' hidden matrices, AdamW (lr, beta1, beta2, eps, weight_decay
    # above) on everything else; see jaxgpt/muon.py. Defaults: KellerJordan/Muon's Muon(lr=0.02, momentum=0.95,
    # nesterov=True, ns_steps=5, weight_decay=0) and its quintic coefficients.
    muon_lr: float = 0.02  # peak lr of the Muon part; the warmup/cosine schedule scales it as it scales lr
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_coeffs: tuple[float, ...] = (3.4445, -4.7750, 2.0315)  # the quintic's (a, b, c)
    muon_ns_dtype: Literal["bfloat16", "float32", "float64"] = "bfloat16"  # as torch.optim.Muon and the speedrun
    muon_weight_decay: float = 0.0  # decoupled, p -= lr_t * wd * p (torch.optim.Muon's rule)
    muon_qkv: Literal["split", "fused"] = "split"  # c_attn's (C, 3C) as three (C, C) matrices, or one
    muon_lr_adjust: Literal["original", "match_rms_adamw"] = "original"  # sqrt(max(1, out/in)) or 0.2 sqrt(max)

    def __post_init__(self) -> None:
        n = type(self).__name__

        def number(field: str, ok, allowed: str) -> None:
            v = getattr(self, field)
            is_num = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            _require(n, field, v, is_num and ok(v), allowed)

        def integer(field: str, lo: int) -> None:
            v = getattr(self, field)
            _require(n, field, v, isinstance(v, int) and not isinstance(v, bool) and v >= lo,
                     f"must be an integer >= {lo}")

        _require(n, "name", self.name, self.name in OPTIMIZERS, f"allowed values are {list(OPTIMIZERS)}")
        _require(n, "schedule", self.schedule, self.schedule in SCHEDULES,
                 f"allowed values are {list(SCHEDULES)}")
        number("lr", lambda v: v > 0, "must be a finite number > 0")
        number("min_lr_ratio", lambda v: 0 <= v <= 1, "must be in [0, 1]")
        integer("warmup_steps", 0)
        integer("decay_steps", 1)
        if self.schedule == "cosine":
            _require(n, "decay_steps", self.decay_steps, self.decay_steps > self.warmup_steps,
                     f"must be > warmup_steps ({self.warmup_steps}) for the cosine schedule")
        number("beta1", lambda v: 0 <= v < 1, "must be in [0, 1)")
        number("beta2", lambda v: 0 <= v < 1, "must be in [0, 1)")
        number("eps", lambda v: v > 0, "must be a finite number > 0")
        number("weight_decay", lambda v: v >= 0, "must be a finite number >= 0")
        number("momentum", lambda v: 0 <= v < 1, "must be in [0, 1)")
        _require(n, "nesterov", self.nesterov, isinstance(self.nesterov, bool), "expected true or false")
        if self.nesterov:
            _require(n, "nesterov", self.nesterov, self.name == "sgd",
                     f"applies to name='sgd' only (name is {self.name!r})")
            _require(n, "nesterov", self.nesterov, self.momentum > 0, "needs momentum > 0")
        number("rmsprop_alpha", lambda v: 0 <= v < 1, "must be in [0, 1)")
        number("adagrad_initial_accumulator", lambda v: v >= 0, "must be a finite number >= 0")
        number("grad_clip", lambda v: v >= 0, "must be a finite number >= 0 (0 disables clipping)")
        _require(n, "grad_norm", self.grad_norm, self.grad_norm in GRAD_NORMS, f"allowed values are {list(GRAD_NORMS)}")
        number("muon_lr", lambda v: v > 0, "must be a finite number > 0")
        number("muon_momentum", lambda v: 0 <= v < 1, "must be in [0, 1)")
        _require(n, "muon_nesterov", self.muon_nesterov, isinstance(self.muon_nesterov, bool),
                 "expected true or false")
        integer("muon_ns_steps", 1)
        coeffs = self.muon_ns_coeffs
        _require(n, "muon_ns_coeffs", coeffs, isinstance(coeffs, tuple) and len(coeffs) == 3 and all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in coeffs),
                 "must be three finite numbers (a, b, c), e.g. [3.4445, -4.7750, 2.0315]")
        _require(n, "muon_ns_dtype", self.muon_ns_dtype, self.muon_ns_dtype in NS_DTYPES,
                 f"allowed values are {list(NS_DTYPES)}")
        number("muon_weight_decay", lambda v: v >= 0, "must be a finite number >= 0")
        _require(n, "muon_qkv", self.muon_qkv, self.muon_qkv in MUON_QKV, f"allowed values are {list(MUON_QKV)}")
        _require(n, "muon_lr_adjust", self.muon_lr_adjust, self.muon_lr_adjust in MUON_LR_ADJUST,
                 f"allowed values are {list(MUON_LR_ADJUST)}")

    @property
    def min_lr(self) -> float:
        return self.lr * self.min_lr_ratio

    def replace(self, **changes: Any) -> "OptimConfig":
        return from_dict(OptimConfig, {**to_dict(self), **changes})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OptimConfig":
        return from_dict(cls, data)


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """build-nanogpt's ``get_lr``: ``lr * (step + 1) / warmup`` for ``step < warmup``, then a cosine from
    ``lr`` (at ``step == warmup``) to ``lr * min_lr_ratio`` (at ``step >= decay_steps``); ``step`` counts
    optimizer updates from 0. ``schedule='constant'``: the same warmup, then ``lr``."""
    lr, min_lr, warmup, decay = cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        if cfg.schedule == "cosine":
            ratio = jnp.clip((step - warmup) / (decay - warmup), 0.0, 1.0)
            after = min_lr + 0.5 * (1.0 + jnp.cos(jnp.pi * ratio)) * (lr - min_lr)
        else:
            after = jnp.full_like(step, lr)
        if warmup == 0:
            return after
        return jnp.where(step < warmup, lr * (step + 1.0) / warmup, after)

    return schedule


def decay_mask(params: Any) -> Any:
    """True for the parameters weight decay applies to: ndim >= 2 (Linear kernels, wte and wpe); False for
    biases and LayerNorm scales. Same structure as ``params``."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def grouped_norm(tree: Any) -> jax.Array:
    """The global L2 norm of ``tree``'s leaves (optax.tree.norm's value) with every leaf under :data:`SMALL_LEAF`
    elements concatenated into one sum of squares: one reduction for gpt2's 98 biases and LayerNorm scales instead
    of one each. The summation order differs from optax.tree.norm's, so the two agree to fp32 rounding."""
    leaves = jax.tree.leaves(tree)
    small = [jnp.ravel(x) for x in leaves if jnp.size(x) < SMALL_LEAF]
    squares = [jnp.sum(jnp.square(x)) for x in leaves if jnp.size(x) >= SMALL_LEAF]
    if small:
        squares.append(jnp.sum(jnp.square(jnp.concatenate(small))))
    return jnp.sqrt(sum(squares)) if squares else jnp.zeros((), jnp.float32)


def global_norm_fn(cfg: OptimConfig):
    """The global-norm function ``cfg.grad_norm`` names (what clipping uses; the train step's grad_norm metric
    should use the same one, so XLA computes it once)."""
    return grouped_norm if cfg.grad_norm == "grouped" else optax.tree.norm


def clip_by_global_norm(max_norm: float, norm=optax.tree.norm) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with the norm given: ``g * max_norm / |g|`` when ``|g| >= max_norm``; the same
    empty state (checkpoints do not change)."""

    def update_fn(updates, state, params=None):
        del params
        g_norm = norm(updates)
        trigger = g_norm < max_norm
        updates = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm),
                               updates)
        return updates, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _transform(cfg: OptimConfig, learning_rate) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_norm == "per-leaf"
                     else clip_by_global_norm(cfg.grad_clip, grouped_norm))
    wd = cfg.weight_decay
    if cfg.name == "adamw":  # decoupled: p -= lr * wd * p, on the mask
        parts.append(optax.adamw(learning_rate, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=wd,
                                 mask=decay_mask))
        return optax.chain(*parts)
    if wd > 0:  # coupled L2 (torch's weight_decay for these optimizers): g += wd * p, after clipping
        parts.append(optax.add_decayed_weights(wd, mask=decay_mask))
    if cfg.name == "adam":
        parts.append(optax.adam(learning_rate, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps))
    elif cfg.name == "sgd":
        parts.append(optax.sgd(learning_rate, momentum=cfg.momentum or None, nesterov=cfg.nesterov))
    elif cfg.name == "adagrad":
        parts.append(optax.adagrad(learning_rate, initial_accumulator_value=cfg.adagrad_initial_accumulator,
                                   eps=cfg.eps))
    elif cfg.name == "rmsprop":
        parts.append(optax.rmsprop(learning_rate, decay=cfg.rmsprop_alpha, eps=cfg.eps, eps_in_sqrt=False))
    elif cfg.name == "muon":  # decay is inside each part (decoupled): not the coupled L2 above
        raise ConfigError("OptimConfig.name = 'muon' is built by jaxgpt.muon.muon_transform")
    else:  # unreachable: __post_init__ validates the name
        raise ConfigError(f"OptimConfig.name = {cfg.name!r}: allowed values are {list(OPTIMIZERS)}")
    return optax.chain(*parts)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm -> optimizer`` with ``lr_schedule(cfg)`` and weight decay on ``decay_mask``;
    the learning rate of each update is kept in the state (see :func:`current_lr`)."""

    schedule = lr_schedule(cfg)
    if cfg.name == "muon":
        from jaxgpt.muon import muon_transform

        ratio = cfg.muon_lr / cfg.lr

        def muon_chain(learning_rate, muon_learning_rate):
            return muon_transform(cfg, learning_rate, muon_learning_rate, decay_mask=decay_mask)

        # one schedule for both parts: the Muon part's lr is the AdamW part's times muon_lr / lr
        return optax.inject_hyperparams(muon_chain)(learning_rate=schedule,
                                                    muon_learning_rate=lambda step: schedule(step) * ratio)

    def chain(learning_rate):
        return _transform(cfg, learning_rate)

    return optax.inject_hyperparams(chain)(learning_rate=schedule)


def current_lr(opt_state: Any) -> jax.Array | None:
    """The learning rate the last update used (the schedule's value before the first), or None when the
    optimizer was not built by :func:`make_optimizer` (no injected ``learning_rate``)."""
    hyperparams = getattr(opt_state, "hyperparams", None)
    return hyperparams.get("learning_rate") if isinstance(hyperparams, dict) else None
