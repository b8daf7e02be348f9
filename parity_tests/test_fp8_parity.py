"""fp8 forward GEMMs (``precision: fp8``): jaxgpt.fp8 against its torch_ref twin (torch_ref.fp8), and against bf16.

* The quantization itself: the same e4m3 bits and the same power-of-two scales from both frameworks, bit for bit.
* jaxgpt-fp8 against torch_ref-fp8 with everything else in fp32 (matmul precision "highest"), every forward GEMM
  in e4m3: logits, loss, gradients and 20 AdamW steps within the flip bound of ``tolerances.FP8_FLIP_RATIO``
  (the two frameworks' fp32 roundoff moves an element across an e4m3 rounding midpoint now and then).
* The named ``precision: fp8`` policy against ``precision: bf16`` on the same model: KL and decided-position top-1
  (tolerances.FP8_KL_FACTOR), for jaxgpt and for torch_ref under autocast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_ref.load
from conftest import PEAKED_WTE_SCALE, jax_logits_and_loss, on_device, random_tokens
from jaxgpt import fp8 as jfp8
from jaxgpt.optim import OptimConfig, make_optimizer
from jaxgpt.precision import Policy
from jaxgpt.step import data_mesh, init_train_state, make_train_step
from jaxgpt.weights import from_hf, params_to_ref
from test_grad_parity import jax_grads, rel, torch_grads
from test_logits_parity import _log_softmax64
from test_train_parity import batches, build, jax_device, param_rel_diffs, torch_model
from tolerances import (BF16_MARGIN_SIGMAS, BF16_TOP1_DECIDED, FP8_FLIP_RATIO, FP8_KL_FACTOR, FP8_MEAN_KL_MAX,
                        FP8_TRAIN_FACTOR, GRAD_FP32_REL, LOSS_FP32_REL, TRAIN_LOSS_ABS, TRAIN_PARAM_REL, fp32_logits_pairwise)
from torch_ref import fp8 as tfp8
from torch_ref import train as ref_train

FP8_FP32 = Policy(compute_dtype="float32", fp8="all", matmul_precision="highest")  # fp8 GEMMs, fp32 elsewhere
FP32 = Policy(matmul_precision="highest")


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a.astype(np.float64)))))


# ---- the quantization --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantization_is_the_same_bits_and_scales(dtype):
    """Round to nearest even at the same power-of-two scale: identical e4m3 bytes, scales, NaN for inf."""
    rng = np.random.default_rng(0)
    cases = [rng.normal(0, 1, (64, 48)), rng.normal(0, 1e-3, (7, 5)) * rng.integers(0, 2, (7, 5)),
             np.exp(rng.normal(0, 6, (40, 40))) * rng.choice([-1, 1], (40, 40)), np.zeros((3, 3)),
             np.full((2, 2), 448.0 * 2.0 ** -3), rng.normal(0, 1, (4, 4)) * 1e30]
    for x in cases:
        x = x.astype(np.float32)
        jq, js = jfp8.quantize(jnp.asarray(x).astype(dtype))
        tq, ts = tfp8.quantize(torch.from_numpy(x).to(getattr(torch, dtype)))
        assert float(js) == float(ts)
        amax = float(np.abs(np.asarray(jnp.asarray(x).astype(dtype), np.float32)).max())
        assert amax == 0 or 224 <= amax / float(js) < 448
        np.testing.assert_array_equal(np.asarray(jq).view(np.uint8), tq.view(torch.uint8).numpy())
    bad = np.ones((2, 2), np.float32)
    bad[0, 0] = np.inf
    assert np.isnan(float(jfp8.quantize(jnp.asarray(bad))[1])) and np.isnan(float(tfp8.quantize(torch.from_numpy(bad))[1]))


def test_fp8_gemm_is_exact_e4m3_products_with_fp32_accumulation():
    """jaxgpt.fp8.matmul = (q_x s_x) @ (q_w s_w) in float64 up to fp32 accumulation, for bf16 and fp32 compute."""
    rng = np.random.default_rng(1)
    x, w = rng.normal(0, 1, (32, 256)).astype(np.float32), rng.normal(0, 0.02, (256, 48)).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        (qx, sx), (qw, sw) = jfp8.quantize(jnp.asarray(x, dtype)), jfp8.quantize(jnp.asarray(w, dtype))
        exact = (np.asarray(qx, np.float64) * float(sx)) @ (np.asarray(qw, np.float64) * float(sw))
        y = np.asarray(jfp8.matmul(jnp.asarray(x), jnp.asarray(w), dtype=dtype, precision=jax.lax.Precision.HIGHEST))
        bound = 256 * 2.0 ** -24 * (np.abs(np.asarray(qx, np.float64) * float(sx)) @ np.abs(np.asarray(qw, np.float64)
                                                                                           * float(sw)))
        assert np.all(np.abs(y - exact) <= bound + 1e-30)
        t = tfp8.matmul(torch.from_numpy(x), torch.from_numpy(w))
        if dtype == jnp.float32:
            np.testing.assert_allclose(t.detach().numpy(), exact, atol=float(bound.max()), rtol=0)


# ---- jaxgpt-fp8 against torch_ref-fp8, fp32 elsewhere ------------------------------------------------------------
def _jax_logits(directory, tokens, policy):
    model = from_hf(directory, policy=policy)
    return jax_logits_and_loss(model, tokens)


def _torch_logits(directory, tokens, fp8: str | None, autocast: bool = False):
    ref = torch_ref.load.from_hf(directory)
    if fp8:
        ref.set_fp8(fp8)
    t = torch.from_numpy(tokens)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = ref(t)[0].float().numpy()
        loss = float(ref(t[:, :-1], t[:, 1:])[1])
    return logits, loss


@pytest.mark.parametrize("name", ["tiny", "odd"])
def test_fp8_logits_and_loss_match_torch_ref(name, hf_checkpoint, parity_report):
    directory, _ = hf_checkpoint(name)
    tokens = random_tokens(4, 32, seed=2)
    with on_device("cpu"):
        j8, jl8 = _jax_logits(directory, tokens, FP8_FP32)
        j32, jl32 = _jax_logits(directory, tokens, FP32)
    t8, tl8 = _torch_logits(directory, tokens, "all")
    n_layer = 2 if name == "tiny" else 3
    fp32_bound = fp32_logits_pairwise(float(np.abs(j32).max()), n_layer)
    own = _rms(j8 - j32)  # fp8's own error against fp32
    diff = _rms(j8 - t8)
    bound = FP8_FLIP_RATIO * own + fp32_bound
    flipped = float(np.mean(np.abs(j8 - t8) > fp32_bound))
    parity_report(f"fp8/{name}/logits", rms_diff=diff, rms_bound=bound, fp8_error_rms=own,
                  max_abs=float(np.abs(j8 - t8).max()), beyond_fp32_bound=flipped,
                  loss_diff=abs(jl8 - tl8), loss_fp8_vs_fp32=abs(jl8 - jl32))
    assert own > 10 * fp32_bound  # the e4m3 rounding is there (and is the same on both sides)
    assert diff <= bound, (diff, bound)
    assert abs(jl8 - tl8) <= LOSS_FP32_REL * abs(tl8) + FP8_FLIP_RATIO * abs(jl8 - jl32) + 2 * bound


def test_fp8_gradients_match_torch_ref(hf_checkpoint, parity_report):
    directory, _ = hf_checkpoint("tiny")
    x = random_tokens(2, 33, seed=3)
    x, y = x[:, :-1], x[:, 1:]
    with on_device("cpu"):
        g8 = jax_grads(directory, x, y, FP8_FP32)
        g32 = jax_grads(directory, x, y, FP32)
    ref = torch_ref.load.from_hf(directory)
    ref.set_fp8("all")
    t8 = torch_grads(ref, x, y, "cpu")
    worst = {}
    for k, t in t8.items():
        r, own = rel(g8[k], t), rel(g8[k], g32[k])
        worst[k] = (r, own)
        assert r <= FP8_FLIP_RATIO * own + GRAD_FP32_REL, (k, r, own)
    k = max(worst, key=lambda k: worst[k][0])
    parity_report("fp8/tiny/grads", worst_rel=worst[k][0], its_fp8_vs_fp32=worst[k][1], tensor_index=list(worst).index(k))


def test_fp8_adamw_20_steps_match_torch_ref():
    """test_train_parity's 20 AdamW steps (4 micro-steps each: gradient accumulation) with every forward GEMM in e4m3
    on both sides; the bounds: the fp32 twin's plus FP8_TRAIN_FACTOR x how far fp8 moves jaxgpt's own run from
    fp32."""
    import test_train_parity as tp

    cfg = OptimConfig(name="adamw", lr=1e-3, warmup_steps=5, decay_steps=15, weight_decay=0.1, grad_clip=0.5)
    data = batches(20)

    def jax_run(policy):
        model = build()
        ref = torch_model(model, "cpu")
        model = nnx.merge(*_with_policy(model, policy))
        with on_device("cpu"):
            mesh = data_mesh([jax_device("cpu")])
            optimizer = make_optimizer(cfg)
            graphdef, state = init_train_state(model, optimizer, mesh=mesh)
            step = make_train_step(graphdef, optimizer, micro_steps=tp.MICRO_STEPS, mesh=mesh)
            losses = []
            for x, y in data:
                state, m = step(state, x, y)
                losses.append(float(m["loss"]))
        return losses, state.params, ref

    j8, p8, ref = jax_run(FP8_FP32)
    j32, p32, _ = jax_run(FP32)
    ref.set_fp8("all")
    t8 = ref_train.train_steps(ref, data, cfg)
    envelope = max(abs(a - b) for a, b in zip(j8, j32))
    loss_diffs = [abs(a - b) for a, b in zip(j8, t8)]
    assert j8[-1] < j8[0] - 0.1  # it learns
    rel_t = param_rel_diffs(p8, ref)
    own = _param_rel(p8, p32)
    print(f"\nfp8 adamw 20 steps: max loss |diff| {max(loss_diffs):.2e} (fp8 vs fp32 envelope {envelope:.2e}); "
          f"max param rel diff {max(rel_t.values()):.2e} (fp8 vs fp32 {max(own.values()):.2e})")
    assert loss_diffs[0] <= TRAIN_LOSS_ABS, loss_diffs  # the same quantization before any update
    assert max(loss_diffs) <= TRAIN_LOSS_ABS + FP8_TRAIN_FACTOR * envelope, (loss_diffs, envelope)
    for k, r in rel_t.items():
        assert r <= TRAIN_PARAM_REL + FP8_TRAIN_FACTOR * own[k], (k, r, own[k])


def _with_policy(model, policy):
    """``model``'s graph rebuilt under ``policy`` with the same parameters."""
    from jaxgpt.model import GPT

    _, params = nnx.split(model, nnx.Param)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: GPT(model.config, policy=policy, rngs=nnx.Rngs(0))), nnx.Param)
    return graphdef, params


