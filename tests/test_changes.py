"""jaxgpt.train.changes: which settings a resumed run may change, one test per kind of field."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxgpt.config import ConfigError, to_dict
from jaxgpt.train import TrainConfig
from jaxgpt.train.changes import check_resume, classify

# the BPE Shakespeare preset (the default run's before issue 34): batch 16 x 128, 2 micro steps at 4,096 tokens
PRESET = Path(__file__).resolve().parent.parent / "configs" / "shakespeare-cpu.yaml"
SAVED = TrainConfig.load(PRESET, overrides={"total_batch_tokens": 4096})


def as_saved(cfg: TrainConfig) -> dict:
    return {**cfg.to_dict(), "model": to_dict(cfg.model)}


def changed(**overrides) -> tuple[list[str], dict]:
    new = TrainConfig.load(PRESET, overrides={"total_batch_tokens": 4096, **overrides})
    tokens = lambda c: c.micro_steps() * c.batch_size * c.seq_len  # noqa: E731
    return classify(as_saved(SAVED), as_saved(new), saved_global_batch=tokens(SAVED), global_batch=tokens(new))


@pytest.mark.parametrize("field,value", [
    ("model.n_embd", 64), ("model.n_layer", 2), ("model.padded_vocab_size", None), ("optim.name", "sgd"),
    ("seed", 7), ("seq_len", 64), ("loader_mode", "sequential")])
def test_refused_fields_name_the_fix(field, value):
    refused, allowed = changed(**{field: value})
    assert len(refused) >= 1 and refused[0].startswith(f"{field}: ") and f"use --{field}=" in refused[0]
    assert field not in allowed


def test_the_global_batch_is_refused_and_per_device_batch_allowed():
    refused, _ = changed(total_batch_tokens=8192)
    assert any(r.startswith("tokens per optimizer step: 4,096 -> 8,192") for r in refused)
    refused, allowed = changed(batch_size=8)  # same 4,096 tokens: 4 micro steps of 8 x 128
    assert refused == [] and allowed == {"batch_size": [16, 8]}


@pytest.mark.parametrize("field,value", [
    ("optim.lr", 1e-3), ("optim.warmup_steps", 10), ("optim.min_lr_ratio", 0.5), ("optim.weight_decay", 0.0),
    ("optim.grad_clip", 0.5), ("precision", "fp32"), ("kernels.attention", "xla"), ("kernels.preset", "pallas"),
    ("dropout", 0.0),
    ("model.dropout", 0.2), ("max_steps", 900), ("eval_interval", 50), ("sample_interval", -1),
    ("keep_checkpoints", 5), ("spike_loss_factor", 2.0), ("data_dir", "elsewhere")])
def test_allowed_fields_are_returned_old_and_new(field, value):
    refused, allowed = changed(**{field: value})
    assert refused == []
    assert field in allowed and allowed[field][1] == value


def test_actions_are_not_compared_and_check_resume_raises_with_every_field():
    assert changed(resume_step=4, skip_batches=2, out_dir="runs/x", resume="must") == ([], {})
    new = as_saved(TrainConfig.load(PRESET, overrides={"total_batch_tokens": 4096, "seed": 1, "seq_len": 64}))
    with pytest.raises(ConfigError) as e:
        check_resume(as_saved(SAVED), new, step=300, where="runs/x", saved_global_batch=4096, global_batch=4096)
    msg = str(e.value)
    assert "cannot resume runs/x (step 300)" in msg and "seed: 1337 -> 1" in msg and "seq_len: 128 -> 64" in msg
    assert "another out_dir" in msg



def test_switching_clipping_off_reshapes_the_optimizer_state_and_is_refused():
    """A change the optimizer state's tree would not survive (the restore could not fit the saved arrays) is
    refused with its fix, while a change beside it that keeps the structure stays allowed."""
    refused, allowed = changed(**{"optim.grad_clip": 0.0, "optim.lr": 1e-3})
    assert [r.split(":")[0] for r in refused] == ["optim.grad_clip"]
    assert "use --optim.grad_clip=1.0" in refused[0] and "another structure" in refused[0]
    assert allowed == {"optim.lr": [3e-3, 1e-3]}  # the default preset's lr


@pytest.mark.parametrize("field", ["momentum", "weight_decay"])
def test_sgd_momentum_or_coupled_decay_switched_off_is_refused(field):
    """SGD: momentum 0.9 -> 0 drops the trace from the state; weight decay 0.1 -> 0 drops the L2 transform."""
    base = {"total_batch_tokens": 4096, "optim.name": "sgd"}
    saved = as_saved(TrainConfig.load(PRESET, overrides=base))
    new = as_saved(TrainConfig.load(PRESET, overrides={**base, f"optim.{field}": 0.0, "optim.lr": 1e-3}))
    refused, allowed = classify(saved, new)
    assert [r.split(":")[0] for r in refused] == [f"optim.{field}"] and "another structure" in refused[0]
    assert allowed == {"optim.lr": [3e-3, 1e-3]}
