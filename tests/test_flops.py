"""Tests for jaxgpt.flops: the matmul count by kind against hand arithmetic, backward = 2 x forward, the
per-token / per-sequence / per-step scaling, causal halving, the padded lm_head, the published
conventions (nanoGPT, llm.c, MaxText) evaluated from their own definitions, and precision: fp8's split of the FLOPs
into e4m3 and bf16 GEMMs (by hand, and against the dots of jaxgpt's fp8 train step)."""

from __future__ import annotations

import json

import pytest

from jaxgpt.config import ConfigError, GPTConfig
from jaxgpt.flops import (BACKWARD_FACTOR, FP8_GEMM_KINDS, FP8_GEMM_SETS, KINDS, LAYER_KINDS, conventions,
                          conventions_table, count_flops, e4m3_kinds, n_params)

PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
             "gpt2-xl": 1_557_611_200}


def test_hand_counted_tiny_model():
    # C=4, N=2 heads of D=2, T=3, V=10: every matmul written out as 2*m*n*k.
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=4, block_size=8, vocab_size=10)
    fc = count_flops(cfg, 3)
    assert fc.layer_forward == {
        "qkv": 2 * 3 * 4 * 12,  # (3, 4) @ (4, 12)
        "attn_scores": 2 * (2 * 3 * 3 * 2),  # 2 heads x (3, 2) @ (2, 3)
        "attn_values": 2 * (2 * 3 * 2 * 3),  # 2 heads x (3, 3) @ (3, 2)
        "attn_out_proj": 2 * 3 * 4 * 4,
        "mlp_up": 2 * 3 * 4 * 16,
        "mlp_down": 2 * 3 * 16 * 4,
    }
    assert fc.lm_head_forward == 2 * 3 * 4 * 10
    assert fc.forward == sum(fc.layer_forward.values()) + fc.lm_head_forward
    assert fc.backward == 2 * fc.forward and fc.training == 3 * fc.forward
    assert list(fc.forward_by_kind) == list(KINDS)


def test_gpt2_per_token_closed_form():
    cfg = GPTConfig.preset("gpt2")
    T, L, C, V = 1024, 12, 768, 50257
    fc = count_flops(cfg, T)
    assert fc.per_token()["forward"] == 24 * L * C * C + 4 * L * T * C + 2 * C * V
    assert fc.per_token()["training"] == 3 * (24 * L * C * C + 4 * L * T * C + 2 * C * V)
    assert fc.forward == 291_648_307_200  # per 1024-token sequence, printed in the README


def test_backward_is_twice_forward_kind_by_kind():
    fc = count_flops(GPTConfig.preset("small"), 128)
    for kind in KINDS:
        assert fc.backward_by_kind[kind] == BACKWARD_FACTOR * fc.forward_by_kind[kind]
    for row in fc.rows():
        assert row["backward"] == 2 * row["forward"]
    assert len(fc.rows()) == 4 * len(LAYER_KINDS) + 1


def test_scaling_per_sequence_micro_step_and_step():
    cfg = GPTConfig.preset("mini")
    one = count_flops(cfg, 64)
    many = count_flops(cfg, 64, batch_size=5, grad_accum=3)
    assert many.training_per_micro_step == 5 * one.training
    assert many.training_per_step == 15 * one.training
    assert many.tokens_per_step == 5 * 64 * 3
    assert many.per_token() == one.per_token()
    # seq_len defaults to block_size
    assert count_flops(cfg).seq_len == cfg.block_size


def test_causal_halving_touches_only_attention():
    cfg = GPTConfig.preset("gpt2")
    full, half = count_flops(cfg, 1024), count_flops(cfg, 1024, causal_halving=True)
    for kind in KINDS:
        ratio = 2 if kind in ("attn_scores", "attn_values") else 1
        assert full.forward_by_kind[kind] == ratio * half.forward_by_kind[kind]
    assert full.attention_forward == 2 * half.attention_forward
    # odd T stays exact: T*T*C is an integer
    assert count_flops(cfg, 7, causal_halving=True).layer_forward["attn_scores"] == 7 * 7 * 768


