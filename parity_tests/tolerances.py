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

# precision: bf16-autocast (Policy.bf16_autocast: torch.autocast's roundings, GEMM outputs and logits in bf16) is held
# to the same logits and gradient bounds as bf16 above: it adds one bf16 rounding (2^-9 relative) per GEMM output,
# which is what torch_ref under autocast already does and passes them with. Measured on the 2-core AVX2-only AMD EPYC
# (test_logits_parity, tiny / odd, init / peaked): mean KL 1.9e-7 / 1.2e-7 / 1.2e-6 / 8.4e-7 (torch autocast: the
# same to two digits; bound 1e-3), top-1 on decided positions 1.0 (bound 0.999), over all peaked positions 1.0. It
# sits closer to torch's autocast logits than the bf16 policy: 47-65% of its logits are bit for bit torch's (bf16
# policy: 0.001-0.002%); by RMS the two are alike (0.96-1.01x), the bf16 rounding of the logits themselves setting
# that scale (with fp32 logits the autocast policy measured 0.91-0.93x). CPU kinds: the bf16 roundings are exact IEEE
# round-to-nearest-even on every CPU (XLA and ATen convert the fp32 accumulator once), so only the fp32 accumulation
# order differs between AVX2, AVX-512-bf16 and AMX kernels (~1e-7 relative): far below the bf16 rounding these
# bounds measure.
#
# 20 AdamW steps under a bf16 policy (test_train_parity.py, the steps of test_adamw_20_steps): a run's distance from
# its own framework's fp32 run, against torch.autocast's distance from torch's fp32 run (the forward under autocast,
# as torch's AMP recipe). As with Muon's bf16 Newton-Schulz (MUON_BF16_NOISE_FACTOR below), each step's loss moves by
# a fresh draw of rounding noise, so the scale is the envelope max_s |torch_autocast - torch_fp32| over the run.
# Measured on the 2-core AVX2-only AMD EPYC: torch's envelope 8.4e-5 (per step 8e-6 - 8.4e-5); jaxgpt bf16 5.3e-5 from
# its fp32 run (0.63x the envelope), 7.2e-5 from torch autocast; bf16-autocast 8.2e-5 (0.97x), 6.9e-5 from torch
# autocast; final parameters' max per-tensor relative distance from fp32: torch 9.8e-3, bf16 9.75e-3 (0.99x),
# bf16-autocast 9.6e-3 (0.97x). The factor 3 (as Muon's) covers the spread of two draws of a 20-step maximum and a
# CPU whose bf16 GEMMs (AMX, AVX-512-bf16) accumulate in another order; a rounding placed wrong (e.g. the optimizer
# step inside CPU autocast: 7.2e-2) is ~300x the envelope.
BF16_TRAIN_NOISE_FACTOR = 3.0


def bf16_train_loss_bound(torch_fp32_losses, torch_bf16_losses):
    """Per-step bound on a bf16 run's loss distance from its fp32 run (and from torch.autocast's run): the fp32 floor
    (LOSS_FP32_REL) plus BF16_TRAIN_NOISE_FACTOR x the envelope max_s |torch_autocast - torch_fp32|."""
    envelope = max(abs(a - b) for a, b in zip(torch_bf16_losses, torch_fp32_losses, strict=True))
    return [LOSS_FP32_REL * abs(loss) + BF16_TRAIN_NOISE_FACTOR * envelope for loss in torch_fp32_losses]

