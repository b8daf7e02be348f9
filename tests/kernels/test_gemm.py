"""jaxgpt.kernels.gemm and jaxgpt.kernels.qkv (kernels.qkv = "pallas"): the GEMM with a bias + bf16 epilogue and the GEMM summing
several lhs blocks, in Pallas' interpreter against the fp64 truth and XLA's expression; the q, k, v projections' custom
VJP against autodiff of the plain path; a tiny GPT under the policy; the policy field; the compiled tiny H100 step
holding the kernels, read as GEMMs.

Bounds (derived, not fitted; u = 2^-24): the bf16 x bf16 products are exact in fp32, so an fp32 accumulator of K of
them (plus a bias: K + 1 terms) lies within gamma_{K+1} (sum |x| |w| + |b|) of the exact value in any summation order;
rounded to bf16, two such values differ by at most one bf16 ulp of the larger plus twice that bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import ops
from jaxgpt.kernels import gemm, qkv
from jaxgpt.config import ConfigError
from jaxgpt.precision import Policy
from tests import tiny_h100
from tests.kernels.test_mlp import BF16, SMALL, _f64, _fwd_inputs
from tests.kernels.test_gelu import U, _bf16_ulp, _check, _gamma
from tests.tiny_training import tiny_adamw_losses


@pytest.mark.parametrize("m, k, n, block", [(96, 64, 256, SMALL), (100, 48, 200, SMALL), (256, 128, 256, None)],
                         ids=["tiles", "ragged", "default-blocks"])
def test_bias_cast_kernel_against_the_truth_and_xla(m, k, n, block):
    x, w, b = _fwd_inputs(m, k, n)
    y = gemm.gemm_bias_cast(x, w, b, interpret=True, block=block)
    assert (y.dtype, y.shape) == (BF16, (m, n))
    absw = np.abs(_f64(x)) @ np.abs(_f64(w)) + np.abs(_f64(b))
    y_x = (ops._dot(x, w, BF16, None) + b).astype(BF16)
    _check("kernel y vs xla", y, y_x, _bf16_ulp(y, y_x) + 2 * _gamma(k + 1) * absw + 1e-30)
    truth = _f64(x) @ _f64(w) + _f64(b)
    _check("kernel y vs truth", y, truth, _bf16_ulp(y, truth) + _gamma(k + 1) * absw + 1e-30)
    y32 = gemm.gemm_bias_cast(x, w, None, out_dtype=jnp.float32, interpret=True, block=block)  # no bias, fp32 out
    _check("fp32 y", y32, _f64(x) @ _f64(w), _gamma(k) * (absw - np.abs(_f64(b))) + 1e-30)


@pytest.mark.parametrize("k, n, block", [
    # one tile per third: the in-place read of the two-tile case below with one tile
    pytest.param(48, 96, SMALL, marks=pytest.mark.slow), (48, 96, (32, 16, 16)), (48, 90, SMALL),
    (40, 96, (32, 16, 16))],
                         ids=["one-tile-blocks", "two-tile-blocks", "ragged-block-sliced", "ragged-k-sliced"])
def test_a_column_block_is_the_kernel_on_its_slice(k, n, block):
    """column_block=(s, 3): the s-th third of w and b, read in place where a third and K are whole tiles (96 = 3 x
    32: one tile of 32 per third, or two of 16, the block's first tile at 2 s: the q, k, v case has six of 128): bit
    for bit the kernel on the slice, with or without a bias. Where they are not (90: 30 columns; K 40 in steps of 16:
    padded) the block is sliced first, so that comparison is the fallback with itself: there (and everywhere) the
    block is also checked against the fp64 truth of x @ w[:, block] + b[block], within one bf16 ulp plus
    gamma_(K+1) sum |x| |w| + |b|."""
    x, w, b = _fwd_inputs(40, k, n)
    third = n // 3
    for s in range(3):
        cols = slice(s * third, (s + 1) * third)
        for bias, bias_slice in ((b, b[cols]), (None, None)):
            got = gemm.gemm_bias_cast(x, w, bias, interpret=True, block=block, column_block=(s, 3))
            want = gemm.gemm_bias_cast(x, w[:, cols], bias_slice, interpret=True, block=block)
            assert got.shape == (40, third)
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
            bias64 = 0.0 if bias is None else _f64(bias_slice)
            truth = _f64(x) @ _f64(w[:, cols]) + bias64
            absw = np.abs(_f64(x)) @ np.abs(_f64(w[:, cols])) + np.abs(bias64)
            _check(f"block {s} vs truth", got, truth, _bf16_ulp(got, truth) + _gamma(k + 1) * absw + 1e-30)
    with pytest.raises(gemm.GemmKernelError, match=r"column_block \(3, 3\).*0 <= s < count"):
        gemm.gemm_bias_cast(x, w, b, interpret=True, column_block=(3, 3))
    with pytest.raises(gemm.GemmKernelError, match="count dividing the columns"):
        gemm.gemm_bias_cast(x, w, b, interpret=True, column_block=(0, 7))


def test_sum_kernel_against_the_truth():
    """gemm_sum_nt: the sum of three lhs blocks' products with b's column blocks, one fp32 accumulation over their
    widths, within gamma_K sum |a| |b| of the fp64 concat(a) @ b^T (K = 96: 32 per block); the column sums of
    concat(a), per block of rows, within gamma_rows sum |a| of the truth (rows 50: a ragged, zero-padded tile)."""
    r = np.random.default_rng(4)
    a = [jnp.asarray(r.standard_normal((50, 32)), jnp.float32).astype(BF16) for _ in range(3)]
    b = jnp.asarray(r.standard_normal((48, 96)) / 10, jnp.float32).astype(BF16)
    got, sums = gemm.gemm_sum_nt(a, b, interpret=True, block=(32, 16, 16))
    cat = np.concatenate([_f64(x) for x in a], axis=1)
    assert (got.dtype, got.shape, sums.dtype, sums.shape) == (jnp.float32, (50, 48), jnp.float32, (2, 96))
    _check("sum of products", got, cat @ _f64(b).T, _gamma(96) * np.abs(cat) @ np.abs(_f64(b)).T + 1e-30)
    _check("column sums", sums.sum(0), cat.sum(0), _gamma(50) * np.abs(cat).sum(0) + 1e-30)
    _check("first row block", sums[0], cat[:32].sum(0), _gamma(32) * np.abs(cat[:32]).sum(0) + 1e-30)


def test_kernels_and_projections_refuse_what_they_cannot_take():
    x, w, b = _fwd_inputs(8, 16, 32)
    with pytest.raises(gemm.GemmKernelError, match=r"x must be 2-D, \(rows, d_in\).*reshape"):
        gemm.gemm_bias_cast(x[None], w, b, interpret=True)
    with pytest.raises(gemm.GemmKernelError, match="w must be bfloat16, got float32.*kernels.qkv: xla"):
        gemm.gemm_bias_cast(x, w.astype(jnp.float32), b, interpret=True)
    with pytest.raises(gemm.GemmKernelError, match=r"do not chain.*\(d_out,\)"):
        gemm.gemm_bias_cast(x, w, b[:8], interpret=True)
    with pytest.raises(gemm.GemmKernelError, match="split b's 40 columns"):
        gemm.gemm_sum_nt([x, x, x], jnp.ones((32, 40), BF16), interpret=True)
    with pytest.raises(gemm.GemmKernelError, match="multiples of 16"):
        gemm.gemm_sum_nt([x[:, :8], x[:, :8]], jnp.ones((32, 16), BF16), interpret=True)
    with pytest.raises(gemm.GemmKernelError, match="impl = 'cuda'"):
        qkv.projections(x, w, b, 2, dtype=BF16, impl="cuda")
    with pytest.raises(gemm.GemmKernelError, match="32 output columns do not split into 3 equal blocks.*pass n"):
        qkv.projections(x, w, b, 3, dtype=BF16)
    with pytest.raises(gemm.GemmKernelError, match="no lhs blocks"):
        gemm.gemm_sum_nt([], w.T, interpret=True)


def _grads(f, x, w, b, dy):
    @jax.jit
    def run(x, w, b, dy):
        def loss(x, w, b):
            ys = f(x, w, b)
            return sum(jnp.sum(y.astype(jnp.float32) * d) for y, d in zip(ys, dy)), ys
        (_, ys), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, b)
        return ys, *grads
    return run(x, w, b, dy)


@pytest.mark.parametrize("with_bias, batch", [(True, 2), (False, 2), (True, 7)],
                         ids=["bias", "no-bias", "bias-168-rows"])
def test_projections_vjp_against_autodiff_of_the_plain_path(with_bias, batch):
    """qkv.projections against autodiff of the plain path as attention sees it (three column blocks of x @ w + b,
    each rounded to bf16), (batch, 24, 32) -> 3 x 32 (168 rows: two of the kernel's 128-row tiles, so the bias
    gradient sums two rows of partial sums): with XLA's expressions the values and dW bit for bit, dx (the
    blocks' input gradients, summed) within the fp32 adds' rounding and d(bias) within a sum-order bound; with the
    kernels (interpreted) the values within one bf16 ulp plus the GEMM bound, dx within the one-GEMM sum's bound of
    the fp64 truth, dW as XLA's, d(bias) (the kernel's column sums) within the sum-order bound."""
    r = np.random.default_rng(3)
    x = jnp.asarray(r.standard_normal((batch, 24, 32)), jnp.float32)
    w = jnp.asarray(0.3 * r.standard_normal((32, 96)), jnp.float32)
    b = jnp.asarray(0.5 * r.standard_normal(96), jnp.float32) if with_bias else None
    dy = [jnp.asarray(r.standard_normal((batch, 24, 32)), jnp.float32).astype(BF16) for _ in range(3)]

    def plain(x, w, b):
        ws, bs = jnp.split(w, 3, axis=-1), (jnp.split(b, 3) if b is not None else [None] * 3)
        return tuple((ops.matmul(x, wi, dtype=BF16) + (0 if bi is None else bi)).astype(BF16)
                     for wi, bi in zip(ws, bs))

    ys_p, dx_p, dw_p, db_p = _grads(plain, x, w, b, dy)
    ys_x, dx_x, dw_x, db_x = _grads(lambda x, w, b: qkv.projections(x, w, b, 3, dtype=BF16, impl="xla"), x, w, b, dy)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(ys_x[i], np.float32), np.asarray(ys_p[i], np.float32))
    np.testing.assert_array_equal(np.asarray(dw_x), np.asarray(dw_p))
    g = np.concatenate([_f64(d).reshape(-1, 32) for d in dy], axis=1)  # (rows, 96): the bf16 cotangents
    rows = g.shape[0]
    wb = _f64(w.astype(BF16))
    dx_truth, dx_abs = g @ wb.T, np.abs(g) @ np.abs(wb).T
    _check("xla dx", np.asarray(dx_x).reshape(-1, 32), np.asarray(dx_p).reshape(-1, 32), 4 * U * dx_abs + 1e-30)
    if with_bias:
        _check("xla d(bias)", db_x, db_p, 2 * _gamma(rows) * np.abs(g).sum(0) + 1e-30)
    else:
        assert db_x is None and db_p is None
    ys_k, dx_k, dw_k, db_k = _grads(lambda x, w, b: qkv.projections(x, w, b, 3, dtype=BF16, impl="interpret"),
                                    x, w, b, dy)
    absw = np.abs(_f64(x.astype(BF16))).reshape(-1, 32) @ np.abs(wb) + (0.0 if b is None else np.abs(_f64(b)))
    y_k = np.concatenate([np.asarray(y, np.float32).reshape(-1, 32) for y in ys_k], axis=1)
    y_p = np.concatenate([np.asarray(y, np.float32).reshape(-1, 32) for y in ys_p], axis=1)
    _check("kernel y", y_k, y_p, _bf16_ulp(y_k, y_p) + 2 * _gamma(33) * absw + 1e-30)
    _check("kernel dx", np.asarray(dx_k).reshape(-1, 32), dx_truth, _gamma(96) * dx_abs + 1e-30)
    np.testing.assert_array_equal(np.asarray(dw_k), np.asarray(dw_p))
    if with_bias:
        _check("kernel d(bias)", db_k, db_p, 2 * _gamma(rows) * np.abs(g).sum(0) + 1e-30)


def test_tiny_gpt_trains_to_the_plain_policys_losses(monkeypatch):
    """A tiny GPT under kernels.qkv = "pallas", bf16, with the GPU's path forced here (jaxgpt.kernels.qkv.projections:
    q, k and v in bf16 before attention, whose CPU backward then rounds dq, dk, dv to bf16 as cuDNN's does on GPUs):
    with the op's XLA expression (impl "xla") and with its kernels (interpreted), 3 AdamW losses within 1e-4 relative
    of the plain policy's, the kernels' within 1e-4 of the XLA expression's. (On the CPU itself the op runs the
    reference path: the registry's platforms, checked in test_policy_field_and_train_config.)"""
    plain = tiny_adamw_losses(Policy.bf16(), 3)
    assert plain[-1] < plain[0] - 0.05, plain
    monkeypatch.setattr(qkv, "applies", lambda dtype: True)
    projections = qkv.projections
    monkeypatch.setattr(qkv, "projections", functools.partial(projections, impl="xla"))
    xla = tiny_adamw_losses(Policy.bf16(kernels={"qkv": "pallas"}), 3)
    monkeypatch.setattr(qkv, "projections", functools.partial(projections, impl="interpret"))
    kernels = tiny_adamw_losses(Policy.bf16(kernels={"qkv": "pallas"}), 3)
    np.testing.assert_allclose(xla, plain, rtol=1e-4)
    np.testing.assert_allclose(kernels, xla, rtol=1e-4)


