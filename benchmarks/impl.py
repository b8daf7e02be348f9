"""What the benchmarks measure: the project's own pieces where they exist, minimal stand-ins where they don't.

Every function returns the thing *and* where it came from (``"jaxgpt.step"`` or ``"benchmarks stand-in"``), and
every result records it, so a table can never pass off a stand-in as the project's train step. The stand-ins
follow the interfaces announced for the library modules:

* ``jaxgpt.optim``: ``OptimConfig``, ``make_optimizer(cfg)``;
* ``jaxgpt.step``: ``init_train_state(model, optimizer) -> (graphdef, state)``,
  ``make_train_step(graphdef, optimizer, *, micro_steps) -> step_fn(state, x, y, key) -> (state, metrics)``;
* ``torch_ref.train``: torch.optim.AdamW with the same hyperparameters and decay groups;
* ``jaxgpt.flops``: analytic FLOPs of a train step;
* ``jaxgpt.generate``: ``generate(model, prompt_ids, max_new_tokens=, temperature=, top_k=, seed=, num_samples=)``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

STANDIN = "benchmarks stand-in"

# AdamW hyperparameters of the stand-in (nanoGPT's GPT-2 recipe); replaced by OptimConfig() once it exists.
STANDIN_HYPER = dict(lr=6e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (e.name == name or name.startswith(e.name + ".") or e.name.startswith(name)):
            return None
        raise


# ---- optimizer hyperparameters, shared by both frameworks -----------------------------------------------------
def _field(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        if hasattr(cfg, n):
            return getattr(cfg, n)
    return default


def optim_hyper() -> tuple[dict[str, Any], str]:
    """AdamW hyperparameters for both frameworks: ``jaxgpt.optim.OptimConfig()`` defaults, else the stand-in's."""
    mod = _try_import("jaxgpt.optim")
    if mod is None or not hasattr(mod, "OptimConfig"):
        return dict(STANDIN_HYPER), STANDIN
    cfg = mod.OptimConfig()
    betas = _field(cfg, "betas")
    hyper = dict(
        lr=float(_field(cfg, "lr", "learning_rate", "peak_lr", "max_lr", default=STANDIN_HYPER["lr"])),
        b1=float(betas[0] if betas else _field(cfg, "b1", "beta1", default=0.9)),
        b2=float(betas[1] if betas else _field(cfg, "b2", "beta2", default=0.95)),
        eps=float(_field(cfg, "eps", "epsilon", default=1e-8)),
        weight_decay=float(_field(cfg, "weight_decay", default=0.1)),
        grad_clip=_field(cfg, "grad_clip", "clip_norm", "max_grad_norm", default=1.0),
    )
    hyper["config"] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else repr(cfg)
    return hyper, "jaxgpt.optim"


# ---- JAX ---------------------------------------------------------------------------------------------------
def jax_optimizer():
    """(optax optimizer, source)."""
    mod = _try_import("jaxgpt.optim")
    if mod is not None and hasattr(mod, "make_optimizer"):
        return mod.make_optimizer(mod.OptimConfig()), "jaxgpt.optim"
    import jax
    import optax

    h = STANDIN_HYPER
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(h["grad_clip"]),
        optax.adamw(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"], mask=decay_mask),
    )
    return tx, STANDIN


def jax_train_step(model, optimizer, *, micro_steps: int):
    """(state, step_fn, source): the project's jitted, donating train step, or the stand-in."""
    mod = _try_import("jaxgpt.step")
    if mod is not None and hasattr(mod, "make_train_step"):
        graphdef, state = mod.init_train_state(model, optimizer)
        return state, mod.make_train_step(graphdef, optimizer, micro_steps=micro_steps), "jaxgpt.step"
    return (*_standin_train_step(model, optimizer, micro_steps), STANDIN)


