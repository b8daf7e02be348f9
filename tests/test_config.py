"""Tests for jaxgpt.config: the GPT-2 presets against Hugging Face's published shapes, validation errors that
name the field, the value and what is allowed, and the YAML / dict / Hugging Face config round trips."""

from __future__ import annotations

import math

import pytest

from jaxgpt.config import PRESETS, ConfigError, GPTConfig, from_dict, to_dict

# Hugging Face's GPT-2 family (the config.json of openai-community/gpt2{,-medium,-large,-xl}) and their
# parameter counts with the tied lm_head counted once, as the GPT-2 paper / model cards report them.
HF_SHAPES = {  # name: (n_layer, n_head, n_embd, n_positions, vocab_size, parameters)
    "gpt2": (12, 12, 768, 1024, 50257, 124_439_808),
    "gpt2-medium": (24, 16, 1024, 1024, 50257, 354_823_168),
    "gpt2-large": (36, 20, 1280, 1024, 50257, 774_030_080),
    "gpt2-xl": (48, 25, 1600, 1024, 50257, 1_557_611_200),
}


def _raises(match_all: list[str], fn, *args, **kwargs) -> str:
    """Call ``fn`` expecting a ConfigError whose message contains every string of ``match_all``."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for part in match_all:
        assert part in msg, f"{part!r} not in error message {msg!r}"
    return msg


# ---- presets ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(HF_SHAPES))
def test_preset_matches_hugging_face_shape(name):
    n_layer, n_head, n_embd, n_positions, vocab, n_params = HF_SHAPES[name]
    cfg = GPTConfig.preset(name)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (
        n_layer, n_head, n_embd, n_positions, vocab)
    assert cfg.padded_vocab_size is None and cfg.vocab_rows == vocab
    assert cfg.bias is True and cfg.layer_norm_epsilon == 1e-5 and cfg.head_dim == n_embd // n_head
    # The weight shapes the loader expects add up to the published parameter count.
    from jaxgpt.weights import expected_shapes

    assert sum(math.prod(s) for s in expected_shapes(cfg).values()) == n_params


def test_gpt2_preset_is_transformers_default_config():
    from transformers import GPT2Config

    assert GPTConfig.from_hf_config(GPT2Config().to_dict()).replace(dropout=0.0) == GPTConfig.preset("gpt2")


@pytest.mark.parametrize("name", sorted(HF_SHAPES))
def test_from_transformers_config_gives_preset(name):
    from transformers import GPT2Config

    n_layer, n_head, n_embd, n_positions, vocab, _ = HF_SHAPES[name]
    hf = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions, vocab_size=vocab,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    assert GPTConfig.from_hf_config(hf.to_dict()) == GPTConfig.preset(name)


def test_preset_overrides_and_unknown_preset():
    cfg = GPTConfig.preset("gpt2", padded_vocab_size=50304, dropout=0.1)
    assert cfg.vocab_rows == 50304 and cfg.vocab_size == 50257 and cfg.dropout == 0.1
    _raises(["'gpt3'", "valid presets", "gpt2-xl"], GPTConfig.preset, "gpt3")
    _raises(["unknown key", "n_layers", "n_layer"], GPTConfig.preset, "gpt2", n_layers=3)


# ---- validation ---------------------------------------------------------------------------------------
def test_n_embd_must_be_divisible_by_n_head():
    msg = _raises(["GPTConfig.n_embd", "100", "divisible by n_head (12)"], GPTConfig.preset, "gpt2", n_embd=100)
    assert "e.g. n_embd = 96" in msg  # a concrete suggestion


@pytest.mark.parametrize("field", ["block_size", "vocab_size", "n_layer", "n_head", "n_embd"])
@pytest.mark.parametrize("value", [0, -1])
def test_sizes_must_be_positive(field, value):
    _raises([f"GPTConfig.{field}", repr(value), "positive integer"], GPTConfig.from_dict, {field: value})
    _raises([f"GPTConfig.{field}", repr(value), "positive integer"], GPTConfig, **{field: value})


def test_unknown_keys_are_listed_with_the_valid_ones():
    msg = _raises(["unknown key", "'n_ctx'", "'nlayer'", "valid keys", "'block_size'"],
                  GPTConfig.from_dict, {"n_ctx": 1024, "nlayer": 2, "n_head": 2})
    assert "n_head'" not in msg.split("valid keys")[0]  # only the unknown ones are reported as unknown


@pytest.mark.parametrize("field,value,allowed", [
    ("n_layer", "12", "expected an integer"),
    ("n_layer", 12.0, "expected an integer"),
    ("n_layer", True, "expected an integer"),  # bool is an int subclass; still refused
    ("bias", 1, "expected true or false"),
    ("bias", "yes", "expected true or false"),
    ("dropout", "a tenth", "expected a number"),
    ("padded_vocab_size", "50304", "expected"),
    ("padded_vocab_size", 50304.0, "expected"),
])
def test_wrong_types_are_refused(field, value, allowed):
    _raises([f"GPTConfig.{field}", repr(value), allowed], GPTConfig.from_dict, {field: value})


def test_yaml_exponent_strings_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads `1e-5` as the string '1e-5'; float fields take it as the number it spells."""
    path = tmp_path / "m.yaml"
    path.write_text("layer_norm_epsilon: 1e-5\ndropout: 1e-1\n")
    cfg = GPTConfig.from_yaml(path)
    assert cfg.layer_norm_epsilon == 1e-5 and cfg.dropout == 0.1


@pytest.mark.parametrize("field,value", [("dropout", "0.1"), ("layer_norm_epsilon", "1e-5"), ("bias", "no"),
                                         ("bias", 1), ("dropout", True), ("padded_vocab_size", 50304.0)])
