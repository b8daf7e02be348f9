"""What a resumed run may change: every field of the checkpoint's training config that differs from the
requested one, classified.

| field | on resume |
|---|---|
| ``model.*`` (shape; not ``model.dropout``) | refused: the arrays would not fit |
| ``optim.name`` | refused: the optimizer state is another optimizer's |
| ``seed``, ``seq_len``, ``loader_mode`` | refused: the data position (and dropout masks) would mean another stream |
| the global batch (tokens per optimizer step) | refused: the data position counts global batches |
| ``resume``, ``resume_step``, ``skip_batches``, ``out_dir`` | not compared: actions and the directory itself |
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
    if saved_global_batch is not None and global_batch is not None and saved_global_batch != global_batch:
        refused.append(f"{GLOBAL_BATCH}: {saved_global_batch:,} -> {global_batch:,} (the data position counts global "
                       "batches; keep batch_size x seq_len x processes x micro steps = total_batch_tokens as saved, "
                       "e.g. change batch_size only together with total_batch_tokens unchanged)")
    return refused, allowed


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
