"""What the fp8 program is compiled with (jaxgpt.kernels.fp8, jaxgpt.step): the XLA options that make its e4m3 GEMMs cuBLASLt
fp8 calls on GPUs, and the program changes they came with, each with the same values on the CPU. The compiled H100
step's cuBLASLt fp8 GEMMs are counted in tests/test_compile.py (they need JAX's CUDA plugin)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgpt import ops, step
from jaxgpt.kernels import fp8, loss as fused_loss
from jaxgpt.model import GPT, GPTConfig
from jaxgpt.precision import Policy
from tests.test_autocast_policy import mlp_against_plain

GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def _gpu_mesh():
    return SimpleNamespace(devices=np.array([SimpleNamespace(platform="gpu")]))


def test_fp8_programs_alone_get_the_cublaslt_compiler_options():
    """The Triton GEMM emitter off for a GPU program with e4m3 GEMMs (XLA's GEMM fusion would otherwise claim them
    before the cuBLAS rewriter sees them), whichever GEMMs are e4m3; nothing for bf16/fp32 programs or on CPUs. The
    train and eval steps read the policy from the model's graphdef, so every caller jits one program."""
    for gemms in ("lm_head", "mlp", "mlp+lm_head", "all"):
        assert fp8.compiler_options(gemms, "gpu") == GPU_OPTIONS
        assert fp8.compiler_options(gemms, "cpu") == {}
    assert fp8.compiler_options("none", "gpu") == {}
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    for policy, gpu in ((Policy.named("fp8", fp8_gemms="lm_head"), GPU_OPTIONS), (Policy.named("bf16"), None),
                        (Policy.named("fp32"), None), (Policy.named("bf16-autocast"), None)):
        model = nnx.eval_shape(lambda: GPT(cfg, policy=policy, rngs=nnx.Rngs(params=0)))
        graphdef, _ = nnx.split(model, nnx.Param)
        assert step.compiler_options(graphdef, step.data_mesh()) is None  # this process's CPU devices
        assert step.compiler_options(graphdef, _gpu_mesh()) == gpu, policy