def test_lm_head_counts_padded_rows():
    plain = count_flops(GPTConfig.preset("gpt2"), 256)
    padded = count_flops(GPTConfig.preset("gpt2", padded_vocab_size=50304), 256)
    assert padded.lm_head_forward - plain.lm_head_forward == 2 * 256 * 768 * (50304 - 50257)
    assert padded.lm_head_rows == 50304
    assert {k: v for k, v in padded.forward_by_kind.items() if k != "lm_head"} == \
        {k: v for k, v in plain.forward_by_kind.items() if k != "lm_head"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_counts_by_formula(name):
    assert n_params(GPTConfig.preset(name))["total"] == PUBLISHED[name]


def test_conventions_from_their_own_definitions():
    cfg = GPTConfig.preset("gpt2")
    by = {c.name: c for c in conventions(cfg, 1024)}
    L, T, C = 12, 1024, 768
    # nanoGPT's estimate_mfu: N = get_num_params() = 123.65M (wpe excluded), 6N + 12 L H Q T
    assert by["PaLM / nanoGPT"].n == 123_653_376
    assert by["PaLM / nanoGPT"].flops_per_token == 6 * 123_653_376 + 12 * L * T * C
    # llm.c pads the vocabulary to 50304 and prints num_parameters: 124475904
    llmc = {c.name: c for c in conventions(GPTConfig.preset("gpt2", padded_vocab_size=50304), 1024)}["llm.c"]
    assert llmc.n == 124_475_904
    assert llmc.flops_per_token == 6 * 124_475_904 + 6 * L * C * T
    # MaxText is the exact matmul count with causal-halved attention (biases are not matmuls)
    assert by["MaxText"].flops_per_token == by["jaxgpt causal-halved"].flops_per_token
    assert by["6N (non-embedding)"].n == 85_056_000
    assert by["jaxgpt (exact matmuls)"].flops_per_token == count_flops(cfg, 1024).per_token()["training"]
    text = conventions_table(cfg, 1024)
    for name in by:
        assert name in text


def test_table_and_json():
    fc = count_flops(GPTConfig.preset("gpt2"), 1024, batch_size=2, grad_accum=4)
    text = fc.table()
    for kind in KINDS:
        assert kind in text
    assert "per token" in text and "291,648,307,200" in text
    per_layer = fc.table(per_layer=True)
    assert per_layer.count("mlp_up") == 12
    d = json.loads(json.dumps(fc.to_dict()))
    assert d["training_per_step"] == fc.training_per_step == 8 * 3 * 291_648_307_200
    assert d["lm_head_rows"] == 50257


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=0), "seq_len"), (dict(seq_len=2048), "block_size"), (dict(batch_size=0), "batch_size"),
    (dict(grad_accum=-1), "grad_accum"), (dict(batch_size=1.5), "batch_size"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        count_flops(GPTConfig.preset("gpt2"), **kwargs)


# ---- fp8: which FLOPs run in e4m3 ---------------------------------------------------------------------------------
# gpt2 124M per token (T = 1024, C = 768, L = 12, V = 50257), forward, by hand: the attention projections
# L (6 + 2) C^2 = 56,623,104; the MLP L (8 + 8) C^2 = 113,246,208; the lm_head 2 C V = 77,194,752; attention's
# QK^T and PV 4 L T C = 37,748,736 (never e4m3). Training = 3 x forward = 854,438,400.
GPT2_E4M3_PER_TOKEN = {"all": 56_623_104 + 113_246_208 + 77_194_752, "mlp+lm_head": 113_246_208 + 77_194_752,
                       "mlp": 113_246_208, "lm_head": 77_194_752, "none": 0}


@pytest.mark.parametrize("gemms", sorted(GPT2_E4M3_PER_TOKEN))
def test_fp8_e4m3_flops_of_gpt2_by_hand(gemms):
    fc = count_flops(GPTConfig.preset("gpt2"), 1024, batch_size=4, grad_accum=2)
    split = fc.training_by_dtype(gemms)
    assert split["e4m3"] == 1024 * GPT2_E4M3_PER_TOKEN[gemms]
    assert split["e4m3"] + split["bf16"] == fc.training == 1024 * 854_438_400
    assert fc.training_per_step_by_dtype(gemms) == {k: 8 * v for k, v in split.items()}
    assert GPT2_E4M3_PER_TOKEN["all"] == 247_064_064 and round(247_064_064 / 854_438_400, 3) == 0.289


def test_fp8_kinds_never_include_attention_matmuls_or_backward():
    assert e4m3_kinds("all") == ("qkv", "attn_out_proj", "mlp_up", "mlp_down", "lm_head")
    assert e4m3_kinds("mlp") == ("mlp_up", "mlp_down") and e4m3_kinds("lm_head") == ("lm_head",)
    assert e4m3_kinds("none") == ()
    fc = count_flops(GPTConfig.preset("small"), 256)
    assert fc.training_by_dtype("all")["e4m3"] == fc.forward - fc.attention_forward  # forward only, no QK^T / PV
    with pytest.raises(ConfigError, match="fp8_gemms = 'attn': allowed values are"):
        e4m3_kinds("attn")


def test_fp8_gemm_sets_mirror_jaxgpt_fp8_and_the_model():
    """flops stays jax-free, so it mirrors jaxgpt.kernels.fp8's GEMM classes; they must agree, and each Linear layer's
    ``gemm`` kind must be the class its FLOP kind is counted in."""
    from flax import nnx

    from jaxgpt.kernels import fp8
    from jaxgpt.model import GPT
    from jaxgpt.precision import Policy

    assert FP8_GEMM_SETS == fp8.GEMM_SETS
    model = nnx.eval_shape(lambda: GPT(GPTConfig.preset("tiny"), policy=Policy.fp8_policy(), rngs=nnx.Rngs(0)))
    block = model.h[0]
    layers = {"qkv": block.attn.c_attn, "attn_out_proj": block.attn.c_proj, "mlp_up": block.mlp.c_fc,
              "mlp_down": block.mlp.c_proj}
    assert {kind: lin.gemm for kind, lin in layers.items()} == \
        {k: g for g, kinds in FP8_GEMM_KINDS.items() for k in kinds if k != "lm_head"}


def _dot_flops_by_operand_dtype(jaxpr, acc, mult=1):
    """2 m n k of every dot_general in a jaxpr (scan bodies times their length), keyed by the first operand's dtype."""
    import jax.extend as jex
    import numpy as np

    for eqn in jaxpr.eqns:
        subs = [v for v in eqn.params.values() if isinstance(v, (jex.core.ClosedJaxpr, jex.core.Jaxpr))]
        for sub in subs:
            _dot_flops_by_operand_dtype(getattr(sub, "jaxpr", sub), acc,
                                        mult * (eqn.params["length"] if eqn.primitive.name == "scan" else 1))
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            k = int(np.prod([eqn.invars[0].aval.shape[i] for i in contract]))
            acc[str(eqn.invars[0].aval.dtype)] += mult * 2 * int(np.prod(eqn.outvars[0].aval.shape)) * k
    return acc


@pytest.mark.parametrize("gemms", ["all", "mlp", "lm_head", "mlp+lm_head"])
def test_fp8_split_equals_the_dots_of_the_train_step(gemms):
    """The dot_generals of jaxgpt's fp8 value_and_grad (its jaxpr, dead code removed: the straight-through backward
    differentiates a bf16 forward XLA drops), by operand dtype: the e4m3 ones are exactly the split's e4m3 FLOPs, the
    others the rest (on XLA's full T x T attention path, which the analytic count describes)."""
    import collections

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax._src.interpreters import partial_eval as pe

    from jaxgpt.model import GPT
    from jaxgpt.precision import Policy

    cfg, B, T = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=96), 2, 64
    policy = Policy.fp8_policy(gemms, kernels={"attention": "xla"})
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: GPT(cfg, policy=policy, rngs=nnx.Rngs(0))),
                                       nnx.Param, ...)
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, x, y: jax.value_and_grad(
        lambda p: nnx.merge(graphdef, p, rest).loss(x, y))(p))(params, tok, tok).jaxpr
    jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    got = _dot_flops_by_operand_dtype(jaxpr, collections.Counter())
    want = count_flops(cfg, T, batch_size=B).training_per_step_by_dtype(gemms)
    e4m3 = got.pop("float8_e4m3fn")
    assert e4m3 == want["e4m3"]
    # the rest: bf16 GEMMs (jax.nn's XLA attention runs its forward QK^T and PV on fp32 operands here)
    assert set(got) <= {"bfloat16", "float32"} and sum(got.values()) == want["bf16"]
