"""The whole account (:func:`account`): parameters, memory, FLOPs, time and cost of a run, and its tables."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxgpt.account.common import MATMUL_DTYPES, AccountError, GiB
from jaxgpt.account.devices import (
    DEVICES,
    default_attention,
    default_matmul_dtype,
    dtype_table,
    fp8_peak,
    peak_flops,
    resolve_device,
    resolve_dtype,
)
from jaxgpt.account.memory import MemoryEstimate, ParamCount, count_params, estimate_memory, mesh_devices, validate_run
from jaxgpt.config import GPTConfig
from jaxgpt.flops import conventions, count_flops, e4m3_kinds


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
    # precision fp8 (jaxgpt.kernels.fp8): which forward GEMMs run in e4m3, their FLOPs per step per device (the rest, in
    # flops_per_step too, runs at peak_flops), and the rate they run at (the dense fp8 peak, or peak_flops where the
    # device has no fp8 tensor cores: fp8_native False)
    fp8_gemms: str | None = None
    e4m3_flops_per_step: int = 0
    fp8_peak_flops: float | None = None
    fp8_native: bool | None = None

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step over all devices."""
        return self.batch_size * self.seq_len * self.grad_accum * self.devices

    @property
    def ideal_model_time_s(self) -> float:
        """The step's model FLOPs at the dense peaks, each class at its own: the e4m3 GEMMs' at
        ``fp8_peak_flops``, the rest at ``peak_flops`` (jaxgpt.devices.MixedPeak.ideal_time_s)."""
        e4m3 = self.e4m3_flops_per_step
        return (e4m3 / self.fp8_peak_flops if e4m3 else 0.0) + (self.flops_per_step - e4m3) / self.peak_flops

    @property
    def effective_peak_flops(self) -> float:
        """The peak MFU is measured against: ``peak_flops``, or under fp8 the blended peak, model FLOPs over
        :attr:`ideal_model_time_s`."""
        return self.flops_per_step / self.ideal_model_time_s

    @property
    def step_time_s(self) -> float:
        """The step's model and optimizer matmul FLOPs at their peaks, at ``mfu`` of them (the assumed matmul
        efficiency)."""
        return (self.ideal_model_time_s + self.optimizer_flops_per_step / self.peak_flops) / self.mfu

    @property
    def model_flops_utilization(self) -> float:
        """MFU proper: model FLOPs over the step time at the (blended) peak (below ``mfu`` when the optimizer adds
        work)."""
        return self.ideal_model_time_s / self.step_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def train_time_s(self) -> float:
        return self.tokens / self.tokens_per_step * self.step_time_s

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
            fp8=None if self.fp8_gemms is None else dict(
                fp8_gemms=self.fp8_gemms, e4m3_kinds=list(e4m3_kinds(self.fp8_gemms)),
                e4m3_flops_per_step=self.e4m3_flops_per_step,
                e4m3_flops_per_token=self.e4m3_flops_per_step / (self.batch_size * self.seq_len * self.grad_accum),
                fp8_peak_flops=self.fp8_peak_flops, fp8_native=self.fp8_native,
                ideal_model_time_s=self.ideal_model_time_s),
            peak_flops=self.peak_flops, effective_peak_flops=self.effective_peak_flops, mfu=self.mfu,
            model_flops_utilization=self.model_flops_utilization,
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
               f"{self.tokens_per_step:,} tokens/step; {self.precision}"
               + (f" ({self.fp8_gemms} in e4m3)" if self.fp8_gemms else "")
               + f" compute, fp32 params; {self.optimizer}; "
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
        if m.fp8 is not None and m.fp8.layer_operands:
            out.append(f"  (not in the total: a layer GEMM's e4m3 x and weight, at most "
                       f"{_fmt_bytes(m.fp8.layer_operands)}, live only during its forward GEMM, before the peak)")
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
        out += self._fp8_lines()
        ns = self.optimizer_flops_per_step
        if ns:  # optimizer work: not in the model FLOPs MFU is defined on, but in the step's time
            out.append(f"  Muon's Newton-Schulz (defaults: 5 steps, q/k/v as three matrices): {ns:,} matmul FLOPs per "
                       f"optimizer step per device, {ns / self.flops_per_step:.2%} of its model FLOPs")
        time_head = (f"Time at {self.mfu:.0%} MFU of {self.peak_flops / 1e12:,.1f} TFLOP/s ({self.matmul_dtype} dense "
                     "peak)")
        if self.e4m3_flops_per_step:
            time_head = (f"Time at {self.mfu:.0%} MFU of the blended {self.effective_peak_flops / 1e12:,.1f} TFLOP/s "
                         f"(ideal step {self.ideal_model_time_s * 1e3:,.2f} ms, above)")
        if ns:
            model_peak = (f"the blended {self.effective_peak_flops / 1e12:,.1f} TFLOP/s, Newton-Schulz's of "
                          if self.e4m3_flops_per_step else "")
            time_head = (f"Time with the model's and Newton-Schulz's matmuls at {self.mfu:.0%} of {model_peak}"
                         f"{self.peak_flops / 1e12:,.1f} TFLOP/s ({self.matmul_dtype} dense peak; MFU, model FLOPs "
                         f"only: {self.model_flops_utilization:.1%})")
        out += ["", time_head,
                f"  step {self.step_time_s * 1e3:,.1f} ms, {self.tokens_per_s:,.0f} tokens/s"
                + (f" on {self.devices} devices" if self.devices > 1 else ""),
                f"  {self.tokens:,.3g} tokens: {_fmt_time(self.train_time_s)}, "
                f"${self.train_cost_dollars:,.2f} at ${self.dollars_per_hour:.2f}/hour"
                + (f" per device x {self.devices}" if self.devices > 1 else "")]
        return "\n".join(out)

    def _fp8_lines(self) -> list[str]:
        """precision fp8: the e4m3 share of the FLOPs, each class at its peak, their sum (the ideal step) and the
        blended peak MFU is measured against."""
        if self.fp8_gemms is None:
            return []
        e4m3, total = self.e4m3_flops_per_step, self.flops_per_step
        tokens = self.batch_size * self.seq_len * self.grad_accum
        kinds = e4m3_kinds(self.fp8_gemms)
        peak8 = (f"fp8 dense peak {self.fp8_peak_flops / 1e12:,.1f} TFLOP/s" if self.fp8_native else
                 f"{self.matmul_dtype} peak {self.fp8_peak_flops / 1e12:,.1f} TFLOP/s: {self.device} has no fp8 "
                 f"tensor cores, its e4m3 GEMMs run upcast (no fp8 gain; the fallback)")
        t8, t16 = e4m3 / self.fp8_peak_flops if e4m3 else 0.0, (total - e4m3) / self.peak_flops
        return [f"  fp8 ({self.fp8_gemms}): e4m3 forward GEMMs {', '.join(kinds) or 'none'}: {e4m3 / tokens:,.0f} per "
                f"token ({e4m3 / total:.1%}); the rest {self.matmul_dtype} (their backward, attention's QK^T and PV"
                + (", the GEMMs not selected" if len(kinds) < 5 else "") + ")",
                f"  ideal step, each class at its dense peak: e4m3 {e4m3 / 1e12:,.2f} TFLOP at the {peak8} = "
                f"{t8 * 1e3:,.2f} ms + {self.matmul_dtype} {(total - e4m3) / 1e12:,.2f} TFLOP at "
                f"{self.peak_flops / 1e12:,.1f} = {t16 * 1e3:,.2f} ms = {self.ideal_model_time_s * 1e3:,.2f} ms: "
                f"blended peak {self.effective_peak_flops / 1e12:,.1f} TFLOP/s (MFU's denominator)"]


