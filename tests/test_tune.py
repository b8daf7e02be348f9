"""kernels: auto (jaxgpt.tune): candidates measured for real on this CPU at a tiny size (one search: the default
program, two alternatives, a test implementation that raises and one that changes values), the choice cached and
reused without measuring, the search's rules (noise, budget, greedy order) on stub measurements, the cache's key and
places, and the tile mechanism with a test-registered op (no Pallas GEMM runs on a CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxgpt.config import ConfigError
from jaxgpt.kernels import attention as attention_mod
from jaxgpt.kernels import registry
from jaxgpt.kernels.registry import Implementation, Kernels
from jaxgpt.train.config import TrainConfig
from jaxgpt.kernels import tiles
from jaxgpt.train.tune import auto, cache, cli, search
from jaxgpt.train.tune.measure import Measurement

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-test.yaml"
# the tiny config, smaller still (a 1-layer model, a 256-token vocabulary), every op but attention pinned
SMALL = {"model.n_layer": 1, "model.vocab_size": 256, "batch_size": 2, "seq_len": 16, "total_batch_tokens": None,
         "kernels.layer_norm": "xla", "kernels.qkv": "xla", "kernels.mlp": "xla", "kernels.loss": "xla"}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "COMMITTED_DIR", tmp_path / "committed")
    return tmp_path / "cache" / "tune"


@pytest.fixture
def test_impls(monkeypatch):
    """Two attention implementations registered for the test: one raises when traced, one changes the values while
    claiming to keep them (numerics "reordered"): the loss check must refuse it. And one declaring "changes"."""
    for name, numerics in (("test-raises", "reordered"), ("test-scaled", "reordered"), ("test-bf16", "changes")):
        monkeypatch.setitem(registry.REGISTRY["attention"], name, Implementation(
            "attention", name, registry.ALL, ("float32",), numerics, "a test implementation"))
    real = attention_mod.attention

    def attention(q, k, v, *, policy, **kw):
        impl = policy.kernel("attention")
        if impl == "test-raises":
            raise NotImplementedError("test-raises: this implementation does not lower")
        if impl == "test-scaled":
            return real(q, k, v, policy=Policy_with(policy, "xla"), **kw) * 1.5
        return real(q, k, v, policy=policy, **kw)

    monkeypatch.setattr(attention_mod, "attention", attention)


def Policy_with(policy, attention: str):
    import dataclasses

    return dataclasses.replace(policy, kernels=dataclasses.replace(policy.kernels, attention=attention))


def small_config(**extra) -> TrainConfig:
    return TrainConfig.load(TINY, {**SMALL, **extra})


def test_search_measures_drops_refuses_chooses_caches_and_reuses(cache_dir, test_impls, capsys, monkeypatch):
    real = search.alternatives  # (xla's attention left out: three compiles, not four, on the test's time budget)
    keep = ("einsum", "reference", "test-raises", "test-scaled", "test-bf16")
    monkeypatch.setattr(search, "alternatives", lambda op, policy, platform: [
        n for n in real(op, policy, platform) if n in keep])
    assert cli.main([f"--config={TINY}", *(f"--{k}={v}" for k, v in SMALL.items() if v is not None),
                     "--total_batch_tokens=null", "--no-progress", "--budget-s=120"]) == 0
    out = capsys.readouterr().out
    files = list(cache_dir.glob("*.json"))
    assert len(files) == 1, out
    record = json.loads(files[0].read_text())
    by = {c["name"]: c for c in record["candidates"]}
    assert by["xla"]["median_ms"] > 0 and len(by["xla"]["times_ms"]) == 5  # the default program: always measured
    measured = [c for c in record["candidates"] if c["error"] is None and c["same_as"] is None]
    assert len(measured) >= 2, out
    assert by["pallas"]["same_as"] == "xla"  # every op pinned but attention: the same program, not compiled again
    assert by["xla+attention=einsum"]["same_as"] == "xla"  # attention auto is einsum on CPUs
    assert by["xla+attention=reference"]["median_ms"] > 0
    assert "test-raises" in by["xla+attention=test-raises"]["error"]
    assert "auto: xla+attention=test-raises dropped: NotImplementedError" in out
    assert by["xla+attention=test-scaled"]["error"].startswith("refused: first-step loss")
    assert not any("test-bf16" in name for name in by)  # numerics "changes": never a candidate
    losses = {c["loss"] for c in measured}
    assert max(losses) - min(losses) <= search.LOSS_REL_FP32 * max(losses)
    chosen = by[record["name"]]
    assert chosen["median_ms"] <= by["xla"]["median_ms"]  # never slower than the default program as measured
    assert "candidate" in out and "<-" in out and "auto: chose" in out

    def no_bench(*a, **k):
        raise AssertionError("a cached choice must not measure")

    monkeypatch.setattr("jaxgpt.train.tune.measure.Bench", no_bench)
    assert cli.main([f"--config={TINY}", *(f"--{k}={v}" for k, v in SMALL.items() if v is not None),
                     "--total_batch_tokens=null", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "auto: cached choice" in out and "<-" in out


def _m(name, ms, iqr=0.0, kernels=None, loss=1.0):
    m = Measurement(name, kernels or Kernels("xla"), compile_s=0.1, loss=loss, spent_s=1.0)
    m.times_ms = [ms - iqr, ms - iqr / 2, ms, ms + iqr / 2, ms + iqr]  # IQR: iqr
    return m


class StubBench:
    """Measurements from a table (name -> ms), no compile: the search's decisions alone."""

    def __init__(self, cfg, table, losses=None):
        self.cfg, self.table, self.losses, self.calls = cfg, table, losses or {}, []

    def policy_for(self, kernels):
        from jaxgpt.precision import Policy

        return Policy.named(self.cfg.precision, **{**self.cfg.policy_options(), "kernels": kernels})

    def measure(self, name, kernels):
        self.calls.append(name)
        ms = self.table.get(name, 10.0)
        if ms is None:
            m = Measurement(name, kernels, error="RuntimeError: boom", spent_s=1.0)
            return m
        return _m(name, ms, 0.4, kernels, self.losses.get(name, 1.0))


