"""What implementations each op of the kernel layer has, where they run, what numerics they need, and the presets.

An implementation keeps the reference's values ("reference": the same XLA expression or bit for bit the same
values; "reordered": the same values but for the order of fp32 sums) or changes them ("changes"). Where its kernels
do not run (``platforms``, ``computes``: the compute dtypes) an op runs its reference's path instead: a policy is
platform-free (the same config compiles for an H100 from a CPU host, and a GPU run resumes on a CPU), so the platform
picks the path at trace time (:func:`jaxgpt.ops.platform`); :func:`implementations` says what runs where. What a
policy's *numerics* rule out (``needs``) is refused when the policy is built: :func:`check`, the one place.
``kernels: auto`` (issue 45) selects among :func:`implementations`; docs/kernels.md describes the layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxgpt.config import ConfigError, from_dict

OPS = ("layer_norm", "attention", "qkv", "mlp", "loss")  # the ops the model calls with a choice of implementation
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Implementation:
    op: str
    name: str
    platforms: tuple[str, ...]  # where its own path runs (elsewhere: the op's reference path)
    computes: tuple[str, ...]  # the compute dtypes its kernels take
    numerics: str  # "reference", "reordered" (the reference's values but for the order of fp32 sums), "changes"
    summary: str
    needs: tuple[tuple[str, Callable[[Any], bool]], ...] = ()  # (what, test of the Policy): else refused

    def refusal(self, policy) -> str | None:
        """Why ``policy``'s numerics rule this implementation out (None: they do not)."""
        missing = [what for what, ok in self.needs if not ok(policy)]
        return "; ".join(missing) or None


ALL, F32_BF16 = PLATFORMS, ("float32", "bfloat16")
_GEMM_F32 = ("gemm_output float32 (not bf16-autocast)", lambda p: p.gemm_output == "float32")
_FAST = ("fast_kernels", lambda p: p.fast_kernels)


def _no_fp8(kind: str) -> tuple[str, Callable[[Any], bool]]:
    return (f"no fp8 {kind} GEMMs", lambda p: not p.fp8_on(kind))


_IMPLS = (
    Implementation("layer_norm", "xla", ALL, ("float32", "bfloat16", "float64"), "reference",
                   "the residual add, then LayerNorm's expression; autodiff's backward"),
    Implementation("layer_norm", "fused", ALL, F32_BF16, "reordered",
                   "the row statistics kept, a two-pass XLA backward (jaxgpt.kernels.layer_norm.layer_norm); the CPU "
                   "path of pallas"),
    Implementation("layer_norm", "pallas", ("gpu",), F32_BF16, "reordered",
                   "add + LayerNorm forward and backward one Pallas Triton kernel each, ln(x) written in the GEMMs' "
                   "dtype, the residual gradient added in the backward kernel (fused's passes elsewhere)"),
    Implementation("attention", "auto", ALL, ("float32", "bfloat16", "float64"), "reordered",
                   "cudnn on GPUs with bf16 compute, einsum on CPUs (with fast_kernels), xla otherwise"),
    Implementation("attention", "xla", ALL, ("float32", "bfloat16", "float64"), "reordered",
                   "jax.nn.dot_product_attention's XLA path"),
    Implementation("attention", "cudnn", ("gpu",), ("bfloat16",), "reordered", "cuDNN's fused attention"),
    Implementation("attention", "einsum", ("cpu",), ("float32", "bfloat16"), "reordered",
                   "query-blocked einsums with a hand-written backward (jaxgpt.kernels.attention.causal_attention)"),
    Implementation("attention", "reference", ALL, ("float32", "bfloat16", "float64"), "reference",
                   "softmax(q k^T / sqrt(D)) v as plain einsums (the oracle; dropout)"),
    Implementation("qkv", "xla", ALL, ("float32", "bfloat16", "float64"), "reference",
                   "c_attn's GEMM split in three on CPUs, one GEMM per column block on GPUs (dense q, k, v)"),
    Implementation("qkv", "pallas", ("gpu",), ("bfloat16",), "reordered",
                   "q, k, v's bias add and bf16 rounding in their Pallas GEMMs' epilogues, one GEMM for their input "
                   "gradient", (_GEMM_F32, _no_fp8("attn"),
                                ("attention not einsum", lambda p: p.kernels.attention != "einsum"))),
    Implementation("mlp", "xla", ALL, ("float32", "bfloat16", "float64"), "reference",
                   "c_fc, the tanh GELU in fp32, c_proj (gelu_h_dtype bfloat16: jaxgpt.kernels.mlp's XLA path)"),
    Implementation("mlp", "pallas-gemm", ("gpu",), ("bfloat16",), "reordered",
                   "GELU in the c_fc GEMM's epilogue and gelu'(h) in c_proj's input-gradient GEMM (two Pallas Triton "
                   "GEMMs)", (_GEMM_F32, _no_fp8("mlp"), _FAST)),
    Implementation("mlp", "pallas-recompute", ("gpu",), ("bfloat16",), "reordered",
                   "pallas-gemm without keeping h: recomputed in the backward kernel (a memory option: 9.0 GiB less "
                   "at gpt2 b64, 805 MB per layer)", (_GEMM_F32, _no_fp8("mlp"), _FAST,
                                                      ("gelu_h_dtype float32", lambda p: p.gelu_h_dtype == "float32"))),
    Implementation("loss", "xla", ALL, ("float32", "bfloat16", "float64"), "reference",
                   "the chunked fused lm_head + cross-entropy (fast_kernels), or logits then cross_entropy"),
    Implementation("loss", "pallas", ("gpu",), ("bfloat16",), "reordered",
                   "the bf16 logits GEMM writing each tile's row max and sum of exp (no pass re-reads the logits)",
                   (("logits_dtype bfloat16", lambda p: p.logits_dtype == "bfloat16"), _no_fp8("lm_head"), _FAST)),
)
REGISTRY: dict[str, dict[str, Implementation]] = {op: {i.name: i for i in _IMPLS if i.op == op} for op in OPS}

