"""Every tolerance the parity tests use, in one place, each with the reason it is what it is.

fp32 comparisons run with matmul precision pinned to "highest" in both frameworks (no TF32 on A100/H100,
no bf16 passes on TPU): the remaining differences come only from summation order (XLA vs ATen GEMM
blocking, fused vs unfused softmax), which is ~1e-7 relative per op and grows with depth and width.
"""

# Logits, fp32. Tiny configs: logits are O(1), accumulated over C <= 64; observed ~3e-7.
LOGITS_FP32_TINY = 1e-5
# Full gpt2 124M shapes (12 layers, C=768, random init, short sequence): longer sums and 12 residual
# additions; observed ~1e-5 at most.
LOGITS_FP32_GPT2 = 1e-4
# Mean cross-entropy, relative: a mean over B*T terms of values that each agree to ~1e-7 relative.
LOSS_FP32_REL = 1e-6

# bf16 compute (matmul operands rounded to 8 mantissa bits, fp32 accumulation) against the fp32 reference:
# the probabilities must stay close in distribution and in argmax.
BF16_MEAN_KL = 1e-3  # mean over tokens of KL(p_fp32 || p_bf16), nats
BF16_TOP1 = 0.99  # fraction of positions whose argmax agrees

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
