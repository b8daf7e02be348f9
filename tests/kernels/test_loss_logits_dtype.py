"""``logits_dtype: bfloat16`` as a user's opt-in (TrainConfig.logits_dtype -> Policy.logits_dtype): how it is reached
and refused, and what it does to a small GPT's losses and gradients against the same GPT with fp32 logits (same
weights, same batch), held to the bounds derived in parity_tests/tolerances.py (bf16 logits). The fused loss itself
against the plain expression: tests/kernels/test_loss_logits.py; 20 AdamW steps against torch autocast's noise:
parity_tests/test_train_parity.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgpt import ops
from jaxgpt.kernels import loss as fused_loss
from jaxgpt.config import ConfigError, GPTConfig
from jaxgpt.model import GPT
from jaxgpt.precision import Policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parity_tests"))
from tolerances import (LOSS_FP32_REL, bf16_logits_grad_bounds, bf16_logits_loss_bounds,  # noqa: E402
                        cross_entropy_shift)

CFG = GPTConfig.preset("tiny", vocab_size=512)  # 2 layers, C = 32, one 512-row loss chunk
B, T = 8, 64
WTE_SCALE = 30.0  # a peaked model: logits up to ~27 (the random init's reach 0.7 and round by less than 2^-9 each)


def _gpt(logits_dtype: str) -> GPT:
    model = GPT(CFG, policy=Policy.bf16(logits_dtype=logits_dtype), rngs=nnx.Rngs(0))
    model.wte.embedding[...] = model.wte.embedding[...] * WTE_SCALE
    return model


def _batch():
    rng = np.random.default_rng(1)
    seq = (rng.integers(0, CFG.vocab_size, (B, 1)) + 3 * np.arange(T + 1)) % CFG.vocab_size
    return jnp.asarray(seq[:, :-1], jnp.int32), jnp.asarray(seq[:, 1:], jnp.int32)


# ---- the setting -----------------------------------------------------------------------------------------------
def test_train_config_reaches_the_policy():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    assert TrainConfig.load(None, {}).logits_dtype is None and Policy().logits_dtype == "float32"
    bf16 = TrainConfig.load(None, {"precision": "auto", "logits_dtype": "bfloat16", "kernels": "pallas"})
    assert resolve_policy(bf16, "gpu") == Policy.bf16(logits_dtype="bfloat16", kernels="pallas")
    assert resolve_policy(bf16, "gpu").kernel("loss") == "pallas"  # the preset's loss kernel takes bf16 logits
    assert resolve_policy(TrainConfig.load(None, {"precision": "bf16"}), "gpu").logits_dtype == "float32"
    assert Policy.named("fp8", logits_dtype="bfloat16") == Policy.fp8_policy(logits_dtype="bfloat16")
    # bf16-autocast is torch.autocast's numerics, bf16 logits included: null or bfloat16 name it, float32 is refused
    for value in (None, "bfloat16"):
        cfg = TrainConfig.load(None, {"precision": "bf16-autocast", "logits_dtype": value})
        assert resolve_policy(cfg, "gpu") == Policy.bf16_autocast()
    with pytest.raises(ConfigError, match="TrainConfig.logits_dtype = 'float32'.*bf16-autocast.*precision: bf16"):
        TrainConfig.load(None, {"precision": "bf16-autocast", "logits_dtype": "float32"})
    with pytest.raises(ConfigError, match="logits_dtype = 'float32' with precision bf16-autocast.*drop logits_dtype"):
        Policy.named("bf16-autocast", logits_dtype="float32")
    with pytest.raises(ConfigError, match=r"TrainConfig.logits_dtype = 'float16': allowed values are "
                                          r"\['float32', 'bfloat16'\] \(or null\)"):
        TrainConfig.load(None, {"logits_dtype": "float16"})
    with pytest.raises(ConfigError, match="Policy.logits_dtype = 'float16'.*'float32', 'bfloat16'"):
        Policy(logits_dtype="float16")


def test_fp32_compute_takes_bf16_logits_too():
    """precision: fp32 (and auto where it picks fp32, as on CPUs without fast bf16 GEMMs) with bf16 logits is allowed:
    a config written for the GPU still runs there, and the numerics are well defined: fp32 GEMMs whose fp32 logits are
    rounded to bf16, the loss in fp32 (the bound of tolerances.py depends on the logits' rounding alone). On the GPU
    path the GEMM cannot write bf16 from fp32 operands, so it writes fp32 and the rounding follows: both paths give
    the plain loss of the rounded logits."""
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    cfg = TrainConfig.load(None, {"precision": "fp32", "logits_dtype": "bfloat16"})
    assert resolve_policy(cfg, "cpu") == Policy.fp32(logits_dtype="bfloat16")
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 16))
    w = jax.random.normal(jax.random.PRNGKey(1), (40, 16))
    t = jax.random.randint(jax.random.PRNGKey(2), (2, 7), 0, 37)
    z = jnp.einsum("btc,vc->btv", h, w, precision="highest")[..., :37].astype(jnp.bfloat16).astype(jnp.float32)
    want = float(jnp.mean(jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, t[..., None], -1)[..., 0]))
    f = jax.jit(lambda h, w: fused_loss.lm_head_cross_entropy(h, w, t, vocab_size=37, dtype=jnp.float32,
                                                              precision="highest", logits_dtype="bfloat16"))
    cpu = float(f(h, w))
    with ops.traced_for([SimpleNamespace(platform="gpu")]):
        gpu = float(jax.jit(lambda h, w: fused_loss.lm_head_cross_entropy(
            h, w, t, vocab_size=37, dtype=jnp.float32, precision="highest", logits_dtype="bfloat16"))(h, w))
    assert abs(cpu - want) <= 1e-6 * abs(want) and abs(gpu - want) <= 1e-6 * abs(want), (cpu, gpu, want)


def test_model_logits_under_fp8_lm_head_are_rounded_too():
    """GPT.logits (generation, evaluation) under precision: fp8 with an e4m3 lm_head: the fp32-accumulated logits are
    rounded to logits_dtype as the loss's are (before, that path returned them unrounded)."""
    cfg = GPTConfig.preset("tiny", vocab_size=256)
    x = jax.random.randint(jax.random.PRNGKey(3), (2, 16), 0, cfg.vocab_size)
    logits = {}
    for dt in ("float32", "bfloat16"):
        model = GPT(cfg, policy=Policy.fp8_policy("lm_head", logits_dtype=dt), rngs=nnx.Rngs(params=0))
        logits[dt] = np.asarray(model(x), np.float32)
    rounded = np.asarray(jnp.asarray(logits["float32"]).astype(jnp.bfloat16).astype(jnp.float32))
    assert not np.array_equal(logits["float32"], rounded)  # fp32 logits carry more than bf16's 8 bits
    np.testing.assert_array_equal(logits["bfloat16"], rounded)


# ---- a small GPT: bf16 logits against fp32 logits ----------------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    x, y = _batch()
    m32, m16 = _gpt("float32"), _gpt("bfloat16")
    z = np.asarray(m32(x), np.float64)  # the fp32 logits (bf16 operands, fp32 accumulation) both start from
    zr = np.asarray(jnp.asarray(z, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    for logits in (m16(x), nnx.jit(lambda m: m(x))(m16)):  # Model.logits: exactly those, rounded once (also jitted)
        assert np.array_equal(np.asarray(logits, np.float64), zr)
    return dict(x=x, y=np.asarray(y), m32=m32, m16=m16, z=z, d=zr - z)


def test_each_positions_loss_moves_within_the_rounding_bound(pair):
    """Per position (the eval path, token_losses): |dCE_i| <= range_v(d_iv) <= 2 u max_v |z_iv|, and the bound is
    tight: the worst position reaches a large part of it (measured 0.53 of 2 u max|z_i|, 0.92 of range_i)."""
    (l32, g32), (l16, g16) = (m.token_losses(pair["x"], jnp.asarray(pair["y"])) for m in (pair["m32"], pair["m16"]))
    dce = np.asarray(l16, np.float64) - np.asarray(l32, np.float64)
    bound = bf16_logits_loss_bounds(pair["z"])
    spread = pair["d"].max(-1) - pair["d"].min(-1)
    floor = LOSS_FP32_REL * np.abs(np.asarray(l32))  # the fp32 arithmetic after the rounding
    assert np.abs(pair["d"]).max() <= 2.0**-8 * np.abs(pair["z"]).max()
    assert np.all(np.abs(dce) <= spread + floor), np.max(np.abs(dce) - spread - floor)
    assert np.all(spread <= bound)
    print(f"\nper position: max |dCE| / (2u max|z|) {np.max(np.abs(dce) / bound):.3f}, / range(d) "
          f"{np.max(np.abs(dce) / spread):.3f}; greedy flags changed at {int(np.sum(g32 != g16))} of {g32.size}")
    assert np.max(np.abs(dce) / bound) >= 0.25  # not a loose bound: some position comes within 4x of it
    assert np.max(np.abs(dce) / spread) >= 0.5


def test_the_mean_loss_is_what_its_rounded_logits_say(pair):
    """The training loss (value and gradient through the fused loss): |dL| <= mean_i 2 u max|z_i| (the a-priori
    bound, the worst case of every rounding adding up), and dL equals the first-order change E_p[d] - d_y of the
    actual roundings up to the remainder bound mean range^2 / 8 (tolerances.cross_entropy_shift), which is far below
    |dL|: the mean moves exactly as much as its logits' rounding says, no more."""
    x, y = pair["x"], jnp.asarray(pair["y"])
    l32, l16 = (float(nnx.jit(lambda m: m.loss(x, y))(m)) for m in (pair["m32"], pair["m16"]))
    first, remainder = cross_entropy_shift(pair["z"], pair["z"] + pair["d"], pair["y"])
    bound = float(bf16_logits_loss_bounds(pair["z"]).mean())
    floor = LOSS_FP32_REL * abs(l32)
    print(f"\nmean loss {l32:.5f}: dL {l16 - l32:.3e}, first order {first:.3e}, remainder <= {remainder:.2e}, "
          f"a-priori bound {bound:.2e}")
    assert abs(l16 - l32) <= bound + floor
    assert abs((l16 - l32) - first) <= remainder + floor
    assert abs(l16 - l32) >= 3 * (remainder + floor)  # the check has teeth (measured 6.4x): the effect is resolved


def test_lm_head_gradients_within_the_rounding_bound(pair):
    """dh and dW of the fused loss at the GPT's own final hidden states and head, bf16 against fp32 logits: within
    tolerances.bf16_logits_grad_bounds elementwise, and the largest difference a sizeable part of its bound (measured
    0.23 and 0.28). jax.grad alone, the loss unused: where XLA:CPU's YNNPACK fusion dropped the logits' fp32 -> bf16
    -> fp32 convert pair (jaxgpt.ops.round_to), both gradients came out equal and this failed."""
    h, _ = pair["m32"].hidden(pair["x"])
    w = pair["m32"].wte.embedding[...]
    y = jnp.asarray(pair["y"])

    def grads(logits_dtype):
        f = jax.jit(jax.grad(lambda h, w: fused_loss.lm_head_cross_entropy(
            h, w, y, vocab_size=CFG.vocab_size, dtype=jnp.bfloat16, logits_dtype=logits_dtype), argnums=(0, 1)))
        return [np.asarray(g, np.float64) for g in f(h, w)]

    (dh32, dw32), (dh16, dw16) = grads("float32"), grads("bfloat16")
    def operand(a):  # as the GEMM reads it
        return np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float64)

    b_dh, b_dw = bf16_logits_grad_bounds(pair["z"].reshape(-1, CFG.vocab_size), pair["y"],
                                         operand(h).reshape(-1, CFG.n_embd), operand(w[:CFG.vocab_size]))
    err_dh, err_dw = np.abs(dh16 - dh32).reshape(b_dh.shape), np.abs(dw16 - dw32)[:CFG.vocab_size]
    assert np.all(err_dh <= b_dh * 1.01 + 1e-9) and np.all(err_dw <= b_dw * 1.01 + 1e-9)
    print(f"\nlm_head gradients: max |ddh| / bound {np.max(err_dh / b_dh):.3f}, "
          f"|ddW| / bound {np.max(err_dw / b_dw):.3f}")
    assert np.max(err_dh / b_dh) >= 0.1 and np.max(err_dw / b_dw) >= 0.1


# ---- the eval and generate commands take a run's logits_dtype ----------------------------------------------------
def test_eval_and_generate_commands_take_the_runs_logits_dtype(monkeypatch, capsys, tmp_path):
    """``python -m jaxgpt.eval`` and ``python -m jaxgpt.generate --logits-dtype bfloat16``: the model they load has
    the run's bf16 logits (evaluated and sampled with the numerics it trained with), eval's summary records it, and
    ``--precision bf16-autocast --logits-dtype float32`` is refused on one line that names the fix."""
    from jaxgpt.eval import cli as eval_cli
    from jaxgpt.generate import cli as gen_cli
    from tests.test_eval import write_items

    policies = []
    gen_load, eval_load = gen_cli.load_model, eval_cli.load_model

    def gen_spy(*args, **kwargs):
        policies.append(kwargs["policy"])
        return gen_load(*args, **kwargs)

    def eval_spy(*args, **kwargs):
        model = eval_load(*args, **kwargs)
        policies.append(model.policy)
        return model

    monkeypatch.setattr(gen_cli, "load_model", gen_spy)
    monkeypatch.setattr(eval_cli, "load_model", eval_spy)
    gen = ["--init-from", "random:tiny", "--prompt-ids", "1 2", "--max-new-tokens", "2", "--print-ids"]
    assert gen_cli.main([*gen, "--precision", "bf16", "--logits-dtype", "bfloat16"]) == 0
    assert policies[-1] == Policy.bf16(logits_dtype="bfloat16")
    assert gen_cli.main([*gen, "--precision", "bf16"]) == 0 and policies[-1].logits_dtype == "float32"
    capsys.readouterr()
    assert gen_cli.main([*gen, "--precision", "bf16-autocast", "--logits-dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "logits_dtype = 'float32' with precision bf16-autocast" in err[0] and "drop" in err[0]

    items = write_items(tmp_path / "items.jsonl", 2)
    argv = ["--task", "hellaswag", "--init-from", "random:tiny", "--data", str(items), "--no-progress",
            "--precision", "bf16", "--logits-dtype", "bfloat16", "--json", str(tmp_path / "s.json")]
    assert eval_cli.main(argv) == 0
    assert policies[-1] == Policy.bf16(logits_dtype="bfloat16")
    assert json.loads((tmp_path / "s.json").read_text())["logits_dtype"] == "bfloat16"
