"""Parameters and memory of a training step per device: params, grads, optimizer state, weight copies, saved
activations, loss buffers, FSDP shards (the model in :mod:`jaxgpt.account`'s docstring)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxgpt.account.common import (
    ATTENTION_IMPLS,
    ATTENTION_QUERY_BLOCKS,
    CE_CHUNK_ELEMENTS,
    CE_CHUNK_ELEMENTS_GPU,
    FP8_SCALE_BYTES,
    OPTIMIZER_STATES,
    OPTIMIZERS,
    PRECISIONS,
    AccountError,
)
from jaxgpt.account.devices import DEVICES, cpu_memory_bytes, resolve_device
from jaxgpt.config import GPTConfig


def optimizer_state_elements(config: GPTConfig, optimizer: str, n: int) -> int:
    """fp32 elements of the optimizer state for ``n`` parameters: states x n, or for Muon one momentum buffer per
    Muon matrix element and AdamW's two moments for the rest (jaxgpt.muon's routing)."""
    if optimizer == "muon":
        from jaxgpt.flops import muon_matrix_params

        n_muon = muon_matrix_params(config)
        return n_muon + 2 * (n - n_muon)
    return OPTIMIZER_STATES[optimizer] * n


def visible_keys_per_query(seq_len: int) -> float:
    """Mean number of keys per query row that jaxgpt.kernels.attention.causal_attention's query blocks compute (and save P
    for): block [a, b) multiplies against keys [0, b). 0.625 T with 4 blocks, T for one."""
    n = max(1, min(ATTENTION_QUERY_BLOCKS, seq_len))
    edges = [round(i * seq_len / n) for i in range(n + 1)]
    return sum((b - a) * b for a, b in zip(edges[:-1], edges[1:])) / seq_len



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
    fp8: "Fp8Memory | None" = None  # precision: fp8's e4m3 copies and scales (None under fp32 / bf16)

    @property
    def fp8_bytes(self) -> int:
        """What precision: fp8 adds at the step's peak: the lm_head's e4m3 operands, its loss chunks' growth on
        GPUs and the scales."""
        return 0 if self.fp8 is None else self.fp8.at_peak

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.grad_accumulator + self.optimizer_state + self.weight_copies
                + self.gathered_weights + self.fp8_bytes + self.activations.total)

    @property
    def xla_temp(self) -> int:
        """What XLA reports as temp for a train step with donated params/opt state: everything that is
        neither an input nor an output."""
        return (self.grads + self.grad_accumulator + self.weight_copies + self.gathered_weights + self.fp8_bytes
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
                *(self.fp8.rows() if self.fp8 is not None else []),
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
                    gathered_weights=self.gathered_weights, fp8=None if self.fp8 is None else self.fp8.to_dict())


def loss_chunk_rows(n_rows: int, vocab_rows: int, *, gpu: bool, fp8: bool = False) -> int:
    """Rows per chunk of jaxgpt's fused lm_head + cross-entropy, as ``jaxgpt.kernels.loss._chunk_rows`` picks them
    (mirrored: the accountant stays jax-free; tests/test_account.py checks they agree): one chunk's fp32 logits near
    CE_CHUNK_ELEMENTS (the CPU) or CE_CHUNK_ELEMENTS_GPU elements, balanced chunks, and on GPUs the e4m3 logits
    GEMM's (``fp8``) rounded up to a multiple of 16 rows (cuBLASLt's fp8 GEMM)."""
    budget = CE_CHUNK_ELEMENTS_GPU if gpu else CE_CHUNK_ELEMENTS
    rows = max(1, min(n_rows, budget // vocab_rows))
    rows = -(-n_rows // -(-n_rows // rows))
    return -(-rows // 16) * 16 if fp8 and gpu else rows


@dataclasses.dataclass(frozen=True)
class Fp8Memory:
    """What ``precision: fp8`` (jaxgpt.kernels.fp8) adds to the bf16 policy's memory, per device. Its bf16 straight-through
    backward keeps the same bf16 operand copies as the bf16 policy (the weight copies and the saved activations,
    counted there unchanged); on top of them, at the step's peak (the fused loss's chunk loop, every layer's
    activations saved):

    * ``lm_head_operands``: the lm_head's e4m3 copies of h (B T x C, padded to whole loss chunks) and of the head
      (Vp x C), 1 byte per element. The fused loss quantizes both whole arrays once and keeps them through its
      chunk loop.
    * ``chunk_growth``: on GPUs the e4m3 logits GEMM's chunks are a multiple of 16 rows (``loss_chunk_rows``:
      5,056 rather than bf16's 5,042 at gpt2 b64), so every buffer of a chunk grows by the extra rows: the fp32
      logits and the compute-dtype softmax gradient ((4 + 2) x rows x Vp), the chunk's h (2 x rows x C), the
      padded h (2 x padded rows x C), the targets and valid-row mask (5 B per padded row) and the per-row fp32
      max, sum and log-sum-exp (12 B per row). 0 on the CPU (its chunks are not rounded).
    * ``scales``: two fp32 scales per e4m3 GEMM call of a forward (jaxgpt.kernels.fp8.scales_bytes), recomputed every call,
      none kept between steps or checkpointed; counted (an upper bound: at most the lm_head's two are alive at the
      peak).
    * ``layer_operands``: the largest layer GEMM's e4m3 copies of x and of its weight (mlp.c_proj's 4C-wide input
      under ``mlp``/``all``, else c_attn's). They live only during that forward GEMM, freed long before the peak
      (nothing of the e4m3 forward is saved for the bf16 backward): printed, not added to the total.

    Checked against XLA:GPU (tests/test_account.py): the compiled gpt2 124M b64 H100 steps
    (benchmarks/results/predicted-h100-fp8*-b64.json, cuBLASLt fp8 GEMMs) against their bf16 twin
    (predicted-h100-baseline-b64.json). XLA's buffer assignment (``--xla_dump_to``) puts the temp peak of each in
    the fused loss's chunk loop, where the fp8 programs (fp8_gemms all, lm_head, mlp+lm_head alike) hold 93,640,246
    bytes more live than bf16: the e4m3 h (65,728 x 768 = 50,479,104) and head (38,633,472) and the chunk growth
    (4,527,670), this model's terms to the byte; no layer's e4m3 copy is live there. The temp XLA reports is the
    heap its packer lays these buffers in, with gaps at the peak (buffers of other times placed between them):
    355.9 MB for bf16, 46.9 MB (all), 17.6 MB (lm_head), 20.7 MB (mlp+lm_head) more for fp8, which no shape
    predicts (0.06-0.16% of the temp): compiled temp differences of 140,543,744, 111,258,368 and 114,373,376 B."""

    fp8_gemms: str
    gemm_calls: int  # e4m3 GEMM calls per forward (c_attn as three on GPUs: jaxgpt.model's q, k, v column blocks)
    lm_head_operands: int
    scales: int
    layer_operands: int
    chunk_growth: int = 0

    @property
    def at_peak(self) -> int:
        return self.lm_head_operands + self.chunk_growth + self.scales

    def rows(self) -> list[tuple[str, int]]:
        return [(f"fp8 e4m3 lm_head operands (h, head; {self.fp8_gemms})", self.lm_head_operands),
                *([("fp8 loss chunks rounded to 16 rows", self.chunk_growth)] if self.chunk_growth else []),
                (f"fp8 scales ({self.gemm_calls} e4m3 GEMMs x 2 fp32)", self.scales)]

    def to_dict(self) -> dict[str, Any]:
        return dict(fp8_gemms=self.fp8_gemms, gemm_calls=self.gemm_calls, lm_head_operands=self.lm_head_operands,
                    chunk_growth=self.chunk_growth, scales=self.scales, layer_operands=self.layer_operands,
                    at_peak=self.at_peak)


def estimate_fp8(config: GPTConfig, *, tokens: int, fp8_gemms: str, gpu: bool = True,
                 compute_bytes: int = 2) -> Fp8Memory:
    """precision: fp8's e4m3 copies and scales for a micro-step of ``tokens`` tokens (see :class:`Fp8Memory`).
    ``gpu``: the program jaxgpt runs on GPUs (c_attn as three GEMMs, the fused loss's GPU chunks with the e4m3
    ones rounded to 16 rows); on the CPU c_attn is one GEMM and the chunks are the bf16 ones."""
    from jaxgpt.flops import FP8_GEMM_SETS, e4m3_kinds

    e4m3_kinds(fp8_gemms)  # the one-line error for a bad name
    gemms = FP8_GEMM_SETS[fp8_gemms]
    C, L, Vp, M, cd = config.n_embd, config.n_layer, config.vocab_rows, tokens, compute_bytes
    calls = L * ((4 if gpu else 2) * ("attn" in gemms) + 2 * ("mlp" in gemms)) + ("lm_head" in gemms)
    head = growth = 0
    if "lm_head" in gemms:
        rows, bf16_rows = (loss_chunk_rows(M, Vp, gpu=gpu, fp8=f) for f in (True, False))
        padded, bf16_padded = (-(-M // r) * r for r in (rows, bf16_rows))
        head = padded * C + Vp * C  # h padded to whole chunks (jaxgpt.kernels.loss), the head
        extra_rows, extra_padded = rows - bf16_rows, padded - bf16_padded
        growth = extra_rows * ((4 + cd) * Vp + cd * C + 3 * 4) + extra_padded * (cd * C + 4 + 1)
    layer = max([M * 4 * C + 4 * C * C] * ("mlp" in gemms) + [M * C + 3 * C * C] * ("attn" in gemms), default=0)
    return Fp8Memory(fp8_gemms=fp8_gemms, gemm_calls=calls, lm_head_operands=head, scales=FP8_SCALE_BYTES * calls,
                     layer_operands=layer, chunk_growth=growth)


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
                    mesh: Mapping[str, int] | None = None, fp8_gemms: str | None = None) -> MemoryEstimate:
    """Bytes per device of one training step (see the module docstring for every term). ``precision="fp8"``:
    the bf16 terms plus :class:`Fp8Memory` for ``fp8_gemms`` (default "all", jaxgpt.kernels.fp8.DEFAULT_GEMMS)."""
    seq_len = config.block_size if seq_len is None else seq_len
    validate_run(config, batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
              grad_accum=grad_accum, attention=attention, fp8_gemms=fp8_gemms)
    if precision == "fp8" and not fast_kernels:
        raise AccountError("precision = 'fp8' needs fast_kernels (jaxgpt.precision.Policy: its lm_head runs in the "
                           "fused loss): drop fast_kernels=False")
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
        device_bytes = cpu_memory_bytes() if name == "cpu" else DEVICES[name].memory_bytes
    fp8 = None
    if precision == "fp8":
        fp8 = estimate_fp8(config, tokens=batch_size * seq_len, fp8_gemms=fp8_gemms or "all",
                           gpu=device is None or resolve_device(device) != "cpu")
    return MemoryEstimate(
        params=per_device(4 * n), grads=per_device(4 * n),
        grad_accumulator=per_device(4 * n) if grad_accum > 1 else 0,
        optimizer_state=per_device(4 * optimizer_state_elements(config, optimizer, n)),
        weight_copies=weight_copies, activations=acts, device_bytes=device_bytes, state_shards=shards,
        gathered_weights=4 * n if shards > 1 else 0, fp8=fp8)


def validate_run(config: GPTConfig, *, batch_size: Any, seq_len: Any, precision: str, optimizer: str,
              grad_accum: Any, attention: str = "xla", fp8_gemms: str | None = None) -> None:
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
    if fp8_gemms is not None:
        if precision != "fp8":
            raise AccountError(f"fp8_gemms = {fp8_gemms!r} selects the e4m3 GEMMs of precision fp8, but precision is "
                               f"{precision!r}: use precision fp8 or drop fp8_gemms")
        from jaxgpt.flops import e4m3_kinds

        e4m3_kinds(fp8_gemms)