# each preset: per op, its candidates in order; the first whose needs the policy's numerics meet is taken
PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "xla": {op: ("auto",) if op == "attention" else ("xla",) for op in OPS},
    "pallas": {"layer_norm": ("pallas",), "attention": ("auto",), "qkv": ("pallas", "xla"),
               "mlp": ("pallas-gemm", "xla"), "loss": ("pallas", "xla")},
}


AUTO = "auto"  # not a preset: jaxgpt.train measures the candidates at a run's start and runs one (jaxgpt.tune)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which implementation each op of the kernel layer runs (:mod:`jaxgpt.kernels.registry`): a ``preset`` ("xla":
    the reference paths; "pallas": the Pallas kernels, the same numerics) and per-op choices over it (None: the
    preset's). Implementations, not numerics: what a choice may change is the order of fp32 sums."""

    preset: str = "xla"
    layer_norm: str | None = None
    attention: str | None = None
    qkv: str | None = None
    mlp: str | None = None
    loss: str | None = None

    @classmethod
    def parse(cls, value) -> "Kernels":
        """A preset name ("pallas"), a mapping of fields ({"preset": "pallas", "mlp": "xla"}) or a Kernels."""
        if isinstance(value, Kernels):
            return value
        if isinstance(value, str):
            return cls(preset=value)
        if isinstance(value, dict):
            return from_dict(cls, value)
        raise ConfigError(f"kernels = {value!r}: a preset ({', '.join(PRESETS)}) or a mapping op -> "
                          "implementation (e.g. --kernels=pallas --kernels.mlp=xla)")

    def overrides(self) -> dict[str, str | None]:
        return {op: getattr(self, op) for op in OPS}


def implementations(op: str, platform: str | None = None, compute: str | None = None, policy=None) -> list[str]:
    """The implementations of ``op`` whose own path runs on ``platform`` with ``compute`` (None: any), and whose
    numerics needs ``policy`` meets (None: any policy)."""
    if op not in REGISTRY:
        raise ConfigError(f"kernels: unknown op {op!r}; the ops are {', '.join(OPS)}")
    return [name for name, i in REGISTRY[op].items()
            if (platform is None or platform in i.platforms) and (compute is None or compute in i.computes)
            and (policy is None or i.refusal(policy) is None)]


def describe(op: str, name: str) -> Implementation:
    if name not in REGISTRY.get(op, {}):
        raise ConfigError(f"kernels.{op} = {name!r}: valid choices are {', '.join(implementations(op))}{where(op)}")
    return REGISTRY[op][name]


def where(op: str) -> str:
    """Which of ``op``'s implementations are for one platform, for an error message: " (GPU: pallas)"."""
    only = {}
    for i in REGISTRY[op].values():
        if set(i.platforms) != set(PLATFORMS):
            only.setdefault("/".join(p.upper() for p in i.platforms), []).append(i.name)
    return " (" + "; ".join(f"{p}: {', '.join(n)}" for p, n in only.items()) + ")" if only else ""


def check_names(kernels: Kernels) -> None:
    """Refuses an unknown preset or implementation name (what needs no policy to check)."""
    if kernels.preset not in PRESETS and kernels.preset != AUTO:
        raise ConfigError(f"kernels = {kernels.preset!r}: the presets are {', '.join(PRESETS)}, or {AUTO} (measured: "
                          "docs/auto.md); or set one op: --kernels.mlp=pallas-gemm")
    for op, name in kernels.overrides().items():
        if name is not None:
            describe(op, name)


def resolve(preset: str, overrides: dict[str, str | None], policy) -> dict[str, str]:
    """The implementation of every op under ``preset`` with ``overrides`` (op -> name, None: the preset's) for
    ``policy``'s numerics; refuses an unknown preset, op or name, and an override the numerics rule out."""
    check_names(Kernels(preset, **overrides))
    if preset == AUTO:
        raise ConfigError("kernels: auto is chosen by measuring at a run's start (jaxgpt.tune, docs/auto.md); a "
                          f"policy takes a preset: {', '.join(PRESETS)}")
    out = {}
    for op in OPS:
        name = overrides.get(op)
        if name is None:
            out[op] = next(n for n in PRESETS[preset][op] if REGISTRY[op][n].refusal(policy) is None)
            continue
        why = describe(op, name).refusal(policy)
        if why:
            raise ConfigError(f"kernels.{op} = {name!r} needs {why}; valid choices with this precision are "
                              f"{', '.join(implementations(op, policy=policy))}")
        out[op] = name
    return out
