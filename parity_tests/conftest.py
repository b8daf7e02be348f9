"""Shared fixtures for the parity tests: a device (CPU always; CUDA where one exists, skipped cleanly
otherwise), fp32 matmul precision pinned to "highest" in both frameworks, and HF checkpoints made on the
spot by ``transformers`` (random init, saved with ``save_pretrained``) so nothing comes from a hub."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
import torch


def _jax_has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> str:
    """Run the test on CPU, and again on CUDA when both torch and JAX see a GPU."""
    if request.param == "cuda" and not (torch.cuda.is_available() and _jax_has_gpu()):
        pytest.skip("no CUDA GPU visible to both torch and JAX")
    return request.param


@contextlib.contextmanager
def on_device(device: str):
    """Place JAX computations on ``device`` (torch tensors are moved explicitly by the tests)."""
    jax_device = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    with jax.default_device(jax_device):
        yield


@pytest.fixture(autouse=True)
def highest_precision():
    """fp32 means fp32: no TF32 in torch, full-precision matmuls in JAX."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
           torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    with jax.default_matmul_precision("highest"):
        yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old[:2]
    torch.set_float32_matmul_precision(old[2])


def make_hf_checkpoint(path, *, n_layer, n_head, n_embd, n_positions, vocab_size=50257, seed=0):
    """A random-init Hugging Face GPT-2 saved with save_pretrained; returns the model (eval mode)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                       n_positions=n_positions, vocab_size=vocab_size)).eval()
    model.save_pretrained(path)
    return model


# name -> (GPT2Config shape, sequence length used in tests)
CHECKPOINTS = {
    "tiny": (dict(n_layer=2, n_head=2, n_embd=64, n_positions=64), 64),
    "odd": (dict(n_layer=3, n_head=3, n_embd=48, n_positions=37), 37),  # 3 heads, block size not 2^k
    "gpt2": (dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024), 64),  # full 124M shapes
}


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name) -> (directory, transformers model); made once per session."""
    cache = {}

    def get(name: str):
        if name not in cache:
            shape, _ = CHECKPOINTS[name]
            d = tmp_path_factory.mktemp(f"hf-{name}")
            cache[name] = (d, make_hf_checkpoint(d, **shape))
        return cache[name]

    return get


def random_tokens(batch: int, seq: int, vocab: int = 50257, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq), dtype=np.int64)
