"""Sampling text from a GPT: a jit-compiled KV-cache decoder with nanoGPT's semantics, and a CLI.

    >>> out = generate(model, [15496, 11], max_new_tokens=20, temperature=0.8, top_k=50, seed=1337)
    >>> out.shape  # (num_samples, prompt length + max_new_tokens)
    (1, 22)

Semantics (the same as ``torch_ref.GPT.generate``, nanoGPT's ``generate``): for each new token the model
sees the last ``block_size`` tokens of the sequence so far, takes the logits of the last position, divides
them by ``temperature``, keeps the logits >= the ``top_k``-th largest (ties kept), and samples from their
softmax. ``temperature == 0`` is greedy decoding (argmax). The model's logits cover the real vocabulary
only, so padded-vocabulary ids can never be sampled.

Modules: :mod:`~jaxgpt.generate.api` (:func:`generate`, :func:`generate_samples`, :func:`generate_text`),
:mod:`~jaxgpt.generate.decode` (the jitted prefill + KV-cache decode loop), :mod:`~jaxgpt.generate.sampling`
(temperature, top-k and the categorical draw), :mod:`~jaxgpt.generate.load` (the model and tokenizer
``--init-from`` names), :mod:`~jaxgpt.generate.cli` (``python -m jaxgpt.generate``),
:mod:`~jaxgpt.generate.errors` (:class:`GenerateError`). This package re-exports their public names, importing
each module when one of its names is first used: ``python -m jaxgpt.generate`` imports this package before its
``__main__`` hands the tool to :func:`jaxgpt.interrupt.run_cli`, which must import jax itself (so that a Ctrl-C
during those imports is the tool's one line).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "generate": "api", "generate_samples": "api", "generate_text": "api",
    "build_parser": "cli", "int_at_least": "cli", "main": "cli",
    "trace_count": "decode",
    "GenerateError": "errors",
    "load_checkpoint": "load", "load_model": "load", "load_tokenizer": "load",
    "argmax": "sampling", "categorical": "sampling", "kth_largest": "sampling", "sample_logits": "sampling",
}

__all__ = ["GenerateError", "argmax", "build_parser", "categorical", "generate", "generate_samples", "generate_text",
           "int_at_least", "kth_largest", "load_checkpoint", "load_model", "load_tokenizer", "main", "sample_logits",
           "trace_count"]


def __getattr__(name: str) -> Any:
    """A re-exported name, from the module that defines it (imported now, then kept here)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