def test_search_rules_noise_greedy_and_budget():
    cfg = TrainConfig.load(TINY, {"precision": "fp32"})
    # pallas 0.3 ms faster than xla, inside the 0.4 ms noise: the default stays; greedy then from xla; attention=xla
    # 2 ms faster: kept; the others slower or failing
    bench = StubBench(cfg, {"xla": 10.0, "pallas": 9.7, "xla+attention=xla": 8.0, "xla+layer_norm=fused": None})
    r = search.search(bench, platform="cpu", budget_s=1e9, say=lambda s: None, progress=False)
    assert r.chosen.name == "xla+attention=xla"
    assert bench.calls[:2] == ["xla", "pallas"]
    assert "xla+attention=reference" in bench.calls  # alternatives tried from the new best
    assert "xla+attention=xla+layer_norm=fused" not in bench.calls  # layer_norm came first, from xla
    # a budget of 0.5 s with 1 s per candidate (as measured): the default, then the search stops with a note
    bench = StubBench(cfg, {"xla": 10.0, "pallas": 5.0})
    r = search.search(bench, platform="cpu", budget_s=lambda d: 0.5, say=lambda s: None, progress=False)
    assert bench.calls == ["xla"] and r.chosen.name == "xla" and "budget" in r.notes[0]
    # the default program failing: nothing to fall back on
    with pytest.raises(RuntimeError, match="default program"):
        search.search(StubBench(cfg, {"xla": None}), platform="cpu", budget_s=10, say=lambda s: None, progress=False)


def test_alternatives_keep_the_policys_values(test_impls):
    from jaxgpt.precision import Policy

    alts = search.alternatives("attention", Policy.fp32(), "cpu")
    assert "test-bf16" not in alts and {"xla", "einsum", "reference"} <= set(alts)
    assert "cudnn" not in alts  # its own path does not run on CPUs
    assert "pallas" not in search.alternatives("layer_norm", Policy.fp32(), "cpu")
    assert "pallas" in search.alternatives("layer_norm", Policy.bf16(), "gpu")


def test_budget_rules():
    cfg = TrainConfig.load(TINY)
    assert auto.search_budget(cfg, "cpu", 10_000, 1)[0] is None  # CPUs: cached/committed choices only
    assert auto.search_budget(cfg, "gpu", 100, 1)[0] is None  # a short run
    budget, rule = auto.search_budget(cfg, "gpu", 10_000, 4)
    assert budget(_m("xla", 100.0)) == auto.CAP_S  # 10% of 4000 s: capped
    assert budget(_m("xla", 1.0)) == pytest.approx(0.1 * 40)
    assert auto.search_budget(cfg.__class__.load(TINY, {"kernels_search_s": 0}), "gpu", 10_000, 1)[0] is None
    assert auto.search_budget(cfg.__class__.load(TINY, {"kernels_search_s": 30}), "cpu", 5, 1)[0] == 30.0
    with pytest.raises(ConfigError, match="kernels_search_s"):
        TrainConfig.load(TINY, {"kernels_search_s": -1})


