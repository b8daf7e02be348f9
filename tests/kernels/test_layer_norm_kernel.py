"""jaxgpt.kernels.layer_norm's kernels.layer_norm: pallas: the LayerNorm backward kernel that also adds the residual stream's gradient and
the forward kernel that adds the branch and writes ln(x) in the GEMMs' dtype (in Pallas' interpreter) against the
fp64 truth and the fused two-pass backward, the (x, ln(x)) branch's custom VJP against autodiff of the plain
expression (its bf16 output's gradients fp32), a tiny GPT under the policy, the policy field, and the compiled tiny
H100 step holding both kernels once per block LayerNorm (ln_1's backward summing q, k and v's input gradients).

Bounds (derived, not fitted; u = 2^-24, fp32), as tests/kernels/test_layer_norm.py derives them: LayerNorm's dx lies within
gamma_{C+8} S_dx of the fp64 truth (C the width), d(scale) and d(bias) within gamma_{R+8} of their sums of absolute
terms (R rows; Higham's bound holds for a sum in any order, so also for the kernel's per-block partial sums summed
afterwards). The kernel's output dres + dx adds one rounding of at most u |dres + dx|, so it lies within
gamma_{C+9} (S_dx + |dres|) of dres + the true dx (S_dx >= |dx|). Two implementations each within that bound of the
truth lie within twice it of each other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.kernels import layer_norm as norm
from jaxgpt.config import ConfigError
from jaxgpt.precision import Policy
from tests.kernels.test_layer_norm import EPS, _check, _gamma, _inputs, _truth
from tests.tiny_training import tiny_adamw_losses

U = 2.0 ** -24


def _kernel_inputs(rows: int, dim: int, seed: int = 0):
    x, dy, scale, bias = _inputs(rows, dim, seed)
    dres = np.random.default_rng(seed + 7).standard_normal((rows, dim))
    return x, dy, dres, scale, bias


@pytest.mark.parametrize("rows, dim", [(300, 96), (40, 96), (256, 768)], ids=["ragged-rows", "small", "gpt2-width"])
def test_kernel_matches_the_truth_and_the_two_pass_backward(rows, dim):
    """The kernel (interpreted) on rows that are not a multiple of its 128-row block and widths that are not powers
    of two (masked to 128 / 1024 columns): dres + dx within the derived bound of the fp64 truth, d(scale) and d(bias)
    (the partial sums' sums: one row per 128 rows) within gamma_{R+8} of theirs, as is the fused two-pass backward."""
    x, dy, dres, scale, bias = _kernel_inputs(rows, dim)
    t = _truth(x, dy, scale, bias)
    xj, dyj, dresj, sj = (jnp.asarray(a, jnp.float32) for a in (x, dy, dres, scale))
    mean, rstd = norm._stats(xj, EPS)
    out, ds, db = norm.layer_norm_backward(xj, dyj, dresj, mean, rstd, sj, interpret=True)
    assert out.shape == (rows, dim) and out.dtype == jnp.float32
    assert ds.shape == db.shape == (-(-rows // min(norm.BLOCK_ROWS, max(8, 1 << (rows - 1).bit_length()))), dim)
    bound = _gamma(dim + 9, U) * (t["s_dx"] + np.abs(dres))
    _check("kernel dres + dx", out, dres + t["dx"], bound)
    _check("kernel dscale", ds.sum(0), t["dscale"], _gamma(rows + 8, U) * t["s_dscale"])
    _check("kernel dbias", db.sum(0), t["dbias"], _gamma(rows + 8, U) * t["s_dbias"])
    dx2, ds2, db2 = norm._backward_xla(xj, mean, rstd, sj, jnp.asarray(bias, jnp.float32), dyj)
    _check("kernel vs two-pass dx", out, np.asarray(dresj + dx2, np.float64), 2 * bound)
    _check("kernel vs two-pass dscale", ds.sum(0), np.asarray(ds2, np.float64), 2 * _gamma(rows + 8, U) * t["s_dscale"])
    _check("kernel vs two-pass dbias", db.sum(0), np.asarray(db2, np.float64), 2 * _gamma(rows + 8, U) * t["s_dbias"])


@pytest.mark.parametrize("rows, dim", [(300, 96), (256, 768)], ids=["ragged-rows", "gpt2-width"])
@pytest.mark.parametrize("with_add", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_kernel_matches_the_truth(rows, dim, with_add, dtype):
    """layer_norm_forward (interpreted) on ragged rows and a width that is not a power of two: x + add is the fp32
    sum bit for bit; mean within gamma_C of the sum of |x| / C, rstd within gamma_{C+8} r of the truth (relative; r:
    tests.kernels.test_layer_norm._truth's factor of the variance's error); y within gamma_{C+8} S_y of the fp64 truth in fp32,
    and in bf16 one more rounding: 2^-8 of |y| plus that bound."""
    x, add, _, scale, bias = _kernel_inputs(rows, dim, seed=3)
    xj, sj, bj = (jnp.asarray(a, jnp.float32) for a in (x, scale, bias))
    aj = jnp.asarray(add, jnp.float32) if with_add else None
    x_out, y, mean, rstd = norm.layer_norm_forward(xj, aj, sj, bj, eps=EPS, dtype=dtype, interpret=True)
    want_sum = np.asarray(xj) + (np.asarray(aj) if with_add else 0.0)  # numpy's fp32 add: the same rounding
    np.testing.assert_array_equal(np.asarray(x_out), want_sum)
    assert y.dtype == jnp.dtype(dtype) and mean.shape == rstd.shape == (rows, 1)
    s = np.asarray(want_sum, np.float64)
    t = _truth(s, np.zeros_like(s), scale, bias)
    m64 = s.mean(-1, keepdims=True)
    r64 = 1.0 / np.sqrt(((s - m64) ** 2).mean(-1, keepdims=True) + EPS)
    a = r64 * (np.abs(s) + np.abs(s).mean(-1, keepdims=True))
    r = 1.0 + (a * np.abs((s - m64) * r64)).mean(-1, keepdims=True)
    _check("mean", mean, m64, _gamma(dim, U) * np.abs(s).mean(-1, keepdims=True))
    _check("rstd", rstd, r64, _gamma(dim + 8, U) * r * r64)
    e32 = _gamma(dim + 8, U) * t["s_y"]
    _check("y", np.asarray(y, np.float32), t["y"], e32 if dtype == "float32" else 2.0 ** -8 * (np.abs(t["y"]) + e32) + e32)


@pytest.mark.parametrize("backward", ["xla", "interpret"])
def test_branch_adds_its_input_and_hands_the_gemms_bf16_operands_with_fp32_gradients(backward):
    """layer_norm_branch(add=a, dtype=bfloat16), as the Block's ln_2 runs it on GPUs: (x + a, ln(x + a)) with the
    kernel's ln(x + a) written in bf16 and returned as fp32, read by a GEMM (jaxgpt.ops.matmul, bf16 operands). Every
    gradient is fp32 and bit for bit the one of the unrounded ln(x + a) that the GEMM casts itself (the same bf16
    operand); a's gradient is x's; and both lie within the kernel bound of autodiff of the plain expression."""
    from jaxgpt import ops

    rows, dim, out = 72, 96, 40
    x, add, dxo, scale, bias = _kernel_inputs(rows, dim, seed=9)
    r = np.random.default_rng(10)
    w, g = (jnp.asarray(r.standard_normal(sh) / 4, jnp.float32) for sh in ((dim, out), (rows, out)))
    xj, aj, dxoj, sj, bj = (jnp.asarray(v, jnp.float32) for v in (x, add, dxo, scale, bias))

    def grads(f):
        def loss(x, a, s, b):
            xo, y = f(x, a, s, b)
            return (xo * dxoj).sum() + (ops.matmul(y, w, dtype=jnp.bfloat16) * g).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(xj, aj, sj, bj)

    def branch(dtype):
        return lambda x, a, s, b: norm.layer_norm_branch(x, s, b, eps=EPS, backward=backward, add=a, dtype=dtype)

    y16 = jax.jit(branch(jnp.bfloat16))(xj, aj, sj, bj)[1]
    assert y16.dtype == jnp.float32  # the kernel's bf16 values (the XLA path's are not rounded)
    assert np.array_equal(np.asarray(y16), np.asarray(y16.astype(jnp.bfloat16), np.float32)) == (backward != "xla")
    got, fp32 = grads(branch(jnp.bfloat16)), grads(branch(jnp.float32))
    for name, u, v in zip(("d_x", "d_add", "d_scale", "d_bias"), got, fp32):
        assert u.dtype == jnp.float32 and np.array_equal(np.asarray(u), np.asarray(v)), name
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(got[1]))
    plain = grads(lambda x, a, s, b: (x + a, _plain_ln(x + a, s, b)))
    s = np.asarray(xj + aj, np.float64)
    dy = np.asarray(jax.vjp(lambda y: ops.matmul(y, w, dtype=jnp.bfloat16), _plain_ln(xj + aj, sj, bj))[1](g)[0],
                    np.float64)
    t = _truth(s, dy, scale, bias)
    _check("d_x", got[0], np.asarray(plain[0], np.float64), 2 * _gamma(dim + 9, U) * (t["s_dx"] + np.abs(dxo)))
    _check("d_scale", got[2], np.asarray(plain[2], np.float64), 2 * _gamma(rows + 8, U) * t["s_dscale"])
    _check("d_bias", got[3], np.asarray(plain[3], np.float64), 2 * _gamma(rows + 8, U) * t["s_dbias"])


def _exact_parts(dy: np.ndarray, n: int, seed: int) -> list[np.ndarray]:
    """n parts of a dy on a 2^-10 grid (|part| < 8: 13 significant bits), so every partial sum of them is exact in
    fp32 whatever the order: a kernel that sums the parts meets the same bound as one handed their sum."""
    r = np.random.default_rng(seed)
    parts = [np.round(r.standard_normal(dy.shape) * 2**10) / 2**10 for _ in range(n - 1)]
    last = np.round(dy * 2**10) / 2**10 - sum(parts)
    assert all(np.abs(p).max() < 8 for p in (*parts, last)), "rescale the parts"
    return [*parts, last]


@pytest.mark.parametrize("backward", ["xla", "interpret"])
def test_kernel_and_branch_sum_the_gemms_input_gradients(backward):
    """layer_norm_branch(copies=3): the attention's q, k and v GEMMs each read their own copy of ln(x) and hand back
    their own input gradient; the backward (the kernel, interpreted, or the two XLA passes) sums the three. With
    parts whose sums are exact in fp32, d_x, d(scale) and d(bias) meet the one-dy bounds of the fp64 truth of their
    sum; the forward's copies are ln(x) bit for bit."""
    rows, dim = 300, 96
    x, dy, dres, scale, bias = _kernel_inputs(rows, dim, seed=11)
    parts = _exact_parts(dy, 3, seed=12)
    dy = sum(parts)  # exact: the grid's sums
    t = _truth(x, dy, scale, bias)
    xj, dresj, sj, bj = (jnp.asarray(a, jnp.float32) for a in (x, dres, scale, bias))
    pj = [jnp.asarray(p, jnp.float32) for p in parts]

    @jax.jit
    def run(x, s, b):
        outs, vjp = jax.vjp(lambda x, s, b: norm.layer_norm_branch(x, s, b, eps=EPS, backward=backward, copies=3),
                            x, s, b)
        return outs, vjp((dresj, *pj))

    (x_out, *ys), (d_x, d_s, d_b) = run(xj, sj, bj)
    np.testing.assert_array_equal(np.asarray(x_out), np.asarray(xj))
    one = jax.jit(lambda x, s, b: norm.layer_norm_branch(x, s, b, eps=EPS, backward=backward)[1])(xj, sj, bj)
    assert len(ys) == 3 and all(np.array_equal(np.asarray(y), np.asarray(one)) for y in ys)
    _check("d_x", d_x, dres + t["dx"], _gamma(dim + 9, U) * (t["s_dx"] + np.abs(dres)))
    _check("d_scale", d_s, t["dscale"], _gamma(rows + 8, U) * t["s_dscale"])
    _check("d_bias", d_b, t["dbias"], _gamma(rows + 8, U) * t["s_dbias"])
    if backward == "interpret":  # the kernel handed the parts sums them as the kernel handed their sum would
        mean, rstd = norm._stats(xj, EPS)
        got = norm.layer_norm_backward(xj, pj, dresj, mean, rstd, sj, interpret=True)
        want = norm.layer_norm_backward(xj, jnp.asarray(dy, jnp.float32), dresj, mean, rstd, sj, interpret=True)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_kernel_takes_a_bf16_dy():
    """A bf16 dy is read as bf16 and computed on in fp32: the same numbers as the fp32 dy it rounds to."""
    x, dy, dres, scale, _ = _kernel_inputs(64, 96, seed=3)
    xj, dresj, sj = (jnp.asarray(a, jnp.float32) for a in (x, dres, scale))
    dyb = jnp.asarray(dy, jnp.bfloat16)
    mean, rstd = norm._stats(xj, EPS)
    got = norm.layer_norm_backward(xj, dyb, dresj, mean, rstd, sj, interpret=True)
    want = norm.layer_norm_backward(xj, dyb.astype(jnp.float32), dresj, mean, rstd, sj, interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_kernel_and_branch_refuse_what_they_cannot_take():
    ones = jnp.ones((4, 8))
    m = jnp.zeros((4, 1))
    with pytest.raises(norm.LayerNormKernelError, match=r"one \(rows, embed\) shape.*reshape"):
        norm.layer_norm_backward(ones, ones, jnp.ones((4, 16)), m, m, jnp.ones(8), interpret=True)
    with pytest.raises(norm.LayerNormKernelError, match="float32 x and residual gradient.*float16"):
        norm.layer_norm_backward(ones, ones.astype(jnp.float16), ones, m, m, jnp.ones(8), interpret=True)
    with pytest.raises(norm.LayerNormKernelError, match=r"mean and rstd must be \(4, 1\)"):
        norm.layer_norm_backward(ones, ones, ones, jnp.zeros(4), m, jnp.ones(8), interpret=True)
    with pytest.raises(norm.LayerNormKernelError, match="backward = 'triton'"):
        norm.layer_norm_branch(ones, jnp.ones(8), None, eps=EPS, backward="triton")
    with pytest.raises(norm.LayerNormKernelError, match="float32 x.*bfloat16"):
        norm.layer_norm_branch(ones.astype(jnp.bfloat16), jnp.ones(8), None, eps=EPS)
    with pytest.raises(norm.LayerNormError, match="features"):
        norm.layer_norm_branch(ones, jnp.ones(6), None, eps=EPS)
    with pytest.raises(norm.LayerNormKernelError, match="copies = 0: the number of GEMMs"):
        norm.layer_norm_branch(ones, jnp.ones(8), None, eps=EPS, copies=0)
    with pytest.raises(norm.LayerNormKernelError, match="at least one dy"):
        norm.layer_norm_backward(ones, [], ones, m, m, jnp.ones(8), interpret=True)
    with pytest.raises(norm.LayerNormKernelError, match=r"\(4, 8\), \(4, 8\), \(4, 16\), \(4, 8\)"):
        norm.layer_norm_backward(ones, [ones, jnp.ones((4, 16))], ones, m, m, jnp.ones(8), interpret=True)
    with pytest.raises(norm.LayerNormKernelError, match=r"optional float32 add of its shape, got float32 \(4, 8\) and "
                       r"\('float32', \(4, 16\)\)"):
        norm.layer_norm_branch(ones, jnp.ones(8), None, eps=EPS, add=jnp.ones((4, 16)))
    with pytest.raises(norm.LayerNormKernelError, match=r"float32 add of x's shape, got float32 \(4, 8\) and "
                       r"\('bfloat16', \(4, 8\)\)"):
        norm.layer_norm_forward(ones, ones.astype(jnp.bfloat16), jnp.ones(8), None, eps=EPS, interpret=True)


def _plain_ln(x, scale, bias):
    mean = x.mean(axis=-1, keepdims=True)
    var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + EPS) * scale
    return y + bias if bias is not None else y


def _branch_grads(f, x, scale, bias, dxo, dy):
    @jax.jit
    def run(x, scale, bias):
        (xo, y), vjp = jax.vjp(f, x, scale, bias)
        return xo, y, *vjp((dxo, dy))
    return run(x, scale, bias)


@pytest.mark.parametrize("backward", ["xla", "interpret"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_branch_custom_vjp_against_autodiff(backward, with_bias):
    """layer_norm_branch's values and its VJP with random cotangents for both outputs against autodiff of
    ``(x, plain_ln(x))``: x passed through bit for bit, y within twice the fp32 bound, d_x = d_x_out + dx within twice
    the kernel bound, d(scale) and d(bias) within twice gamma_{R+8} of their sums of absolute terms."""
    rows, dim = 72, 96
    x, dy, dxo, scale, bias = _kernel_inputs(rows, dim, seed=5)
    bias = bias if with_bias else None
    t = _truth(x, dy, scale, bias)
    xj, dyj, dxoj, sj = (jnp.asarray(a, jnp.float32) for a in (x, dy, dxo, scale))
    bj = None if bias is None else jnp.asarray(bias, jnp.float32)
    got = _branch_grads(lambda x, s, b: norm.layer_norm_branch(x, s, b, eps=EPS, backward=backward),
                        xj, sj, bj, dxoj, dyj)
    want = _branch_grads(lambda x, s, b: (x, _plain_ln(x, s, b)), xj, sj, bj, dxoj, dyj)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(xj))
    _check("y", got[1], np.asarray(want[1], np.float64), 2 * _gamma(dim + 8, U) * t["s_y"])
    _check("d_x", got[2], np.asarray(want[2], np.float64), 2 * _gamma(dim + 9, U) * (t["s_dx"] + np.abs(dxo)))
    _check("d_scale", got[3], np.asarray(want[3], np.float64), 2 * _gamma(rows + 8, U) * t["s_dscale"])
    if with_bias:
        _check("d_bias", got[4], np.asarray(want[4], np.float64), 2 * _gamma(rows + 8, U) * t["s_dbias"])
    else:
        assert got[4] is None and want[4] is None


@pytest.mark.parametrize("backward", ["xla", "interpret"])
def test_a_branch_without_its_residual_is_the_branch_with_a_zero_residual_gradient(backward):
    """residual=False (ln_f: no block adds to it): ``(y,)`` alone, and its VJP (the backward kernel reading no
    residual gradient) bit for bit the full branch's with a zero cotangent for x; the kernel without dres as the
    kernel with a zero dres."""
    rows, dim = 72, 96
    x, dy, _, scale, bias = _kernel_inputs(rows, dim, seed=6)
    add = np.random.default_rng(9).standard_normal((rows, dim))
    xj, dyj, sj, bj, aj = (jnp.asarray(a, jnp.float32) for a in (x, dy, scale, bias, add))

    @jax.jit
    def grads(x, a, s, b):
        y_only, vjp = jax.vjp(lambda x, a, s, b: norm.layer_norm_branch(x, s, b, eps=EPS, backward=backward, add=a,
                                                                        residual=False), x, a, s, b)
        (xo, y), vjp_full = jax.vjp(lambda x, a, s, b: norm.layer_norm_branch(x, s, b, eps=EPS, backward=backward,
                                                                               add=a), x, a, s, b)
        return y_only, y, vjp((dyj,)), vjp_full((jnp.zeros_like(xo), dyj))

    y_only, y, got, want = grads(xj, aj, sj, bj)
    assert len(y_only) == 1
    np.testing.assert_array_equal(np.asarray(y_only[0]), np.asarray(y))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    mean, rstd = norm._stats(xj, EPS)
    without = norm.layer_norm_backward(xj, dyj, None, mean, rstd, sj, interpret=True)
    with_zero = norm.layer_norm_backward(xj, dyj, jnp.zeros_like(xj), mean, rstd, sj, interpret=True)
    for a, b in zip(without, with_zero, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _train(policy: Policy, backward: str, monkeypatch, steps: int = 4) -> list[float]:
    """tests.tiny_training's AdamW losses with jaxgpt.kernels.layer_norm's backward forced to ``backward``."""
    monkeypatch.setattr(norm, "_resolve", lambda b: backward)
    return tiny_adamw_losses(policy, steps)


@pytest.mark.slow  # the same checks on the GPU's three-projection attention (its real use) in
# test_tiny_gpt_with_the_gpus_three_projections_trains_to_the_plain_policys_losses, the branch against autodiff in
# test_branch_custom_vjp_against_autodiff, and pallas == fused on the CPU under bf16 in the "bf16 + mlp" case below
def test_tiny_gpt_trains_to_the_plain_policys_losses(monkeypatch):
    """A tiny GPT (2 layers, n_embd 32) under kernels.layer_norm = "pallas", bf16 compute, with the GPU's backward (the
    kernel, interpreted: LayerNorm gradients within fp32 rounding of the plain ones) takes 4 AdamW steps to the plain
    policy's losses within 1e-4 relative (fp32 rounding differences, amplified by a few bf16 GEMM roundings and
    AdamW's normalisation), and the losses fall; with the CPU's backward it trains exactly as layer_norm: fused."""
    plain = _train(Policy.bf16(), "xla", monkeypatch)
    assert plain[-1] < plain[0] - 0.05, plain
    np.testing.assert_allclose(_train(Policy.bf16(kernels={"layer_norm": "pallas"}), "interpret", monkeypatch), plain, rtol=1e-4)
    assert _train(Policy.bf16(kernels={"layer_norm": "pallas"}), "xla", monkeypatch) == _train(
        Policy.bf16(kernels={"layer_norm": "fused"}), "xla", monkeypatch)


@pytest.mark.parametrize("name, policy, bias", [
    ("bf16 + mlp: pallas-gemm", lambda ln: Policy.bf16(kernels={"layer_norm": ln, "mlp": "pallas-gemm"}), True),
    ("bf16-autocast", lambda ln: Policy.bf16_autocast(kernels={"layer_norm": ln}), True),
    ("bf16-autocast, no biases (a bf16 branch output)", lambda ln: Policy.bf16_autocast(kernels={"layer_norm": ln}), False),
    ("fp8", lambda ln: Policy.fp8_policy(kernels={"layer_norm": ln}), True)], ids=lambda v: v if isinstance(v, str) else "")
def test_pallas_trains_as_fused_under_the_other_opt_in_policies(name, policy, bias, monkeypatch):
    """On CPUs layer_norm: pallas is fused's passes: under the other policies its branch (adding the attention's
    output itself, or leaving a bf16 one to XLA's add) takes 4 AdamW steps to fused's losses bit for bit."""
    monkeypatch.setattr(norm, "_resolve", lambda b: "xla")
    assert tiny_adamw_losses(policy("pallas"), bias=bias) == tiny_adamw_losses(policy("fused"), bias=bias), name


def test_tiny_gpt_with_the_gpus_three_projections_trains_to_the_plain_policys_losses(monkeypatch):
    """The GPU's attention (q, k and v as three GEMMs, so ln_1 hands out three copies and its kernel sums their
    input gradients), run here by making CausalSelfAttention.inputs 3: under layer_norm=pallas with the kernel
    (interpreted) the tiny GPT takes 4 AdamW steps to the plain policy's losses (the same three GEMMs, autodiff's
    sum) within 1e-4 relative, as in the test above; with the CPU's backward, to layer_norm: fused's exactly."""
    from jaxgpt.model import CausalSelfAttention

    monkeypatch.setattr(CausalSelfAttention, "inputs", property(lambda self: 3))
    plain = _train(Policy.bf16(), "xla", monkeypatch)
    assert plain[-1] < plain[0] - 0.05, plain
    np.testing.assert_allclose(_train(Policy.bf16(kernels={"layer_norm": "pallas"}), "interpret", monkeypatch), plain, rtol=1e-4)
    assert _train(Policy.bf16(kernels={"layer_norm": "pallas"}), "xla", monkeypatch) == _train(
        Policy.bf16(kernels={"layer_norm": "fused"}), "xla", monkeypatch)


def test_policy_field_and_train_config():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    assert resolve_policy(TrainConfig.load(None, {}), "gpu").kernel("layer_norm") == "xla"
    cfg = TrainConfig.load(None, {"kernels.layer_norm": "pallas", "precision": "auto"})
    assert resolve_policy(cfg, "gpu") == Policy.bf16(kernels={"layer_norm": "pallas"})
    with pytest.raises(ConfigError, match="kernels.layer_norm = 'triton': valid choices are xla, fused, pallas"):
        Policy(kernels={"layer_norm": "triton"})
    with pytest.raises(ConfigError, match="kernels.layer_norm = 'fast': valid choices are xla, fused, pallas"):
        TrainConfig.load(None, {"kernels.layer_norm": "fast"})


def test_tiny_h100_step_runs_the_pallas_kernels_once_per_block_layer_norm_and_micro_step():
    """The tiny step compiled for the H100 under layer_norm=pallas: two Pallas Triton custom calls (forward and
    backward) per LayerNorm (4 per layer and ln_f's two) and micro-step, in LayerNorm's category, priced as a fusion
    at the least efficient measured fusion rate; every GEMM of a class the calibration measured; every residual add in
    the forward kernels, the last block's in ln_f's."""
    from tests.test_compile import PLUGIN_PROBLEM, TINY_BF16, _compiled

    if PLUGIN_PROBLEM is not None:
        pytest.skip(f"compile-only GPU tests need JAX's CUDA plugin: {PLUGIN_PROBLEM}")
    from jaxgpt.compile import calibrated, hlo

    cs, _ = _compiled(TINY_BF16[0], None, 1, TINY_BF16[1] + ("kernels.layer_norm=pallas",))
    assert cs.policy.kernel("layer_norm") == "pallas"
    ks, _ = hlo.kernels(cs.hlo_text())
    triton = [k for k in ks if k.opcode == "__gpu$xla.gpu.triton"]
    assert len(triton) == 4 * cs.cfg.model.n_layer + 2 and all(k.count == cs.micro_steps for k in triton), [
        (k.name, k.count) for k in triton]
    assert all(k.category == "LayerNorm" for k in triton), [(k.category, k.op_name) for k in triton]
    fwd = [k for k in triton if "layer_norm_forward_residual" in k.op_name]
    bwd = [k for k in triton if "layer_norm_backward_residual" in k.op_name]
    assert len(fwd) == len(bwd) == 2 * cs.cfg.model.n_layer + 1
    # ln_1's backward kernels read q, k and v's three input gradients (two more (rows, embed) fp32 arrays than ln_2's
    # one dy), and no XLA pass adds them first: the step's only add_any kernels are GELU's (its plain backward here);
    # ln_f's reads no residual gradient (one fp32 array fewer than ln_2's)
    rows_embed = cs.micro_batch * cs.cfg.seq_len * cs.cfg.model.n_embd * 4
    ln_f = min(k.bytes for k in bwd)
    ln_2 = ln_f + rows_embed
    assert sorted(k.bytes for k in bwd) == [ln_f] + [ln_2] * cs.cfg.model.n_layer + [ln_2 + 2 * rows_embed] * \
        cs.cfg.model.n_layer
    # ln_2's forward kernel reads the attention's output beside x and writes their sum (two more fp32 arrays than
    # ln_1's), and both write ln(x) in bf16 (half an fp32 array): no XLA pass adds, converts or takes the statistics
    ln_1 = min(k.bytes for k in fwd)
    assert sorted({k.bytes for k in fwd}) == [ln_1, ln_1 + 2 * rows_embed]
    # every ln_2, every ln_1 but the first block's and ln_f add a branch: the MLP's output is left to the next ln_1's
    # kernel (the Block's (hidden, residual) out), the last block's to ln_f's, so no XLA residual add is left: the large adds left are
    # the sums of a split-K GEMM's partials (XLA splits the tiny MLP c_proj's K of 128 in 4), which read no residual
    m = hlo.Module(cs.hlo_text())
    for k in [k for k in ks if k.op_name.endswith("jvp()/add") and k.bytes >= 3 * rows_embed]:
        comp = next(c for c, instrs in m.computations.items() if k.name in m.by_name[c])
        shapes = [m.instr_shape(comp, o)[0] for o in m.by_name[comp][k.name].operands]
        assert [len(a.dims) for a in shapes] == [3, 1], (k.name, shapes)  # the (splits, rows, embed) partials, bias
    assert sum(k.bytes > ln_1 for k in fwd) == 2 * cs.cfg.model.n_layer
    assert ln_1 == rows_embed * 3 // 2 + 2 * 4 * cs.micro_batch * cs.cfg.seq_len + 2 * 4 * cs.cfg.model.n_embd
    assert [k.name for k in ks if k.op_name.endswith("add_any") and k.category != "GELU"] == []
    cal = calibrated.for_target("h100-sxm")
    assert all(cal.rate(k)[1] for k in ks if k.gemm), sorted({k.gemm for k in ks if k.gemm and not cal.rate(k)[1]})
    rate, known = cal.rate(triton[0])
    worst = min((r for r in cal.rates.values() if r.kind == "fusion" and r.efficiency() > 0),
                key=calibrated.Rate.efficiency)
    assert not known and rate == worst
