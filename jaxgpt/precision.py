"""The precision policy: one object, passed to every layer, that decides the dtypes of a GPT-2 forward pass.

Rules (the same in jaxgpt and, through ``torch.autocast``, in torch_ref):

* parameters are stored in ``param_dtype`` (fp32);
* every matmul casts its operands to ``compute_dtype`` (fp32 or bf16) and accumulates in fp32
  (``preferred_element_type=float32``), so its result is fp32;
* everything that is not a matmul (LayerNorm statistics, GELU, softmax, the residual stream, logits and
  the loss) runs in fp32.

``precision: fp8`` is bf16 with the forward GEMMs selected by ``Policy.fp8`` taking float8_e4m3fn operands
(per-tensor current scaling, fp32 accumulation, bf16 straight-through backward: :mod:`jaxgpt.kernels.fp8`).

So "bf16" here means: matmul *operands* in bf16 with fp32 accumulation. On CPU that is the only bf16 that
pays off (bf16 -> bf16 dots are slower than fp32 in XLA:CPU); on GPU it is what tensor cores do anyway.

``matmul_precision="highest"`` pins fp32 matmuls to full fp32 (no TF32 on A100/H100); parity tests use it.

The fields above are numerics; ``Policy.kernels`` says which implementation each op of the kernel layer runs (a preset,
"xla" or "pallas", and per-op choices: :mod:`jaxgpt.kernels.registry`, docs/kernels.md), resolved and validated here
against the numerics when the policy is built (:meth:`Policy.kernel`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxgpt import ops
from jaxgpt.config import ConfigError, from_dict
from jaxgpt.kernels import fp8 as f8
from jaxgpt.kernels import registry
from jaxgpt.kernels.registry import Kernels

DType = Literal["float32", "bfloat16", "float64"]
PRECISIONS = ("fp32", "bf16", "bf16-autocast", "fp8", "auto")  # what precision: (TrainConfig, CLIs) accepts


@dataclasses.dataclass(frozen=True)
class Policy:
    compute_dtype: DType = "float32"
    param_dtype: DType = "float32"
    matmul_precision: Literal["default", "high", "highest"] = "default"  # default: follow jax's config
    fast_kernels: bool = True  # jaxgpt.ops: row-major backward matmuls, chunked fused lm_head cross-entropy
    # the dtype every activation matmul rounds its fp32-accumulated result to: the forward Linear and attention
    # outputs and the backward's input gradients (weight gradients stay fp32); "bfloat16" is torch.autocast's bf16
    # GEMM output (needs compute_dtype bfloat16). Bias adds then promote to fp32 as in torch_ref, so GELU, the
    # residual stream and LayerNorm stay fp32: what it removes is the fp32 copy of each GEMM output in memory
    gemm_output: Literal["float32", "bfloat16"] = "float32"
    # the dtype the lm_head's logits are written in (jaxgpt.kernels.loss: logits_dtype); the loss and its gradient
    # are computed in fp32 from them. "bfloat16": torch.autocast's bf16 lm_head output (torch_ref then calls .float()),
    # named by bf16_autocast and an opt-in of the others (TrainConfig.logits_dtype; its loss bound:
    # parity_tests/tolerances.py, bf16 logits). With fp32 compute the fp32 GEMM result is rounded to bf16
    logits_dtype: Literal["float32", "bfloat16"] = "float32"
    # the dtype the MLP keeps its c_fc output h in for GELU's backward: "bfloat16" takes gelu'(h) from h rounded to
    # bf16, as torch_ref under autocast (whose c_fc GEMM writes h in bf16): one more bf16 rounding in the gradient
    # (the bf16 policies' bounds, parity_tests/tolerances.py), half of h's memory and traffic (403 MB less per layer
    # at gpt2 b64). Needs bf16 compute, gemm_output float32, no fp8 MLP GEMMs (jaxgpt.kernels.mlp)
    gelu_h_dtype: Literal["float32", "bfloat16"] = "float32"
    # which forward GEMMs take e4m3 operands (jaxgpt.kernels.fp8: per-tensor current scaling, fp32 accumulation,
    # backward in compute_dtype): "none", "lm_head", "mlp", "mlp+lm_head" or "all" (+ the attention projections)
    fp8: f8.Gemms = "none"
    # which implementation each op runs (jaxgpt.kernels.registry; docs/kernels.md): a preset and per-op choices
    kernels: Kernels = Kernels()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", Kernels.parse(self.kernels))
        if self.logits_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"Policy.logits_dtype = {self.logits_dtype!r}: allowed values are 'float32', 'bfloat16'")
        if self.param_dtype != "float32" and not (self.param_dtype == self.compute_dtype == "float64"):
            raise ConfigError(f"Policy.param_dtype = {self.param_dtype!r}: parameters are kept in float32 (float64 "
                              "only for the float64 reference policy, Policy.fp64()); use compute_dtype='bfloat16' "
                              "for bf16 compute")
        if self.gemm_output != "float32" and self.compute_dtype != self.gemm_output:
            raise ConfigError(f"Policy.gemm_output = {self.gemm_output!r} needs compute_dtype = {self.gemm_output!r} "
                              f"(got {self.compute_dtype!r}): use Policy.bf16_autocast() or precision: bf16-autocast")
        if self.fp8 not in f8.GEMM_SETS:
            raise ConfigError(f"Policy.fp8 = {self.fp8!r}: allowed values are {', '.join(map(repr, f8.GEMM_SETS))}")
        if self.fp8 != "none" and (self.compute_dtype not in ("bfloat16", "float32") or self.gemm_output != "float32"
                                   or not self.fast_kernels):
            raise ConfigError(f"Policy.fp8 = {self.fp8!r} needs compute_dtype bfloat16 (or float32), gemm_output "
                              "float32 and fast_kernels: use Policy.fp8_policy() or precision: fp8")
        if self.gelu_h_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"Policy.gelu_h_dtype = {self.gelu_h_dtype!r}: allowed values are 'float32', 'bfloat16'")
        if self.gelu_h_dtype == "bfloat16" and (self.compute_dtype != "bfloat16" or self.gemm_output != "float32"
                                                or self.fp8_on("mlp") or not self.fast_kernels):
            raise ConfigError(f"Policy.gelu_h_dtype = 'bfloat16' keeps h in bf16 for a bf16 policy's backward; got "
                              f"compute_dtype {self.compute_dtype!r}, gemm_output {self.gemm_output!r}, fp8 "
                              f"{self.fp8!r}: use precision bf16, or gelu_h_dtype: float32")
        if self.compute_dtype == "float64" and (self.param_dtype != "float64" or self.fast_kernels):
            raise ConfigError("Policy: float64 compute is the reference policy only: use Policy.fp64() (float64 "
                              "params, fast_kernels=False)")
        object.__setattr__(self, "_impls", registry.resolve(self.kernels.preset, self.kernels.overrides(), self))

    def __str__(self) -> str:  # the fields, then what each op runs (the benchmarks record it)
        return f"{self!r}: " + ", ".join(f"{op}={name}" for op, name in self._impls.items())

    @property
    def implementations(self) -> dict[str, str]:
        """What every op of the kernel layer runs under this policy: {op: implementation}."""
        return dict(self._impls)

    def kernel(self, op: str) -> str:
        """The implementation ``op`` runs under this policy (:mod:`jaxgpt.kernels.registry`)."""
        return self._impls[op]

    # ---- named policies -----------------------------------------------------------------------------
    @classmethod
    def fp32(cls, **kw) -> "Policy":
        return cls(compute_dtype="float32", **kw)

    @classmethod
    def bf16(cls, **kw) -> "Policy":
        return cls(compute_dtype="bfloat16", **kw)

    @classmethod
    def bf16_autocast(cls, **kw) -> "Policy":
        """torch.autocast's bf16 numerics as torch_ref runs them: bf16 operands, fp32 accumulation, GEMM outputs
        rounded to bf16 (forward and input gradients); bias adds, GELU, LayerNorm, the residual stream and the
        loss in fp32 (``precision: bf16-autocast``)."""
        return cls(compute_dtype="bfloat16", gemm_output="bfloat16", logits_dtype="bfloat16", **kw)

    @classmethod
    def fp8_policy(cls, gemms: str = f8.DEFAULT_GEMMS, **kw) -> "Policy":
        """``precision: fp8``: the bf16 policy with the forward GEMMs named by ``gemms`` (see :attr:`fp8`) in e4m3
        (jaxgpt.kernels.fp8)."""
        return cls(compute_dtype="bfloat16", fp8=gemms, **kw)

    @classmethod
    def fp64(cls) -> "Policy":
        """Everything in float64 (params, matmuls, accumulation), plain einsum kernels: the ground truth the
        parity tests measure fp32 errors against. Needs ``jax.enable_x64(True)`` (else jax silently computes in
        float32)."""
        if not jax.config.jax_enable_x64:
            raise ConfigError("Policy.fp64() needs 64-bit jax: run it inside `with jax.enable_x64(True):`")
        return cls(compute_dtype="float64", param_dtype="float64", fast_kernels=False,
                   kernels=Kernels(attention="reference"))

    @classmethod
    def named(cls, name: str, *, fp8_gemms: str | None = None, logits_dtype: str | None = None, **kw) -> "Policy":
        """'fp32', 'bf16', 'bf16-autocast' (:meth:`bf16_autocast`), 'fp8' or 'auto' (see ``default_compute``).
        ``logits_dtype``: the lm_head's logits dtype (:attr:`logits_dtype`); None: the named policy's own (bf16 under
        bf16-autocast, fp32 otherwise). bf16-autocast is torch.autocast's numerics, whose lm_head writes bf16: fp32
        logits there are refused."""
        if name == "auto":
            name = default_compute()
        if fp8_gemms is not None and name != "fp8":
            raise ConfigError(f"fp8_gemms = {fp8_gemms!r} selects the e4m3 GEMMs of precision: fp8, but precision is "
                              f"{name!r}: set precision: fp8 or drop fp8_gemms")
        if name == "bf16-autocast" and logits_dtype not in (None, "bfloat16"):
            raise ConfigError(f"logits_dtype = {logits_dtype!r} with precision bf16-autocast: that policy is "
                              "torch.autocast's numerics, whose lm_head writes bf16 logits; drop logits_dtype (or use "
                              "precision: bf16 for fp32 logits)")
        if logits_dtype is not None and name != "bf16-autocast":
            kw["logits_dtype"] = logits_dtype
        if name in ("fp32", "float32"):
            return cls.fp32(**kw)
        if name in ("bf16", "bfloat16"):
            return cls.bf16(**kw)
        if name == "bf16-autocast":
            return cls.bf16_autocast(**kw)
        if name == "fp8":  # fp8_gemms: TrainConfig.fp8_gemms (None: f8.DEFAULT_GEMMS)
            return cls.fp8_policy(fp8_gemms or f8.DEFAULT_GEMMS, **kw)
        raise ConfigError(f"precision = {name!r}: allowed values are {', '.join(map(repr, PRECISIONS))}")

    @classmethod
    def from_dict(cls, data: dict) -> "Policy":
        return from_dict(cls, data)

    # ---- what layers call -----------------------------------------------------------------------------
    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    @property
    def accum_dtype(self) -> jnp.dtype:
        """What matmuls accumulate in and return: fp32 (fp64 under :meth:`fp64`)."""
        return jnp.dtype(jnp.float64 if self.compute_dtype == "float64" else jnp.float32)

    @property
    def lax_precision(self) -> jax.lax.Precision | None:
        """None for "default", so ``jax.default_matmul_precision(...)`` (as parity tests set) still applies."""
        return {"default": None, "high": jax.lax.Precision.HIGH,
                "highest": jax.lax.Precision.HIGHEST}[self.matmul_precision]

    @property
    def out_dtype(self) -> jnp.dtype:
        """What activation matmuls return: fp32 (fp64 under :meth:`fp64`), or bf16 under ``gemm_output``."""
        return self.accum_dtype if self.gemm_output == "float32" else jnp.dtype(self.gemm_output)

    def round_logits(self, logits: Array) -> Array:
        """Logits rounded to ``logits_dtype`` and returned in their own dtype (fp32): torch_ref's ``.float()``."""
        if self.logits_dtype == "float32":  # no rounding beyond the accumulation's (fp64 stays fp64)
            return logits
        return ops.round_to(logits, self.logits_dtype)  # not a convert pair: XLA:CPU's fusions may drop one

    def cast(self, x: Array) -> Array:
        """Cast a matmul operand to the compute dtype."""
        return x.astype(self.dtype)

    def einsum(self, spec: str, a: Array, b: Array) -> Float[Array, "..."]:
        """A matmul under the policy: operands in compute dtype, fp32 accumulation, fp32 result."""
        return jnp.einsum(spec, self.cast(a), self.cast(b), precision=self.lax_precision,
                          preferred_element_type=self.accum_dtype)

    def fp8_on(self, gemm: f8.GemmKind) -> bool:
        """Whether the forward GEMMs of kind ``gemm`` ("attn", "mlp", "lm_head") run in e4m3 (:attr:`fp8`)."""
        return gemm in f8.GEMM_SETS[self.fp8]

    def matmul(self, x: Float[Array, "... d_in"], w: Float[Array, "d_in d_out"], *, gemm: f8.GemmKind = "attn"
               ) -> Float[Array, "... d_out"]:
        """``x @ w`` under the policy (what every Linear layer calls; ``gemm``: its kind for :attr:`fp8`), its result
        in :attr:`out_dtype`."""
        if self.fp8_on(gemm):  # e4m3 operands, fp32 result, a compute_dtype backward (jaxgpt.kernels.fp8)
            return f8.matmul(x, w, dtype=self.dtype, precision=self.lax_precision)
        if self.fast_kernels:  # same product; a backward laid out for XLA:CPU (jaxgpt.ops.matmul)
            return ops.matmul(x, w, dtype=self.dtype, precision=self.lax_precision, out_dtype=self.out_dtype)
        return ops.round_to(self.einsum("...i,io->...o", x, w), self.out_dtype).astype(self.out_dtype)

    def attention_impl(self) -> Literal["xla", "cudnn", "einsum", "reference"]:
        impl = self.kernel("attention")
        if impl != "auto":
            return impl
        backend = ops.platform()
        if backend == "gpu" and self.compute_dtype == "bfloat16":
            return "cudnn"
        return "einsum" if backend == "cpu" and self.fast_kernels else "xla"


