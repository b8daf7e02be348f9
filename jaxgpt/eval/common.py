"""What the evaluations share: the error type, loading a model the way ``jaxgpt.generate`` does and jitting its
programs with the compiler options the train step gets."""

from __future__ import annotations

from typing import Any


def jit_model_program(graphdef: Any, fun: Any, **jit_kwargs: Any) -> Any:
    """``jax.jit(fun, **jit_kwargs)`` with the XLA options the train step and jaxgpt.generate compile
    ``graphdef``'s model with on the platform traced for now (:func:`jaxgpt.step.platform_compiler_options`: under
    precision fp8 on GPUs, cuBLASLt fp8 GEMMs instead of Triton ones; None, XLA's defaults, for every other model and
    on the CPU). The options change which kernels run, not the numbers."""
    import jax

    from jaxgpt import ops
    from jaxgpt.step import platform_compiler_options

    return jax.jit(fun, compiler_options=platform_compiler_options(graphdef, ops.platform()), **jit_kwargs)


class EvalError(ValueError):
    """A user-facing evaluation problem (missing or malformed data, a bad option); the message names the fix."""


def load_model(init_from: str, *, precision: str = "fp32", fp8_gemms: str | None = None,
               logits_dtype: str | None = None, seed: int = 0, step: int | None = None) -> Any:
    """A GPT from ``init_from`` (a training run directory, a Hugging Face directory or name, ``random:PRESET``),
    with a ``precision`` policy (``fp32``, ``bf16``, ``fp8`` with ``fp8_gemms``, ``auto``, ...; ``logits_dtype``:
    the lm_head's, None for the precision's own): :func:`jaxgpt.generate.load_model`."""
    from jaxgpt.generate import load_model as _load
    from jaxgpt.precision import Policy

    policy = Policy.named(precision, fp8_gemms=fp8_gemms, logits_dtype=logits_dtype)
    return _load(init_from, policy=policy, seed=seed, step=step)
