"""Resource accounting for a GPT-2 training run: parameters, memory, FLOPs, time and cost.

Modules: :mod:`~jaxgpt.account.devices` (:mod:`jaxgpt.devices`' table of accelerators, peaks and MFU re-exported,
the policy's picks, dtype ranges), :mod:`~jaxgpt.account.memory` (parameters and memory per device),
:mod:`~jaxgpt.account.report` (the whole account and its tables), :mod:`~jaxgpt.account.cli` (the command); this
package re-exports their public names. The account imports neither :mod:`jaxgpt.train` nor :mod:`jaxgpt.compile`
(both read it; tests/test_imports.py).

``python -m jaxgpt.account --model gpt2 --batch 16 --precision bf16 --device h100-sxm`` prints readable
tables; ``--json`` prints one JSON object instead. The same numbers are available as functions:
:func:`count_params`, :func:`estimate_memory`, :func:`account`, :func:`peak_flops`, :func:`mfu`,
:func:`mixed_peak`, :func:`measure_cpu_peak`, :func:`dtype_table`.

``--precision fp8 [--fp8-gemms lm_head|mlp|mlp+lm_head|all]`` (jaxgpt.kernels.fp8; default all): the forward GEMMs it
selects run with e4m3 operands, priced at the device's dense fp8 peak (H100 SXM / H200 1,978.9, H100 PCIe 1,513
TFLOP/s; the A100 has no fp8 tensor cores: its bf16 peak, said so); the rest of the model FLOPs (their backward,
attention's QK^T and PV, the GEMMs not selected) at the bf16 peak. The ideal step is the sum of the two classes' times
and MFU is measured against the blended peak, model FLOPs over that ideal time (:class:`MixedPeak`): dividing every
FLOP by the bf16 peak would inflate an fp8 run's MFU, dividing every FLOP by the fp8 peak deflate it.

Memory model (bytes, for one device; ``B`` sequences of ``T`` tokens per micro-step)
------------------------------------------------------------------------------------------
* params: fp32 (jaxgpt keeps parameters in fp32 under every policy): 4 N.
* grads: fp32, 4 N (they live inside the step until the optimizer consumes them).
* gradient accumulator: 4 N more when ``grad_accum > 1`` (the sum over micro-steps).
* optimizer state, fp32: adamw / adam 2 x 4 N (first and second moments), sgd with momentum 4 N,
  adagrad 4 N (sum of squares), rmsprop 4 N (mean square); muon: one momentum buffer for its matrices
  (4 x 12 L C^2) plus AdamW's two moments for the rest (2 x 4 (N - 12 L C^2)). (Plus a scalar step count.)
* compute-dtype weight copies (bf16 only): the bf16 matmul saves its bf16 operands for the backward,
  weights included: 2 x (12 L C^2 + Vp C) bytes.
* fp8 (:class:`Fp8Memory`): everything bf16 has (its bf16 straight-through backward saves the same bf16 operands),
  plus the lm_head's e4m3 copies of h and of the head (1 byte per element, live through the fused loss, at the
  peak), on GPUs its loss chunks' growth to a multiple of 16 rows (cuBLASLt's fp8 GEMM), and 2 fp32 scales per e4m3
  GEMM of a forward; a layer GEMM's e4m3 copies live only during that forward GEMM and are printed but not added.
  The compiled H100 b64 fp8 steps hold exactly these terms more live at their temp peak than bf16 (XLA's buffer
  assignment); their temp differences exceed them by XLA's heap-packing gaps, 0.06-0.16% of the temp.
* activations saved for the backward, derived tensor by tensor below.

Saved activations per layer per token (C = n_embd, N = n_head, T = sequence length). What the backward of
each op reads, for this model (pre-LayerNorm block, fp32 LayerNorm/GELU/softmax, matmul operands in the
compute dtype; ``cd`` = 4 bytes for fp32, 2 for bf16):

=====================================  ===========  =========  ============================================
tensor                                 elements     dtype      needed by
=====================================  ===========  =========  ============================================
ln_1: x - mean, and 1/std              C + 1        fp32       LayerNorm backward
ln_1 output                            C            cd         c_attn weight gradient
q, k, v                                3C           cd         dQ = dS K, dK = dS^T Q, dV = P^T dO
attention output y                     C            cd         c_proj weight gradient
ln_2: x - mean, and 1/std              C + 1        fp32       LayerNorm backward
ln_2 output                            C            cd         c_fc weight gradient
c_fc output (GELU input)               4C           fp32       GELU backward
GELU output                            4C           cd         mlp.c_proj weight gradient
attention T x T, XLA path              4 N T        fp32       softmax backward (P), dV (P), see below
attention, einsum path (CPU default)   N T' + C     fp32       P for dV and dS; y for rowsum(dO * y)
attention, flash/cuDNN path            N            fp32       log-sum-exp per row (no T x T at all)
=====================================  ===========  =========  ============================================

So per layer per token: fp32 compute ``16 C`` elements = 64 C bytes (+ 8 B); bf16 compute
``6 C`` fp32 + ``10 C`` bf16 = 44 C bytes (+ 8 B); plus the attention term. The textbook minimum for the
T x T term is one fp32 copy of the probabilities (4 N T bytes, + 2 N T for a bf16 copy under bf16);
jaxgpt's XLA path (``jax.nn.dot_product_attention(implementation="xla")``, with the causal mask applied
as a select) keeps **four** fp32 T x T tensors per head alive into the backward as compiled by XLA:CPU
(masked scores, exp(s - max), and the probabilities in two layouts, one per backward matmul), measured
as 15-16 bytes per (head, query, key) in ``memory_analysis()``; that is what is counted for ``xla``.
On CPU, jaxgpt's default is ``jaxgpt.kernels.attention.causal_attention`` (``einsum``): its hand-written backward saves one fp32
copy of P and the fp32 output y, and P only over the keys each query block sees: ``T' = 0.625 T`` with its 4 query
blocks (:func:`visible_keys_per_query`); its backward adds 8 C fp32 per token of transient copies. On GPU with bf16, jaxgpt uses cuDNN's fused attention (``kernels.attention: auto``), which recomputes
the probabilities in the backward and saves only the output and one log-sum-exp per (head, query).

Outside the layers: ln_f (C + 1 fp32 + C cd per token), the loss buffers, and the backward's transient
working set (the C-sized gradient buffers of one layer, 8 C fp32 per token; its T x T gradients dP and
dS fit in the memory of the T x T tensors that layer just released). jaxgpt's fused chunked
cross-entropy (``Policy.fast_kernels``) never holds the full (B T, Vp) logits: per chunk of at most
``CE_CHUNK_ELEMENTS // Vp`` tokens (1,334 at GPT-2's vocabulary; balanced, so 1,024 for 2,048 tokens) XLA
keeps one fp32 (rows, Vp) buffer (the logits, which exp(logits - max) then reuses) and the bf16
softmax-minus-one-hot gradient, plus dh (4 B T C) and the fp32 wte gradient accumulator
(4 C Vp). Without fast kernels: 2 x 4 B T V bytes (logits and their gradient).

With rematerialisation (``--remat``: ``jax.checkpoint`` around each block saving nothing), each layer
keeps only its input (the fp32 residual stream, 4 C bytes per token) and the backward recomputes one
block at a time, so one layer's full set is live on top. That is the saving a memory-aware scheduler realises (XLA:GPU's);
XLA:CPU's scheduler was seen to hoist the recomputation of every block ahead of the backward, so
``memory_analysis()`` on CPU shows no saving from ``jax.checkpoint`` (measured on a 4-layer model: the
saved residuals drop from 162 to 62 tensors, temp bytes stay the same).

On a mesh (``--mesh data=D,fsdp=F``, :mod:`jaxgpt.mesh`): params, grads, the gradient accumulator and the
optimizer state are divided by F (FSDP shards them; ``data`` replicates them), activations follow the
per-device batch (``--batch`` is per device; ``--global-batch`` is split over all D x F devices), and with
F > 1 the train step all-gathers the full fp32 weights inside each micro-step's loss: another 4 N bytes that
live through the forward and backward (a transient, counted as "FSDP all-gathered weights"; XLA:CPU
memory_analysis of a 4-layer C=256 step on 4 devices, 1 and 2 micro-steps: temp bytes 9% under to 26% over
this model for fsdp=4 and data=2 x fsdp=2; XLA:CPU sometimes keeps a micro-step's full local gradient
alive before its reduce-scatter). Time and cost are for the whole mesh (D x F devices at the given MFU each).

The estimate is checked against XLA's own ``memory_analysis()`` of the compiled train step on CPU
(tests/test_account.py): temp bytes = activations + grads + weight copies + loss buffers + transient,
within 20%.
"""

