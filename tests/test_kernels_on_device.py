"""The opt-in Pallas kernels on a GPU, as compiled Triton kernels, against XLA's path (CUDA only: skipped cleanly
without a GPU; ``python -m benchmarks.gpu.session kernels`` runs them on one, beside the kernels' own tests, whose
interpreted kernels it compiles).

A tiny GPT (2 layers, n_embd 32, a 256-token vocabulary: tests/tiny_training.py) under each opt-in setting against
the same GPT on XLA's path, on the device, from the same init and batch: its loss and every parameter's gradient
after one step, and its losses over 3 AdamW steps. Bounds, those of the CPU tests of the same kernels: the losses
within 1e-4 relative of XLA's path's (tests/kernels/test_mlp.py, test_layer_norm_kernel.py: the interpreted
kernels' bound; gelu_h_dtype bfloat16 under kernels.mlp pallas-gemm, one more rounding of h, within 1e-3 of the
plain policy's, its tests/kernels/test_mlp.py bound), and each gradient within parity_tests/tolerances.py's bf16 gradient bounds (relative
Frobenius error <= GRAD_BF16_REL, cosine >= GRAD_BF16_COS: the bound gelu_h_dtype bfloat16 is held to against
fp32; a kernel differing from XLA by summation order and single roundings sits far inside it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests.tolerances import GRAD_BF16_COS, GRAD_BF16_REL


def _gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU (the kernels run compiled "
                                                                         "there; on a CPU their own tests interpret them)")]

# (setting, its Policy fields, the Policy fields of XLA's path it is compared with, the losses' relative bound)
XLA_BF16_LOGITS = {"logits_dtype": "bfloat16"}
SETTINGS = [
    ("kernels.layer_norm=pallas", {"kernels": {"layer_norm": "pallas"}}, {}, 1e-4),
    ("kernels.mlp=pallas-gemm", {"kernels": {"mlp": "pallas-gemm"}}, {}, 1e-4),
    ("kernels.mlp=pallas-recompute", {"kernels": {"mlp": "pallas-recompute"}}, {}, 1e-4),
    ("kernels.mlp=pallas-gemm gelu_h_dtype=bfloat16", {"kernels": {"mlp": "pallas-gemm"}, "gelu_h_dtype": "bfloat16"},
     {}, 1e-3),
    ("kernels.qkv=pallas", {"kernels": {"qkv": "pallas"}}, {}, 1e-4),
    ("kernels.loss=pallas", {"kernels": {"loss": "pallas"}, **XLA_BF16_LOGITS}, XLA_BF16_LOGITS, 1e-4),
    ("kernels=pallas", {"kernels": "pallas"}, {}, 1e-4),
]


def _fast_set():
    from benchmarks.gpu import fastset

    return ("the fast set", fastset.policy_fields(), XLA_BF16_LOGITS, 1e-3)


def _loss_and_grads(policy):
    from flax import nnx

    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT

    cfg = dataclasses.replace(GPTConfig.preset("tiny"), vocab_size=256)
    idx = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    tgt = jnp.roll(idx, -1, axis=1)
    graphdef, params = nnx.split(GPT(cfg, policy=policy, rngs=nnx.Rngs(params=0)), nnx.Param)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(idx, tgt)))(params)
    return float(loss), {jax.tree_util.keystr(k): np.asarray(v, np.float64)
                         for k, v in jax.tree_util.tree_leaves_with_path(grads)}


@pytest.mark.parametrize("name, fields, reference, rtol", [*SETTINGS, _fast_set()], ids=lambda v: v
                         if isinstance(v, str) else "")
def test_kernel_against_xlas_path_on_the_device(name, fields, reference, rtol):
    from benchmarks.gpu import pallas_tiles
    from jaxgpt.precision import Policy
    from tests.tiny_training import tiny_adamw_losses

    with pallas_tiles.recording() as built:
        loss_k, grads_k = _loss_and_grads(Policy.bf16(**fields))
    assert built, f"{name}: no Pallas kernel was built on the GPU"  # the kernels ran, not XLA's path
    loss_x, grads_x = _loss_and_grads(Policy.bf16(**reference))
    assert abs(loss_k / loss_x - 1) <= rtol, (name, loss_k, loss_x)
    assert grads_k.keys() == grads_x.keys()
    for key, gx in grads_x.items():
        gk = grads_k[key]
        rel = np.linalg.norm(gk - gx) / max(np.linalg.norm(gx), 1e-30)
        cos = float(np.sum(gk * gx) / max(np.linalg.norm(gk) * np.linalg.norm(gx), 1e-30))
        assert rel <= GRAD_BF16_REL and cos >= GRAD_BF16_COS, (name, key, rel, cos)
    losses_x = tiny_adamw_losses(Policy.bf16(**reference), 3)
    assert losses_x[-1] < losses_x[0] - 0.05, losses_x
    np.testing.assert_allclose(tiny_adamw_losses(Policy.bf16(**fields), 3), losses_x, rtol=rtol, err_msg=name)
