"""Shared fixtures for the parity tests: a device (CPU always; CUDA where one exists, skipped cleanly
otherwise), fp32 matmul precision pinned to "highest" in both frameworks, and HF checkpoints made on the
spot by ``transformers`` (random init, saved with ``save_pretrained``) so nothing comes from a hub; JAX's
persistent compilation cache for the run (compile_cache.py) and, with $JAXGPT_COMPILE_COUNTS, the XLA
compilations of every case counted (compile_counts.py)."""

from __future__ import annotations

import contextlib
import os

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from compile_cache import cache_dir, persistent_cache
from compile_counts import (pytest_configure, pytest_runtest_logreport,  # noqa: F401 (hooks: compile_counts.py)
                            pytest_runtest_protocol, pytest_sessionfinish, pytest_terminal_summary)
from report_file import merge_into


def _jax_has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@pytest.fixture(scope="session", autouse=True)
def persistent_compilation_cache(request):
    """JAX's persistent compilation cache for the whole parity run (compile_cache.py says where and why)."""
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    worker = getattr(request.config, "workerinput", {}).get("workerid")  # pytest-xdist's worker, if one
    path = cache_dir(cache.mkdir("jax-compilation-cache") if cache is not None else None, worker)
    if path is None:  # off, or the user's own JAX_COMPILATION_CACHE_DIR is in charge
        yield None
        return
    with persistent_cache(path):
        yield path


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


def make_hf_checkpoint(path, *, n_layer, n_head, n_embd, n_positions, vocab_size=50257, seed=0, wte_scale=1.0):
    """A random-init Hugging Face GPT-2 saved with save_pretrained; returns the model (eval mode).
    ``wte_scale`` multiplies the (tied) token embedding after init: see PEAKED_WTE_SCALE."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                       n_positions=n_positions, vocab_size=vocab_size)).eval()
    if wte_scale != 1.0:
        with torch.no_grad():
            model.transformer.wte.weight.mul_(wte_scale)
    model.save_pretrained(path)
    return model


# name -> (GPT2Config shape, sequence length used in tests)
CHECKPOINTS = {
    "tiny": (dict(n_layer=2, n_head=2, n_embd=64, n_positions=64), 64),
    "odd": (dict(n_layer=3, n_head=3, n_embd=48, n_positions=37), 37),  # 3 heads, block size not 2^k
    "gpt2": (dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024), 64),  # full 124M shapes
}


# A random-init GPT-2 predicts a near-uniform distribution whose top logits are nearly tied (over 50,257
# candidates the median top-1/top-2 logit gap measured 0.08-0.09, 0.2-0.5 of the logits' std), so bf16
# rounding flips the argmax at 1-5% of positions (measured 0.945-0.99 agreement for tiny and gpt2 shapes, also
# with initializer_range raised to 0.05-0.2, which scales the gaps and the rounding errors alike): top-1
# agreement would measure tie-breaking, not precision. Scaling the token embedding 3x after init makes the
# residual stream carry the current token strongly, so the tied lm_head gives one token a clear lead (median
# gap measured 0.8 / 1.4 / 2.5 for odd / tiny / gpt2), as a trained model has a clear favourite at most
# positions. Every block still runs on that stream, so KL and top-1 still see every bf16 matmul.
PEAKED_WTE_SCALE = 3.0


ATTN_PEAK = (16.0, 34.0)  # the odd checkpoint's largest attention logits must lie in this range


def peak_attention(model, scale: float) -> None:
    """Scale every layer's q and k projections (weights and biases): attention logits grow by scale**2."""
    with torch.no_grad():
        for block in model.transformer.h:
            C = block.attn.c_attn.weight.shape[0]
            block.attn.c_attn.weight[:, : 2 * C].mul_(scale)
            block.attn.c_attn.bias[: 2 * C].mul_(scale)


@torch.no_grad()
def max_attention_logit(model, tokens: torch.Tensor) -> float:
    """The largest |q.k/sqrt(d)| over all layers, heads and causal pairs, in float64."""
    out = model(tokens, output_hidden_states=True)
    worst = 0.0
    for block, h in zip(model.transformer.h, out.hidden_states):
        q, k, _ = block.attn.c_attn(block.ln_1(h)).split(h.shape[-1], dim=-1)
        nh = model.config.n_head
        q, k = (t.view(*t.shape[:2], nh, -1).transpose(1, 2) for t in (q, k))
        s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        causal = torch.tril(torch.ones(s.shape[-2:], dtype=torch.bool))
        worst = max(worst, float(s.abs()[..., causal].max()))
    return worst



@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, wte_scale=1.0) -> (directory, transformers model); made once per session."""
    cache = {}

    def get(name: str, wte_scale: float = 1.0):
        if (name, wte_scale) not in cache:
            shape, _ = CHECKPOINTS[name]
            d = tmp_path_factory.mktemp(f"hf-{name}" + ("" if wte_scale == 1.0 else f"-wte{wte_scale:g}"))
            cache[name, wte_scale] = (d, make_hf_checkpoint(d, **shape, wte_scale=wte_scale))
        return cache[name, wte_scale]

    return get


@pytest.fixture(scope="session")
def _parity_numbers():
    numbers: dict[str, dict[str, float]] = {}
    yield numbers
    path = os.environ.get("JAXGPT_PARITY_REPORT")
    if path and numbers:  # merged into the file, so several runs, files or xdist workers add up to one report
        merge_into(path, numbers)


@pytest.fixture
def parity_report(_parity_numbers, record_property):
    """parity_report(key, **measured): print the measured numbers (visible with -s), record them as test
    properties (junitxml), and write them to the JSON file named by $JAXGPT_PARITY_REPORT at session end."""

    def report(key: str, **measured: float) -> None:
        measured = {k: float(v) for k, v in measured.items()}
        print(f"\n[parity] {key}: " + ", ".join(f"{k}={v:.3g}" for k, v in measured.items()))
        for k, v in measured.items():
            record_property(f"{key}:{k}", v)
        _parity_numbers.setdefault(key, {}).update(measured)

    return report


def _logits_and_loss(model, idx):
    return model(idx), model.loss(idx[:, :-1], idx[:, 1:])


# One compiled function per model structure (config and policy: nnx.jit keys on the graph definition) and token
# shape, shared by every test that calls it (an nnx.jit made inside a helper compiled anew on every call).
_jit_logits_and_loss = nnx.jit(_logits_and_loss)


def jax_logits_and_loss(model, tokens: np.ndarray) -> tuple[np.ndarray, float]:
    """jaxgpt's logits of the full sequence and its next-token loss, jitted."""
    import jax.numpy as jnp

    logits, loss = _jit_logits_and_loss(model, jnp.asarray(tokens, dtype=jnp.int32))
    return np.asarray(logits), float(loss)


def random_tokens(batch: int, seq: int, vocab: int = 50257, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq), dtype=np.int64)