def default_compute(backend: str | None = None) -> str:
    """The compute dtype ``precision: auto`` picks on ``backend`` (default: where computations are placed now,
    :func:`jaxgpt.ops.platform`): bf16 on GPU/TPU; on CPU bf16 only where bf16-operand GEMMs (fp32
    accumulation) beat fp32 ones (:func:`cpu_bf16_is_fast`), fp32 elsewhere."""
    if (backend or ops.platform()) != "cpu":
        return "bf16"
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        return "fp32"
    return "bf16" if cpu_bf16_is_fast(cpuinfo) else "fp32"


def cpu_bf16_is_fast(cpuinfo: str) -> bool:
    """Whether the CPU described by ``cpuinfo`` (the text of ``/proc/cpuinfo``) runs bf16 x bf16 -> fp32 GEMMs
    faster than fp32 ones. The ``avx512_bf16`` flag alone does not say so; measured on our 2-core machines:

    ===========================================  =================  =======================  ================
    CPU (2 cores, KVM guest)                     fp32 GEMM GFLOP/s  bf16->fp32 GEMM GFLOP/s  jaxgpt bf16 step
    ===========================================  =================  =======================  ================
    AMD EPYC family 25 (Zen 4), avx512_bf16      ~215               ~420                     1.8x fp32 step
    Intel Xeon family 6 model 207, avx512_bf16,  ~250-330           ~165                     0.8x fp32 step
    AMX not exposed to the guest
    AMD EPYC family 25 model 1 (the guest sees   ~165-175           ~100 (XLA; torch's bf16  0.67x fp32 step
    AVX2 and FMA only, no AVX-512)                                  GEMM: ~1.3)
    ===========================================  =================  =======================  ================

    On that Intel core ``vdpbf16ps`` issues at half the rate of the two fp32 FMA ports (a register-only loop:
    86 vs 171 GFLOP/s per core), so a bf16 GEMM reaches only half the fp32 peak; on AMD's Zen 4 it issues at
    the fp32 FMA rate with twice the work per instruction. So: bf16 where there is AMX (``amx_bf16``), or on an
    AMD CPU with ``avx512_bf16``; fp32 otherwise (without a native bf16 dot, bf16 is emulated and slower still).
    ``precision: bf16`` still forces bf16 anywhere."""
    first = cpuinfo.split("\n\n")[0]  # one logical CPU's block
    flags_line = re.search(r"^flags\s*:(.*)$", first, flags=re.M)
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", first, flags=re.M)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    if "amx_bf16" in flags:
        return True
    return "avx512_bf16" in flags and vendor is not None and vendor.group(1) == "AuthenticAMD"
