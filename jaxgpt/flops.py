"""Analytic FLOP counts for GPT-2, matmul by matmul, and the shorthand conventions others use.

Counting rule: a matmul of an (m, k) by a (k, n) matrix costs ``2 * m * n * k`` FLOPs (one multiply and
one add per term). Only matmuls are counted here; LayerNorm, GELU, softmax, residual adds, the loss and
the optimizer update are left out of the "model FLOPs" on purpose (that is what MFU is defined against).
:func:`nonmatmul_flops` estimates those separately, by category, so that a compiler's own count
(XLA's ``cost_analysis()``) can be reconciled with this one.

The seven matmul kinds, per layer and per sequence of T tokens (C = n_embd, N heads of D = C / N):

=============  ==============================  ==================
kind           shape                           forward FLOPs
=============  ==============================  ==================
qkv            (T, C) @ (C, 3C)                2 * T * C * 3C
attn_scores    N x (T, D) @ (D, T)             2 * T * T * C
attn_values    N x (T, T) @ (T, D)             2 * T * T * C
attn_out_proj  (T, C) @ (C, C)                 2 * T * C * C
mlp_up         (T, C) @ (C, 4C)                2 * T * C * 4C
mlp_down       (T, 4C) @ (4C, C)               2 * T * 4C * C
lm_head        (T, C) @ (C, Vp)  once          2 * T * C * Vp
=============  ==============================  ==================

``lm_head`` is counted over the **padded** vocabulary rows ``Vp = config.vocab_rows``: both jaxgpt
(``einsum("btc,vc->btv", h, wte)[..., :vocab_size]``) and torch_ref (``x @ wte.T`` then slice) multiply
by every row of the tied embedding and drop the padded columns afterwards, so the padded rows cost
FLOPs. (With ``padded_vocab_size=None``, Vp is the real vocabulary.) The embedding lookups
(``wte[idx]``, ``wpe[pos]``) are gathers, not matmuls: 0 FLOPs here.

Backward = exactly 2x forward, kind by kind. For ``Y = A @ B`` reverse-mode autodiff computes
``dA = dY @ B^T`` and ``dB = A^T @ dY``, each the same size as the forward matmul, whenever both operands
need a gradient. In GPT-2 they all do: every weight is a parameter; q, k, v and the attention
probabilities depend on parameters; and even the *first* layer's input, ``ln_1(wte[idx] + wpe[pos])``,
depends on the embedding tables, so its input gradient is computed too (it flows on to the
scatter-add that is the embedding's backward, itself no matmul). Nothing is skipped, so a training
step is 3x the forward matmul FLOPs. ``torch.utils.flop_counter.FlopCounterMode`` agrees with these
numbers exactly (``parity_tests/test_flops_parity.py``).

Causal halving: a causal mask makes half of ``q @ k^T`` (and of ``probs @ v``) multiply by zero.
Dense implementations (jaxgpt's XLA path, torch_ref's "math" path, FlopCounterMode, XLA's
cost_analysis) still do the full T x T work; flash kernels that skip masked blocks do about half.
``causal_halving=True`` divides the two attention kinds by 2, as MaxText does (the exact lower triangle
would be T(T+1)/2 key positions instead of T^2/2: a difference of T/2 per query row).

Conventions others use (all per *token*, training = forward + backward), see :func:`conventions`:

* ``6N`` (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Sec. 2.1: C ~ 6N per token,
  N = non-embedding parameters, i.e. without wte and wpe); the same rule with N = all parameters is the
  usual "C = 6 N D" budget.
* Kaplan's full form, ``6N + 6 * L * T * C`` (its Table 1: forward = 2N + 2 n_layer n_ctx d_attn).
* PaLM (Chowdhery et al. 2022, App. B) and nanoGPT's ``estimate_mfu``: ``6N + 12 * L * H * Q * T``
  (H heads of size Q, so H * Q = C: ``6N + 12 * L * T * C``). nanoGPT uses
  ``N = get_num_params()`` = all parameters minus ``wpe`` (wte stays: it is the tied lm_head) and
  ``T = block_size``.
* llm.c (``gpt2_estimate_mfu`` in train_gpt2.cu): ``6N + 6 * L * C * T`` with N = *all* parameters
  (its wte has the padded 50304 rows, plus wpe, LayerNorms and biases): the attention term is PaLM's,
  halved for causality.
* MaxText (``calculate_tflops_training_per_device``): 3 x (weight matmuls without biases + the logits
  matmul ``2 * T * C * V``) + 3 x causal attention (``4 * T^2 * C / 2`` per layer per sequence). For
  GPT-2 that is this module's count with ``causal_halving=True``.

fp8 (``precision: fp8``, :mod:`jaxgpt.kernels.fp8`): the same FLOPs, split by the operands' dtype
(:meth:`FlopCount.training_by_dtype`). Only *forward* GEMMs take e4m3 operands, and only the kinds that
``fp8_gemms`` (``TrainConfig.fp8_gemms`` / ``Policy.fp8``) selects: ``attn`` = qkv and attn_out_proj, ``mlp`` =
mlp_up and mlp_down, ``lm_head``; attention's own QK^T and PV (attn_scores, attn_values) and every backward GEMM
(straight-through, bf16) stay bf16. For gpt2 124M at T = 1024 that is, per token, of 854,438,400 training FLOPs:
``all`` 247,064,064 in e4m3 (28.9%), ``mlp+lm_head`` 190,440,960, ``mlp`` 113,246,208 (13.3%), ``lm_head``
77,194,752 (9.0%). :func:`jaxgpt.devices.mixed_peak` prices each class at its own dense peak.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxgpt.config import ConfigError, GPTConfig

KINDS: tuple[str, ...] = ("qkv", "attn_scores", "attn_values", "attn_out_proj", "mlp_up", "mlp_down", "lm_head")
LAYER_KINDS: tuple[str, ...] = KINDS[:-1]
BACKWARD_FACTOR = 2  # dA and dB, each as large as the forward matmul


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} = {value!r}: must be a positive integer")
    return value


def layer_forward_flops(config: GPTConfig, seq_len: int, *, causal_halving: bool = False) -> dict[str, int]:
    """Forward matmul FLOPs of one transformer block on one sequence of ``seq_len`` tokens, by kind."""
    T, C = seq_len, config.n_embd
    attn = 2 * T * T * C  # N heads x 2 * T * T * D
    if causal_halving:
        attn //= 2  # T*T*C is an integer for every T, so this is exact
    return {
        "qkv": 2 * T * C * 3 * C,
        "attn_scores": attn,
        "attn_values": attn,
        "attn_out_proj": 2 * T * C * C,
        "mlp_up": 2 * T * C * 4 * C,
        "mlp_down": 2 * T * 4 * C * C,
    }


def lm_head_forward_flops(config: GPTConfig, seq_len: int) -> int:
    """Forward FLOPs of the tied lm_head on one sequence, over the padded rows ``config.vocab_rows``."""
    return 2 * seq_len * config.n_embd * config.vocab_rows


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """Matmul FLOPs of GPT-2 for one configuration, sequence length, batch and accumulation.

    ``layer_forward`` holds one block's forward FLOPs per sequence (every block is the same);
    ``lm_head_forward`` the lm_head's per sequence. Everything else is derived from those two.
    """

    config: GPTConfig
    seq_len: int
    batch_size: int  # sequences per micro-step
    grad_accum: int  # micro-steps per optimizer step
    causal_halving: bool
    layer_forward: dict[str, int]
    lm_head_forward: int

    # ---- per sequence -------------------------------------------------------------------------------
    @property
    def lm_head_rows(self) -> int:
        return self.config.vocab_rows

    @property
    def forward_by_kind(self) -> dict[str, int]:
        """Forward FLOPs per sequence by kind, summed over all layers."""
        out = {k: v * self.config.n_layer for k, v in self.layer_forward.items()}
        out["lm_head"] = self.lm_head_forward
        return out

    @property
    def backward_by_kind(self) -> dict[str, int]:
        return {k: BACKWARD_FACTOR * v for k, v in self.forward_by_kind.items()}

    @property
    def forward(self) -> int:
        """Forward FLOPs per sequence."""
        return sum(self.forward_by_kind.values())

    @property
    def backward(self) -> int:
        """Backward FLOPs per sequence (input and weight gradients of every matmul)."""
        return BACKWARD_FACTOR * self.forward

    @property
    def training(self) -> int:
        """Forward + backward FLOPs per sequence."""
        return self.forward + self.backward

    def training_by_dtype(self, fp8_gemms: str = "none") -> dict[str, int]:
        """Training FLOPs per sequence by GEMM operand dtype under ``precision: fp8`` with ``fp8_gemms``:
        ``e4m3``, the forward FLOPs of the kinds :func:`e4m3_kinds` selects; ``bf16``, the rest (their backward,
        attention's QK^T and PV, the kinds not selected). ``"none"``: everything bf16."""
        e4m3 = sum(self.forward_by_kind[k] for k in e4m3_kinds(fp8_gemms))
        return {"e4m3": e4m3, "bf16": self.training - e4m3}

    def training_per_step_by_dtype(self, fp8_gemms: str = "none") -> dict[str, int]:
        """:meth:`training_by_dtype` of one optimizer step (all micro-steps)."""
        return {k: v * self.batch_size * self.grad_accum for k, v in self.training_by_dtype(fp8_gemms).items()}

    @property
    def attention_forward(self) -> int:
        """The two activation-activation matmuls (scores and values), per sequence, all layers."""
        f = self.forward_by_kind
        return f["attn_scores"] + f["attn_values"]

    # ---- per token / micro-step / step ---------------------------------------------------------------
    def per_token(self) -> dict[str, float]:
        T = self.seq_len
        return {"forward": self.forward / T, "backward": self.backward / T, "training": self.training / T}

    @property
    def tokens_per_micro_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    @property
    def forward_per_micro_step(self) -> int:
        return self.forward * self.batch_size

    @property
    def training_per_micro_step(self) -> int:
        return self.training * self.batch_size

    @property
    def training_per_step(self) -> int:
        """Forward + backward FLOPs of one optimizer step (all gradient-accumulation micro-steps)."""
        return self.training * self.batch_size * self.grad_accum

    # ---- presentation -------------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """One row per (layer, kind) with forward and backward FLOPs per sequence."""
        rows = []
        for layer in range(self.config.n_layer):
            for kind, fwd in self.layer_forward.items():
                rows.append(dict(layer=layer, kind=kind, forward=fwd, backward=BACKWARD_FACTOR * fwd))
        rows.append(dict(layer=None, kind="lm_head", forward=self.lm_head_forward,
                         backward=BACKWARD_FACTOR * self.lm_head_forward))
        return rows

    def to_dict(self) -> dict[str, Any]:
        return dict(
            seq_len=self.seq_len, batch_size=self.batch_size, grad_accum=self.grad_accum,
            causal_halving=self.causal_halving, lm_head_rows=self.lm_head_rows,
            layer_forward_per_sequence=dict(self.layer_forward),
            forward_by_kind_per_sequence=self.forward_by_kind,
            backward_by_kind_per_sequence=self.backward_by_kind,
            forward_per_sequence=self.forward, backward_per_sequence=self.backward,
            training_per_sequence=self.training, per_token=self.per_token(),
            training_per_micro_step=self.training_per_micro_step,
            training_per_step=self.training_per_step, tokens_per_step=self.tokens_per_step,
        )

    def table(self, *, per_layer: bool = False) -> str:
        """A readable table: FLOPs per sequence by kind (and optionally by layer), then the totals."""
        cfg = self.config
        lines = [f"Matmul FLOPs, n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_head={cfg.n_head} "
                 f"T={self.seq_len} lm_head rows={self.lm_head_rows}"
                 f"{' (padded)' if cfg.vocab_rows != cfg.vocab_size else ''}"
                 f"{', causal-halved attention' if self.causal_halving else ', full T x T attention'}",
                 f"{'layer':>5}  {'kind':<14}{'forward':>18}{'backward':>18}{'share':>8}"]
        total = self.forward
        if per_layer:
            for r in self.rows():
                layer = "-" if r["layer"] is None else str(r["layer"])
                lines.append(f"{layer:>5}  {r['kind']:<14}{r['forward']:>18,}{r['backward']:>18,}"
                             f"{r['forward'] / total:>8.1%}")
        else:
            for kind, fwd in self.forward_by_kind.items():
                layers = "-" if kind == "lm_head" else f"x{cfg.n_layer}"
                lines.append(f"{layers:>5}  {kind:<14}{fwd:>18,}{BACKWARD_FACTOR * fwd:>18,}{fwd / total:>8.1%}")
        lines.append(f"{'':>5}  {'per sequence':<14}{self.forward:>18,}{self.backward:>18,}")
        pt = self.per_token()
        lines.append(f"{'':>5}  {'per token':<14}{pt['forward']:>18,.0f}{pt['backward']:>18,.0f}")
        lines.append(f"training (fwd+bwd): {self.training:,} per sequence, {pt['training']:,.0f} per token, "
                     f"{self.training_per_step:,} per step ({self.batch_size} x {self.seq_len} tokens x "
                     f"{self.grad_accum} micro-steps)")
        return "\n".join(lines)


def count_flops(
    config: GPTConfig,
    seq_len: int | None = None,
    *,
    batch_size: int = 1,
    grad_accum: int = 1,
    causal_halving: bool = False,
) -> FlopCount:
    """Matmul FLOPs of GPT-2 (``seq_len`` defaults to ``config.block_size``)."""
    seq_len = config.block_size if seq_len is None else seq_len
    _check_positive("seq_len", seq_len)
    _check_positive("batch_size", batch_size)
    _check_positive("grad_accum", grad_accum)
    if seq_len > config.block_size:
        raise ConfigError(f"seq_len = {seq_len}: must be <= block_size ({config.block_size})")
    return FlopCount(config=config, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
                     causal_halving=causal_halving,
                     layer_forward=layer_forward_flops(config, seq_len, causal_halving=causal_halving),
                     lm_head_forward=lm_head_forward_flops(config, seq_len))


# ---- fp8: which GEMMs take e4m3 operands -----------------------------------------------------------------------------
# jaxgpt.kernels.fp8's GEMM classes (Policy.fp8 / TrainConfig.fp8_gemms) and the kinds above each one covers, mirrored here so
# that this module stays jax-free (tests/test_flops.py checks them against jaxgpt.kernels.fp8.GEMM_SETS and the model's Linear
# layers). The attention projections are ``attn``; attention's QK^T and PV are in no class: they stay bf16.
FP8_GEMM_SETS: dict[str, frozenset[str]] = {
    "none": frozenset(), "lm_head": frozenset({"lm_head"}), "mlp": frozenset({"mlp"}),
    "mlp+lm_head": frozenset({"mlp", "lm_head"}), "all": frozenset({"attn", "mlp", "lm_head"}),
}
FP8_GEMM_KINDS: dict[str, tuple[str, ...]] = {"attn": ("qkv", "attn_out_proj"), "mlp": ("mlp_up", "mlp_down"),
                                              "lm_head": ("lm_head",)}


def e4m3_kinds(fp8_gemms: str) -> tuple[str, ...]:
    """The matmul kinds (:data:`KINDS`, in that order) whose forward GEMMs take e4m3 operands under ``fp8_gemms``."""
    if fp8_gemms not in FP8_GEMM_SETS:
        raise ConfigError(f"fp8_gemms = {fp8_gemms!r}: allowed values are {', '.join(map(repr, FP8_GEMM_SETS))}")
    chosen = {k for g in FP8_GEMM_SETS[fp8_gemms] for k in FP8_GEMM_KINDS[g]}
    return tuple(k for k in KINDS if k in chosen)


# ---- parameter counts the conventions need (jaxgpt.account.memory has the full breakdown) ----------------------------
def n_params(config: GPTConfig) -> dict[str, int]:
    """Parameter counts by the definitions the conventions use (the tied lm_head counted once)."""
    C, L, b = config.n_embd, config.n_layer, int(config.bias)
    wte = config.vocab_rows * C
    wpe = config.block_size * C
    per_layer = (C * 3 * C + b * 3 * C) + (C * C + b * C) + (C * 4 * C + b * 4 * C) + (4 * C * C + b * C) \
        + 2 * (C + b * C)
    ln_f = C + b * C
    total = wte + wpe + L * per_layer + ln_f
    return dict(total=total, wte=wte, wpe=wpe, non_embedding=total - wte - wpe, total_minus_wpe=total - wpe,
                matmul_weights=L * 12 * C * C + wte)


@dataclasses.dataclass(frozen=True)
class Convention:
    """One published way of estimating training FLOPs per token, evaluated for a config."""

    name: str
    formula: str
    n_definition: str
    n: int | None
    flops_per_token: float
    source: str


def conventions(config: GPTConfig, seq_len: int | None = None) -> list[Convention]:
    """Training (fwd+bwd) FLOPs per token by this module and by others' shorthands."""
    T = config.block_size if seq_len is None else seq_len
    L, C = config.n_layer, config.n_embd
    p = n_params(config)
    exact = count_flops(config, T).per_token()["training"]
    halved = count_flops(config, T, causal_halving=True).per_token()["training"]
    return [
        Convention("jaxgpt (exact matmuls)", "3 x sum of 2mnk, full T x T attention", "-", None, exact,
                   "jaxgpt.flops.count_flops"),
        Convention("jaxgpt causal-halved", "same, attention / 2", "-", None, halved,
                   "jaxgpt.flops.count_flops(causal_halving=True)"),
        Convention("6N (non-embedding)", "6N", "all params - wte - wpe", p["non_embedding"],
                   6 * p["non_embedding"], "Kaplan et al. 2020, Sec. 2.1"),
        Convention("6N (all params)", "6N", "all params", p["total"], 6 * p["total"], "C = 6ND rule of thumb"),
        Convention("Kaplan", "6N + 6LTC", "all params - wte - wpe", p["non_embedding"],
                   6 * p["non_embedding"] + 6 * L * T * C, "Kaplan et al. 2020, Table 1 (x3 for training)"),
        Convention("PaLM / nanoGPT", "6N + 12LTC", "all params - wpe (nanoGPT)", p["total_minus_wpe"],
                   6 * p["total_minus_wpe"] + 12 * L * T * C,
                   "Chowdhery et al. 2022 App. B; nanoGPT model.py estimate_mfu (T = block_size)"),
        Convention("llm.c", "6N + 6LCT", "all params (padded wte, wpe, LN, biases)", p["total"],
                   6 * p["total"] + 6 * L * C * T, "llm.c train_gpt2.cu gpt2_estimate_mfu"),
        Convention("MaxText", "6(12LC^2 + CV) + 6LTC", "weight matmuls, no biases", p["matmul_weights"],
                   6 * p["matmul_weights"] + 6 * L * T * C,
                   "MaxText maxtext_utils.calculate_tflops_training_per_device (causal attention / 2)"),
    ]


def conventions_table(config: GPTConfig, seq_len: int | None = None) -> str:
    rows = conventions(config, seq_len)
    base = rows[0].flops_per_token
    lines = [f"{'convention':<24}{'formula':<40}{'FLOPs/token':>16}{'vs exact':>10}  N"]
    for c in rows:
        n = "-" if c.n is None else f"{c.n:,} ({c.n_definition})"
        lines.append(f"{c.name:<24}{c.formula:<40}{c.flops_per_token:>16,.0f}{c.flops_per_token / base - 1:>+10.2%}  {n}")
    return "\n".join(lines)


# ---- the non-matmul remainder, for reconciling with a compiler's count ------------------------------------
# FLOPs per parameter of one optax update as XLA counts it (measured with cost_analysis() of the jitted
# update alone; e.g. adamw: m = b1 m + (1-b1) g [3], v = b2 v + (1-b2) g^2 [4], two bias corrections [2],
# + eps [1], divide [1], + wd p [2], * -lr [1], p + u [1] = 15; sqrt is a transcendental).
OPTIMIZER_FLOPS_PER_PARAM: dict[str, int] = {"adamw": 15, "adam": 13, "sgd": 4, "adagrad": 8, "rmsprop": 8}
# Muon (jaxgpt/muon.py), per element of a Muon matrix, besides its Newton-Schulz: trace m b + g [2], Nesterov
# g + m b [2], * (1 - m) [1], the shape scale [1], + wd p [2], * -lr [1], p + u [1] = 10; AdamW's 15 on the rest.
MUON_ELEMENTWISE_PER_PARAM = 10


def muon_matrix_params(config: GPTConfig) -> int:
    """Elements of the matrices Muon updates (every block's c_attn, attn.c_proj, c_fc and mlp.c_proj kernels):
    12 L C^2; AdamW updates the other ``n_params(config)['total'] - muon_matrix_params(config)``."""
    return 12 * config.n_layer * config.n_embd ** 2


def newton_schulz_flops(config: GPTConfig, *, ns_steps: int = 5, split_qkv: bool = True) -> dict[str, int]:
    """FLOPs of Muon's Newton-Schulz per optimizer step (once per step, whatever the batch), counted as XLA
    counts them: ``matmul`` (2 m n k per product) and ``elementwise``. Each matrix is taken wide (m <= n, as
    both optax and torch transpose a tall one); an iteration is A = X X^T (2 m^2 n), A A (2 m^3), (b A + c A A) X
    (2 m^2 n) and the sums b A + c A A (3 m^2: two scalings and an add), a X + B X (2 m n); before the iterations
    the Frobenius normalisation (~3 m n). Per block, C = n_embd: c_attn as three (C, C) (``split_qkv``) or one
    (C, 3C), attn.c_proj (C, C), c_fc (C, 4C), mlp.c_proj (4C, C): with 5 steps and split, 300 C^3 matmul FLOPs
    per layer (1.6 TFLOP for GPT-2 124M's 12 layers: 0.4% of its model FLOPs on a 0.5M-token step, 12% on a
    16k-token one; the share grows as the batch shrinks, since Newton-Schulz runs once per step)."""
    C = config.n_embd
    shapes = ([(C, C)] * 3 if split_qkv else [(C, 3 * C)]) + [(C, C), (C, 4 * C), (4 * C, C)]
    mm = ew = 0
    for a, b in shapes:
        m, n = min(a, b), max(a, b)
        mm += ns_steps * (4 * m * m * n + 2 * m ** 3)
        ew += ns_steps * (3 * m * m + 2 * m * n) + 3 * m * n
    return dict(matmul=config.n_layer * mm, elementwise=config.n_layer * ew)


def nonmatmul_flops(config: GPTConfig, seq_len: int, *, batch_size: int = 1, train: bool = True,
                    loss: bool = True, fused_loss: bool = True, optimizer: str | None = "adamw"
                    ) -> dict[str, int]:
    """Estimated non-matmul FLOPs of one micro-step of ``batch_size`` sequences (plus, with ``optimizer``,
    one optimizer update), by category, counted the way XLA's ``HloCostAnalysis`` counts them: 1 FLOP per
    output element of an elementwise op (add, mul, div, max, select, compare, convert), n - 1 per reduction
    of n elements, 0 for data movement (gather, transpose, reshape, pad, slice), and transcendentals (exp,
    log, tanh, rsqrt) not in "flops" at all (XLA reports them separately).

    Forward, per token, counted from jaxgpt's source (C = n_embd, N heads, T tokens, L layers, Vp rows):

    * embedding: ``wte[idx] + wpe[pos]``: C (the gathers are free).
    * layernorm, 2L + 1 of them: mean (C), x - mean twice (2C: XLA does not CSE the two), square (C),
      variance sum (C), * 1/std (C), * scale (C), + bias (C), and per row 1/C, + eps: 8C + 1 each
      (7C + 1 without bias). 1/std = rsqrt is a transcendental.
    * bias adds: 3C + C + 4C + C = 9C per layer; residual adds: 2C per layer.
    * attention, per layer: scale (N T), causal mask select (N T), softmax max, subtract, sum, divide
      (4 N T): 6 N T, plus the select jax.nn applies for its mask: 7 N T in all.
    * GELU (tanh form): x^3 (2), * 0.044715, + x, * sqrt(2/pi), + 1, * 0.5, * x: 8 per element of 4C,
      32 C per layer.
    * loss (``loss=False`` for a logits-only forward): jaxgpt's fused cross-entropy (``fused_loss``,
      ``Policy.fast_kernels``) masks the padded columns, then max, subtract, sum: ~4 Vp; the plain
      ``cross_entropy`` on sliced logits: max, subtract, sum, target pick: ~3 V.

    Backward, per token, as emitted by JAX's autodiff of that code (counted from the jaxpr; the JVP adds a
    few ops per element on top of the textbook derivative): layernorm 16 C each; GELU 14 per element
    (56 C per layer); attention 11 N T per layer (softmax backward P * (dP - sum(P dP)), the mask and the
    scale); bias gradients 9 C per layer (sums over tokens); nothing in the residual category (the q/k/v
    split's gradient is a concatenate, as the model splits with ``jnp.split``);
    embedding 2.5 C per token plus the wte gradient's two paths summed (Vp C per micro-step); loss ~5.5 Vp
    + 3 C per token (exp(logits - lse), minus the one-hot, its mask, scaling dh) plus the chunked
    wte-gradient accumulation (C Vp per micro-step) when fused; ~5 V per token for the plain loss.

    Optimizer: :data:`OPTIMIZER_FLOPS_PER_PARAM` x parameters, once per step; for ``"muon"``
    :data:`MUON_ELEMENTWISE_PER_PARAM` on its matrices, AdamW's on the rest, plus :func:`newton_schulz_flops`
    (its matmuls too: optimizer work, not model FLOPs, so MFU, defined on model FLOPs, leaves them out).

    These reconcile the analytic matmul count with XLA's ``cost_analysis()`` of the program as lowered
    (before fusion) to well under 1% on small models; the compiled count is a few % higher on small models
    because XLA duplicates cheap elementwise ops into several fusions (recomputing rather than storing).
    See parity_tests/test_flops_parity.py.
    """
    T, C, N, L = seq_len, config.n_embd, config.n_head, config.n_layer
    Vp, M = config.vocab_rows, batch_size * seq_len
    b = int(config.bias)
    per_token = {
        "embedding": C,
        "layernorm": (2 * L + 1) * ((7 + b) * C + 1),
        "bias": b * 9 * C * L,
        "residual": 2 * C * L,
        "attention": 7 * N * T * L,
        "gelu": 32 * C * L,
        "loss": (4 * Vp if fused_loss else 3 * config.vocab_size) if loss else 0,
    }
    out = {k: v * M for k, v in per_token.items()}
    if train:
        bwd = {
            "embedding": int(2.5 * C * M) + Vp * C,
            "layernorm": (2 * L + 1) * 16 * C * M,
            "bias": b * 9 * C * L * M,
            "attention": 11 * N * T * L * M,
            "gelu": 56 * C * L * M,
            "loss": 0 if not loss else (int(5.5 * Vp + 3 * C) * M + C * Vp if fused_loss
                                        else 5 * config.vocab_size * M),
        }
        out = {k: out[k] + bwd.get(k, 0) for k in out}
    if optimizer == "muon":  # Muon's elementwise work and its Newton-Schulz (matmuls included: they are not the model's)
        n, n_muon = n_params(config)["total"], muon_matrix_params(config)
        ns = newton_schulz_flops(config)
        out["optimizer"] = (MUON_ELEMENTWISE_PER_PARAM * n_muon + OPTIMIZER_FLOPS_PER_PARAM["adamw"] * (n - n_muon)
                            + ns["matmul"] + ns["elementwise"])
    elif optimizer is not None:
        if optimizer not in OPTIMIZER_FLOPS_PER_PARAM:
            raise ConfigError(f"unknown optimizer {optimizer!r}; valid optimizers are "
                              f"{sorted(OPTIMIZER_FLOPS_PER_PARAM)}")
        out["optimizer"] = OPTIMIZER_FLOPS_PER_PARAM[optimizer] * n_params(config)["total"]
    return out