def test_wrong_types_are_refused_by_the_constructor_too(field, value):
    _raises([f"GPTConfig.{field}", repr(value)], GPTConfig, **{field: value})


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5])
def test_dropout_out_of_range(value):
    _raises(["GPTConfig.dropout", repr(value), "[0, 1)"], GPTConfig.from_dict, {"dropout": value})


def test_layer_norm_epsilon_must_be_positive():
    _raises(["GPTConfig.layer_norm_epsilon", "0.0", "> 0"], GPTConfig.from_dict, {"layer_norm_epsilon": 0.0})


def test_padded_vocab_smaller_than_vocab():
    _raises(["GPTConfig.padded_vocab_size", "50000", ">= vocab_size (50257)"],
            GPTConfig.from_dict, {"padded_vocab_size": 50000})
    assert GPTConfig.from_dict({"padded_vocab_size": 50257}).vocab_rows == 50257  # equal is fine


def test_config_is_frozen():
    cfg = GPTConfig()
    with pytest.raises(Exception):
        cfg.n_layer = 3  # type: ignore[misc]
    assert cfg.replace(n_layer=3).n_layer == 3 and cfg.n_layer == 12
    _raises(["GPTConfig.n_layer", "0"], cfg.replace, n_layer=0)  # replace validates too


def test_from_dict_needs_a_mapping():
    _raises(["GPTConfig", "expected a mapping", "list"], from_dict, GPTConfig, [1, 2])


# ---- YAML and dict round trips ------------------------------------------------------------------------
def test_yaml_loading(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("n_layer: 3\nn_head: 3\nn_embd: 48\nblock_size: 37\npadded_vocab_size: 50304\n"
                    "dropout: 0.1\nlayer_norm_epsilon: 1.0e-5\n")
    cfg = GPTConfig.from_yaml(flat)
    assert cfg == GPTConfig(n_layer=3, n_head=3, n_embd=48, block_size=37, padded_vocab_size=50304, dropout=0.1)

    nested = tmp_path / "run.yaml"  # a run config with a `model:` section
    nested.write_text("model:\n  n_layer: 2\n  n_head: 2\n  n_embd: 32\ntrain:\n  lr: 3.0e-4\n")
    assert GPTConfig.from_yaml(nested) == GPTConfig(n_layer=2, n_head=2, n_embd=32)

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert GPTConfig.from_yaml(empty) == GPTConfig()


def test_yaml_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    _raises([str(missing), "does not exist"], GPTConfig.from_yaml, missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_layer: [1, 2\n")
    _raises([str(bad), "not valid YAML"], GPTConfig.from_yaml, bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    _raises([str(listy), "mapping"], GPTConfig.from_yaml, listy)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("n_layers: 2\n")
    _raises(["unknown key", "n_layers"], GPTConfig.from_yaml, unknown)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("n_embd: 100\nn_head: 12\n")
    _raises(["GPTConfig.n_embd", "100", "divisible"], GPTConfig.from_yaml, wrong)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_to_dict_from_dict_round_trip(name, tmp_path):
    import yaml

    cfg = GPTConfig.preset(name, dropout=0.1)
    d = to_dict(cfg)
    assert all(isinstance(v, (int, float, bool, type(None))) for v in d.values())
    assert GPTConfig.from_dict(d) == cfg
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(d))
    assert GPTConfig.from_yaml(path) == cfg


# ---- Hugging Face config round trip ---------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
    from transformers import GPT2Config

    cfg = GPTConfig.preset(name, dropout=0.1)
    hf = cfg.hf_config()
    assert hf["model_type"] == "gpt2" and hf["activation_function"] == "gelu_new"
    assert (hf["n_layer"], hf["n_head"], hf["n_embd"], hf["n_positions"], hf["vocab_size"]) == (
        cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size)  # the real vocab, never padded
    unpadded = cfg.replace(padded_vocab_size=None)  # padding is jaxgpt's layout, not part of the HF model
    assert GPTConfig.from_hf_config(hf) == unpadded
    # ... and through transformers' own GPT2Config (what save_pretrained writes)
    assert GPTConfig.from_hf_config(GPT2Config(**hf).to_dict()) == unpadded


def test_hf_config_needs_biases():
    _raises(["bias", "False"], GPTConfig(bias=False).hf_config)


@pytest.mark.parametrize("change,words", [
    ({"model_type": "llama"}, ["model_type", "'llama'", "GPT-2"]),
    ({"model_type": "gpt_neo"}, ["'gpt_neo'"]),
    ({"activation_function": "relu"}, ["activation_function", "'relu'"]),
    ({"activation_function": "gelu"}, ["'gelu'"]),  # exact erf GELU is not GPT-2's tanh approximation
    ({"n_inner": 1000}, ["n_inner", "1000"]),
    ({"tie_word_embeddings": False}, ["tie_word_embeddings"]),
    ({"scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx"]),
    ({"reorder_and_upcast_attn": True}, ["reorder_and_upcast_attn"]),
    ({"scale_attn_weights": False}, ["scale_attn_weights"]),
])
def test_from_hf_config_refuses_what_gpt2_cannot_represent(change, words):
    hf = {**GPTConfig.preset("tiny").hf_config(), **change}
    _raises(["my/config.json", *words], GPTConfig.from_hf_config, hf, source="my/config.json")


def test_from_hf_config_accepts_equivalent_spellings():
    hf = {**GPTConfig.preset("tiny").hf_config(), "activation_function": "gelu_pytorch_tanh", "n_inner": 128}
    assert GPTConfig.from_hf_config(hf) == GPTConfig.preset("tiny")
