"""What the evaluations share: the error type and loading a model the way ``jaxgpt.generate`` does."""

from __future__ import annotations

from typing import Any


class EvalError(ValueError):
    """A user-facing evaluation problem (missing or malformed data, a bad option); the message names the fix."""


def load_model(init_from: str, *, precision: str = "fp32", fp8_gemms: str | None = None, seed: int = 0,
               step: int | None = None) -> Any:
    """A GPT from ``init_from`` (a training run directory, a Hugging Face directory or name, ``random:PRESET``),
    with a ``precision`` policy (``fp32``, ``bf16``, ``fp8`` with ``fp8_gemms``, ``auto``, ...):
    :func:`jaxgpt.generate.load_model`."""
    from jaxgpt.generate import load_model as _load
    from jaxgpt.precision import Policy

    return _load(init_from, policy=Policy.named(precision, fp8_gemms=fp8_gemms), seed=seed, step=step)