# logits_dtype: bfloat16 (Policy.logits_dtype; TrainConfig.logits_dtype, an opt-in of precision bf16 / fp8 / fp32 and
# bf16-autocast's own): the lm_head's fp32-accumulated logits z are written once in bf16 (jaxgpt.kernels.loss), the loss
# and its gradient then computed in fp32 from them. Rounding to nearest with 8 significant bits moves a logit by at
# most half an ulp of its binade, |d_v| = |bf16(z_v) - z_v| <= u |z_v| with u = BF16_UNIT_ROUNDOFF = 2^-8 (not 2^-9:
# 1 + 2^-8 is a tie that rounds to 1, a relative error of 2^-8 / (1 + 2^-8); measured max |d| / |z| = 0.996 u over a
# tiny GPT's logits). The bound grows with |z| itself, not with the logits' spread: a common offset of the logits
# cancels in the softmax but not in their rounding.
# * Loss. CE_i = lse(z_i) - z_i[y_i], and lse(z + d) - lse(z) lies in [min_v d_v, max_v d_v] (lse is monotone and
#   lse(z + c) = lse(z) + c), so CE_i moves by an amount in [min d - d_y, max d - d_y]:
#       |dCE_i| <= range_v(d_iv) <= 2 u max_v |z_iv|   (bf16_logits_loss_bounds),
#   the mean loss by at most the mean of these. Tight per position: where p_i sits on one token a != y_i,
#   dCE_i ~ d_a - d_y, two roundings that may have opposite signs; measured (a tiny GPT, 512 positions, logits up to
#   0.7 / 27, on the AVX2-only AMD EPYC; tests/kernels/test_loss_logits_dtype.py runs the second) max_i |dCE_i| / range_i = 0.56 /
#   0.92 and max_i |dCE_i| / (2 u max|z_i|) = 0.36 / 0.53. For the mean it is the worst case of every position's
#   roundings adding up; independent roundings cancel (measured |dL| / bound = 0.004 / 0.023), so the mean loss is
#   held instead to what its own rounded logits say: cross_entropy_shift below with the actual d, whose remainder
#   bound mean_i range_i^2 / 8 measured 6.4x below |dL| (3.3e-3) on the peaked model.
# * Gradient with respect to the logits: d CE_i / d z_iv = p_iv - [v = y_i]. With the rounded logits
#   p~_v = p_v exp(d_v - dlse), |d_v - dlse| <= range(d) <= 2 u L (L: the largest |logit|), so
#   |p~_v - p_v| <= p_v (e^{2uL} - 1): at most e^{2uL} - 1 ~ 2uL of the unit L1 mass of p per position. The fused loss
#   then rounds (p - onehot) / M to the compute dtype before its two GEMMs (bf16: relative u, on both sides), adding
#   u (p~ + p + 2 onehot) / M per element; dh = dlogits W and dW = dlogits^T h carry that through |W| and |h|
#   (bf16_logits_grad_bounds; the fp32 accumulation of those GEMMs is ~1e-7 relative, far below). Measured on the
#   peaked tiny GPT: the largest |d dh| and |d dW| 0.23 and 0.28 of their bounds.
# * Logits parity (test_logits_parity.test_bf16_against_fp32, "bf16-logits"): the bf16 KL bound above (one more 2^-8
#   rounding per logit on top of bf16's operands; measured mean KL 1.0e-7 - 1.2e-6, as bf16-autocast's). Top-1 on
#   decided positions: rounding both leading logits to bf16 can close their gap by up to u (|z_1| + |z_2|) whatever
#   the RMS error (two logits within one bf16 ulp may round to the same value, and argmax then takes the lower index),
#   so a position counts as decided only where fp32's margin also exceeds BF16_MARGIN_SIGMAS x the RMS plus that
#   (without it: 1 of 250 and 1 of 144 decided positions of the random inits tied so, 0.996 / 0.993 < 0.999; with
#   it 229 and 136 positions, all agreeing). torch's autocast logits and the bf16-autocast policy are rounded the same
#   way and keep the criterion without the term (unchanged; they pass it on these checkpoints).
# * 20 AdamW steps (test_train_parity, "bf16-logits"): bf16_train_loss_bound, as bf16 and bf16-autocast: the rounding
#   adds a fresh draw of noise of the size bf16-autocast's own logits rounding adds, inside torch.autocast's envelope
#   (whose logits are bf16 too). Measured: 7.4e-5 from its fp32 run (0.88x torch's envelope 8.4e-5), 6.0e-5 from
#   torch autocast; final parameters 9.84e-3 from its fp32 run (1.00x torch's).
#
# gelu_h_dtype: bfloat16 (Policy.gelu_h_dtype; jaxgpt.kernels.mlp with h_dtype bf16): the bf16 policy with c_fc's output h kept
# for GELU's backward rounded to bf16. The forward is the bf16 policy's bit for bit (gelu(h) from the fp32 h;
# tests/kernels/test_mlp.py); the backward's gelu'(h) comes from the rounded h, |bf16(h) - h| <= u |h|
# (u = BF16_UNIT_ROUNDOFF), so gelu'(h) moves by |gelu''(xi)| u |h| for some xi between the two, at most
# u max_x |x gelu''(x)| / (1 - u) = 0.332 u (max |x gelu''(x)| = 0.3309 at |x| = 0.662 for the tanh form; max |gelu''| =
# 0.798, at 0), and dh = g gelu'(h) by at most 0.34 u |g| before its own bf16 rounding (u |g| |gelu'(h)|, which every
# bf16 policy does): no larger than that rounding wherever gelu'(h) >= 0.34 (h >= -0.2), a fraction of u |g| in GELU's
# flat negative tail, where dh itself is small. torch_ref under autocast computes gelu'(h) from the same bf16 h (its
# c_fc GEMM writes bf16), and rounds g as well. Held to the bf16 policies' gradient and training bounds, unchanged
# (test_grad_parity.test_bf16_gradients_close_to_fp32, test_train_parity's "bf16-gelu-bf16h"). Measured on the 2-core
# AVX2-only AMD EPYC (Zen 3): largest per-tensor relative gradient error from fp32 0.00586 (tiny) / 0.00918 (gpt2
# shapes) against the bf16 policy's 0.00565 / 0.0087 and torch autocast's 0.00644 / 0.0105 (bound 2e-2; every cosine
# 1.000); 20 AdamW steps: loss 8.73e-5 from its fp32 run (1.03x torch's envelope 8.4e-5; the bf16 policy 5.29e-5 in
# the same run), 6.39e-5 from torch autocast; final parameters 9.67e-3 from fp32 (0.98x torch's 9.83e-3). CPU kinds:
# the rounding of h is IEEE round-to-nearest-even everywhere, as bf16-autocast's (above).


