"""Tests for jaxgpt.weights: finding and reading Hugging Face GPT-2 checkpoints (directory, .bin, legacy keys,
the local HF cache), the errors for everything that is not a GPT-2 checkpoint (one message, nothing half
loaded), and the atomic export. Numerical parity of the loaded models is in parity_tests/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT
from jaxgpt.weights import (CheckpointError, from_hf, from_torch_state_dict, load_hf, load_ref, params_to_ref,
                            save_hf, to_torch_state_dict)

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, n_positions=16)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A random-init transformers GPT-2 saved with save_pretrained (config.json + model.safetensors)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("hf-tiny")
    GPT2LMHeadModel(GPT2Config(**SHAPE)).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf_state(hf_dir) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as stored (transformer.* keys; the tied lm_head is not stored)."""
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))


def expected_ref(hf_state) -> dict[str, np.ndarray]:
    return {k.removeprefix("transformer."): v.numpy() for k, v in hf_state.items() if k != "lm_head.weight"}


def assert_params_equal(model: GPT, ref: dict[str, np.ndarray]) -> None:
    got = params_to_ref(model)
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def write_checkpoint(d: Path, tensors: dict[str, torch.Tensor], *, config: dict | None = None,
                     fmt: str = "safetensors") -> Path:
    """A checkpoint directory with the given tensors and the tiny GPT-2's config.json."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    hf_config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16).hf_config()
    (d / "config.json").write_text(json.dumps({**hf_config, **(config or {})}))
    tensors = {k: v.contiguous().clone() for k, v in tensors.items()}
    if fmt == "safetensors":
        save_file(tensors, str(d / "model.safetensors"))
    else:
        torch.save(tensors, d / "pytorch_model.bin")
    return d


class NotATensor:
    """An arbitrary pickled object: what torch.load(weights_only=True) must refuse to unpickle."""


def message(exc_info) -> str:
    return str(exc_info.value)


# ---- loading what is there ---------------------------------------------------------------------------
def test_from_hf_directory(hf_dir, hf_state):
    model = from_hf(hf_dir)
    assert model.config == GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1)
    assert_params_equal(model, expected_ref(hf_state))
    assert_params_equal(from_hf(hf_dir / "model.safetensors"), expected_ref(hf_state))  # a file: its directory


def test_from_hf_padded_vocab(hf_dir, hf_state):
    model = from_hf(hf_dir, padded_vocab_size=50304)
    assert model.config.vocab_rows == 50304 and model.config.vocab_size == 50257
    wte = params_to_ref(model)["wte.weight"]
    np.testing.assert_array_equal(wte[:50257], hf_state["transformer.wte.weight"].numpy())
    assert wte.shape == (50304, 32) and not wte[50257:].any()


def test_pytorch_model_bin(tmp_path, hf_state):
    """A .bin-only checkpoint (older hub repos), read with torch.load(weights_only=True)."""
    d = write_checkpoint(tmp_path / "bin", dict(hf_state), fmt="bin")
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "pytorch_model.bin"]
    assert_params_equal(from_hf(d), expected_ref(hf_state))


def test_pytorch_model_bin_refuses_pickled_code(tmp_path, hf_state):
    d = write_checkpoint(tmp_path / "evil", dict(hf_state), fmt="bin")
    torch.save({"transformer.wte.weight": hf_state["transformer.wte.weight"], "x": NotATensor()},
               d / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as info:
        from_hf(d)
    assert "pytorch_model.bin" in message(info) and "weights_only" in message(info)


def test_legacy_buffers_and_unprefixed_keys(tmp_path, hf_state):
    """Old GPT2Model-style checkpoints: no `transformer.` prefix, plus the causal-mask buffers attn.bias
    (1, 1, n_positions, n_positions) and attn.masked_bias (a scalar) that transformers < 4.x saved."""
    n = SHAPE["n_positions"]
    tensors = {k.removeprefix("transformer."): v for k, v in hf_state.items()}
    for i in range(SHAPE["n_layer"]):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    d = write_checkpoint(tmp_path / "legacy", tensors)
    assert_params_equal(from_hf(d), expected_ref(hf_state))


def test_tied_lm_head_stored_explicitly_is_fine(tmp_path, hf_state):
    tensors = dict(hf_state)
    tensors["lm_head.weight"] = hf_state["transformer.wte.weight"]
    assert_params_equal(from_hf(write_checkpoint(tmp_path / "tied", tensors)), expected_ref(hf_state))


def test_sharded_safetensors(tmp_path, hf_state):
    from safetensors.torch import save_file

    d = tmp_path / "sharded"
    keys = sorted(hf_state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    write_checkpoint(d, {})
    (d / "model.safetensors").unlink()
    for name, ks in shards.items():
        save_file({k: hf_state[k].contiguous() for k in ks}, str(d / name))
    index = {"metadata": {}, "weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_params_equal(from_hf(d), expected_ref(hf_state))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: listed in .* but missing"):
        from_hf(d)


# ---- errors ------------------------------------------------------------------------------------------
def test_missing_path(tmp_path, monkeypatch):
    missing = tmp_path / "no" / "such" / "checkpoint"
    with pytest.raises(CheckpointError) as info:
        from_hf(missing)
    assert message(info) == f"checkpoint {str(missing)!r}: no such directory: {missing}"  # not asked of the hub
    (tmp_path / "runs" / "shakespeare-char-cpu").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # runs/ is here: runs/NAME is a path, a typo of one is a missing directory
    with pytest.raises(CheckpointError) as info:
        from_hf("runs/shakespeare-char-cpy")
    assert message(info) == ("checkpoint 'runs/shakespeare-char-cpy': no such directory: runs/shakespeare-char-cpy "
                             "(did you mean runs/shakespeare-char-cpu?)")


def test_directory_without_weights_lists_its_files(tmp_path):
    d = write_checkpoint(tmp_path / "empty", {})
    (d / "model.safetensors").unlink()
    (d / "README.md").write_text("hi")
    with pytest.raises(CheckpointError) as info:
        from_hf(d)
    msg = message(info)
    assert str(d) in msg and "no weights found" in msg and "model.safetensors" in msg
    assert "'README.md'" in msg and "'config.json'" in msg  # what is there


def test_directory_without_config(tmp_path, hf_state):
    d = write_checkpoint(tmp_path / "noconfig", dict(hf_state))
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json: missing"):
        from_hf(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        from_hf(d)


def test_truncated_safetensors(tmp_path, hf_dir):
    d = tmp_path / "truncated"
    d.mkdir()
    (d / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    data = (hf_dir / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        from_hf(d)
    assert str(d / "model.safetensors") in message(info) and "truncated" in message(info)


def test_truncated_bin(tmp_path, hf_state):
    d = write_checkpoint(tmp_path / "truncated-bin", dict(hf_state), fmt="bin")
    data = (d / "pytorch_model.bin").read_bytes()
    (d / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="pytorch_model.bin: cannot be loaded"):
        from_hf(d)


@pytest.mark.parametrize("config,words", [
    ({"model_type": "llama"}, ["model_type", "'llama'", "GPT-2 checkpoints only"]),
    ({"activation_function": "relu"}, ["'relu'"]),
    ({"tie_word_embeddings": False}, ["tie_word_embeddings"]),
])
def test_non_gpt2_config(tmp_path, hf_state, config, words):
    d = write_checkpoint(tmp_path / "other", dict(hf_state), config=config)
    with pytest.raises(CheckpointError) as info:
        from_hf(d)
    for w in [str(d / "config.json"), *words]:
        assert w in message(info)


def test_wrong_keys_are_reported_together(tmp_path, hf_state):
    """Missing, unexpected and mis-shaped keys all in ONE error, so one run shows everything that is wrong."""
    tensors = dict(hf_state)
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    del tensors["transformer.ln_f.weight"]
    tensors["transformer.h.0.attn.rotary_emb.inv_freq"] = torch.zeros(8)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    tensors["transformer.wpe.weight"] = torch.zeros(32, 32)  # n_positions 32, config says 16
    d = write_checkpoint(tmp_path / "wrong", tensors)
    with pytest.raises(CheckpointError) as info:
        from_hf(d)
    msg = message(info)
    for w in [str(d), "missing keys", "h.1.mlp.c_fc.bias", "ln_f.weight",
              "unexpected keys", "h.0.attn.rotary_emb.inv_freq", "model.layers.0.self_attn.q_proj.weight",
              "mis-shaped", "wpe.weight: (32, 32) (expected (16, 32))", "n_layer=2"]:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_llama_like_state_dict_lists_everything_abbreviated(tmp_path):
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.zeros(2, 2) for i in range(20)}
    d = write_checkpoint(tmp_path / "llama", tensors)
    with pytest.raises(CheckpointError) as info:
        from_hf(d)
    msg = message(info)
    assert "missing keys" in msg and "unexpected keys" in msg and "more)" in msg  # long lists are abbreviated
    assert "Is it a GPT-2 checkpoint" in msg


def test_untied_lm_head_is_refused(tmp_path, hf_state):
    tensors = dict(hf_state)
    tensors["lm_head.weight"] = hf_state["transformer.wte.weight"] + 1.0
    with pytest.raises(CheckpointError, match="lm_head.weight differs from wte.weight"):
        from_hf(write_checkpoint(tmp_path / "untied", tensors))
    tensors["lm_head.weight"] = torch.zeros(100, 32)  # not even wte's shape: refused, not silently dropped
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        from_hf(write_checkpoint(tmp_path / "untied-shape", tensors))


def test_failed_load_leaves_model_unchanged(hf_dir, hf_state):
    """load_ref validates the whole state dict before touching a parameter."""
    model = from_hf(hf_dir)
    before = params_to_ref(model)
    good = {k: v.copy() + 1.0 for k, v in expected_ref(hf_state).items()}  # differs from `before` everywhere

    one_misshaped = {**good, "ln_f.bias": np.zeros(31, np.float32)}
    one_missing = {k: v for k, v in good.items() if k != "h.1.mlp.c_proj.weight"}
    one_extra = {**good, "h.0.attn.bias": np.zeros((1, 1, 16, 16), np.float32)}
    for bad, word in ((one_misshaped, "ln_f.bias"), (one_missing, "h.1.mlp.c_proj.weight"),
                      (one_extra, "h.0.attn.bias")):
        with pytest.raises(CheckpointError, match=word.replace(".", r"\.")):
            load_ref(model, bad)
        after = params_to_ref(model)
        for k in before:
            np.testing.assert_array_equal(after[k], before[k], err_msg=f"{k} changed by a failed load")
    load_ref(model, {k: torch.from_numpy(v) for k, v in good.items()})  # torch tensors are accepted too
    assert_params_equal(model, good)


def test_torch_state_dict_round_trip(hf_dir):
    model = from_hf(hf_dir, padded_vocab_size=50304)
    cfg = model.config
    sd = to_torch_state_dict(model)
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in sd.values())
    assert sd["wte.weight"].shape == (50304, 32)  # torch_ref keeps the padded rows too
    assert_params_equal(from_torch_state_dict(sd, cfg), params_to_ref(model))


# ---- the Hugging Face cache ---------------------------------------------------------------------------------
def fake_hub_cache(cache: Path, repo: str, src: Path) -> Path:
    """Lay out `models--{owner}--{name}/{refs/main, snapshots/<hash>/...}` as huggingface_hub writes it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = cache / f"models--{repo.replace('/', '--')}"
    snap = entry / "snapshots" / commit
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (snap / name).write_bytes((src / name).read_bytes())
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return snap


