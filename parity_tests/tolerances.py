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