def bf16_logits_loss_bounds(logits):
    """Per position (``logits``: fp32 logits ``(..., vocab)``), the a-priori bound 2 u max_v |z_v| on how far rounding
    the logits to bf16 moves that position's cross-entropy (see above), in float64."""
    import numpy as np

    return 2 * BF16_UNIT_ROUNDOFF * np.abs(np.asarray(logits, np.float64)).max(-1)


def bf16_logits_grad_bounds(logits, targets, h, w):
    """Elementwise bounds on |dh| and |dW| between the fused loss with bf16 and with fp32 logits (bf16 compute): the
    mean cross-entropy of ``logits = h w^T`` (``logits``: the fp32 logits (M, V), ``targets`` (M,), ``h`` (M, C) and
    ``w`` (V, C) the GEMM's operands as it reads them), in float64 (see above)."""
    import numpy as np

    u = BF16_UNIT_ROUNDOFF
    z = np.asarray(logits, np.float64)
    M, V = z.shape
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.eye(V)[np.asarray(targets).reshape(-1)]
    grow = np.expm1(2 * u * np.abs(z).max())
    dl = grow * p + u * (p * (2 + grow) + 2 * onehot)  # bound on |d~logits - dlogits| * M, per element
    return dl @ np.abs(np.asarray(w, np.float64)) / M, dl.T @ np.abs(np.asarray(h, np.float64)) / M