def test_the_e4m3_dots_highest_precision_changes_nothing_on_the_cpu():
    """HIGHEST on the e4m3 dot turns cuBLASLt's fp8 fast accumulation off on GPUs; on the CPU it is the same dot, bit
    for bit (e4m3 x e4m3 products are exact in fp32)."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(48, 96)) * 30, jnp.float32).astype(fp8.E4M3)
    b = jnp.asarray(rng.normal(size=(96, 40)) * 30, jnp.float32).astype(fp8.E4M3)
    default = jax.lax.dot(a, b, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(fp8.e4m3_dot(a, b)), np.asarray(default))
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    assert np.abs(np.asarray(default) - exact).max() <= 2**-20 * np.abs(np.asarray(a, np.float64)).max() * \
        np.abs(np.asarray(b, np.float64)).max() * 96  # fp32 accumulation of exact products


def test_fp8_mlp_recomputes_gelu_with_the_same_values_and_gradients():
    """Under precision: fp8 the MLP keeps the e4m3 c_fc GEMM's fp32 output for the backward and recomputes bias +
    GELU (jax.checkpoint; XLA otherwise kept the fp32 tanh too once the GEMM was a cuBLASLt call that fuses nothing
    after it: 38.8 -> 28.8 GiB at gpt2 b64): the same loss and gradients as the plain expression, bit for bit."""
    (va, ga), (vb, gb) = mlp_against_plain(Policy.named("fp8", fp8_gemms="mlp"))
    assert float(va) == float(vb)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_logits_chunks_are_a_multiple_of_16_rows_on_gpus_only():
    """cuBLASLt's fp8 GEMM takes dimensions divisible by 16: on GPUs the e4m3 logits GEMM's chunks are rounded up to
    a multiple of 16 rows (else XLA pads each chunk and slices its fp32 logits back: 8.6 ms per gpt2 b64 step
    predicted); the bf16 chunks and every CPU chunk are as they were."""
    with ops.traced_for([SimpleNamespace(platform="gpu")]):
        bf16_rows, fp8_rows = fused_loss._chunk_rows(65536, 50304), fused_loss._chunk_rows(65536, 50304, fp8=True)
        small = fused_loss._chunk_rows(256, 50304, fp8=True)
    assert bf16_rows == 5042 and fp8_rows == 5056 and small == 256
    assert fused_loss._chunk_rows(65536, 50304, fp8=True) == fused_loss._chunk_rows(65536, 50304)  # CPU: unchanged
    assert fused_loss._chunk_rows(1000, 50304, fp8=True) == 1000


def test_generation_is_jitted_with_the_fp8_compiler_options():
    """jaxgpt.generate jits its decoder with the options the train and eval steps get (jaxgpt.step.
    platform_compiler_options): the Triton GEMM emitter off for an fp8 model traced for a GPU, XLA's defaults for
    bf16 models and on the CPU. The options change kernels, not numbers: on the CPU the fp8 decoder jitted with them
    samples the same tokens as without."""
    from jaxgpt import generate as gen
    from jaxgpt.generate import decode

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    fp8_model = GPT(cfg, policy=Policy.named("fp8", fp8_gemms="all"), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(fp8_model)
    bf16_graphdef = nnx.split(GPT(cfg, policy=Policy.named("bf16"), rngs=nnx.Rngs(0)))[0]
    with_options = decode._generate_with_options(tuple(GPU_OPTIONS.items()))
    with ops.traced_for([SimpleNamespace(platform="gpu")]):
        assert step.platform_compiler_options(graphdef, "gpu") == GPU_OPTIONS
        assert decode._generate_program(graphdef) is with_options
        assert decode._generate_program(bf16_graphdef) is decode._generate_compiled
    assert decode._generate_program(graphdef) is decode._generate_compiled  # this process's CPU
    args = (graphdef, state, jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32), jax.random.key(0), jnp.float32(0.8))
    static = dict(n_new=6, top_k=None, use_cache=True)
    np.testing.assert_array_equal(np.asarray(with_options(*args, **static)),
                                  np.asarray(decode._generate_compiled(*args, **static)))
    out = gen.generate(fp8_model, [1, 2, 3], max_new_tokens=6, temperature=0.8, seed=0)
    assert out.shape == (1, 9)


def test_eval_programs_are_jitted_with_the_fp8_compiler_options(monkeypatch):
    """python -m jaxgpt.eval's programs (val_loss, hellaswag, the lm-eval harness's scoring, prefill and decode) are
    jitted with the options the train step and jaxgpt.generate get: the Triton GEMM emitter off for an fp8 model
    traced for a GPU, XLA's defaults (None) for a bf16 model and on the CPU. On the CPU the options change no
    number: the fp8 model's val-loss program gives the same losses with and without them."""
    from jaxgpt.eval import harness, hellaswag, val_loss

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    fp8_model = GPT(cfg, policy=Policy.named("fp8", fp8_gemms="all"), rngs=nnx.Rngs(0))
    bf16_model = GPT(cfg, policy=Policy.named("bf16"), rngs=nnx.Rngs(0))
    seen = []
    real_jit = jax.jit

    def spy(fun, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return real_jit(fun, **kwargs)

    monkeypatch.setattr(jax, "jit", spy)

    def options(model):
        seen.clear()
        graphdef = nnx.split(model)[0]
        val_loss.loss_sum_program(graphdef)
        hellaswag.Scorer(model)
        harness.programs(graphdef, harness.collections.Counter())
        assert len(seen) == 5, seen
        return set(map(str, seen))

    with ops.traced_for([SimpleNamespace(platform="gpu")]):
        assert options(fp8_model) == {str(GPU_OPTIONS)}
        assert options(bf16_model) == {"None"}
    assert options(fp8_model) == {"None"}  # this process's CPU
    monkeypatch.undo()
    graphdef, state = nnx.split(fp8_model)
    x = jnp.asarray(np.arange(32).reshape(2, 16) % 64, jnp.int32)
    y = jnp.roll(x, -1, axis=1)
    with ops.traced_for([SimpleNamespace(platform="gpu")]):
        with_options = val_loss.loss_sum_program(graphdef)
    np.testing.assert_array_equal(np.asarray(with_options(state, x, y)),
                                  np.asarray(val_loss.loss_sum_program(graphdef)(state, x, y)))
