"""precision: bf16-autocast (jaxgpt.precision.Policy.bf16_autocast): the name reaches the policy from every entry
point, each of its numerics is its own Policy field (the bf16 program stays reachable), and the dtypes come out where
torch.autocast puts them: bf16 GEMM outputs and input gradients, bf16-rounded logits, fp32 everything else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgpt import ops
from jaxgpt.config import ConfigError, GPTConfig
from jaxgpt.model import GPT
from jaxgpt.precision import PRECISIONS, Policy
from jaxgpt.train import TrainConfig


def test_named_policy_and_its_fields():
    p = Policy.named("bf16-autocast")
    assert (p.compute_dtype, p.gemm_output, p.logits_dtype) == ("bfloat16", "bfloat16", "bfloat16")
    assert p.out_dtype == jnp.bfloat16
    b = Policy.named("bf16")
    assert (b.gemm_output, b.logits_dtype, b.out_dtype) == ("float32", "float32", jnp.float32)
    # each numerics change is a field of its own: bf16 plus one field is a program of its own
    assert Policy.bf16(gemm_output="bfloat16") != p and Policy.bf16(logits_dtype="bfloat16") != p
    assert Policy.named("bf16-autocast", kernels={"attention": "xla"}).kernel("attention") == "xla"
    assert "bf16-autocast" in PRECISIONS


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match="gemm_output .* needs compute_dtype"):
        Policy.fp32(gemm_output="bfloat16")
    with pytest.raises(ConfigError, match="allowed values are 'fp32', 'bf16', 'bf16-autocast'"):
        Policy.named("autocast")


def test_train_config_and_clis_accept_it():
    assert TrainConfig.from_dict({"model_preset": "gpt2", "precision": "bf16-autocast"}).precision == "bf16-autocast"
    with pytest.raises(ConfigError, match="precision"):
        TrainConfig.from_dict({"model_preset": "gpt2", "precision": "bf16-autocst"})
    from jaxgpt.eval.cli import _parser as eval_parser
    from jaxgpt.generate import build_parser as gen_parser

    assert gen_parser().parse_args(["--init-from", "x", "--precision", "bf16-autocast"]).precision == "bf16-autocast"
    args = eval_parser().parse_args(["--task", "hellaswag", "--init-from", "x", "--precision", "bf16-autocast"])
    assert args.precision == "bf16-autocast"


def test_matmul_rounds_output_and_input_gradient_not_weight_gradient():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    exact = jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    y = ops.matmul(x, w, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(exact.astype(jnp.bfloat16)))
    g = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    dx, dw = jax.vjp(lambda a, b: ops.matmul(a, b, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16), x, w)[1](
        g.astype(jnp.bfloat16))
    dx32, dw32 = jax.vjp(lambda a, b: ops.matmul(a, b, dtype=jnp.bfloat16), x, w)[1](g)
    assert dx.dtype == dw.dtype == jnp.float32  # the parameters' and inputs' dtypes
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx32.astype(jnp.bfloat16).astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw32))  # weight gradients: not rounded
    assert not np.array_equal(np.asarray(dx32), np.asarray(dx))  # the rounding did something


def test_the_rounding_survives_jit_where_fp32_ops_consume_it():
    """Jitted, the bf16 GEMM output is promoted by the fp32 bias and consumed by fp32 ops: a convert pair fp32 ->
    bf16 -> fp32 that XLA:CPU's YNNPACK fusions (jax 0.10.2) dropped from the gradient's computation, so bf16-autocast
    trained on CPUs with the unrounded output in its backward (this test failed: 8.3e-4 from the rounded sums, 1.3e-7
    from the unrounded). ops.round_to rounds with reduce_precision. The forward value and a gradient that reads the
    output must both be those of the rounded output, at a gpt2-sized layer."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(512, 768)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(768, 768)) / 28, jnp.float32)
    b = jnp.asarray(rng.normal(size=(768,)), jnp.float32)
    exact = np.asarray(jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32))
    rounded = np.asarray(jnp.asarray(exact).astype(jnp.bfloat16).astype(jnp.float32))  # eager: nothing fuses
    f = jax.jit(lambda x, w: jnp.tanh(ops.matmul(x, w, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16) + b))
    got = np.asarray(f(x, w))
    assert np.abs(got - np.tanh(rounded + np.asarray(b))).max() < 1e-5
    assert np.abs(got - np.tanh(exact + np.asarray(b))).max() > 1e-3  # the rounding is visible at this size
    # gradient only (the output itself unused, as under jax.grad): d/db sum((y + b)^3 / 3) = column sums of (y + b)^2
    # at the output y the forward wrote, summed in fp32; the rounding moves them ~100x more than that summation does
    db = np.asarray(jax.jit(jax.grad(lambda w, b: (((ops.matmul(x, w, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16)
                                                      + b) ** 3) / 3).sum(), argnums=1))(w, b), np.float64)
    at_rounded = ((rounded.astype(np.float64) + np.asarray(b)) ** 2).sum(0)
    at_exact = ((exact.astype(np.float64) + np.asarray(b)) ** 2).sum(0)
    assert np.abs(db / at_rounded - 1).max() < 1e-5
    assert np.abs(db / at_exact - 1).max() > 1e-4


@pytest.mark.parametrize("fast_kernels", [True, False])
def test_model_dtypes_and_logits(fast_kernels):
    cfg = GPTConfig.preset("tiny", vocab_size=512)
    auto = GPT(cfg, policy=Policy.bf16_autocast(fast_kernels=fast_kernels), rngs=nnx.Rngs(0))
    bf16 = GPT(cfg, policy=Policy.bf16(fast_kernels=fast_kernels), rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).integers(0, 512, (2, 16)), jnp.int32)
    block = auto.h[0]
    assert block.mlp.c_fc.policy.matmul(jnp.ones((2, 32)), block.mlp.c_fc.kernel[...]).dtype == jnp.bfloat16
    assert block.mlp.c_fc(jnp.ones((2, 32))).dtype == jnp.float32  # + fp32 bias: promoted, as in torch_ref
    logits = auto(x)
    assert logits.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits.astype(jnp.bfloat16).astype(jnp.float32)))
    ref = bf16(x)
    assert not np.array_equal(np.asarray(ref), np.asarray(ref.astype(jnp.bfloat16).astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=0.05)
    la, lb = float(auto.loss(x, x)), float(bf16.loss(x, x))
    assert abs(la - lb) < 1e-2 * lb


def mlp_against_plain(policy: Policy):
    """(loss, grads) of a tiny MLP under ``policy`` (its own ``__call__``) and of the plain expression
    ``c_proj(gelu(c_fc(x)))`` with the same layers: ((va, ga), (vb, gb))."""
    from jaxgpt.model import MLP

    cfg = GPTConfig.preset("tiny", vocab_size=512)
    mlp = MLP(cfg, policy=policy, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, cfg.n_embd)), jnp.float32)

    def plain(m, x):
        return jnp.sum(m.c_proj(jax.nn.gelu(m.c_fc(x), approximate=True)) ** 2)

    def mine(m, x):
        return jnp.sum(m(x) ** 2)

    return tuple(nnx.value_and_grad(f, argnums=(0, 1))(mlp, x) for f in (mine, plain))


def test_mlp_recomputes_gelu_with_the_same_values_and_gradients():
    """Under bf16 GEMM outputs the MLP keeps the bf16 c_fc output for the backward and recomputes bias + GELU
    (jax.checkpoint): the same values and gradients as the plain expression."""
    (va, ga), (vb, gb) = mlp_against_plain(Policy.bf16_autocast())
    np.testing.assert_allclose(float(va), float(vb), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