def _param_rel(a, b) -> dict[str, float]:
    a, b = params_to_ref(a), params_to_ref(b)
    return {k: float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in a}


# ---- precision: fp8 against precision: bf16 ----------------------------------------------------------------------
def _kl_top1(p_logits: np.ndarray, q_logits: np.ndarray) -> dict[str, float]:
    lp, lq = _log_softmax64(p_logits), _log_softmax64(q_logits)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    agree = p_logits.argmax(-1) == q_logits.argmax(-1)
    top2 = np.sort(p_logits, axis=-1)[..., -2:]
    sigma = _rms(q_logits - p_logits)
    decided = (top2[..., 1] - top2[..., 0]) > BF16_MARGIN_SIGMAS * sigma
    return dict(mean_kl=float(kl.mean()), top1=float(agree.mean()), error_rms=sigma,
                decided=int(decided.sum()), positions=int(agree.size),
                top1_decided=float(agree[decided].mean()) if decided.any() else float("nan"))


@pytest.mark.parametrize("wte_scale", [1.0, PEAKED_WTE_SCALE], ids=["init", "peaked"])
@pytest.mark.parametrize("name", ["tiny", "odd"])
def test_fp8_against_bf16(name, wte_scale, hf_checkpoint, parity_report):
    directory, _ = hf_checkpoint(name, wte_scale)
    tokens = random_tokens(4, 32, seed=1)
    with on_device("cpu"):
        j32, _ = _jax_logits(directory, tokens, FP32)
        j16, _ = _jax_logits(directory, tokens, Policy.bf16())
        j8, _ = _jax_logits(directory, tokens, Policy.named("fp8"))
    t16, _ = _torch_logits(directory, tokens, None, autocast=True)
    t8, _ = _torch_logits(directory, tokens, "all", autocast=True)
    tag = f"fp8-vs-bf16{'' if wte_scale == 1.0 else '-peaked'}/{name}"
    for impl, (bf16, fp8) in {"jaxgpt": (j16, j8), "torch_ref_autocast": (t16, t8)}.items():
        ref_kl = _kl_top1(j32, bf16)["mean_kl"]
        m = _kl_top1(bf16, fp8)
        bound = min(FP8_KL_FACTOR * ref_kl, FP8_MEAN_KL_MAX)
        parity_report(f"{tag}/{impl}", **m, kl_bound=bound, bf16_vs_fp32_kl=ref_kl)
        assert m["mean_kl"] <= bound, (impl, m, bound)
        assert m["decided"] >= 0.25 * m["positions"], (impl, m)
        # torch's bf16 GEMMs round their outputs to bf16 too (heavier tails than the RMS says; measured 1 flip of 89
        # decided positions, tiny): reported for torch_ref, required of jaxgpt, as in test_bf16_against_fp32
        if impl == "jaxgpt":
            assert m["top1_decided"] >= BF16_TOP1_DECIDED, (impl, m)