def test_from_hf_cache_in_process(tmp_path, monkeypatch, hf_dir, hf_state):
    """huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE into module constants when it is imported, so a
    process that already imported it needs the constants patched too (the env-only route is the subprocess
    test below)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snap = fake_hub_cache(cache, "someone/tiny-gpt2", hf_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # "someone/tiny-gpt2" must not resolve as a relative path

    config, ref = load_hf("someone/tiny-gpt2")
    assert config.n_layer == 2 and ref.keys() == expected_ref(hf_state).keys()
    assert_params_equal(from_hf("someone/tiny-gpt2"), expected_ref(hf_state))
    from jaxgpt.weights import resolve

    assert resolve("someone/tiny-gpt2") == snap

    with pytest.raises(CheckpointError) as info:
        from_hf("someone/not-cached")
    msg = message(info)
    assert "'someone/not-cached'" in msg and "not in the Hugging Face cache" in msg
    assert "no such local directory: someone/not-cached" in msg  # (no someone/ here: maybe a hub name, asked there)


@pytest.mark.slow  # a fresh interpreter importing jax, flax and torch: ~10 s of CPU
def test_from_hf_cache_env_only_subprocess(tmp_path, hf_dir):
    """The user's route: only environment variables, set before huggingface_hub is imported."""
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "someone/tiny-gpt2", hf_dir)
    script = textwrap.dedent("""
        import json
        from jaxgpt.weights import CheckpointError, load_hf
        config, ref = load_hf("someone/tiny-gpt2")
        out = {"n_layer": config.n_layer, "wte": ref["wte.weight"][:2, :3].tolist()}
        try:
            load_hf("someone/not-cached")
        except CheckpointError as e:
            out["error"] = str(e)
        print(json.dumps(out))
    """)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HOME", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n_layer"] == 2
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(np.array(out["wte"], np.float32),
                                  load_file(str(hf_dir / "model.safetensors"))["transformer.wte.weight"][:2, :3])
    assert "someone/not-cached" in out["error"] and "not in the Hugging Face cache" in out["error"]


# ---- export -----------------------------------------------------------------------------------------
def test_save_hf_round_trip(tmp_path, hf_dir, hf_state):
    model = from_hf(hf_dir, padded_vocab_size=50304)
    out = save_hf(model, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "jaxgpt_export.json", "merges.txt", "model.safetensors",
        "special_tokens_map.json", "tokenizer_config.json", "vocab.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 50257 and config["model_type"] == "gpt2"
    assert_params_equal(from_hf(out), expected_ref(hf_state))  # padding stripped, values bit-exact


def test_save_hf_is_atomic(tmp_path, monkeypatch, hf_dir):
    import safetensors.numpy

    model = from_hf(hf_dir)
    out = save_hf(model, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken_save(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors.numpy, "save_file", broken_save)
    # different weights: a successful save would change the files
    other = load_ref(from_hf(hf_dir), {k: v * 2 for k, v in params_to_ref(model).items()})
    with pytest.raises(OSError, match="disk full"):
        save_hf(other, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous export is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary or .old directories

    with pytest.raises(OSError, match="disk full"):  # a first export that fails leaves nothing behind
        save_hf(other, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    monkeypatch.undo()
    save_hf(other, out)  # overwriting works, and leaves no .old directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before
