"""Every tolerance the parity tests use, in one place, each with the reason it is what it is.

fp32 comparisons run with matmul precision pinned to "highest" in both frameworks (no TF32 on A100/H100,
no bf16 passes on TPU): the remaining differences come only from summation order (XLA vs ATen GEMM
blocking, fused vs unfused softmax), which is ~1e-7 relative per op and grows with depth and width.
"""

import math

# Logits, fp32, one implementation against another: a bound in fp32 ulps of the logits' scale (the largest
# |logit| of the reference), growing with depth. Each implementation's fp32 error against float64 truth
# (test_float64_truth.py) measured 3.9 ulps (tiny, 2 layers), 8.6 (odd, 3 layers, peaked attention), 7.9 and
# 12 (gpt2 shapes, 12 layers, T=16 and 64); a pairwise difference is at most the sum of two such errors. The
# bound, 16 sqrt(n_layer) ulps (23 for 2 layers, 55 for 12), leaves 3-6x headroom over the measured pairs and
# follows the logits' scale: peaked models with large logits get a proportionally larger bound, where a fixed
# 1e-5 failed a correct implementation.
PAIRWISE_ULPS_PER_SQRT_LAYER = 16


def fp32_logits_pairwise(scale: float, n_layer: int) -> float:
    """The largest fp32 logits difference allowed between two correct implementations (see above)."""
    return PAIRWISE_ULPS_PER_SQRT_LAYER * math.sqrt(n_layer) * float(2.0 ** -23) * scale

# Mean cross-entropy, relative: a mean over B*T terms of values that each agree to ~1e-7 relative.
LOSS_FP32_REL = 1e-6

# bf16 compute (matmul operands rounded to 8 mantissa bits, fp32 accumulation) against the fp32 reference:
# the probabilities must stay close in distribution and in argmax.
BF16_MEAN_KL = 1e-3  # mean over tokens of KL(p_fp32 || p_bf16), nats
BF16_TOP1 = 0.99  # fraction of positions whose argmax agrees (a peaked checkpoint: see PEAKED_WTE_SCALE)
# Where fp32's top-1/top-2 margin exceeds 3x the RMS difference of bf16 and fp32 logits, a flip needs a bf16
# rounding error of several standard deviations on the two leading logits at once: the argmax must agree there.
BF16_MARGIN_SIGMAS = 3.0
BF16_TOP1_DECIDED = 0.999

# Gradients, fp32: relative Frobenius error per parameter tensor.
GRAD_FP32_REL = 1e-5
# Gradients, bf16 compute vs fp32 reference, per tensor.
GRAD_BF16_COS = 0.999
GRAD_BF16_REL = 2e-2

# Training (issue: training parity): per-step loss and final params after a few optimizer steps, fp32.
TRAIN_LOSS_ABS = 1e-5
TRAIN_PARAM_REL = 1e-4
GRAD_ACCUM_ABS = 1e-6

# HellaSwag: an ending's summed / mean loss over its tokens (a sum of at most ~45 per-token losses that each
# agree to ~1e-7 relative); the predictions (argmins) must be identical.
EVAL_LOSS_REL = 1e-5

# lm-evaluation-harness: a request's log-likelihood is a sum of up to ~50 token log-probabilities (the rolling
# windows: a whole text); each agrees to ~1e-6 between jaxgpt and transformers in fp32.
LM_EVAL_LOGLIK_ABS = 1e-4
# Perplexities are exp of such sums divided by word / byte counts: they agree to float rounding of those.
LM_EVAL_PPL_REL = 1e-5

# ---- fp32 against float64 truth (test_float64_truth.py) ----------------------------------------------------
# jaxgpt's and torch_ref's fp32 errors against the float64 truth may be at most this factor times transformers'
# own fp32 error against it: the same arithmetic in a different order may round differently, but should not be
# systematically worse than the independent implementation. 3, not 2: on CPU jaxgpt's matmuls run through XLA's
# YNNPACK kernels, whose fp32 dot products accumulate with ~3x the rounding error of MKL's (which transformers and
# torch_ref use): RMS error 8.2e-7 against 2.9e-7 for a (128, 3072) x (3072, 768) product, 2.6e-7 with XLA's
# Eigen kernels (--xla_cpu_experimental_ynn_fusion_type=); measured jaxgpt / transformers error ratios: 2.1
# (gpt2-shaped logits, T=64) and 2.25 (the tiny model's ln_2.bias gradient). The default, faster kernels are
# what users train with, so they are what is held to this bound.
FP32_VS_TRUTH_FACTOR = 3.0
# Two float64 implementations of the same forward (transformers .double(), jaxgpt Policy.fp64()): they differ
# only by float64 rounding (~1e-16 per op), measured 5.6e-16 of the logits' scale on the tiny checkpoint.
TRUTH_AGREEMENT_REL = 1e-12
_EPS32 = 2.0 ** -23  # float32's machine epsilon


