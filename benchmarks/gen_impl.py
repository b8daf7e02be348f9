"""The generation variants (run inside ``benchmarks.worker``): each returns ``gen(prompts, max_new_tokens)``.

All sample with temperature 1.0 and top_k 50 and never stop early (random-init models would otherwise hit
the end-of-text token at random times):

* ``jax_{fp32,bf16}_cache``: ``jaxgpt.generate.generate`` (jit-compiled prefill + KV-cache decode loop);
* ``torch_ref_fp32_nocache``: ``torch_ref.GPT.generate``, nanoGPT's plain generate: **no KV cache**, every
  new token is a full forward pass over the context so far;
* ``hf_{fp32,bf16}_cache``: ``transformers`` ``GPT2LMHeadModel.generate`` with its (dynamic) KV cache, bf16 as
  ``torch.autocast``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

GEN_VARIANTS = ["jax_fp32_cache", "jax_bf16_cache", "torch_ref_fp32_nocache", "hf_fp32_cache", "hf_bf16_cache"]
TOP_K = 50


def make(variant: str, cfg, init: str | None):
    if variant.startswith("jax_"):
        return _jax(variant, cfg, init)
    if variant.startswith("torch_ref_"):
        return _torch_ref(cfg, init)
    if variant.startswith("hf_"):
        return _hf(variant, cfg)
    raise ValueError(f"unknown generation variant {variant!r}; valid: {GEN_VARIANTS}")


def _load_init(init):
    if not init:
        return None
    with np.load(init) as z:
        return {k: z[k] for k in z.files}


def _jax(variant, cfg, init):
    from flax import nnx

    from jaxgpt.generate import generate
    from jaxgpt.model import GPT
    from jaxgpt.precision import Policy

    policy = Policy.named(variant.split("_")[1])
    model = GPT(cfg, policy=policy, rngs=nnx.Rngs(0))
    ref = _load_init(init)
    if ref is not None:
        from jaxgpt.weights import load_ref

        load_ref(model, ref)
    calls = {"n": 0}

    def gen(prompts, new):
        calls["n"] += 1
        return generate(model, prompts, max_new_tokens=new, temperature=1.0, top_k=TOP_K, seed=calls["n"])

    return gen, {"impl": "jaxgpt.generate.generate (KV cache)", "policy": str(policy)}


def _torch_ref(cfg, init):
    import torch

    from torch_ref.model import GPT

    model = GPT(cfg, seed=0).eval()
    ref = _load_init(init)
    if ref is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in ref.items()})
    g = torch.Generator().manual_seed(0)

    def gen(prompts, new):
        with torch.no_grad():
            return model.generate(torch.from_numpy(prompts).long(), new, temperature=1.0, top_k=TOP_K,
                                  generator=g).numpy()

    return gen, {"impl": "torch_ref.GPT.generate (no KV cache: full forward per token)",
                 "torch_threads": torch.get_num_threads()}


def _hf(variant, cfg):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2Config(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, n_positions=cfg.block_size,
                    vocab_size=cfg.vocab_size, layer_norm_epsilon=cfg.layer_norm_epsilon)
    hf._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(hf).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    bf16 = "bf16" in variant
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def gen(prompts, new):
        ids = torch.from_numpy(prompts).long()
        with torch.no_grad(), autocast():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=True, temperature=1.0, top_k=TOP_K, use_cache=True)
        return out.numpy()

    info: dict[str, Any] = {"impl": "transformers GPT2LMHeadModel.generate (KV cache)" + (", autocast bf16" if bf16 else ""),
                            "torch_threads": torch.get_num_threads()}
    return gen, info
