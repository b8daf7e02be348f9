"""Resource accounting for a GPT-2 training run: parameters, memory, FLOPs, time and cost.

``python -m jaxgpt.account --model gpt2 --batch 16 --precision bf16 --device h100-sxm`` prints readable
tables; ``--json`` prints one JSON object instead. The same numbers are available as functions:
:func:`count_params`, :func:`estimate_memory`, :func:`account`, :func:`peak_flops`, :func:`mfu`,
:func:`measure_cpu_peak`, :func:`dtype_table`.

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
On CPU, jaxgpt's default is ``jaxgpt.ops.causal_attention`` (``einsum``): its hand-written backward saves one fp32
copy of P and the fp32 output y, and P only over the keys each query block sees: ``T' = 0.625 T`` with its 4 query
blocks (:func:`visible_keys_per_query`); its backward adds 8 C fp32 per token of transient copies. On GPU with bf16, jaxgpt uses cuDNN's fused attention (``Policy.attention = "auto"``), which recomputes
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

from __future__ import annotations

if __name__ == "__main__":  # before the imports below, so a Ctrl-C during them is one line too (jaxgpt.interrupt):
    from jaxgpt.interrupt import run_cli  # run_cli imports this file as jaxgpt.account and runs its main

    run_cli("jaxgpt.account:main", "jaxgpt.account", left="nothing was written")

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxgpt.config import PRESETS, ConfigError, GPTConfig
from jaxgpt.flops import count_flops, conventions

GiB = 1 << 30
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "adagrad": 1, "rmsprop": 1}
OPTIMIZERS = (*OPTIMIZER_STATES, "muon")  # muon's state is per part: optimizer_state_elements


def optimizer_state_elements(config: GPTConfig, optimizer: str, n: int) -> int:
    """fp32 elements of the optimizer state for ``n`` parameters: states x n, or for Muon one momentum buffer per
    Muon matrix element and AdamW's two moments for the rest (jaxgpt.muon's routing)."""
    if optimizer == "muon":
        from jaxgpt.flops import muon_matrix_params

        n_muon = muon_matrix_params(config)
        return n_muon + 2 * (n - n_muon)
    return OPTIMIZER_STATES[optimizer] * n
PRECISIONS = ("fp32", "bf16")
MATMUL_DTYPES = ("fp32", "tf32", "bf16", "fp8")
ATTENTION_IMPLS = ("xla", "cudnn", "einsum")
CE_CHUNK_ELEMENTS = 1 << 26  # == jaxgpt.ops.CE_CHUNK_ELEMENTS (not imported: the accountant stays jax-free)
ATTENTION_QUERY_BLOCKS = 4  # == jaxgpt.ops.ATTENTION_QUERY_BLOCKS


def visible_keys_per_query(seq_len: int) -> float:
    """Mean number of keys per query row that jaxgpt.ops.causal_attention's query blocks compute (and save P
    for): block [a, b) multiplies against keys [0, b). 0.625 T with 4 blocks, T for one."""
    n = max(1, min(ATTENTION_QUERY_BLOCKS, seq_len))
    edges = [round(i * seq_len / n) for i in range(n + 1)]
    return sum((b - a) * b for a, b in zip(edges[:-1], edges[1:])) / seq_len


class AccountError(ConfigError):
    """A bad argument to the accountant; the message says what is allowed."""


# ---- devices ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Dense peak FLOP/s by matmul dtype, memory and bandwidth of one accelerator."""

    name: str
    description: str
    peak: Mapping[str, float | None]  # fp32 (no tensor cores), tf32, bf16, fp8; dense, not 2:4 sparse
    memory_bytes: int
    bandwidth_bytes_s: float | None
    dollars_per_hour: float
    source: str


DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): A100 80GB SXM: FP32 19.5 TFLOPS, TF32 156 TFLOPS
    # (312 with sparsity), BF16 312 TFLOPS (624 with sparsity), no FP8; 80GB HBM2e, 2,039 GB/s.
    "a100-sxm-80gb": DeviceSpec(
        "a100-sxm-80gb", "NVIDIA A100 SXM4 80GB",
        {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp8": None},
        80 * GiB, 2039e9, 1.79, "NVIDIA A100 datasheet"),
    # NVIDIA H100 Tensor Core GPU datasheet: H100 SXM: FP32 67 TFLOPS, TF32 989 / BF16 1,979 / FP8 3,958
    # TFLOPS *with sparsity*; dense = half, as in the H100 architecture whitepaper (494.7 / 989.4 / 1978.9);
    # 80GB HBM3, 3.35 TB/s.
    "h100-sxm": DeviceSpec(
        "h100-sxm", "NVIDIA H100 SXM5 80GB",
        {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp8": 1978.9e12},
        80 * GiB, 3.35e12, 2.99, "NVIDIA H100 datasheet (sparse figures / 2) and H100 whitepaper"),
    # Same datasheet, H100 PCIe: FP32 51 TFLOPS, TF32 756 / BF16 1,513 / FP8 3,026 TFLOPS with sparsity
    # (dense 378 / 756 / 1513); 80GB HBM2e, 2 TB/s.
    "h100-pcie": DeviceSpec(
        "h100-pcie", "NVIDIA H100 PCIe 80GB",
        {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp8": 1513e12},
        80 * GiB, 2.0e12, 2.49, "NVIDIA H100 datasheet (sparse figures / 2)"),
    # NVIDIA H200 Tensor Core GPU datasheet: H200 SXM: FP32 67 TFLOPS, TF32 989 / BF16 1,979 / FP8 3,958
    # TFLOPS with sparsity (same GH100 compute as H100 SXM; dense = half); 141GB HBM3e, 4.8 TB/s.
    "h200": DeviceSpec(
        "h200", "NVIDIA H200 SXM 141GB",
        {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp8": 1978.9e12},
        141 * 10**9, 4.8e12, 3.79, "NVIDIA H200 datasheet (sparse figures / 2)"),
    # Measured on the spot by measure_cpu_peak(); memory is this machine's RAM.
    "cpu": DeviceSpec("cpu", "this machine's CPU (GEMM probe)", {}, 0, None, 0.0, "measured: measure_cpu_peak()"),
}
# Prices are rough 2025 on-demand single-GPU list prices; they vary ~2x between providers: pass
# --dollars-per-hour for your own.
ALIASES = {"a100": "a100-sxm-80gb", "a100-sxm": "a100-sxm-80gb", "a100-80gb": "a100-sxm-80gb",
           "h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200"}
_DTYPE_ALIASES = {"float32": "fp32", "f32": "fp32", "bfloat16": "bf16", "float8": "fp8",
                  "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def _device_from_kind(kind: str) -> str | None:
    k = kind.lower()
    if "a100" in k:
        return "a100-sxm-80gb"
    if "h200" in k:
        return "h200"
    if "h100" in k:
        return "h100-pcie" if "pcie" in k else "h100-sxm"
    if "cpu" in k:
        return "cpu"
    return None


def resolve_device(device: Any) -> str:
    """A device table key from a name, an alias, or a ``jax.Device`` (matched on its ``device_kind``)."""
    if not isinstance(device, str):
        platform = getattr(device, "platform", None)
        kind = getattr(device, "device_kind", "")
        name = "cpu" if platform == "cpu" else _device_from_kind(str(kind))
        if name is None:
            raise AccountError(f"device {kind!r} is not in the peak table; valid devices are {sorted(DEVICES)}")
        return name
    key = device.lower().strip()
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        raise AccountError(f"unknown device {device!r}; valid devices are {sorted(DEVICES)} "
                           f"(aliases: {sorted(ALIASES)})")
    return key


def _resolve_dtype(dtype: str) -> str:
    d = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if d not in MATMUL_DTYPES:
        raise AccountError(f"unknown matmul dtype {dtype!r}; valid dtypes are {list(MATMUL_DTYPES)}")
    return d


@dataclasses.dataclass(frozen=True)
class CPUPeak:
    """Measured GEMM FLOP/s of this CPU: fp32 operands, and bf16 operands with fp32 accumulation.
    ``float(peak)`` is the fp32 figure."""

    fp32: float
    bf16: float
    n: int
    seconds: float

    def __float__(self) -> float:
        return self.fp32

    def get(self, dtype: str) -> float:
        return self.bf16 if dtype == "bf16" else self.fp32


def _probe(n: int, dtype_name: str, seconds: float) -> float:
    import jax
    import jax.numpy as jnp

    dt = jnp.float32 if dtype_name == "fp32" else jnp.bfloat16
    a = jax.random.normal(jax.random.key(0), (n, n), dt)
    b = jax.random.normal(jax.random.key(1), (n, n), dt)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()  # compile and warm up
    best, t_end = math.inf, time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return 2.0 * n**3 / best


@functools.lru_cache(maxsize=None)
def measure_cpu_peak(seconds: float = 0.5, n: int = 1024) -> CPUPeak:
    """Time ``jnp.dot`` of two (n, n) matrices (fp32 inputs, then bf16 inputs with
    ``preferred_element_type=float32``), best of ~``seconds`` each; FLOP/s = 2 n^3 / best time.
    Cached per process (the train loop and the benchmark harness call it repeatedly)."""
    t0 = time.perf_counter()
    fp32 = _probe(n, "fp32", seconds)
    bf16 = _probe(n, "bf16", seconds)
    return CPUPeak(fp32=fp32, bf16=bf16, n=n, seconds=time.perf_counter() - t0)


def _cpu_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def peak_flops(device: Any, dtype: str) -> float:
    """Dense peak FLOP/s of ``device`` (a name from :data:`DEVICES`, an alias, or a ``jax.Device``) for
    matmuls in ``dtype`` (fp32, tf32, bf16, fp8; float32/bfloat16 accepted). ``cpu`` is measured
    (:func:`measure_cpu_peak`; tf32 means fp32 there). Raises :class:`AccountError` when the device has no
    such mode (fp8 on A100 or CPU)."""
    name = resolve_device(device)
    d = _resolve_dtype(dtype)
    if name == "cpu":
        if d == "fp8":
            raise AccountError("device 'cpu' has no fp8 matmul peak; use fp32 or bf16")
        return measure_cpu_peak().get(d)
    value = DEVICES[name].peak[d]
    if value is None:
        have = [k for k, v in DEVICES[name].peak.items() if v is not None]
        raise AccountError(f"device {name!r} has no {d} matmul peak; it has {have}")
    return float(value)


def mfu(flops_per_step: float, step_time_s: float, device: Any, dtype: str) -> float:
    """Model FLOPs utilisation: achieved FLOP/s (``flops_per_step / step_time_s``) over the dense peak."""
    if step_time_s <= 0:
        raise AccountError(f"step_time_s = {step_time_s!r}: must be > 0")
    return flops_per_step / step_time_s / peak_flops(device, dtype)


def default_matmul_dtype(precision: str, device: str) -> str:
    """bf16 policy -> bf16 peak. fp32 policy -> tf32 on A100/H100/H200 (JAX's default matmul precision runs
    float32 dots on TF32 tensor cores there; ``Policy(matmul_precision="highest")`` would need fp32),
    fp32 on CPU."""
    if precision == "bf16":
        return "bf16"
    return "fp32" if resolve_device(device) == "cpu" else "tf32"


def default_attention(precision: str, device: str) -> str:
    """What ``Policy(attention="auto")`` picks: cuDNN fused attention on GPU with bf16, jaxgpt.ops' einsum
    kernel on CPU, XLA's path otherwise."""
    if resolve_device(device) == "cpu":
        return "einsum"
    return "cudnn" if precision == "bf16" else "xla"


# ---- data types -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DTypeInfo:
    name: str
    bits: int
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int  # explicit fraction bits (the leading 1 is implicit)
    max: float
    smallest_normal: float
    eps: float  # distance from 1.0 to the next representable number


def dtype_table() -> list[DTypeInfo]:
    """fp32, fp16, bf16, fp8 e4m3 (``float8_e4m3fn``: no infinities, max 448) and fp8 e5m2, from
    ``jnp.finfo`` (ml_dtypes)."""
    import jax.numpy as jnp

    rows = []
    for name, dt in [("fp32", jnp.float32), ("fp16", jnp.float16), ("bf16", jnp.bfloat16),
                     ("fp8 e4m3", jnp.float8_e4m3fn), ("fp8 e5m2", jnp.float8_e5m2)]:
        fi = jnp.finfo(dt)
        rows.append(DTypeInfo(name=name, bits=int(fi.bits), sign_bits=1, exponent_bits=int(fi.nexp),
                              mantissa_bits=int(fi.nmant), max=float(fi.max),
                              smallest_normal=float(fi.smallest_normal), eps=float(fi.eps)))
    return rows


# ---- parameters -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParamCount:
    """Parameters by component; the lm_head is tied to wte and counted once (in wte)."""

    wte: int
    wpe: int
    attention: int  # c_attn + c_proj weights and biases, all layers
    mlp: int  # c_fc + c_proj weights and biases, all layers
    layernorm: int  # ln_1, ln_2 of every layer, and ln_f
    per_layer: int

    @property
    def embeddings(self) -> int:
        return self.wte + self.wpe

    @property
    def total(self) -> int:
        return self.wte + self.wpe + self.attention + self.mlp + self.layernorm

    @property
    def without_wpe(self) -> int:
        """nanoGPT's ``get_num_params()`` (non_embedding=True): all but the position embeddings."""
        return self.total - self.wpe

    @property
    def non_embedding(self) -> int:
        """Kaplan et al.'s N: without wte and wpe."""
        return self.total - self.wte - self.wpe

    def to_dict(self) -> dict[str, int]:
        return dict(wte=self.wte, wpe=self.wpe, attention=self.attention, mlp=self.mlp,
                    layernorm=self.layernorm, per_layer=self.per_layer, embeddings=self.embeddings,
                    total=self.total, without_wpe=self.without_wpe, non_embedding=self.non_embedding)


def count_params(config: GPTConfig) -> ParamCount:
    C, L, b = config.n_embd, config.n_layer, int(config.bias)
    attn = C * 3 * C + b * 3 * C + C * C + b * C
    mlp = C * 4 * C + b * 4 * C + 4 * C * C + b * C
    ln = C + b * C
    return ParamCount(wte=config.vocab_rows * C, wpe=config.block_size * C, attention=L * attn, mlp=L * mlp,
                      layernorm=(2 * L + 1) * ln, per_layer=attn + mlp + 2 * ln)


# ---- memory -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one micro-step (``tokens`` = B T) saved for, or alive during, the backward."""

    tokens: int
    per_layer_per_token: float  # bytes one layer saves per token (all layers the same)
    per_layer_per_token_no_remat: float
    layers: int  # bytes saved by all layers
    ln_f: int
    loss_buffers: int
    backward_transient: int
    remat: bool

    @property
    def saved(self) -> int:
        return self.layers + self.ln_f

    @property
    def total(self) -> int:
        return self.layers + self.ln_f + self.loss_buffers + self.backward_transient


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device for one training step. ``state_shards`` divides params, grads, the gradient
    accumulator and optimizer state (FSDP); activations depend only on the per-device batch; with FSDP the
    full weights are all-gathered for the forward/backward (``gathered_weights``)."""

    params: int
    grads: int
    grad_accumulator: int
    optimizer_state: int
    weight_copies: int
    activations: ActivationEstimate
    device_bytes: int
    state_shards: int = 1
    gathered_weights: int = 0  # FSDP: the full fp32 weights, all-gathered for the forward/backward

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.grad_accumulator + self.optimizer_state + self.weight_copies
                + self.gathered_weights + self.activations.total)

    @property
    def xla_temp(self) -> int:
        """What XLA reports as temp for a train step with donated params/opt state: everything that is
        neither an input nor an output."""
        return (self.grads + self.grad_accumulator + self.weight_copies + self.gathered_weights
                + self.activations.total)

    @property
    def fits(self) -> bool | None:
        return None if not self.device_bytes else self.total <= self.device_bytes

    @property
    def fits_jax_default(self) -> bool | None:
        """JAX preallocates 75% of GPU memory (XLA_PYTHON_CLIENT_MEM_FRACTION=.75) and allocates from that."""
        return None if not self.device_bytes else self.total <= 0.75 * self.device_bytes

    def rows(self) -> list[tuple[str, int]]:
        a = self.activations
        return [("params", self.params), ("grads", self.grads), ("grad accumulator", self.grad_accumulator),
                ("optimizer state", self.optimizer_state), ("compute-dtype weight copies", self.weight_copies),
                *([("FSDP all-gathered weights (transient)", self.gathered_weights)] if self.state_shards > 1 else []),
                (f"activations, {self.activations_label()}", a.layers), ("activations, ln_f", a.ln_f),
                ("loss buffers (logits)", a.loss_buffers), ("backward transient", a.backward_transient),
                ("total", self.total)]

    def activations_label(self) -> str:
        a = self.activations
        return f"layers ({a.per_layer_per_token:,.0f} B/token/layer{', remat' if a.remat else ''})"

    def to_dict(self) -> dict[str, Any]:
        a = self.activations
        return dict(params=self.params, grads=self.grads, grad_accumulator=self.grad_accumulator,
                    optimizer_state=self.optimizer_state, weight_copies=self.weight_copies,
                    activations=dict(tokens=a.tokens, per_layer_per_token=a.per_layer_per_token,
                                     per_layer_per_token_no_remat=a.per_layer_per_token_no_remat,
                                     layers=a.layers, ln_f=a.ln_f, loss_buffers=a.loss_buffers,
                                     backward_transient=a.backward_transient, remat=a.remat, total=a.total),
                    total=self.total, xla_temp=self.xla_temp, device_bytes=self.device_bytes,
                    fits=self.fits, fits_jax_default=self.fits_jax_default, state_shards=self.state_shards,
                    gathered_weights=self.gathered_weights)


def saved_bytes_per_layer_token(config: GPTConfig, seq_len: int, *, precision: str = "fp32",
                                attention: str = "xla") -> float:
    """Bytes one transformer block saves for its backward, per token (see the module docstring)."""
    C, N, T = config.n_embd, config.n_head, seq_len
    cd = 4 if precision == "fp32" else 2
    fp32_elems = (C + 1) + (C + 1) + 4 * C  # LayerNorm centred inputs + 1/std, GELU input
    cd_elems = C + 3 * C + C + C + 4 * C  # matmul inputs: ln_1 out, q k v, y, ln_2 out, GELU out
    # xla: 4 fp32 T x T per head; einsum: one P over the keys its query block sees, and the fp32 output;
    # flash: one log-sum-exp per head
    tt = {"xla": 4 * 4 * N * T, "einsum": 4 * N * visible_keys_per_query(T) + 4 * C}.get(attention, 4 * N)
    return 4 * fp32_elems + cd * cd_elems + tt


def estimate_activations(config: GPTConfig, *, batch_size: int, seq_len: int, precision: str = "fp32",
                         attention: str = "xla", remat: bool = False, fast_kernels: bool = True
                         ) -> ActivationEstimate:
    C, N, T, L = config.n_embd, config.n_head, seq_len, config.n_layer
    M = batch_size * seq_len
    cd = 4 if precision == "fp32" else 2
    full = saved_bytes_per_layer_token(config, T, precision=precision, attention=attention)
    per = 4 * C if remat else full  # remat: only the fp32 residual-stream input of each block
    layers = int(per * M * L) + (int(full * M) if remat else 0)  # remat: one block recomputed at a time
    ln_f = (4 * (C + 1) + cd * C) * M
    Vp = config.vocab_rows
    if fast_kernels:
        rows = min(M, max(1, CE_CHUNK_ELEMENTS // Vp))
        # one chunk's fp32 logits (exp(logits - max) reuses them) and its gradient in the compute dtype; dh;
        # the fp32 dW carry
        loss = (4 + cd) * rows * Vp + 4 * M * C + 4 * C * Vp
    else:
        loss = 2 * 4 * M * config.vocab_size
    transient = 8 * 4 * C * M
    if attention == "einsum":  # its backward's heads-first fp32 copies: g, dq, dk, dv and their (B, T, H, D) copies
        transient += 8 * 4 * C * M
    return ActivationEstimate(tokens=M, per_layer_per_token=per, per_layer_per_token_no_remat=full,
                              layers=layers, ln_f=ln_f, loss_buffers=loss, backward_transient=transient,
                              remat=remat)


def _state_shards(mesh: Mapping[str, int] | None) -> int:
    """How many devices share (shard) params, grads and optimizer state: the ``fsdp`` axis of ``mesh``.
    A ``data`` axis replicates them (``batch_size`` is always per device)."""
    return _mesh_sizes(mesh).get("fsdp", 1)


def _mesh_sizes(mesh: Mapping[str, int] | None) -> dict[str, int]:
    if not mesh:
        return {}
    unknown = sorted(set(mesh) - {"data", "fsdp"})
    if unknown:
        raise AccountError(f"mesh axes {unknown} are not understood; use 'data' and/or 'fsdp'")
    for k, v in mesh.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise AccountError(f"mesh[{k!r}] = {v!r}: must be a positive integer")
    return dict(mesh)


def mesh_devices(mesh: Mapping[str, int] | None) -> int:
    """Devices in ``mesh`` (``data * fsdp``; 1 without a mesh)."""
    sizes = _mesh_sizes(mesh)
    return sizes.get("data", 1) * sizes.get("fsdp", 1)


def estimate_memory(config: GPTConfig, *, batch_size: int, seq_len: int | None = None, precision: str = "fp32",
                    optimizer: str = "adamw", grad_accum: int = 1, remat: bool = False,
                    attention: str = "xla", device: str | None = None, fast_kernels: bool = True,
                    mesh: Mapping[str, int] | None = None) -> MemoryEstimate:
    """Bytes per device of one training step (see the module docstring for every term)."""
    seq_len = config.block_size if seq_len is None else seq_len
    _validate(config, batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
              grad_accum=grad_accum, attention=attention)
    shards = _state_shards(mesh)
    n = count_params(config).total
    per_device = lambda nbytes: -(-nbytes // shards)  # noqa: E731  (ceil division)
    C, L = config.n_embd, config.n_layer
    weight_copies = 0 if precision == "fp32" else 2 * (12 * L * C * C + config.vocab_rows * C)
    acts = estimate_activations(config, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                attention=attention, remat=remat, fast_kernels=fast_kernels)
    device_bytes = 0
    if device is not None:
        name = resolve_device(device)
        device_bytes = _cpu_memory_bytes() if name == "cpu" else DEVICES[name].memory_bytes
    return MemoryEstimate(
        params=per_device(4 * n), grads=per_device(4 * n),
        grad_accumulator=per_device(4 * n) if grad_accum > 1 else 0,
        optimizer_state=per_device(4 * optimizer_state_elements(config, optimizer, n)),
        weight_copies=weight_copies, activations=acts, device_bytes=device_bytes, state_shards=shards,
        gathered_weights=4 * n if shards > 1 else 0)


def _validate(config: GPTConfig, *, batch_size: Any, seq_len: Any, precision: str, optimizer: str,
              grad_accum: Any, attention: str = "xla") -> None:
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("grad_accum", grad_accum)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise AccountError(f"{name} = {v!r}: must be a positive integer")
    if seq_len > config.block_size:
        raise AccountError(f"seq_len = {seq_len}: must be <= block_size ({config.block_size})")
    if precision not in PRECISIONS:
        raise AccountError(f"precision = {precision!r}: allowed values are {list(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise AccountError(f"unknown optimizer {optimizer!r}; valid optimizers are {sorted(OPTIMIZERS)}")
    if attention not in ATTENTION_IMPLS:
        raise AccountError(f"attention = {attention!r}: allowed values are {list(ATTENTION_IMPLS)}")


# ---- the whole account ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Account:
    config: GPTConfig
    model_name: str
    batch_size: int
    seq_len: int
    precision: str
    optimizer: str
    grad_accum: int
    device: str
    matmul_dtype: str
    attention: str
    mfu: float
    tokens: float
    dollars_per_hour: float
    params: ParamCount
    memory: MemoryEstimate
    flops_per_token: float  # training (fwd + bwd), exact matmuls, full attention
    flops_per_token_causal: float
    flops_per_step: int  # per device
    peak_flops: float
    mesh: Mapping[str, int] | None = None  # {"data": D, "fsdp": F}; None: one device
    devices: int = 1  # D x F: every one runs batch_size sequences per micro-step
    # per device: matmul FLOPs the optimizer adds to each step (Muon's Newton-Schulz, once per optimizer step on
    # every device whatever the batch); not model FLOPs, so not in MFU's numerator, but they take time
    optimizer_flops_per_step: int = 0

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step over all devices."""
        return self.batch_size * self.seq_len * self.grad_accum * self.devices

    @property
    def step_time_s(self) -> float:
        """The step's model and optimizer matmul FLOPs at ``mfu`` of the peak (the assumed matmul efficiency)."""
        return (self.flops_per_step + self.optimizer_flops_per_step) / (self.peak_flops * self.mfu)

    @property
    def model_flops_utilization(self) -> float:
        """MFU proper: model FLOPs over the step time at the peak (below ``mfu`` when the optimizer adds work)."""
        return self.flops_per_step / (self.peak_flops * self.step_time_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def train_time_s(self) -> float:
        return self.tokens * self.flops_per_token / (self.peak_flops * self.mfu * self.devices) * (
            1 + self.optimizer_flops_per_step / self.flops_per_step)

    @property
    def train_cost_dollars(self) -> float:
        return self.train_time_s / 3600 * self.dollars_per_hour * self.devices

    def to_dict(self) -> dict[str, Any]:
        from jaxgpt.config import to_dict

        return dict(
            model=self.model_name, config=to_dict(self.config), batch_size=self.batch_size,
            seq_len=self.seq_len, grad_accum=self.grad_accum, tokens_per_step=self.tokens_per_step,
            precision=self.precision, optimizer=self.optimizer, device=self.device,
            matmul_dtype=self.matmul_dtype, attention=self.attention, params=self.params.to_dict(),
            memory=self.memory.to_dict(),
            flops=dict(per_token_training=self.flops_per_token, per_token_forward=self.flops_per_token / 3,
                       per_token_training_causal_halved=self.flops_per_token_causal,
                       per_step=self.flops_per_step,
                       conventions_per_token={c.name: c.flops_per_token for c in conventions(self.config, self.seq_len)}),
            optimizer_flops_per_step=self.optimizer_flops_per_step,
            peak_flops=self.peak_flops, mfu=self.mfu, model_flops_utilization=self.model_flops_utilization,
            step_time_s=self.step_time_s, tokens_per_s=self.tokens_per_s,
            train_tokens=self.tokens, train_time_s=self.train_time_s, dollars_per_hour=self.dollars_per_hour,
            train_cost_dollars=self.train_cost_dollars, mesh=dict(self.mesh) if self.mesh else None,
            devices=self.devices,
        )

    def table(self) -> str:
        p, m, cfg = self.params, self.memory, self.config
        out = [f"== {self.model_name}: n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} "
               f"vocab={cfg.vocab_size}" + (f" (padded {cfg.vocab_rows})" if cfg.vocab_rows != cfg.vocab_size else "")
               + f" block_size={cfg.block_size}",
               f"   batch {self.batch_size} x seq {self.seq_len} x grad_accum {self.grad_accum}"
               + (f" x {self.devices} devices" if self.devices > 1 else "") + f" = "
               f"{self.tokens_per_step:,} tokens/step; {self.precision} compute, fp32 params; {self.optimizer}; "
               f"{self.attention} attention; device {self.device}"
               + (f"; mesh {' x '.join(f'{k}={v}' for k, v in self.mesh.items())}" if self.mesh else ""), "",
               "Parameters (lm_head tied to wte, counted once)"]
        for name, v in [("wte (token embedding)", p.wte), ("wpe (position embedding)", p.wpe),
                        ("attention (c_attn, c_proj)", p.attention), ("MLP (c_fc, c_proj)", p.mlp),
                        ("LayerNorm", p.layernorm), ("total", p.total), ("total without wpe (nanoGPT)", p.without_wpe),
                        ("non-embedding (Kaplan)", p.non_embedding)]:
            out.append(f"  {name:<34}{v:>16,}{v / p.total:>9.1%}")
        out += ["", "Memory per device" + (f" (params, grads and optimizer state / fsdp = {m.state_shards}; "
                                           f"activations of {self.batch_size} sequences)" if m.state_shards > 1
                                           else "")]
        for name, v in m.rows():
            out.append(f"  {name:<48}{_fmt_bytes(v):>12}")
        if m.device_bytes:
            fits = "yes" if m.fits else "NO"
            fits75 = "yes" if m.fits_jax_default else "no"
            out.append(f"  device memory {_fmt_bytes(m.device_bytes)}: fits {fits} "
                       f"({m.total / m.device_bytes:.0%}); within JAX's default 75% pool: {fits75}")
        out += ["", "FLOPs (matmuls; backward = 2 x forward)",
                f"  per token: forward {self.flops_per_token / 3:,.0f}, training {self.flops_per_token:,.0f} "
                f"(causal-halved {self.flops_per_token_causal:,.0f}; 6N = {6 * p.total:,})",
                f"  per step: {self.flops_per_step:,} ({self.flops_per_step / 1e12:,.2f} TFLOP)"
                + (" per device" if self.devices > 1 else "")]
        ns = self.optimizer_flops_per_step
        if ns:  # optimizer work: not in the model FLOPs MFU is defined on, but in the step's time
            out.append(f"  Muon's Newton-Schulz (defaults: 5 steps, q/k/v as three matrices): {ns:,} matmul FLOPs per "
                       f"optimizer step per device, {ns / self.flops_per_step:.2%} of its model FLOPs")
        time_head = (f"Time at {self.mfu:.0%} MFU of {self.peak_flops / 1e12:,.1f} TFLOP/s ({self.matmul_dtype} dense "
                     "peak)")
        if ns:
            time_head = (f"Time with the model's and Newton-Schulz's matmuls at {self.mfu:.0%} of "
                         f"{self.peak_flops / 1e12:,.1f} TFLOP/s ({self.matmul_dtype} dense peak; MFU, model FLOPs "
                         f"only: {self.model_flops_utilization:.1%})")
        out += ["", time_head,
                f"  step {self.step_time_s * 1e3:,.1f} ms, {self.tokens_per_s:,.0f} tokens/s"
                + (f" on {self.devices} devices" if self.devices > 1 else ""),
                f"  {self.tokens:,.3g} tokens: {_fmt_time(self.train_time_s)}, "
                f"${self.train_cost_dollars:,.2f} at ${self.dollars_per_hour:.2f}/hour"
                + (f" per device x {self.devices}" if self.devices > 1 else "")]
        return "\n".join(out)


def account(config: GPTConfig, *, batch_size: int = 8, seq_len: int | None = None, precision: str = "fp32",
            optimizer: str = "adamw", grad_accum: int = 1, device: Any = "h100-sxm", mfu: float = 0.4,
            tokens: float | None = None, dollars_per_hour: float | None = None, remat: bool = False,
            matmul_dtype: str | None = None, attention: str | None = None, model_name: str = "custom",
            mesh: Mapping[str, int] | None = None) -> Account:
    """Everything at once. ``tokens`` defaults to 20 x parameters (Chinchilla's compute-optimal ratio)."""
    seq_len = config.block_size if seq_len is None else seq_len
    dev = resolve_device(device)
    _validate(config, batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
              grad_accum=grad_accum)
    if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise AccountError(f"mfu = {mfu!r}: must be in (0, 1]")
    mdt = _resolve_dtype(matmul_dtype) if matmul_dtype else default_matmul_dtype(precision, dev)
    attn = attention or default_attention(precision, dev)
    params = count_params(config)
    if tokens is None:
        tokens = 20.0 * params.total
    if tokens <= 0:
        raise AccountError(f"tokens = {tokens!r}: must be > 0")
    price = DEVICES[dev].dollars_per_hour if dollars_per_hour is None else dollars_per_hour
    if price < 0:
        raise AccountError(f"dollars_per_hour = {price!r}: must be >= 0")
    mem = estimate_memory(config, batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
                          grad_accum=grad_accum, remat=remat, attention=attn, device=dev, mesh=mesh)
    fc = count_flops(config, seq_len, batch_size=batch_size, grad_accum=grad_accum)
    fch = count_flops(config, seq_len, batch_size=batch_size, grad_accum=grad_accum, causal_halving=True)
    return Account(config=config, model_name=model_name, batch_size=batch_size, seq_len=seq_len,
                   precision=precision, optimizer=optimizer, grad_accum=grad_accum, device=dev, matmul_dtype=mdt,
                   attention=attn, mfu=float(mfu), tokens=float(tokens), dollars_per_hour=float(price), params=params,
                   memory=mem, flops_per_token=fc.per_token()["training"],
                   flops_per_token_causal=fch.per_token()["training"], flops_per_step=fc.training_per_step,
                   peak_flops=peak_flops(dev, mdt), mesh=dict(mesh) if mesh else None, devices=mesh_devices(mesh),
                   optimizer_flops_per_step=_optimizer_flops(config, optimizer))


def _optimizer_flops(config: GPTConfig, optimizer: str) -> int:
    """Matmul FLOPs an optimizer adds per step on each device: Muon's Newton-Schulz (its defaults); 0 otherwise."""
    if optimizer != "muon":
        return 0
    from jaxgpt.flops import newton_schulz_flops

    return newton_schulz_flops(config)["matmul"]


# ---- formatting -------------------------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _fmt_time(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:,.2f} days"
    if s >= 3600:
        return f"{s / 3600:,.2f} hours"
    if s >= 60:
        return f"{s / 60:,.1f} minutes"
    return f"{s:,.2f} s"


def devices_table() -> str:
    lines = [f"{'device':<15}{'fp32':>8}{'tf32':>8}{'bf16':>8}{'fp8':>8}  TFLOP/s dense{'memory':>12}{'bandwidth':>12}"
             f"{'$/hour':>8}"]
    for name, d in DEVICES.items():
        if name == "cpu":
            continue
        peaks = "".join(f"{'-' if d.peak[k] is None else f'{d.peak[k] / 1e12:,.1f}':>8}" for k in MATMUL_DTYPES)
        lines.append(f"{name:<15}{peaks}{'':>15}{_fmt_bytes(d.memory_bytes):>12}"
                     f"{d.bandwidth_bytes_s / 1e12:>9.2f} TB/s{d.dollars_per_hour:>6.2f}")
    lines.append("cpu: measured on the spot (measure_cpu_peak); sources: NVIDIA datasheets, dense = sparse / 2")
    return "\n".join(lines)


def dtypes_table_text() -> str:
    lines = [f"{'dtype':<10}{'bits':>5}{'sign':>5}{'exp':>5}{'mant':>5}{'max':>14}{'smallest normal':>17}{'eps':>12}"]
    for d in dtype_table():
        lines.append(f"{d.name:<10}{d.bits:>5}{d.sign_bits:>5}{d.exponent_bits:>5}{d.mantissa_bits:>5}"
                     f"{d.max:>14.6g}{d.smallest_normal:>17.6g}{d.eps:>12.6g}")
    return "\n".join(lines)


# ---- CLI --------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit code 2, message, no traceback (argparse's own behaviour)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse_number(text: str) -> float:
    try:
        return float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 10e9)") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m jaxgpt.account",
                description="Parameters, memory, FLOPs, time and cost of training a GPT-2 configuration.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="gpt2", help=f"preset name: {', '.join(sorted(PRESETS))} (default gpt2)")
    src.add_argument("--config", type=Path, help="a YAML config (a model mapping, or a file with a 'model:' key)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--batch", type=int, default=None, help="sequences per micro-step per device (default 8)")
    batch.add_argument("--global-batch", type=int, default=None,
                       help="sequences per micro-step over all devices of --mesh (split evenly)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default block_size)")
    p.add_argument("--precision", default="bf16", help="fp32 or bf16 compute (params stay fp32); default bf16")
    p.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (default 1)")
    p.add_argument("--device", default="h100-sxm", help=f"one of {', '.join(DEVICES)} (default h100-sxm)")
    p.add_argument("--matmul-dtype", default=None, help="peak to use: fp32, tf32, bf16, fp8 (default from precision)")
    p.add_argument("--attention", default=None, help="xla or cudnn (default: what Policy(attention='auto') picks)")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    p.add_argument("--tokens", type=_parse_number, default=None, help="training tokens D (default 20 x params)")
    p.add_argument("--dollars-per-hour", type=float, default=None, help="price of one device (default per device)")
    p.add_argument("--remat", action="store_true", help="activations with per-block rematerialisation")
    p.add_argument("--fsdp", type=int, default=1, help="devices sharding params/grads/optimizer state (default 1)")
    p.add_argument("--mesh", default=None, help="device mesh, e.g. data=2,fsdp=4 (jaxgpt.mesh; memory per device, "
                   "time and cost for all of them); an axis left out or -1 counts as 1")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--dtypes", action="store_true", help="also print the floating-point data types table")
    p.add_argument("--devices", action="store_true", help="also print the device peak table")
    p.add_argument("--conventions", action="store_true", help="also print others' FLOP conventions")
    p.add_argument("--compiled", action="store_true",
                   help="also compile this step for --device (a GPU, without one: JAX's CUDA plugin, "
                        "`make gpu-compile`) and print XLA's memory figures beside the estimate")
    return p


def _cli_mesh(args: argparse.Namespace) -> dict[str, int] | None:
    if args.mesh is None:
        return {"fsdp": args.fsdp} if args.fsdp != 1 else None
    from jaxgpt.mesh import MeshConfig

    if args.fsdp != 1:
        raise AccountError("give --mesh or --fsdp, not both (--mesh data=1,fsdp=8 is --fsdp 8)")
    cfg = MeshConfig.parse(args.mesh)
    return {"data": max(cfg.data, 1), "fsdp": max(cfg.fsdp, 1)}


def _compiled_table(acc: "Account", config: GPTConfig, args: argparse.Namespace, mesh) -> str:
    """The estimate's memory beside XLA's memory_analysis() of the same step compiled for the device."""
    import os

    from jaxgpt.gpu_env import cuda_driver_present

    if "jax" not in sys.modules and not cuda_driver_present():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # keeps the CUDA plugin loaded for a compile-only build
    from jaxgpt.compile.cli import compiled_memory

    xla = compiled_memory(config, batch_size=acc.batch_size, seq_len=acc.seq_len, precision=args.precision,
                          optimizer=args.optimizer, grad_accum=args.grad_accum, device=args.device, mesh=mesh)
    est = acc.memory
    gib = 2**30
    rows = [("arguments (params, optimizer state, batch)", est.params + est.optimizer_state, xla["argument"]),
            ("temporary (everything else)", est.xla_temp, xla["temp"]),
            ("total", est.total, xla["total"])]
    lines = [f"Memory per device: this estimate beside XLA's memory_analysis() of the step compiled for "
             f"{args.device} (python -m jaxgpt.compile; nothing ran)",
             f"{'':<46}{'estimate':>12}{'compiled':>12}{'ratio':>8}"]
    lines += [f"{name:<46}{a / gib:>9.2f} GiB{b / gib:>8.2f} GiB{a / b:>8.2f}" for name, a, b in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.config is not None:
            config, name = GPTConfig.from_yaml(args.config), str(args.config)
        else:
            config, name = GPTConfig.preset(args.model), args.model
        mesh = _cli_mesh(args)
        batch = args.batch if args.batch is not None else 8
        if args.global_batch is not None:
            n = mesh_devices(mesh)
            if args.global_batch <= 0 or args.global_batch % n:
                raise AccountError(f"--global-batch = {args.global_batch}: must be a positive multiple of the "
                                   f"mesh's {n} devices")
            batch = args.global_batch // n
        acc = account(config, batch_size=batch, seq_len=args.seq_len, precision=args.precision,
                      optimizer=args.optimizer, grad_accum=args.grad_accum, device=args.device, mfu=args.mfu,
                      tokens=args.tokens, dollars_per_hour=args.dollars_per_hour, remat=args.remat,
                      matmul_dtype=args.matmul_dtype, attention=args.attention, model_name=name, mesh=mesh)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = acc.to_dict()
        if args.dtypes:
            out["dtypes"] = [dataclasses.asdict(d) for d in dtype_table()]
        if args.devices:
            out["devices"] = {k: dict(peak=dict(d.peak), memory_bytes=d.memory_bytes,
                                      bandwidth_bytes_s=d.bandwidth_bytes_s, dollars_per_hour=d.dollars_per_hour,
                                      source=d.source) for k, d in DEVICES.items() if k != "cpu"}
        print(json.dumps(out, indent=2))
        return 0
    print(acc.table())
    if args.compiled:
        from jaxgpt.compile.targets import CompileError

        try:
            print("\n" + _compiled_table(acc, config, args, mesh))
        except (CompileError, ConfigError) as e:
            print(f"{parser.prog}: error: --compiled: {e}", file=sys.stderr)
            return 2
    if args.conventions:
        from jaxgpt.flops import conventions_table

        print("\nTraining FLOPs per token by convention\n" + conventions_table(config, acc.seq_len))
    if args.devices:
        print("\n" + devices_table())
    if args.dtypes:
        print("\n" + dtypes_table_text())
    return 0

