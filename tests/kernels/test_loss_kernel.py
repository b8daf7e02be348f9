"""jaxgpt.kernels.loss.logits_lse (kernels.loss = "pallas"): the bf16 logits GEMM that also writes each tile's row max
and sum of exp, in Pallas' interpreter against XLA's GEMM and reduction; the fused loss through the GPU path with it
against the same loss without it; the policy field; the compiled tiny H100 step holding the kernel.

Bounds (derived, not fitted; u = 2^-24, fp32): the logits GEMM's fp32 accumulator lies within gamma_K sum |h| |w| of
the exact product in any summation order (bf16 x bf16 products are exact in fp32); rounded to bf16, the kernel's and
XLA's logits differ by one bf16 ulp of the larger plus twice that. The row max of the same values is exact. The sum
of exp(x - max) over V columns: each exp within 4 u of its value (a few ulps: both implementations' exp), each sum of
positive terms within gamma_V of its exact value in any order (tile sums, their rescaling by exp(m_t - m) with its own
4 u, and the combination add at most gamma_V + 8 u): |s_kernel - s_xla| <= (2 gamma_V + 16 u) s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import ops
from jaxgpt.kernels import loss as fused_loss, gemm
from jaxgpt.config import ConfigError
from jaxgpt.precision import Policy
from tests import tiny_h100
from tests.kernels.test_gelu import U, _bf16_ulp, _check, _gamma
from tests.kernels.test_loss_logits import _gpus

BF16, F32 = jnp.bfloat16, jnp.float32


def _f64_of(a) -> np.ndarray:
    """fp64 values of ``a`` rounded to bf16 (the GEMMs' operands)."""
    return np.asarray(jnp.asarray(a, F32).astype(BF16).astype(F32), np.float64)


def _operands(rows: int, vocab_rows: int, width: int, seed: int = 0):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.standard_normal((rows, width)), F32).astype(BF16),
            jnp.asarray(2.0 / np.sqrt(width) * r.standard_normal((vocab_rows, width)), F32).astype(BF16))


@pytest.mark.parametrize("vocab_size, block", [(256, (32, 64, 16)), (200, (32, 64, 16)), (100, (32, 64, 16)),
                                               (250, None)], ids=["no-padding", "padded-columns",
                                                                  "masked-tiles", "default-blocks"])
