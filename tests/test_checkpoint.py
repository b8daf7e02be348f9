"""jaxgpt.checkpoint: bit-identical round trip, keep-last-K, config mismatch, crash mid-save, export."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from jaxgpt.checkpoint import (CheckpointMismatchError, Checkpoints, NoCheckpointError, export, load_model,
                               main)
from jaxgpt.config import GPTConfig, to_dict
from jaxgpt.model import GPT
from jaxgpt.optim import OptimConfig, make_optimizer
from jaxgpt import weights

CFG = GPTConfig.preset("tiny", vocab_size=50257)


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def trained():
    """Params and an AdamW state after two real updates (non-trivial moments), plus a config dict."""
    opt = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=10))

    @jax.jit
    def init_and_update():
        params = nnx.state(GPT(CFG, rngs=nnx.Rngs(0)), nnx.Param)
        opt_state = opt.init(params)
        for i in range(2):
            grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(i), p.shape) * 1e-2, params)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = jax.tree.map(lambda p, u: p + u, params, updates)
        return params, opt_state

    params, opt_state = init_and_update()
    config = {"model": to_dict(CFG), "optim": {"name": "adamw"}}
    return params, opt_state, config


def _save(ckpts, step, trained, **kw):
    params, opt_state, config = trained
    ckpts.save(step, params=params, opt_state=opt_state, config=kw.pop("config", config), **kw)


def test_round_trip_is_bit_identical(tmp_path, trained):
    params, opt_state, config = trained
    key = jax.random.split(jax.random.key(7))[1]
    loader = {"epoch": 1, "shard_pos": 0, "window": 3, "step": 42}
    with Checkpoints(tmp_path) as ckpts:
        _save(ckpts, 5, trained, rng_key=key, loader_state=loader, extra={"loss": 3.25})
    with Checkpoints(tmp_path) as ckpts:
        assert ckpts.all_steps() == [5]
        r = ckpts.restore(params=params, opt_state=opt_state, requested_config=config)
    assert r.step == 5 and r.loader_state == loader and r.extra == {"loss": 3.25} and r.config == config
    assert type(r.params) is type(params) and jax.tree.structure(r.opt_state) == jax.tree.structure(opt_state)
    assert _leaves_equal(r.params, params)
    assert _leaves_equal(r.opt_state, opt_state)
    np.testing.assert_array_equal(jax.random.key_data(r.rng_key), jax.random.key_data(key))
    # the restored key continues the same stream
    np.testing.assert_array_equal(jax.random.normal(r.rng_key, (4,)), jax.random.normal(key, (4,)))


def test_keeps_the_last_k(tmp_path, trained):
    with Checkpoints(tmp_path, keep=2) as ckpts:
        for step in (1, 2, 3, 4):
            _save(ckpts, step, trained)
    assert Checkpoints(tmp_path, read_only=True).all_steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "4"]


def test_mismatched_model_is_named_before_arrays_are_read(tmp_path, trained):
    params, opt_state, config = trained
    with Checkpoints(tmp_path) as ckpts:
        _save(ckpts, 1, trained)
    other = CFG.replace(n_layer=3, n_embd=48)
    other_params = nnx.state(nnx.eval_shape(lambda: GPT(other, rngs=nnx.Rngs(0))), nnx.Param)
    requested = {"model": to_dict(other), "optim": {"name": "sgd"}}
    with Checkpoints(tmp_path) as ckpts, pytest.raises(CheckpointMismatchError) as e:
        ckpts.restore(params=other_params, requested_config=requested)
    msg = str(e.value)
    assert "model.n_layer: checkpoint has 2, requested 3" in msg
    assert "model.n_embd: checkpoint has 32, requested 48" in msg
    assert "optim.name: checkpoint has 'adamw', requested 'sgd'" in msg
    assert "n_head" not in msg  # only the fields that differ
    # dropout changes no array: allowed
    with Checkpoints(tmp_path) as ckpts:
        ckpts.restore(params=params, requested_config={"model": to_dict(CFG.replace(dropout=0.1))})


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, trained):
    """A save that dies after part of it was written (here: its config can't be serialised) never becomes a
    step: the previous checkpoint stays the latest and restores."""
    params, opt_state, config = trained
    with Checkpoints(tmp_path, keep=1) as ckpts:
        _save(ckpts, 1, trained, loader_state={"step": 1})
        with pytest.raises(TypeError):
            _save(ckpts, 2, trained, config={**config, "bad": object()})
            ckpts.wait()
        assert ckpts.all_steps() == [1]
        r = ckpts.restore(params=params, opt_state=opt_state)
    assert r.step == 1 and _leaves_equal(r.params, params)


def test_partial_tmp_dir_from_a_killed_save_is_ignored(tmp_path, trained):
    """What a process killed mid-save leaves: orbax's ``<step>.orbax-checkpoint-tmp*`` directory with some
    of the files. It is not a step; the latest complete one restores, and the debris is cleaned up."""
    params, opt_state, _ = trained
    with Checkpoints(tmp_path) as ckpts:
        _save(ckpts, 1, trained)
    root = tmp_path / "checkpoints"
    partial = root / "2.orbax-checkpoint-tmp-1234567890"
    shutil.copytree(root / "1", partial)
    (partial / "commit_success.txt").unlink(missing_ok=True)
    shutil.rmtree(partial / "opt_state")
    for f in (partial / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])  # truncated writes
    with Checkpoints(tmp_path) as ckpts:
        assert ckpts.latest_step() == 1
        r = ckpts.restore(params=params, opt_state=opt_state)
    assert r.step == 1 and _leaves_equal(r.params, params) and _leaves_equal(r.opt_state, opt_state)
    assert not partial.exists()


def test_no_checkpoint_errors(tmp_path, trained):
    with pytest.raises(NoCheckpointError):
        Checkpoints(tmp_path / "nothing", read_only=True)
    with Checkpoints(tmp_path) as ckpts:
        with pytest.raises(NoCheckpointError, match="no complete checkpoint"):
            ckpts.restore(params=trained[0])
        _save(ckpts, 3, trained)
        with pytest.raises(NoCheckpointError, match=r"saved steps are \[3\]"):
            ckpts.restore(4, params=trained[0])


def test_export_to_hf_and_torch(tmp_path, trained, capsys):
    params, _, _ = trained
    with Checkpoints(tmp_path / "run") as ckpts:
        _save(ckpts, 2, trained)
    model = load_model(tmp_path / "run")
    assert model.config == CFG and _leaves_equal(nnx.state(model, nnx.Param), params)

    out = export(tmp_path / "run", to_hf=tmp_path / "hf", to_torch=tmp_path / "sd.pt")
    assert (out["hf"] / "config.json").is_file() and (out["hf"] / "model.safetensors").is_file()
    assert json.loads((out["hf"] / "config.json").read_text())["n_layer"] == CFG.n_layer
    back = weights.from_hf(out["hf"])
    assert _leaves_equal(nnx.state(back, nnx.Param), params)
    sd = torch.load(out["torch"])
    ref = weights.params_to_ref(params)
    assert sorted(sd) == sorted(ref)
    for k, v in ref.items():
        np.testing.assert_array_equal(sd[k].numpy(), v)

    assert main(["export", "--run-dir", str(tmp_path / "run"), "--to-torch", str(tmp_path / "cli.pt")]) == 0
    assert (tmp_path / "cli.pt").is_file() and "wrote torch" in capsys.readouterr().out
    missing = tmp_path / "missing"  # a missing run directory says so (with the nearest one), in one line
    assert main(["export", "--run-dir", str(missing), "--to-hf", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == f"error: run directory {missing}: no such directory: {missing}\n"
    assert main(["list", str(tmp_path / "runn")]) == 2
    assert capsys.readouterr().err == (f"error: run directory {tmp_path / 'runn'}: no such directory: "
                                       f"{tmp_path / 'runn'} (did you mean {tmp_path / 'run'}?)\n")
    (tmp_path / "empty").mkdir()
    assert main(["export", "--run-dir", str(tmp_path / "empty"), "--to-hf", str(tmp_path / "x")]) == 2
    assert "no checkpoints here" in capsys.readouterr().err


def test_torch_ref_loads_a_to_torch_export(tmp_path, trained):
    """``torch_ref.load.from_export`` rebuilds the model from the config the export records (no GPTConfig by
    hand) and gives jaxgpt's logits; a file without that record is refused in one message naming the fix."""
    from torch_ref.load import from_export

    with Checkpoints(tmp_path / "run") as ckpts:
        _save(ckpts, 2, trained)
    out = export(tmp_path / "run", to_torch=tmp_path / "ref.pt")
    ref = from_export(out["torch"], attention="math")
    assert ref.config == CFG
    idx = np.arange(2 * 16).reshape(2, 16) % CFG.vocab_size
    jax_logits = np.asarray(load_model(tmp_path / "run")(idx))[..., :CFG.vocab_size]
    with torch.no_grad():
        torch_logits, _ = ref(torch.from_numpy(idx))
    np.testing.assert_allclose(torch_logits.numpy(), jax_logits, atol=2e-5)

    torch.save(torch.load(out["torch"]), tmp_path / "bare.pt")  # the same weights without the export's record
    with pytest.raises(ValueError, match="export the run again"):
        from_export(tmp_path / "bare.pt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        from_export(tmp_path / "nope.pt")


def test_keep_best_survives_a_restart(tmp_path):
    """keep_best keeps the step with the lowest val_loss besides the newest ``keep``, also after the manager is
    reopened (a resumed run): the val losses are written beside each step, so a new manager still knows which
    older step is the best and keep-K does not delete it."""
    import jax.numpy as jnp

    tree = {"w": jnp.arange(4.0)}

    def save(c, step, val):
        c.save(step, params=tree, opt_state=tree, config={}, metrics=None if val is None else {"val_loss": val})

    with Checkpoints(tmp_path, keep=1, async_save=False, keep_best=True) as c:
        for step, val in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 4.0)):
            save(c, step, val)
        assert c.all_steps() == [2, 4]
    with Checkpoints(tmp_path, keep=1, async_save=False, keep_best=True) as c:  # the resumed run
        save(c, 5, None)  # the final step may have no val loss of its own
        assert c.all_steps() == [2, 5]
        save(c, 6, 0.5)  # a new best replaces the old one
        assert c.all_steps() == [6]