from jaxgpt.account.cli import build_parser, main
from jaxgpt.account.common import (
                                   ATTENTION_IMPLS,
                                   ATTENTION_QUERY_BLOCKS,
                                   CE_CHUNK_ELEMENTS,
                                   CE_CHUNK_ELEMENTS_GPU,
                                   FP8_SCALE_BYTES,
                                   MATMUL_DTYPES,
                                   OPTIMIZER_STATES,
                                   OPTIMIZERS,
                                   PRECISIONS,
                                   AccountError,
                                   GiB,
)
from jaxgpt.account.devices import (
                                   ALIASES,
                                   DEVICES,
                                   CPUPeak,
                                   DeviceSpec,
                                   DTypeInfo,
                                   MixedPeak,
                                   _device_from_kind,
                                   default_attention,
                                   default_matmul_dtype,
                                   dtype_table,
                                   fp8_peak,
                                   measure_cpu_peak,
                                   mfu,
                                   mixed_peak,
                                   peak_flops,
                                   resolve_device,
)
from jaxgpt.account.memory import (
                                   ActivationEstimate,
                                   Fp8Memory,
                                   MemoryEstimate,
                                   ParamCount,
                                   count_params,
                                   estimate_activations,
                                   estimate_fp8,
                                   estimate_memory,
                                   loss_chunk_rows,
                                   mesh_devices,
                                   optimizer_state_elements,
                                   saved_bytes_per_layer_token,
                                   visible_keys_per_query,
)
from jaxgpt.account.report import Account, account, devices_table, dtypes_table_text

__all__ = [
    "ATTENTION_IMPLS", "ATTENTION_QUERY_BLOCKS", "CE_CHUNK_ELEMENTS", "CE_CHUNK_ELEMENTS_GPU", "FP8_SCALE_BYTES",
    "MATMUL_DTYPES", "OPTIMIZER_STATES", "OPTIMIZERS", "PRECISIONS", "AccountError", "GiB", "ALIASES", "DEVICES",
    "CPUPeak", "DeviceSpec", "DTypeInfo", "MixedPeak", "_device_from_kind", "default_attention",
    "default_matmul_dtype",
    "dtype_table", "fp8_peak", "measure_cpu_peak", "mfu", "mixed_peak", "peak_flops", "resolve_device",
    "ActivationEstimate", "Fp8Memory", "MemoryEstimate", "ParamCount", "count_params", "estimate_activations",
    "estimate_fp8", "estimate_memory", "loss_chunk_rows", "mesh_devices", "optimizer_state_elements",
    "saved_bytes_per_layer_token", "visible_keys_per_query", "Account", "account", "devices_table",
    "dtypes_table_text", "build_parser", "main",
]
