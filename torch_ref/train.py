"""Plain PyTorch training for torch_ref: the oracle for ``jaxgpt.optim`` + ``jaxgpt.step``.

build-nanogpt's loop: per step, set the lr from the warmup + cosine schedule, accumulate gradients over the
micro-steps (each micro-loss divided by their count), clip the global norm, ``optimizer.step()``.

Each ``OptimConfig.name`` maps to the torch.optim class configured to the *same update rule* as jaxgpt's optax
chain (the table in ``jaxgpt/optim.py`` lists the rules and where the two libraries' defaults differ):

=========  ==========================================================================================
adamw      ``AdamW(betas=(beta1, beta2), eps, weight_decay)`` -- decoupled decay, as optax.adamw
adam       ``Adam(betas, eps, weight_decay)`` -- torch's decay is coupled L2 (g += wd * p); jaxgpt puts
           ``optax.add_decayed_weights`` before ``optax.adam`` to match
sgd        ``SGD(momentum, dampening=0, nesterov, weight_decay)`` -- the buffer b = m*b + g is optax's
           trace; decay is coupled L2 in both
adagrad    ``Adagrad(initial_accumulator_value = init + eps, eps = 0, lr_decay = 0)`` -- optax divides by
           sqrt(a + eps), torch by sqrt(a) + eps: folding eps into the accumulator's start value and
           setting torch's eps to 0 gives optax's rule exactly
rmsprop    ``RMSprop(alpha, eps, momentum=0, centered=False)`` -- eps outside the sqrt; jaxgpt passes
           ``eps_in_sqrt=False`` to optax.rmsprop
muon       ``Muon`` (below): ``torch.optim.Muon(lr=muon_lr, momentum, nesterov, ns_coefficients, ns_steps,
           weight_decay=muon_weight_decay, adjust_lr_fn)`` on the blocks' hidden matrices, ``AdamW`` on the rest
=========  ==========================================================================================

Muon, and where it meets jaxgpt (``jaxgpt/muon.py`` names each difference of the two libraries): torch.optim.Muon
reads a weight as nn.Linear's (out, in); our weights are HF Conv1D (in, out), so Muon is given the *transposed view*
of each (``weight.T``, sharing storage; its shape-based lr adjustment then sees (out, in) as it was written for),
and, with ``muon_qkv='split'``, one view per q, k, v block of c_attn (``weight[:, i C:(i+1) C].T``), the three
(C, C) matrices the speedrun orthogonalises. Each step hands the views the matching slices of ``weight.grad``.
torch's Newton-Schulz runs in bf16 whatever the config says (``muon_ns_dtype`` is jaxgpt's; the parity tests build
their float64 referee separately).

Weight decay applies to the >= 2-D parameters only (Linear weights, wte, wpe), through two param groups.
The config object is duck-typed (any object with ``OptimConfig``'s fields), so this module needs no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from jaxgpt.optim import OptimConfig


def get_lr(cfg: "OptimConfig", step: int) -> float:
    """build-nanogpt's ``get_lr``, written out independently of jaxgpt's schedule."""
    max_lr, min_lr = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return max_lr
    if step > cfg.decay_steps:
        return min_lr
    decay_ratio = (step - cfg.warmup_steps) / (cfg.decay_steps - cfg.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (max_lr - min_lr)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: >= 2-D params (decayed) and the rest (biases, LayerNorm weights; not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


MUON_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def is_muon_matrix(name: str) -> bool:
    """The blocks' hidden matrices, ``h.{i}.attn.c_attn.weight`` etc. (jaxgpt.muon.muon_labels' names)."""
    parts = name.split(".")
    return len(parts) == 5 and parts[0] == "h" and parts[1].isdigit() and ".".join(parts[2:]) in MUON_MATRICES


class Muon:
    """torch.optim.Muon on the hidden matrices (as transposed views, see the module docstring) and
    torch.optim.AdamW on every other parameter; one schedule: each group's ``lr_scale`` times the step's lr."""

    def __init__(self, model: torch.nn.Module, cfg: "OptimConfig"):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.muon_names = [n for n, _ in named if is_muon_matrix(n)]
        self.views: list[tuple[torch.nn.Parameter, torch.nn.Parameter, slice]] = []  # (view, weight, columns)
        for name, w in named:
            if not is_muon_matrix(name):
                continue
            n_in, n_out = w.shape
            blocks = 3 if cfg.muon_qkv == "split" and name.endswith("attn.c_attn.weight") else 1
            width = n_out // blocks
            for i in range(blocks):
                cols = slice(i * width, (i + 1) * width)
                view = torch.nn.Parameter(w.data[:, cols].T)  # shares w's storage: Muon's in-place steps land in w
                self.views.append((view, w, cols))
        others = [(n, p) for n, p in named if not is_muon_matrix(n)]
        lr = get_lr(cfg, 0)
        scale = cfg.muon_lr / cfg.lr
        self.muon = torch.optim.Muon(
            [v for v, _, _ in self.views], lr=lr * scale, weight_decay=cfg.muon_weight_decay,
            momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_coefficients=tuple(cfg.muon_ns_coeffs),
            ns_steps=cfg.muon_ns_steps,  # eps: torch's default 1e-7 floor (jaxgpt/muon.py, difference 2)
            adjust_lr_fn="match_rms_adamw" if cfg.muon_lr_adjust == "match_rms_adamw" else "original")
        for group in self.muon.param_groups:
            group["lr_scale"] = scale
        groups = [{"params": [p for _, p in others if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for _, p in others if p.dim() < 2], "weight_decay": 0.0}]
        # AdamW with param_groups' rule (decay on the >= 2-D: wte, wpe)
        self.adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(cfg.beta1, cfg.beta2),
                                       eps=cfg.eps, fused=False, foreach=False)
        self.adamw_params = [p for _, p in others]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        for view, w, cols in self.views:  # the (clipped) gradient slice, transposed like the view
            view.grad = None if w.grad is None else w.grad[:, cols].T
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        for view, w, _ in self.views:
            view.grad = None
            if w.grad is not None:
                w.grad = None if set_to_none else w.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def make_optimizer(model: torch.nn.Module, cfg: "OptimConfig") -> torch.optim.Optimizer:
    if cfg.name == "muon":
        return Muon(model, cfg)
    groups = param_groups(model, cfg.weight_decay)
    lr = get_lr(cfg, 0)
    plain = dict(foreach=False)  # the plain per-tensor loops: the code that reads like the formulas above
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=False, **plain)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=False, **plain)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, dampening=0.0, nesterov=cfg.nesterov,
                               **plain)
    if cfg.name == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr, lr_decay=0.0, eps=0.0,
                                   initial_accumulator_value=cfg.adagrad_initial_accumulator + cfg.eps, **plain)
    if cfg.name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr, alpha=cfg.rmsprop_alpha, eps=cfg.eps, momentum=0.0,
                                   centered=False, **plain)
    raise ValueError(f"optimizer name = {cfg.name!r}: allowed values are adamw, adam, sgd, adagrad, rmsprop, muon")


def accumulate_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Backward over the micro-steps of ``x, y: (micro_steps, micro_batch, seq)``, leaving the mean of the
    micro-batch gradients in ``.grad`` (grads must be zeroed first); returns the mean loss."""
    micro_steps = x.shape[0]
    loss_accum = 0.0
    for i in range(micro_steps):
        _, loss = model(x[i], y[i])
        loss = loss / micro_steps  # so the summed grads are the mean over micro-steps
        loss_accum += loss.detach()
        loss.backward()
    return float(loss_accum)


