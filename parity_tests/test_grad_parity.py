"""Per-parameter gradients of the loss: jaxgpt vs torch_ref vs ``transformers.GPT2LMHeadModel``, all loaded from
one Hugging Face checkpoint and fed the same batch (llm.c's reference-as-oracle check, for the backward pass).

* fp32 (matmul precision pinned to "highest" by conftest): for every parameter tensor
  ||g_a - g_b|| / ||g_b|| <= GRAD_FP32_REL, the max abs diff reported; tiny config and full gpt2 124M shapes.
* bf16 compute vs the fp32 reference: cosine >= GRAD_BF16_COS and relative norm error <= GRAD_BF16_REL per tensor,
  for jaxgpt's bf16 policy and for torch autocast.
* The tied embedding: wte's gradient is the embedding-lookup part plus the lm_head part; both are computed
  separately in an untied transformers copy and their sum checked against jaxgpt's tied gradient.
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxgpt.precision import Policy
from jaxgpt.weights import from_hf, params_to_ref
from parity_tests.conftest import on_device, random_tokens
from parity_tests.tolerances import GRAD_BF16_COS, GRAD_BF16_REL, GRAD_FP32_REL
from torch_ref.load import from_hf as torch_from_hf

SEQ = 32


@functools.partial(jax.jit, static_argnums=0)
def _loss_grads(graphdef, params, x, y):
    """One compiled function per model structure (config and policy: the graph definition) and batch shape, shared
    by every case that uses it (a jax.jit of a closure made per call compiled anew each time)."""
    return jax.grad(lambda p: nnx.merge(graphdef, p).loss(x, y))(params)


def jax_grads(directory, x, y, policy: Policy) -> dict[str, np.ndarray]:
    model = from_hf(directory, policy=policy)
    graphdef, params = nnx.split(model, nnx.Param)
    return params_to_ref(_loss_grads(graphdef, params, jnp.asarray(x), jnp.asarray(y)))


def torch_grads(model: torch.nn.Module, x, y, device: str, *, prefix: str = "", bf16: bool = False
                ) -> dict[str, np.ndarray]:
    model = model.to(device)
    model.zero_grad()
    xt, yt = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        out = model(xt, labels=None) if prefix else model(xt, yt)
        if prefix:  # transformers: shift-free loss on our (x, y) pairs
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), yt.reshape(-1))
        else:
            loss = out[1]
    loss.backward()
    return {k.removeprefix(prefix): p.grad.detach().float().cpu().numpy()
            for k, p in model.named_parameters() if p.grad is not None}


def batch(name: str):
    x = random_tokens(2, SEQ + 1, seed=3)
    return x[:, :-1], x[:, 1:]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.ravel(), b.ravel()) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("name,attention", [("tiny", "einsum"), ("tiny", "xla"), ("gpt2", "einsum"),
                                            pytest.param("gpt2", "xla", marks=pytest.mark.slow)])
def test_fp32_gradients_agree(name, attention, device, hf_checkpoint, parity_report):
    """einsum: jaxgpt.kernels.attention.causal_attention's hand-written backward (the CPU default); xla: jax.nn.dot_product_attention."""
    directory, hf = hf_checkpoint(name)
    x, y = batch(name)
    with on_device(device):
        g_jax = jax_grads(directory, x, y, Policy.fp32(kernels={"attention": attention}))
    g_ref = torch_grads(torch_from_hf(directory), x, y, device)
    g_hf = torch_grads(copy.deepcopy(hf), x, y, device, prefix="transformer.")
    assert set(g_jax) == set(g_ref) == set(g_hf), "every parameter has a gradient in all three"
    worst = {}
    for pair, (a, b) in {"jax-hf": (g_jax, g_hf), "torch_ref-hf": (g_ref, g_hf), "jax-torch_ref": (g_jax, g_ref)}.items():
        rels = {k: rel(a[k], b[k]) for k in b}
        bad = {k: v for k, v in rels.items() if v > GRAD_FP32_REL}
        assert not bad, f"{name} {pair}: relative gradient error above {GRAD_FP32_REL}: {bad}"
        worst[f"{pair}_max_rel"] = max(rels.values())
        worst[f"{pair}_max_abs"] = max(float(np.abs(a[k] - b[k]).max()) for k in b)
    parity_report(f"grads_fp32_{name}_{device}_{attention}", **worst)