def account(config: GPTConfig, *, batch_size: int = 8, seq_len: int | None = None, precision: str = "fp32",
            optimizer: str = "adamw", grad_accum: int = 1, device: Any = "h100-sxm", mfu: float = 0.4,
            tokens: float | None = None, dollars_per_hour: float | None = None, remat: bool = False,
            matmul_dtype: str | None = None, attention: str | None = None, model_name: str = "custom",
            mesh: Mapping[str, int] | None = None, fp8_gemms: str | None = None) -> Account:
    """Everything at once. ``tokens`` defaults to 20 x parameters (Chinchilla's compute-optimal ratio).
    ``precision="fp8"``: ``fp8_gemms`` (default "all") run their forward in e4m3 at the device's dense fp8 peak, the
    rest at the ``matmul_dtype`` (bf16) peak: MFU and time against the blended peak (jaxgpt.devices.MixedPeak)."""
    seq_len = config.block_size if seq_len is None else seq_len
    dev = resolve_device(device)
    validate_run(config, batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
              grad_accum=grad_accum, fp8_gemms=fp8_gemms)
    if precision == "fp8":
        fp8_gemms = fp8_gemms or "all"
    if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise AccountError(f"mfu = {mfu!r}: must be in (0, 1]")
    mdt = resolve_dtype(matmul_dtype) if matmul_dtype else default_matmul_dtype(precision, dev)
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
                          grad_accum=grad_accum, remat=remat, attention=attn, device=dev, mesh=mesh,
                          fp8_gemms=fp8_gemms)
    fc = count_flops(config, seq_len, batch_size=batch_size, grad_accum=grad_accum)
    fp8 = {}
    if fp8_gemms is not None:
        rate, native = fp8_peak(dev, mdt)
        fp8 = dict(fp8_gemms=fp8_gemms, e4m3_flops_per_step=fc.training_per_step_by_dtype(fp8_gemms)["e4m3"],
                   fp8_peak_flops=rate, fp8_native=native)
    fch = count_flops(config, seq_len, batch_size=batch_size, grad_accum=grad_accum, causal_halving=True)
    return Account(config=config, model_name=model_name, batch_size=batch_size, seq_len=seq_len,
                   precision=precision, optimizer=optimizer, grad_accum=grad_accum, device=dev, matmul_dtype=mdt,
                   attention=attn, mfu=float(mfu), tokens=float(tokens), dollars_per_hour=float(price), params=params,
                   memory=mem, flops_per_token=fc.per_token()["training"],
                   flops_per_token_causal=fch.per_token()["training"], flops_per_step=fc.training_per_step,
                   peak_flops=peak_flops(dev, mdt), mesh=dict(mesh) if mesh else None, devices=mesh_devices(mesh),
                   optimizer_flops_per_step=_optimizer_flops(config, optimizer), **fp8)


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
    lines.append("cpu: measured on the spot (measure_cpu_peak); sources: NVIDIA datasheets, dense = sparse / 2; "
                 "fp8 = e4m3 GEMMs; '-': no fp8 tensor cores (precision fp8 falls back to the bf16 peak there)")
    return "\n".join(lines)


def dtypes_table_text() -> str:
    lines = [f"{'dtype':<10}{'bits':>5}{'sign':>5}{'exp':>5}{'mant':>5}{'max':>14}{'smallest normal':>17}{'eps':>12}"]
    for d in dtype_table():
        lines.append(f"{d.name:<10}{d.bits:>5}{d.sign_bits:>5}{d.exponent_bits:>5}{d.mantissa_bits:>5}"
                     f"{d.max:>14.6g}{d.smallest_normal:>17.6g}{d.eps:>12.6g}")
    return "\n".join(lines)