def jax_fixed_batch_step(cfg, policy, init, x, y):
    """A jaxgpt model and train step over one fixed batch, for timing: ``(step, holder, sources)`` where
    ``step()`` runs one update and returns its metrics (on the device), ``holder["state"]`` is the train state
    and ``sources`` names the optimizer and step implementations."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxgpt.model import GPT

    model = GPT(cfg, policy=policy, rngs=nnx.Rngs(0))
    if init is not None:
        from jaxgpt.weights import load_ref

        load_ref(model, init, source="benchmark init")
    optimizer, opt_src = jax_optimizer()
    state, step_fn, step_src = jax_train_step(model, optimizer, micro_steps=x.shape[0])
    del model
    xd, yd = jax.device_put(jnp.asarray(x)), jax.device_put(jnp.asarray(y))
    key = jax.random.key(0)
    holder = {"state": state}
    if hasattr(step_fn, "jitted"):  # jaxgpt's step: its compiled program, for the roofline prediction
        holder["compiled_text"] = lambda: step_fn.jitted.lower(holder["state"], xd, yd, key).compile().as_text()

    def step():
        holder["state"], metrics = step_fn(holder["state"], xd, yd, key)
        return metrics

    return step, holder, {"train_step": step_src, "optimizer": opt_src}


def _standin_train_step(model, optimizer, micro_steps: int):
    import functools

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    graphdef, params = nnx.split(model, nnx.Param)
    state = {"params": params, "opt": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    def loss_fn(params, x, y):
        return nnx.merge(graphdef, params).loss(x, y)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, x, y, key):
        del key  # dropout 0 in the benchmark configs
        def micro(carry, xy):
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], *xy)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None
        zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state["params"]))
        (loss, grads), _ = jax.lax.scan(micro, zeros, (x, y))
        loss, grads = jax.tree.map(lambda g: g / micro_steps, (loss, grads))
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return ({"params": params, "opt": opt, "step": state["step"] + 1},
                {"loss": loss, "grad_norm": optax.global_norm(grads)})

    return state, step


def flops_per_step(cfg, batch: int, seq: int, micro_steps: int = 1) -> tuple[float, str]:
    """Analytic FLOPs of one train step (forward + backward): jaxgpt.flops, else 6N + 12LTC per token with N the
    parameter count less the position embeddings (the PaLM / nanoGPT estimate; attention counted unmasked)."""
    mod = _try_import("jaxgpt.flops")
    if mod is not None and hasattr(mod, "count_flops"):
        fc = mod.count_flops(cfg, seq, batch_size=batch, grad_accum=micro_steps)
        return float(fc.training_per_step), "jaxgpt.flops.count_flops (matmuls only, attention unmasked)"
    C, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_rows, seq
    n = V * C + L * (12 * C * C + 13 * C) + 2 * C  # wte (tied lm_head) + blocks + ln_f; wpe excluded
    per_token = 6 * n + 12 * L * T * C
    return float(per_token * batch * seq * micro_steps), "6N+12LTC (stand-in)"


# ---- torch -----------------------------------------------------------------------------------------------------
def torch_optimizer(model, hyper: dict[str, Any]):
    """(optimizer, grad_clip, source): torch_ref.train's AdamW if it exists, else AdamW with decay on every
    parameter of 2 or more dimensions (matrices and embeddings), none on biases and LayerNorm."""
    import torch

    mod = _try_import("torch_ref.train")
    if mod is not None and hasattr(mod, "param_groups"):
        groups, src = mod.param_groups(model, hyper["weight_decay"]), "torch_ref.train.param_groups + AdamW(fused)"
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": hyper["weight_decay"]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        src = STANDIN
    # torch's fastest CPU AdamW (fused=True): the same update rule as torch_ref.train.make_optimizer's plain
    # per-tensor loop, so the torch baselines are as fast as torch gets.
    opt = torch.optim.AdamW(groups, lr=hyper["lr"], betas=(hyper["b1"], hyper["b2"]), eps=hyper["eps"], fused=True)
    return opt, hyper.get("grad_clip"), src


def torch_lr_schedule():
    """step -> lr for the torch variants: torch_ref.train.get_lr(OptimConfig(), step) (the same warmup + cosine
    as jaxgpt's optax schedule), else the stand-in's constant lr."""
    train, optim = _try_import("torch_ref.train"), _try_import("jaxgpt.optim")
    if train is not None and optim is not None and hasattr(train, "get_lr") and hasattr(optim, "OptimConfig"):
        cfg = optim.OptimConfig()
        return lambda step: train.get_lr(cfg, step)
    return lambda step: STANDIN_HYPER["lr"]
