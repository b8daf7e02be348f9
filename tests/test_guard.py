"""jaxgpt.train.guard: which steps count as diverged, and that the default factors never fire on healthy runs'
logged losses and gradient norms (tests/data/healthy_runs.json, recorded from real runs: see its "source")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jaxgpt.train import TrainConfig
from jaxgpt.train.guard import DivergenceGuard

HEALTHY = Path(__file__).resolve().parent / "data" / "healthy_runs.json"
DEFAULTS = TrainConfig.load(overrides={})


def default_guard() -> DivergenceGuard:
    return DivergenceGuard(loss_factor=DEFAULTS.spike_loss_factor, grad_norm_factor=DEFAULTS.spike_grad_norm_factor,
                           window=DEFAULTS.spike_window)


def test_non_finite_and_spikes_are_diverged_and_stay_out_of_the_history():
    g = DivergenceGuard(loss_factor=2.0, grad_norm_factor=10.0, window=3)
    assert g.check(1, 10.8, 1.0) is None  # the first step is the first history
    v = g.check(2, 30.0, 1.0)
    assert v is not None and v.step == 2 and "loss 30 is 2.78x the median 10.8 of the last 1" in v.reason
    assert g.check(3, 9.0, 1.0) is None and g.state_dict()["losses"] == [10.8, 9.0]  # 30 was not added
    for loss, norm in ((math.nan, 1.0), (math.inf, 1.0), (5.0, math.nan)):
        assert "not finite" in g.check(4, loss, norm).reason
    v = g.check(4, 9.0, 50.0)
    assert v is not None and "grad norm 50 is 50x the median 1" in v.reason
    for s, x in enumerate([8.0, 7.0, 6.0], start=4):  # the window keeps the last 3
        assert g.check(s, x, 1.0) is None
    assert g.state_dict()["losses"] == [8.0, 7.0, 6.0]
    assert g.check(7, 14.5, 1.0) is not None  # above 2 x the median 7
    assert g.check(7, 14.0, 1.0) is None  # "exceeds": at exactly the factor it still passes


def test_a_factor_of_zero_turns_a_rule_off_and_state_round_trips():
    g = DivergenceGuard(loss_factor=0, grad_norm_factor=0, window=5)
    for s, x in enumerate([1.0, 1e6, 1e12], start=1):
        assert g.check(s, x, x) is None
    assert g.check(4, math.inf, 1.0) is not None  # non-finite always counts
    h = DivergenceGuard(loss_factor=2, grad_norm_factor=0, window=5)
    h.load_state_dict(g.state_dict())
    assert h.state_dict() == g.state_dict() and h.check(4, 1.9e6, 1.0) is None  # median 1e6
    assert h.check(5, 1e7, 1.0) is not None  # median now 1.45e6
    h.load_state_dict(None)
    assert h.state_dict() == {"losses": [], "grad_norms": []}


def test_the_default_factors_never_fire_on_healthy_runs():
    runs = json.loads(HEALTHY.read_text())["runs"]
    assert {r["name"] for r in runs} >= {"shakespeare-char-cpu (the default run, nanoGPT's first: 2,000 steps)",
                                         "shakespeare-cpu (BPE, 600 steps; the default run before the char recipe)",
                                         "tiny-test (300 steps, warmup 20, cosine to 300)"}
    for r in runs:
        g = default_guard()
        fired = [v for s, (loss, norm) in enumerate(zip(r["loss"], r["grad_norm"]), start=1)
                 if (v := g.check(s, loss, norm)) is not None]
        assert not fired, (r["name"], fired[:3])
        # the margin: the largest ratio to the running median stays well below the factors
        assert r["max_loss_ratio"] * 1.5 < DEFAULTS.spike_loss_factor, r["name"]
        if DEFAULTS.spike_grad_norm_factor:
            assert r["max_grad_norm_ratio"] * 1.5 < DEFAULTS.spike_grad_norm_factor, r["name"]
    # why the gradient-norm rule is off by default: the BPE Shakespeare run's norm jumps ~100x at step 37 and recovers
    assert max(r["max_grad_norm_ratio"] for r in runs) > 50


@pytest.mark.parametrize("jump", [3.5, 10.0, 1.4e12])
def test_the_default_factors_catch_explosions_at_once(jump):
    r = json.loads(HEALTHY.read_text())["runs"][0]
    g = default_guard()
    for s, (loss, norm) in enumerate(zip(r["loss"][:200], r["grad_norm"][:200]), start=1):
        assert g.check(s, loss, norm) is None
    assert g.check(201, r["loss"][199] * jump, r["grad_norm"][199]) is not None
