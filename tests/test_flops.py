"""Tests for jaxgpt.flops: the matmul count by kind against hand arithmetic, backward = 2 x forward, the
per-token / per-sequence / per-step scaling, causal halving, the padded lm_head, and the published
conventions (nanoGPT, llm.c, MaxText) evaluated from their own definitions. No model needed."""

from __future__ import annotations

import json

import pytest

from jaxgpt.config import ConfigError, GPTConfig
from jaxgpt.flops import (BACKWARD_FACTOR, KINDS, LAYER_KINDS, conventions, conventions_table, count_flops,
                          n_params)

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