def test_policy_field_and_train_config():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    assert resolve_policy(TrainConfig.load(None, {}), "gpu").kernel("qkv") == "xla"  # the default is unchanged
    cfg = TrainConfig.load(None, {"kernels.qkv": "pallas", "precision": "auto"})
    assert resolve_policy(cfg, "gpu") == Policy.bf16(kernels={"qkv": "pallas"})
    from jaxgpt.kernels import registry

    assert registry.implementations("qkv", "cpu") == ["xla"] and registry.implementations("qkv", "gpu", "bfloat16") \
        == ["xla", "pallas"]  # on the CPU kernels.qkv = "pallas" runs the reference path
    with pytest.raises(ConfigError, match="kernels.qkv = 'triton': valid choices are xla, pallas"):
        Policy(kernels={"qkv": "triton"})
    with pytest.raises(ConfigError, match="kernels.qkv = 'fast': valid choices are xla, pallas"):
        TrainConfig.load(None, {"kernels.qkv": "fast"})
    for kw, why in (({"gemm_output": "bfloat16"}, "gemm_output float32"), ({"fp8": "all"}, "no fp8 attn GEMMs"),
                    ({"kernels": {"attention": "einsum", "qkv": "pallas"}}, "attention not einsum")):
        with pytest.raises(ConfigError, match=f"kernels.qkv = 'pallas' needs {why}.*; valid choices with this precision are xla$"):
            Policy(compute_dtype="bfloat16", **{"kernels": {"qkv": "pallas"}, **kw})
    assert Policy.fp8_policy("mlp+lm_head", kernels={"qkv": "pallas"}).kernel("qkv") == "pallas"  # the attention's GEMMs stay bf16 there