# Training (issue: training parity): per-step loss and final params after a few optimizer steps, fp32.
TRAIN_LOSS_ABS = 1e-5
TRAIN_PARAM_REL = 1e-4
GRAD_ACCUM_ABS = 1e-6
# The character model of nanoGPT's CPU recipe, 20 AdamW steps on real batches from jaxgpt's own init (no noise added
# to biases or LayerNorm scales): 65-way logits and 0.007-scale residual projections (0.02 / sqrt(2 x 4 layers)),
# where Adam's m / sqrt(v) turns the two frameworks' summation-order roundoff of small gradients into lr-sized
# moves; measured 1.55e-4 (h.0.mlp.c_proj.weight; its loss |diff| 7.2e-7) on an AVX2-only AMD EPYC: 5x that.
CHAR_TRAIN_PARAM_REL = 8e-4

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
#
# What that noise looks like over 20 steps (the tiny model, loss 6.25 -> 6.03): it does not grow like a random walk;
# each step's loss moves by a fresh 1e-6 - 5e-5 draw (measured |t - r| per step on a 2-core AVX2-only AMD EPYC, no
# avx512: 0, 1.9e-6, 2.4e-6, 8.1e-6, 1.2e-5, 3.3e-5, 3.8e-6, ... 3.8e-5 at step 10, 1.8e-5 at step 19). So the noise
# scale is the envelope of the whole run, max_s |t - r|, not its running maximum: at the early steps the running
# maximum is one small draw, and on an Intel Xeon with AMX (torch's bf16 matmuls through oneDNN's AMX kernels) step 4
# drew |j - t| = 1.72e-5 against a running-maximum bound of 1.33e-5, though that run's envelope was 6.63e-5.
#
# Measured max_s |j - t| / envelope: 1.34 (the AVX2 EPYC above: 5.1e-5 / 3.8e-5), 1.62 (the AMX Xeon: 1.07e-4 /
# 6.63e-5, from issue 30); and jaxgpt's own distance from the referee, max_s |j - r| / envelope: 0.75 (AVX2 EPYC).
# The factor 3 allows for the spread of two draws of a maximum over 20 steps. Its teeth, measured in the same AVX2
# run: a 10% larger Muon lr moves the losses from torch's by 1.6e-4 at step 1 and 6.7e-4 - 4.5e-3 from step 2 on, a
# 2% larger one by 1.3e-4 - 9.4e-4 from step 2: both above 3 x 3.8e-5 + the fp32 floor (1.2e-4) at most steps.
MUON_BF16_NOISE_FACTOR = 3.0


def muon_bf16_loss_bound(ref_losses, referee_losses):
    """Per-step bound on |loss_jaxgpt - loss_torch| (and on |loss_jaxgpt - loss_referee|) with Newton-Schulz in bf16:
    the fp32 floor of a loss (LOSS_FP32_REL) plus MUON_BF16_NOISE_FACTOR x the bf16 noise measured in the same run,
    the envelope max_s |loss_torch_bf16 - loss_referee| over all steps (torch_ref with a float64 Newton-Schulz is
    the referee): how far bf16 orthogonalisation alone moves torch's losses in this run."""
    envelope = max(abs(loss - referee) for loss, referee in zip(ref_losses, referee_losses, strict=True))
    return [LOSS_FP32_REL * abs(loss) + MUON_BF16_NOISE_FACTOR * envelope for loss in ref_losses]

