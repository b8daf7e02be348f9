"""What a resumed run may change: every field of the checkpoint's training config that differs from the
requested one, classified.

| field | on resume |
|---|---|
| ``model.*`` (shape; not ``model.dropout``) | refused: the arrays would not fit |
| ``optim.name`` | refused: the optimizer state is another optimizer's |
| ``seed``, ``seq_len``, ``loader_mode`` | refused: the data position (and dropout masks) would mean another stream |
| the global batch (tokens per optimizer step) | refused: the data position counts global batches |
| ``resume``, ``resume_step``, ``skip_batches``, ``out_dir`` | not compared: actions and the directory itself |
| ``optim.*`` fields whose change gives the optimizer state another structure (clipping or weight decay switched on or off for the coupled-decay optimizers, SGD momentum on or off) | refused: the saved state would not fit the requested optimizer |
| everything else: ``optim.*`` (lr, schedule, weight decay, betas, clipping), ``precision``, ``attention``, ``dropout``, per-device ``batch_size`` at the same global batch, ``max_steps``, intervals, sampling, ``keep_checkpoints``, the divergence guard, ``mesh``, ``data_dir`` (the loader still refuses other data) | allowed: printed (old -> new) and recorded in metrics.jsonl as a ``config_change`` record |

A refused change is a :class:`~jaxgpt.config.ConfigError` naming every such field, its saved and requested
values, and the fix: use the saved value, or start a new run in another ``out_dir``.
"""

from __future__ import annotations

from typing import Any

from jaxgpt.config import ConfigError

NOT_COMPARED = frozenset({"resume", "resume_step", "skip_batches", "out_dir"})
REFUSED = {
    "optim.name": "the optimizer state belongs to another optimizer",
    "seed": "the data order and dropout masks of the saved run follow from its seed",
    "seq_len": "the data position counts windows of the saved sequence length",
    "loader_mode": "the data position belongs to the saved loader mode",
    "tokenizer": "the model's ids are the saved tokenizer's",
}
_MODEL_FREE = frozenset({"model.dropout"})
GLOBAL_BATCH = "tokens per optimizer step"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _why_refused(field: str) -> str | None:
    if field.startswith("model.") and field not in _MODEL_FREE:
        return "the saved arrays have the saved model's shape"
    return REFUSED.get(field)


def classify(saved: dict[str, Any], requested: dict[str, Any], *, saved_global_batch: int | None = None,
             global_batch: int | None = None) -> tuple[list[str], dict[str, list[Any]]]:
    """``(refused, allowed)``: a sentence per refused change, and ``{field: [old, new]}`` of the allowed ones.
    ``saved_global_batch`` / ``global_batch``: tokens per optimizer step then and now (None: not compared)."""
    a, b = flatten(saved), flatten(requested)
    refused, allowed = [], {}
    for field in sorted(set(a) | set(b)):
        if field.split(".")[0] in NOT_COMPARED:
            continue
        old, new = a.get(field, "<absent>"), b.get(field, "<absent>")
        if old == new:
            continue
        why = _why_refused(field)
        if why is None:
            allowed[field] = [old, new]
        else:
            refused.append(f"{field}: {old!r} -> {new!r} ({why}; use --{field}={_cli(old)})")
    optim_changed = [f for f in allowed if f.startswith("optim.")]
    saved_optim, requested_optim = saved.get("optim"), requested.get("optim")
    if optim_changed and optimizer_state_differs(saved_optim, requested_optim):
        alone = [f for f in optim_changed if optimizer_state_differs(
            saved_optim, {**saved_optim, f.removeprefix("optim."): allowed[f][1]})]
        for field in alone or optim_changed:  # the fields that change it alone, else the combination
            old, new = allowed.pop(field)
            refused.append(f"{field}: {old!r} -> {new!r} (gives the optimizer state another structure, which the "
                           f"saved state would not fit; use --{field}={_cli(old)})")
    if saved_global_batch is not None and global_batch is not None and saved_global_batch != global_batch:
        refused.append(f"{GLOBAL_BATCH}: {saved_global_batch:,} -> {global_batch:,} (the data position counts global "
                       "batches; keep batch_size x seq_len x processes x micro steps = total_batch_tokens as saved, "
                       "e.g. change batch_size only together with total_batch_tokens unchanged)")
    return refused, allowed


def optimizer_state_differs(saved: dict[str, Any] | None, requested: dict[str, Any] | None) -> bool:
    """Whether the two optimizer configs' states have different tree structures (checked on a two-parameter
    stand-in with a matrix and a vector, which decides every structural choice: clipping, the decay mask, the
    optimizer's own slots). False when either config cannot be built (an older or foreign checkpoint: the
    restore's own structure check then speaks)."""
    import jax
    import jax.numpy as jnp

    from jaxgpt.optim import OptimConfig, make_optimizer

    try:
        a, b = (OptimConfig.from_dict(d) for d in (saved, requested))
    except (ConfigError, TypeError, ValueError, KeyError, AttributeError):
        return False
    stand_in = {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros((2,))}

    def structure(cfg: OptimConfig) -> Any:
        return jax.tree.structure(jax.eval_shape(make_optimizer(cfg).init, stand_in))

    return structure(a) != structure(b)


def check_resume(saved: dict[str, Any], requested: dict[str, Any], *, step: int, where: str,
                 saved_global_batch: int | None, global_batch: int) -> dict[str, list[Any]]:
    """The allowed changes; raises :class:`ConfigError` listing every refused one with its fix."""
    refused, allowed = classify(saved, requested, saved_global_batch=saved_global_batch, global_batch=global_batch)
    if refused:
        raise ConfigError(f"cannot resume {where} (step {step}) with these changed settings, which would break its "
                          "exact continuation:\n  " + "\n  ".join(refused)
                          + "\nUse the saved values, or start a new run in another out_dir.")
    return allowed


def describe(allowed: dict[str, list[Any]]) -> str:
    return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in allowed.items())


def _cli(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
