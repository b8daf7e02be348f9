"""The fast set: the opt-in settings issue 32 predicts fastest on an H100, named once here for every GPU tool that
runs or compiles it (the compare part's bench rows, profile and recipe, the kernel checks, the wgmma test).

Its bench variant (:data:`VARIANT`, ``benchmarks.gpu.worker``) takes the Policy fields; the optimizer's grouped
gradient norm is a training setting the bench's fixed optimizer does not take, so the bench rows run without it
and the recipe (``python -m jaxgpt.train``) and compiled programs with it.
"""

from __future__ import annotations

VARIANT = "jax_bf16_fast"  # benchmarks.gpu.worker's variant of the fast set
# TrainConfig field -> value, as `python -m jaxgpt.train --FIELD=VALUE` and `python -m jaxgpt.compile --set` take them
# (kernels: pallas, the Pallas LayerNorm, MLP GEMMs, q/k/v GEMMs and loss; h kept in bf16 for GELU's backward and bf16
# logits, as torch.compile's autocast keeps them: numerics changes, so explicit; the grouped gradient norm)
SETTINGS: dict[str, str] = {"kernels": "pallas", "gelu_h_dtype": "bfloat16", "logits_dtype": "bfloat16",
                            "optim.grad_norm": "grouped"}


# the stem of its compiled H100 predictions in benchmarks/results (predicted-h100-kernels-pallas-{b64,b16,gpt2-124m}:
# python -m jaxgpt.compile --config configs/gpt2-124m.yaml --target h100-sxm --no-search --set FIELD=VALUE for each of
# SETTINGS, with total_batch_tokens=65536 for b64, total_batch_tokens=16384 batch_size=16 for b16, nothing for the recipe)
PREDICTED = "kernels-pallas"


def policy_fields() -> dict[str, str]:
    """The Policy fields of the set (what the bench variant sets beyond precision bf16)."""
    return {k: v for k, v in SETTINGS.items() if "." not in k}


def train_flags() -> list[str]:
    """``--FIELD=VALUE`` for ``python -m jaxgpt.train``."""
    return [f"--{k}={v}" for k, v in SETTINGS.items()]


def compile_sets() -> list[str]:
    """``FIELD=VALUE`` for ``python -m jaxgpt.compile --set`` (and ``load_config``)."""
    return [f"{k}={v}" for k, v in SETTINGS.items()]


def shown() -> str:
    return " ".join(compile_sets())