# ---- fp8 forward GEMMs (test_fp8_parity.py, jaxgpt.kernels.fp8 / torch_ref.fp8) ------------------------------------------
# e4m3 keeps 3 mantissa bits: rounding a normal value costs at most half an ulp, 2^-4 relative (2^-3 for the
# subnormals below 2^-6 x scale), against bf16's 2^-8 (7 bits); the scales are powers of two, so scaling is exact and
# the quantization is the same in both frameworks bit for bit (tested), and e4m3 x e4m3 products are exact in fp32.
E4M3_UNIT_ROUNDOFF = 2.0 ** -4
BF16_UNIT_ROUNDOFF = 2.0 ** -8
#
# jaxgpt-fp8 against torch_ref-fp8, everything else fp32 (matmul precision "highest"): the rounded operands are
# identical wherever the two frameworks' inputs to a quantization are, and the GEMMs then differ by fp32 summation
# order only. Where the inputs differ by fp32 roundoff d (a few ulps of the value), an element that lies within d of
# an e4m3 rounding midpoint rounds to the neighbouring value in one framework: a "flip", an operand change of one
# e4m3 ulp u. The chance of a flip is p ~ 2 d / u <= 2 x 2^7 x 2^-23 / 2^-4 = 2^-11 for inputs that agree to 2^7
# ulps (the fp32 logits agree to 16 sqrt(n_layer) ulps of their scale, hidden states better). A rounding error is
# uniform in [-u/2, u/2] (RMS u / sqrt 12) and a flip adds u to it, so p flips among all roundings make a
# difference of RMS sqrt(12 p) times the RMS of fp8's own error (fp8 - fp32, measured on the same model and tokens):
# sqrt(12 x 2^-11) = 0.077; the bound doubles it. Measured (tiny, odd; 2-core AVX2 AMD EPYC): no flip at all in the
# forward (logits RMS difference 6e-10 against fp8's own 8e-3), gradients 1.3e-6 relative against fp8's 2e-2.
FP8_FLIP_RATIO = 2 * math.sqrt(12 * 2.0 ** -11)
# Training: once a flip moves one run's weights, later quantizations see different inputs, flips multiply and the two
# fp8 runs decorrelate into two draws of e4m3 noise around the same trajectory; each is as far from the fp32 run as
# the other, so |jaxgpt8 - torch8| <= |jaxgpt8 - fp32| + |torch8 - fp32| ~ 2 x the envelope max_s |torch8 - fp32|
# (torch's drift, as bf16_train_loss_bound takes torch autocast's, so that a jaxgpt bug cannot widen it; as
# MUON_BF16_NOISE_FACTOR). Before the first update the quantization is identical: step 0 is held to
# TRAIN_LOSS_ABS. Measured: steps 0-3 differ by <= 4.8e-7, max 2.8e-4 over 20 steps against an envelope of 8.1e-4
# (0.34x); parameters 1.7e-3 against fp8's 2.0e-2 from fp32.
FP8_TRAIN_FACTOR = 2.0
#
# fp8 against bf16 on the same model (the named precision: fp8 policy against precision: bf16): the logits' error
# scales with the operands' unit roundoff, and KL(p || q) ~ Var_p(logit error) / 2 with its square: fp8's KL is
# (2^-4 / 2^-8)^2 = 256 times bf16's. Bound: KL(p_bf16 || p_fp8) <= 2 x 256 x KL(p_fp32 || p_bf16), measured on the
# same model and tokens (the factor 2: bf16's own error is part of the bf16 reference), and never above
# FP8_MEAN_KL_MAX. The argmax must agree wherever bf16's top-1/top-2 margin exceeds BF16_MARGIN_SIGMAS x the RMS of
# fp8 - bf16 logits, as for bf16 against fp32 (BF16_TOP1_DECIDED).
FP8_KL_FACTOR = 2 * (E4M3_UNIT_ROUNDOFF / BF16_UNIT_ROUNDOFF) ** 2
FP8_MEAN_KL_MAX = 5e-2  # nats: a next-token distribution visibly changed by e4m3 rounding fails whatever bf16 did
#
# The named precision: fp8 policy (bf16 elsewhere) against torch_ref's fp8 under CPU autocast, directly. Outside the
# e4m3 GEMMs the two frameworks round differently (jaxgpt's bf16 policy keeps fp32 GEMM outputs, autocast rounds
# them to bf16), so their quantization inputs differ by up to one bf16 ulp (2^-7 relative to the binade), not by
# fp32 roundoff; measured as the RMS of bf16-policy minus plain-autocast logits (same model, tokens), which the bound
# contains. Such a difference moves an element across an e4m3 rounding midpoint (midpoints one e4m3 ulp, 2^-3,
# apart) with probability at most 2^-7 / 2^-3 = 2^-4 even if every input differs; with flips at rate p the
# difference has RMS sqrt(12 p) x fp8's own rounding error (the reasoning of FP8_FLIP_RATIO above), so
# FP8_BF16_FLIP_RATIO = sqrt(12 x 2^-4) = 0.87 x the RMS of fp8 - bf16 logits (jaxgpt's), on top of the bf16
# difference. No factor 2 here: p = 2^-4 is already the every-input-differs worst case. Two independent e4m3
# roundings (a torch_ref rounding another way: truncation, stochastic, e5m2) would sit ~sqrt(2) = 1.41 x fp8's error
# apart, over the bound. Measured (tiny, odd x init, peaked; 2-core AVX2-only AMD EPYC): logits RMS 4.5e-3, 7.3e-3,
# 3.2e-3, 5.5e-3 against bounds 7.5e-3, 1.8e-2, 5.9e-3, 1.5e-2 (the bf16 difference 5.6e-4, 1.2e-3, 4.2e-4, 1.0e-3;
# fp8 vs bf16 8.0e-3, 1.9e-2, 6.3e-3, 1.6e-2): (diff - bf16 diff) / fp8 error 0.50, 0.31, 0.44, 0.28 against 0.87.
# CPU kinds: the bf16 roundings are IEEE round-to-nearest-even on every CPU (see bf16-autocast above); AMX and
# AVX-512-bf16 kernels change only torch's fp32 accumulation order inside a GEMM (~1e-7), which moves the bf16
# difference (measured in the same run, so the bound follows it) and not the flip rate's 2^-4 ceiling.
FP8_BF16_FLIP_RATIO = math.sqrt(12 * 2.0 ** -4)
#
# On a CUDA GPU (unmeasured: no GPU has run the fp8 parity tests): torch_ref's torch._scaled_mm (per-tensor scales,
# use_fast_accum off) against jaxgpt's cuBLASLt fp8 GEMM (XLA). Both take the same e4m3 operands and scales; e4m3
# products are exact; the sums are fp32 in different orders and, on Hopper's fp8 tensor cores, possibly through an
# accumulator that keeps ~14 bits between promotions to fp32 (DeepSeek-V3's H800 measurement; whether XLA's call
# enables cuBLASLt's fast accumulation is not checked here). So two fp8 GEMM outputs may differ by d ~ 2^-14
# relative where the CPU's fp32 sums differ by 2^7 x 2^-23 = 2^-16: flips at p ~ 2 d / 2^-4 = 2^-9, ratio
# 2 sqrt(12 x 2^-9) = 0.31 (the factor 2 as in FP8_FLIP_RATIO), and the logits floor the fp32 pairwise rule's
# 16 sqrt(n_layer) ulps of a 14-bit accumulator instead of a 24-bit one. The backward is not fp8 (fp32 GEMMs, TF32
# off): gradients keep GRAD_FP32_REL plus the flip ratio.
FP8_CUDA_ACCUM_BITS = 14
FP8_CUDA_FLIP_RATIO = 2 * math.sqrt(12 * 2 * 2.0 ** -FP8_CUDA_ACCUM_BITS / E4M3_UNIT_ROUNDOFF)