def test_kernel_against_xlas_gemm_and_reduction(vocab_size, block):
    """raw within one bf16 ulp plus the GEMM bound of XLA's bf16 logits; the row max equal and the sum of exp within
    the derived bound of _max_and_sum_exp over the kernel's own logits, masked past vocab_size (whole tiles of padded
    columns included)."""
    h, w = _operands(128, 256, 32)
    raw, m, s = fused_loss.logits_lse(h, w, vocab_size, interpret=True, block=block)
    assert (raw.dtype, raw.shape, m.dtype, s.dtype) == (BF16, (128, 256), F32, F32)
    assert m.shape == s.shape == (128, 1)
    xla = jax.lax.dot_general(h, w, fused_loss._NT, preferred_element_type=F32).astype(BF16)
    absw = np.abs(np.asarray(h, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
    _check("raw", np.asarray(raw, np.float32), np.asarray(xla, np.float32),
           _bf16_ulp(raw.astype(F32), xla.astype(F32)) + 2 * _gamma(32) * absw + 1e-30)
    real = jnp.arange(256) < vocab_size
    m0, s0 = fused_loss._max_and_sum_exp(jnp.where(real, raw.astype(F32), -jnp.inf))
    np.testing.assert_array_equal(np.asarray(m), np.asarray(m0))
    _check("sum of exp", s, s0, (2 * _gamma(256) + 16 * U) * np.asarray(s0, np.float64))


def test_kernel_refuses_what_it_cannot_take():
    h, w = _operands(128, 256, 32)
    with pytest.raises(gemm.GemmKernelError, match=r"multiples of the \(128, 128, 32\) blocks.*kernels.loss: xla"):
        fused_loss.logits_lse(h[:100], w, 256, interpret=True)
    with pytest.raises(gemm.GemmKernelError, match="vocab_size 300"):
        fused_loss.logits_lse(h, w, 300, interpret=True)
    with pytest.raises(gemm.GemmKernelError, match="h must be bfloat16, got float32"):
        fused_loss.logits_lse(h.astype(F32), w, 256, interpret=True)
    with pytest.raises(ValueError, match="lm_head = 'triton'"):
        fused_loss.lm_head_cross_entropy(h[None], w, jnp.zeros((1, 128), jnp.int32), vocab_size=256, dtype=BF16,
                                         logits_dtype=BF16, lm_head="triton")


def test_chunks_are_multiples_of_the_row_block_with_the_fewest_padded_rows():
    assert fused_loss._chunk_rows(65536, 50304, 1 << 28) == 5042  # gpt2 b64 without the kernel: 13 chunks
    assert fused_loss._chunk_rows(65536, 50304, 1 << 28, multiple=128) == 4096  # 16 chunks, none padded
    assert fused_loss._chunk_rows(16384, 50304, 1 << 28, multiple=128) == 4096
    # b128: 25 chunks of 5,248 (128 rows padded) cost less than 32 unpadded chunks of 4,096 (each chunk re-reads the
    # head and rewrites dW: CHUNK_COST_ROWS rows of work)
    assert fused_loss._chunk_rows(131072, 50304, 1 << 28, multiple=128) == 5248
    rows = fused_loss._chunk_rows(1000, 256, 300 * 256, multiple=128)
    assert rows % 128 == 0 and rows * -(-1000 // rows) == 1024  # 1,000 rows: 24 padded at best
    # the kernel's own budget (2 GiB of bf16 logits): gpt2 b16 in one chunk, b64 in four, the recipe's b64 too
    lse = fused_loss.CE_CHUNK_ELEMENTS_LSE
    assert fused_loss._chunk_rows(16384, 50304, lse, multiple=128) == 16384
    assert fused_loss._chunk_rows(65536, 50304, lse, multiple=128) == 16384


@pytest.mark.parametrize("budget_rows", [None, 128], ids=["one-chunk", "two-chunks"])
def test_the_fused_loss_with_the_kernel_is_the_loss_without_it(monkeypatch, budget_rows):
    """lm_head_cross_entropy through the GPU path (bf16 logits, a padded head of 256 rows, 100 of them the
    vocabulary; 150 rows: padded up to the kernel's 128-row chunks), the kernel interpreted, against the same path
    without it. Only the sum of exp differs (module docstring: within (2 gamma_V + 16 u) s), so each row's lse by that
    much and the mean loss by that plus its own fp32 sum's gamma_M. The gradients: softmax = e / s moves by the same
    relative amount, then both paths round dlogits to bf16, where a value near a rounding boundary may go either way
    (2 u_bf16 of |dlogits|): dh[r] within sum_v (2 u_bf16 + eps) |dlogits[r, v]| |w[v]| <= (2 u_bf16 + eps) 2 max|w| /
    M, dW[v] within (2 u_bf16 + eps) max|h| sum_r |dlogits[r, v]|, with |dlogits[r, v]| <= (p[r, v] + [t_r = v]) / M
    from the fp64 softmax p."""
    h, w = _operands(150, 256, 32, seed=1)
    h = h.astype(F32).reshape(3, 50, 32)
    t = jnp.asarray(np.random.default_rng(2).integers(0, 100, (3, 50)), jnp.int32)
    if budget_rows:  # both paths' chunks (the kernel's have a budget of their own)
        monkeypatch.setattr(fused_loss, "CE_CHUNK_ELEMENTS_GPU", budget_rows * 256)
        monkeypatch.setattr(fused_loss, "CE_CHUNK_ELEMENTS_LSE", budget_rows * 256)

    def run(lm_head):
        f = jax.jit(jax.value_and_grad(lambda h, w: fused_loss.lm_head_cross_entropy(
            h, w, t, vocab_size=100, dtype=BF16, logits_dtype=BF16, lm_head=lm_head), argnums=(0, 1)))
        with ops.traced_for(_gpus()):
            return f(h, w.astype(F32))

    plain = run("plain")
    monkeypatch.setattr(fused_loss, "_LSE_IMPL", "interpret")
    kernel = run("pallas")
    M, V, ub = 150, 256, 2.0 ** -8
    eps = 2 * _gamma(V) + 16 * U
    assert abs(float(kernel[0]) - float(plain[0])) <= eps + 2 * _gamma(M) * abs(float(plain[0]))
    exact = _f64_of(h.reshape(M, 32)) @ _f64_of(w)[:100].T
    logits = np.asarray(jnp.asarray(exact, F32).astype(BF16).astype(F32), np.float64)  # as both paths round them
    assert np.abs(logits).max() < 12  # a logit one bf16 ulp off (the sum order) moves its p by < e^(12 / 256) - 1 < 5%
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(100)[np.asarray(t).reshape(-1)]
    per_v = (1.05 * p + onehot).sum(0) / M  # >= sum_r |dlogits[r, v]| of either path
    bound_dh = (2 * ub + 2 * eps) * 2 * float(jnp.abs(w.astype(F32)).max()) / M
    bound_dw = (2 * ub + 2 * eps) * float(jnp.abs(h).max()) * per_v
    err_dh = np.abs(np.asarray(kernel[1][0]) - np.asarray(plain[1][0]))
    err_dw = np.abs(np.asarray(kernel[1][1]) - np.asarray(plain[1][1]))[:100]
    assert err_dh.max() <= bound_dh, (err_dh.max(), bound_dh)
    assert np.all(err_dw <= bound_dw[:, None]), (err_dw.max(), bound_dw.min())
    assert not np.asarray(kernel[1][1][100:]).any()  # padded head rows get exactly no gradient
    with ops.traced_for(_gpus()), pytest.raises(ValueError, match="blocks of 128, got 200.*padded_vocab_size"):
        jax.jit(lambda h: fused_loss.lm_head_cross_entropy(h, w[:200].astype(F32), t, vocab_size=100, dtype=BF16,
                                                           logits_dtype=BF16, lm_head="pallas"))(h)
    monkeypatch.setattr(fused_loss, "_LSE_IMPL", "no kernel here")  # the CPU path never takes the kernel
    cpu = jax.value_and_grad(lambda h: fused_loss.lm_head_cross_entropy(
        h, w.astype(F32), t, vocab_size=100, dtype=BF16, logits_dtype=BF16, lm_head="pallas"))(h)
    assert np.isfinite(float(cpu[0]))


def test_policy_field_and_train_config():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    assert Policy().kernel("loss") == "xla" and resolve_policy(TrainConfig.load(None, {}), "gpu").kernel("loss") == "xla"
    cfg = TrainConfig.load(None, {"kernels.loss": "pallas", "logits_dtype": "bfloat16", "precision": "auto"})
    assert resolve_policy(cfg, "gpu") == Policy.bf16(logits_dtype="bfloat16", kernels={"loss": "pallas"})
    with pytest.raises(ConfigError, match="kernels.loss = 'triton': valid choices are xla, pallas"):
        Policy(kernels={"loss": "triton"})
    with pytest.raises(ConfigError, match="kernels.loss = 'pallas' needs logits_dtype bfloat16; valid choices .* xla$"):
        resolve_policy(TrainConfig.load(None, {"kernels.loss": "pallas"}), "gpu")
    with pytest.raises(ConfigError, match="kernels.loss = 'pallas' needs no fp8 lm_head GEMMs"):
        Policy.fp8_policy("lm_head", logits_dtype="bfloat16", kernels={"loss": "pallas"})
    assert Policy.bf16_autocast(kernels={"loss": "pallas"}).kernel("loss") == "pallas"  # autocast's logits are bf16


def test_tiny_h100_step_reads_the_kernel_as_the_logits_gemm_and_drops_the_reduction_pass():
    """The tiny step compiled for the H100 under kernels.loss=pallas (bf16 logits): one Pallas GEMM per chunk in the loss's
    scope, read as a GEMM with the logits GEMM's FLOPs at the least efficient measured GEMM rate; the reduction pass
    over each chunk's logits is gone (what reads them is the gradient's pass alone)."""
    cs, ks, kp = tiny_h100.kernels_beside_plain(("kernels.loss=pallas",),
                                                base=("logits_dtype=bfloat16", "model.padded_vocab_size=50304"))
    loss = lambda kernels: [k for k in kernels if k.category == "lm_head + cross-entropy"]
    pallas = [k for k in loss(ks) if k.gemm.startswith("pallas")]
    assert [k.gemm for k in pallas] == ["pallas bf16->bf16 NT"]
    logits_gemm = [k for k in loss(kp) if k.gemm.endswith("bf16->bf16 NT")]
    assert len(logits_gemm) == 1 and pallas[0].flops * pallas[0].count == pytest.approx(
        logits_gemm[0].flops * logits_gemm[0].count, rel=1e-3)
    chunk_rows = logits_gemm[0].flops / (2 * cs.cfg.model.n_embd * 50304)
    logits_bytes = chunk_rows * 50304 * 2  # a pass over a chunk's bf16 logits reads at least this
    reads = lambda kernels: [k for k in loss(kernels) if not k.gemm and k.bytes >= 0.9 * logits_bytes]
    assert len(reads(ks)) == len(reads(kp)) - 1, (reads(ks), reads(kp))  # the max / sum-of-exp pass is gone
    cal, worst = tiny_h100.slowest("gemm")
    assert cal.rate(pallas[0]) == (worst, False)