def test_tiny_h100_step_reads_the_kernels_as_gemms_and_drops_attentions_converts():
    """The tiny step compiled for the H100 under kernels.qkv=pallas: per layer three Pallas GEMMs forward (q, k, v: bias and
    bf16 in the epilogue, each reading its column block of W_attn in place) and one backward (the input gradient of all three), each read as a GEMM at the least
    efficient measured GEMM rate, with the plain program's GEMM FLOPs in all; the convert passes in attention's scope
    are gone, and the step moves fewer bytes."""
    cs, ks, kp = tiny_h100.kernels_beside_plain(("kernels.qkv=pallas",))
    pallas = [k for k in ks if k.gemm.startswith("pallas")]
    layers = cs.cfg.model.n_layer
    assert sorted(k.gemm for k in pallas) == ["pallas bf16->bf16 NN"] * 3 * layers + ["pallas bf16->f32 NT"] * layers
    assert sorted(k.category for k in pallas) == ["matmuls bwd"] * layers + ["matmuls fwd"] * 3 * layers
    # equal but for the elementwise ops XLA fuses into its GEMMs
    assert tiny_h100.gemm_flops(ks) == pytest.approx(tiny_h100.gemm_flops(kp), rel=1e-4)
    assert [k for k in kp if k.category == "attention: casts, layout"]
    assert not [k for k in ks if k.category == "attention: casts, layout"]
    # the forward kernels read q's, k's and v's columns of W_attn and b_attn in place: nothing splits them first,
    # and the reader counts the block's bytes as the GEMM's (bf16 x (M, C), its (C, C) block of W, y (M, C)), not
    # all of W's: 2 (M C + C C + M C) bytes for 2 M C C FLOPs
    assert not [k for k in ks if k.op_name.endswith("/split")], [k.name for k in ks if k.op_name.endswith("/split")]
    c = cs.cfg.model.n_embd
    fwd = [k for k in pallas if k.category == "matmuls fwd"]
    assert all(k.bytes == pytest.approx(2 * k.flops / c + 2 * c * c) for k in fwd), [(k.bytes, k.flops) for k in fwd]
    # ... each taking the whole (C, 3 C) bf16 weight and (1, 3 C) bias as its operands (no slice made before it)
    from jaxgpt.compile import hlo

    m = hlo.Module(cs.hlo_text())
    calls = [(comp, i) for comp, instrs in m.computations.items() for i in instrs
             if hlo.pallas_name(i).startswith("gemm_nn_colblock_")]
    assert len(calls) == 3 * layers
    for comp, i in calls:
        w_op, b_op = (m.instr_shape(comp, o)[0] for o in i.operands[1:3])
        assert (w_op.dtype, w_op.dims, b_op.dims) == ("bf16", (c, 3 * c), (1, 3 * c)), (w_op, b_op)
    assert sum(k.bytes * k.count for k in ks) < sum(k.bytes * k.count for k in kp)
    cal, worst = tiny_h100.slowest("gemm")
    assert all(cal.rate(k) == (worst, False) for k in pallas)