def test_cache_places_key_and_committed_first(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXGPT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "jaxgpt" / "tune"
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path / "j"))
    assert cache.cache_dir() == tmp_path / "j" / "tune"
    monkeypatch.setattr(cache, "COMMITTED_DIR", tmp_path / "committed")
    key = {"device_kind": "NVIDIA H100 80GB HBM3", "model": {"n_layer": 12, "n_embd": 768}, "batch_size": 64,
           "seq_len": 1024, "precision": {"compute_dtype": "bfloat16"}}
    assert cache.file_name(key).startswith("nvidia-h100-80gb-hbm3_12L768C_b64x1024_bfloat16_")
    assert cache.lookup(key) is None
    cache.store(key, {"choice": {"preset": "xla"}})
    assert cache.lookup(key)[1].parent == tmp_path / "j" / "tune"
    cache.store(key, {"choice": {"preset": "pallas"}}, tmp_path / "committed")
    record, path = cache.lookup(key)
    assert path.parent == tmp_path / "committed" and record["choice"] == {"preset": "pallas"}
    assert cache.lookup(key, committed_only=True)[1] == path
    other = {**key, "batch_size": 16}
    assert cache.lookup(other) is None
    (tmp_path / "j" / "tune" / cache.file_name(other)).write_text(json.dumps({"format": 1, "key": key}))
    assert cache.lookup(other) is None  # a file whose key differs is never used


def test_run_uses_a_cached_choice_and_records_it(cache_dir, tmp_path, capsys):
    """select() with a cached choice (written as a search writes it), then what the run records."""
    from jaxgpt import mesh as mesh_lib
    from jaxgpt.precision import Policy
    from jaxgpt.train.metrics import MetricsLog, read_metrics

    cfg = small_config()
    mesh = mesh_lib.make_mesh(cfg.mesh)
    none = auto.select(cfg, mesh=mesh, steps_to_train=8, say=print)  # CPU, nothing cached: the default program
    assert none.source == "default" and none.kernels == Kernels("xla", **auto.pinned(cfg.kernels))
    policy = Policy.named(cfg.precision, **{**cfg.policy_options(), "kernels": Kernels("xla")})
    key = auto.cache_key(cfg, auto.model_config(cfg), policy, mesh)
    cache.store(key, {"choice": {"preset": "xla", "layer_norm": "xla", "qkv": "xla", "mlp": "xla", "loss": "xla",
                                 "attention": "reference"}, "name": "xla+attention=reference", "chosen_ms": 1.0,
                      "default_ms": 2.0, "candidates": []})
    choice = auto.select(cfg, mesh=mesh, steps_to_train=8, say=print)
    assert choice.source == "cached" and choice.kernels.attention == "reference"
    assert "auto: cached choice xla+attention=reference" in capsys.readouterr().out
    run_policy = Policy.named(cfg.precision, **{**cfg.policy_options(), "kernels": choice.kernels})
    log = MetricsLog(tmp_path, tensorboard=False, truncate_after=None)
    auto.record_in_run(choice, run_policy, tmp_path, log, say=print, step=0)
    log.close()
    rec = [r for r in read_metrics(tmp_path) if r["type"] == "kernels"][0]
    assert rec["ran"]["attention"] == "reference" and rec["source"] == "cached"
    assert json.loads((tmp_path / "kernels-auto.json").read_text())["choice"]["attention"] == "reference"


def test_tiles_chosen_per_shape_by_op_timing(monkeypatch):
    """A test-registered op on the CPU: a matmul in K chunks (the configuration), one configuration that fails."""
    import jax
    import jax.numpy as jnp

    def make(chunk, shape):
        m, n, k = shape
        if chunk == 7:
            raise ValueError("chunk 7 does not divide K")
        x, w = jnp.ones((m, k)), jnp.ones((k, n))
        f = jax.jit(lambda x, w: sum(x[:, i:i + chunk] @ w[i:i + chunk] for i in range(0, k, chunk)))
        return f, (x, w)

    monkeypatch.setitem(tiles.OPS, "test-matmul", tiles.TunableOp("test-matmul", ("cpu",), (64, 7, 8), make,
                                                                  encode=lambda c: c, decode=lambda c: c))
    lines = []
    tiles.note("test-matmul", (16, 16, 64))
    assert tiles.seen("test-matmul") == [(16, 16, 64)]
    out = tiles.tune_seen("cpu", say=lines.append)["test-matmul"]
    assert out[0]["shape"] == [16, 16, 64] and out[0]["config"] in (64, 8)
    assert [t["median_ms"] is None for t in out[0]["timings"]] == [False, True, False]
    assert "test-matmul (16, 16, 64) 7 dropped: ValueError: chunk 7 does not divide K" in lines[0]
    try:
        assert tiles.install({"test-matmul": out}) == 1
        assert tiles.chosen("test-matmul", (16, 16, 64)) == out[0]["config"]
        assert tiles.chosen("test-matmul", (16, 16, 32)) is None
    finally:
        tiles.install(None)
        tiles.clear_seen()