def fp32_logits_floor(scale: float) -> float:
    """Below this an fp32 error is rounding of the last few bits whatever the order of operations: 4 ulps of the
    largest |logit| (an error of 0 from transformers must not make "2x of it" demand exactness)."""
    return 4 * _EPS32 * scale


def fp32_grad_floor() -> float:
    """The same for a gradient tensor's relative (Frobenius) error: 4 ulps. Independent roundings of its elements
    keep the relative norm of their sum at the per-element size, whatever the tensor's size."""
    return 4 * _EPS32

# ---- Muon (test_muon_parity.py) ----------------------------------------------------------------------------------
# Distances are relative Frobenius norms from a float64 referee (torch.optim.Muon's Newton-Schulz line for line in
# float64); measured on this session's AMD EPYC (avx512_bf16, no AMX).
#
# Newton-Schulz in bf16, jaxgpt's distance over torch's: the issue's ~2x. jaxgpt's bf16 iteration rounds where torch's
# does (jaxgpt/muon.py, difference 8: bf16 operands, fp32 accumulation with the exact coefficients, one rounding per
# addmm), so the two differ only in the order of each fp32 accumulation and in which bf16 ties round which way: two
# draws of the same rounding noise, whose distances from float64 are equal in distribution (ratio ~1). Measured
# 0.99-1.02x in isolation (mini shapes: torch 9.5e-3 - 1.2e-2, jaxgpt 9.6e-3 - 1.2e-2; GPT-2 shapes: torch 7.8e-3 -
# 1.0e-2, jaxgpt 7.8e-3 - 1.0e-2) and 0.9-1.1x after three optimizer steps on the tiny model's gradients. optax's own
# bf16 iteration (coefficients rounded to bf16: another polynomial; every product and sum rounded) measured 3-4x.
# The bound: 2x.
NS_BF16_VS_TORCH = 2.0
# Either side's bf16 distance from float64: at most 1.2e-2 measured (both sides, 128x512); the bound 2x that.
NS_BF16_REL = 2.5e-2
# Newton-Schulz in fp32 against float64: 15 matmuls whose fp32 roundings (2^-23 relative each) compound through 5
# iterations of a polynomial with slope up to a = 3.44 at small singular values; measured 1.4e-6 - 2.0e-6 (GPT-2
# shapes), i.e. 12-17 ulps. The bound: 64 ulps.
NS_FP32_REL = 64 * 2.0 ** -23
# Three optimizer steps, the Muon matrices' distance from the float64 referee relative to the referee's movement:
# the same fp32 Newton-Schulz error plus fp32 momentum and decay arithmetic; measured 7.9e-7 - 1.2e-6. 64 ulps.
MUON_STEP_FP32_REL = 64 * 2.0 ** -23
# The AdamW part in a Muon run: plain AdamW, max|diff| / max|p| as the other update rules' (test_train_parity).
MUON_ADAMW_PART_REL = 1e-6
# 20 training steps, jaxgpt with fp32 Newton-Schulz against the float64-Newton-Schulz referee: the 20-step loss bound
# the issue sets for every optimizer (relative).
MUON_TRAIN_FP32_LOSS_REL = 1e-5


# (c) with Newton-Schulz in bf16 on both sides: jaxgpt's and torch's iterations are two draws of the same rounding
# noise ((a): their distances from float64 0.99-1.02x of each other), so jaxgpt's losses sit as far from a referee run
# (torch_ref with a float64 Newton-Schulz) as torch's own bf16 losses do: |j - t| <= |j - r| + |t - r| ~ 2 |t - r|.
# The factor 3 allows for the spread of two draws; measured |j - t| / max so far of |t - r|, where that is above the
# fp32 floor: at most 2.5 (20 steps, the tiny model; |j - t| at most 5.5e-5, |t - r| 4.2e-5).
MUON_BF16_NOISE_FACTOR = 3.0


def muon_bf16_loss_bound(ref_losses, referee_losses):
    """Per-step bound on |loss_jaxgpt - loss_torch| with Newton-Schulz in bf16 on both sides: the fp32 floor of a loss
    (LOSS_FP32_REL) plus MUON_BF16_NOISE_FACTOR x the bf16 noise measured in the same run, the running maximum of
    |loss_torch_bf16 - loss_referee| (torch_ref with a float64 Newton-Schulz): how far bf16 orthogonalisation alone
    moves torch's losses by step s."""
    out, noise = [], 0.0
    for loss, referee in zip(ref_losses, referee_losses, strict=True):
        noise = max(noise, abs(loss - referee))
        out.append(LOSS_FP32_REL * abs(loss) + MUON_BF16_NOISE_FACTOR * noise)
    return out