def train_steps(model: torch.nn.Module, batches: Iterable[tuple[Any, Any]], cfg: "OptimConfig", *,
                optimizer: torch.optim.Optimizer | None = None, start_step: int = 0) -> list[float]:
    """Train ``model`` in place, one optimizer step per ``(x, y)`` batch shaped (micro_steps, micro_batch,
    seq); returns each step's mean loss. To continue a run pass its ``optimizer`` (from
    :func:`make_optimizer`) and the number of steps already taken as ``start_step``."""
    device = next(model.parameters()).device
    optimizer = optimizer or make_optimizer(model, cfg)
    model.train()
    losses = []
    for step, (x, y) in enumerate(batches, start=start_step):
        x = torch.as_tensor(x, dtype=torch.long, device=device)
        y = torch.as_tensor(y, dtype=torch.long, device=device)
        optimizer.zero_grad(set_to_none=True)
        losses.append(accumulate_grads(model, x, y))
        update(model, optimizer, cfg, step)
    return losses


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: "OptimConfig", step: int) -> float:
    """One optimizer update from the gradients in ``.grad``: the lr of ``step`` (counted from 0), global-norm
    clipping, ``optimizer.step()``. Returns the gradient norm before clipping."""
    lr = get_lr(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    params = [p for p in model.parameters() if p.grad is not None]
    if cfg.grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    optimizer.step()
    return float(norm)