def fp8_cuda_logits_pairwise(scale: float, n_layer: int) -> float:
    """fp32_logits_pairwise for two fp8 GEMM libraries on a GPU: the same ulps of a 14-bit accumulator."""
    return fp32_logits_pairwise(scale, n_layer) * 2.0 ** (23 - FP8_CUDA_ACCUM_BITS)


# The loss of two implementations whose loss-pass logits differ by delta (per position, over the vocabulary): the
# cross-entropy of position i is logsumexp(l_i) - l_i[y_i], so exactly (Taylor with Lagrange remainder; the Hessian of
# logsumexp at l + t delta is the covariance under softmax(l + t delta))
#     CE(l + delta) - CE(l) = (E_p[delta_i] - delta_i[y_i]) + Var_q(delta_i) / 2 for some q on the segment,
# and Var_q(delta_i) <= (max delta_i - min delta_i)^2 / 4 (Popoviciu). Averaged over positions: the first-order term
# from the logits plus at most mean_i range_i^2 / 8 (plus the fp32 floor of a loss, LOSS_FP32_REL). The loss must be
# what its own logits say, so the bound follows the logits' difference instead of adding a multiple of the logits'
# RMS bound (replaces the "+ 2 x the logits bound" of the first fp8 logits test, which had no derivation).
def cross_entropy_shift(base_logits, other_logits, targets) -> tuple[float, float]:
    """(first-order change, bound on the remainder) of the mean cross-entropy from ``base_logits`` to
    ``other_logits`` (``(..., vocab)``, targets ``(...)``), in float64."""
    import numpy as np

    base, delta = np.asarray(base_logits, np.float64), np.asarray(other_logits, np.float64) - base_logits
    p = np.exp(base - base.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    at_target = np.take_along_axis(delta, np.asarray(targets)[..., None], axis=-1)[..., 0]
    first = float(np.mean((p * delta).sum(-1) - at_target))
    remainder = float(np.mean((delta.max(-1) - delta.min(-1)) ** 2) / 8)
    return first, remainder