def test_tied_embedding_gradient_is_lookup_plus_head(device, hf_checkpoint, parity_report):
    """wte receives gradient from the embedding lookup (rows of tokens in the batch) and from the tied lm_head
    (every row). Untie a transformers copy, take each part's gradient, and check jaxgpt's tied sum."""
    directory, hf = hf_checkpoint("tiny")
    x, y = batch("tiny")
    with on_device(device):
        g_jax = jax_grads(directory, x, y, Policy.fp32(kernels={"attention": "xla"}))["wte.weight"]
    untied = copy.deepcopy(hf).to(device)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach().clone())
    g = torch_grads(untied, x, y, device, prefix="transformer.")
    lookup, head = g["wte.weight"], g["lm_head.weight"]
    in_batch = np.zeros(lookup.shape[0], bool)
    in_batch[np.unique(x)] = True
    assert np.all(lookup[~in_batch] == 0) and np.abs(lookup[in_batch]).sum() > 0  # the lookup touches batch rows
    assert np.all(np.abs(head).sum(axis=1) > 0)  # the head touches every row
    assert rel(g_jax, lookup + head) <= GRAD_FP32_REL
    assert rel(g_jax[~in_batch], head[~in_batch]) <= GRAD_FP32_REL  # rows only the head reaches
    parity_report(f"grads_tied_wte_{device}", rel_vs_sum=rel(g_jax, lookup + head),
                  lookup_share=np.linalg.norm(lookup) / np.linalg.norm(lookup + head))


# "pallas-gemm-bf16h" (the report's name since it was gelu's option): gelu_h_dtype bfloat16, one more rounding
@pytest.mark.parametrize("gelu", ["plain", "pallas-gemm-bf16h"])
@pytest.mark.parametrize("name", ["tiny", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_bf16_gradients_close_to_fp32(name, gelu, device, hf_checkpoint, parity_report):
    """The bf16 policy's gradients (and with gelu_h_dtype: bfloat16, h kept in bf16 for GELU's backward) against
    jaxgpt's fp32 ones, as torch autocast's against them: every tensor within GRAD_BF16_COS and GRAD_BF16_REL."""
    directory, hf = hf_checkpoint(name)
    x, y = batch(name)
    with on_device(device):
        g32 = jax_grads(directory, x, y, Policy.fp32(kernels={"attention": "xla"}))
        g16 = jax_grads(directory, x, y, Policy.bf16(gelu_h_dtype="float32" if gelu == "plain" else "bfloat16"))
    t16 = torch_grads(torch_from_hf(directory), x, y, device, bf16=True)
    measured = {}
    for who, g in (("jaxgpt", g16), ("torch_autocast", t16)):
        cos = {k: cosine(g[k], g32[k]) for k in g32}
        rels = {k: rel(g[k], g32[k]) for k in g32}
        low = {k: v for k, v in cos.items() if v < GRAD_BF16_COS}
        high = {k: v for k, v in rels.items() if v > GRAD_BF16_REL}
        assert not low, f"{who} bf16 grads: cosine below {GRAD_BF16_COS}: {low}"
        assert not high, f"{who} bf16 grads: relative error above {GRAD_BF16_REL}: {high}"
        measured[f"{who}_min_cos"] = min(cos.values())
        measured[f"{who}_max_rel"] = max(rels.values())
    parity_report(f"grads_bf16{'' if gelu == 'plain' else '_' + gelu}_{name}_{device}", **measured)

