"""jaxgpt.kernels.mlp (kernels.mlp = "pallas-gemm"): the two Pallas GEMMs with GELU epilogues in Pallas' interpreter
against the fp64 truth and XLA's expression, the MLP's custom VJP against autodiff of the plain MLP, a tiny GPT under
the policy, the policy field, and the compiled tiny H100 step holding the kernels, read as GEMMs.

Bounds (derived, not fitted; u = 2^-24, gamma_n = n u / (1 - n u)). The bf16 x bf16 products are exact in fp32, so a
K-term fp32 sum in any order lies within gamma_K sum |x| |w| of the exact one; the GEMM's accumulator is the same
value as XLA's but for that order. The forward's h adds the bias (one more rounding: gamma_{K+1} against sum |x| |w|
+ |b|). gelu(h) in fp32 is within 16 u |h| (1 + |a|) of its exact value at that h (a = K (h + C3 h^3); the tanh form's
roundings, each against the magnitude it rounds) and moves by at most 1.13 |dh| (GELU's slope is below 1.13), and
bf16 rounds it once more: one bf16 ulp of the larger of two such values. The backward's dh = dg * gelu'(h) takes
tests/kernels/test_gelu.py's fp32 bound 16 u S (with the GEMM's dg for g) plus |gelu'(h)| times dg's sum-order bound,
and one bf16 ulp; the bias gradient sums R rows as there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import ops
from jaxgpt.kernels import gelu, mlp as gelu_gemm, gemm
from jaxgpt.config import ConfigError
from jaxgpt.precision import Policy
from tests import tiny_h100
from tests.kernels.test_gelu import U, _bf16_ulp, _check, _gamma, _truth
from tests.tiny_training import tiny_adamw_losses

BF16 = jnp.bfloat16
SMALL = (32, 64, 16)  # (bm, bn, bk): several tiles and K steps at the tests' sizes


def _bf16(a) -> jax.Array:
    return jnp.asarray(a, jnp.float32).astype(BF16)


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _fwd_inputs(m: int, k: int, n: int, seed: int = 0):
    r = np.random.default_rng(seed)
    return (_bf16(r.standard_normal((m, k))), _bf16(3.0 / np.sqrt(k) * r.standard_normal((k, n))),
            jnp.asarray(0.5 * r.standard_normal(n), jnp.float32))


def _gelu_err(h: np.ndarray) -> np.ndarray:
    a = gelu.K * (h + gelu.C3 * h ** 3)
    return 16 * U * np.abs(h) * (1 + np.abs(a))


@pytest.mark.parametrize("m, k, n, block", [(96, 64, 256, SMALL), (100, 48, 200, SMALL), (256, 128, 256, None)],
                         ids=["tiles", "ragged", "default-blocks"])
def test_forward_kernel_against_the_truth_and_xla(m, k, n, block):
    """h within its fp32 bound of the fp64 truth (as XLA's is); the bf16 gelu(h) within one bf16 ulp plus the
    derived bound of XLA's; rows, columns and K that are not multiples of the blocks (zero-padded) included."""
    x, w, b = _fwd_inputs(m, k, n)
    h, y = gelu_gemm.fc_gemm_gelu(x, w, b, interpret=True, block=block)
    assert (h.dtype, y.dtype, h.shape, y.shape) == (jnp.float32, BF16, (m, n), (m, n))
    absw = np.abs(_f64(x)) @ np.abs(_f64(w)) + np.abs(_f64(b))
    truth = _f64(x) @ _f64(w) + _f64(b)
    h_x = ops._dot(x, w, BF16, None) + b
    y_x = jax.nn.gelu(h_x, approximate=True).astype(BF16)
    _check("kernel h", h, truth, _gamma(k + 1) * absw + 1e-30)
    _check("xla h", h_x, truth, _gamma(k + 1) * absw + 1e-30)
    hb = np.abs(truth) + _gamma(k + 1) * absw
    bound = 1.13 * 2 * _gamma(k + 1) * absw + 2 * _gelu_err(hb)
    _check("kernel y", y, y_x, _bf16_ulp(y, y_x) + bound + 1e-30)
    h0, _ = gelu_gemm.fc_gemm_gelu(x, w, None, interpret=True, block=block)  # no bias: a zero one
    _check("no-bias h", h0, _f64(x) @ _f64(w), _gamma(k) * absw + 1e-30)


@pytest.mark.parametrize("m, k, n, block", [(96, 64, 256, SMALL), (100, 48, 200, SMALL), (256, 128, 256, None)],
                         ids=["tiles", "ragged", "default-blocks"])
def test_backward_kernel_against_the_truth_and_xla(m, k, n, block):
    """dh = (g @ w^T) gelu'(h), bf16, within one bf16 ulp plus the derived bound of the XLA path's (c_proj's dx GEMM,
    then jaxgpt.kernels.gelu's expression); the bias gradient (the partial sums' sum) within the fp32 bound of the truth."""
    r = np.random.default_rng(1)
    g, w = _bf16(r.standard_normal((m, k))), _bf16(r.standard_normal((n, k)) / np.sqrt(k))
    h = jnp.asarray(3.0 * r.standard_normal((m, n)), jnp.float32)
    dh, sums = gelu_gemm.proj_gemm_gelu_backward(g, w, h, interpret=True, block=block)
    bm = gemm.blocks(m, n, k, block)[0]
    assert (dh.dtype, sums.dtype, dh.shape, sums.shape) == (BF16, jnp.float32, (m, n), (-(-m // bm), n))
    dg_truth = _f64(g) @ _f64(w).T
    dg_bound = _gamma(k) * (np.abs(_f64(g)) @ np.abs(_f64(w)).T)
    dh_truth, s = _truth(dg_truth, _f64(h))
    slope = np.abs(gelu.gelu_grad(np.asarray(h, np.float64)))
    fp32_bound = 16 * U * (s + np.abs(dg_bound) * (s / np.maximum(np.abs(dg_truth), 1e-30))) + slope * dg_bound
    dh_x, sums_x = gelu.gelu_backward_xla(ops._dot(g, ops.transpose_operand(w), BF16, None), h)
    _check("bf16 dh", dh, dh_x, _bf16_ulp(dh, dh_x) + 2 * fp32_bound + 1e-30)
    bound = fp32_bound.sum(0) + _gamma(m) * np.abs(dh_truth).sum(0)
    _check("kernel d(bias)", sums.sum(0), dh_truth.sum(0), bound + _gamma(sums.shape[0]) * np.abs(dh_truth).sum(0))
    _check("xla d(bias)", sums_x.sum(0), dh_truth.sum(0), bound)


def test_kernels_refuse_what_they_cannot_take():
    x, w, b = _fwd_inputs(8, 16, 32)
    with pytest.raises(gelu_gemm.GemmKernelError, match=r"x must be 2-D, \(rows, d_in\).*reshape"):
        gelu_gemm.fc_gemm_gelu(x[None], w, b, interpret=True)
    with pytest.raises(gelu_gemm.GemmKernelError, match="x must be bfloat16, got float32.*kernels.mlp: xla"):
        gelu_gemm.fc_gemm_gelu(x.astype(jnp.float32), w, b, interpret=True)
    with pytest.raises(gelu_gemm.GemmKernelError, match=r"do not chain.*\(d_in, d_ff\)"):
        gelu_gemm.fc_gemm_gelu(x, w.T, b, interpret=True)
    with pytest.raises(gelu_gemm.GemmKernelError, match="h must be float32, got float16"):  # bf16 h: pallas-gemm-bf16h
        gelu_gemm.proj_gemm_gelu_backward(x, w.T, jnp.ones((8, 32), jnp.float16), interpret=True)
    with pytest.raises(gelu_gemm.GemmKernelError, match="h_dtype must be float32 or bfloat16, got float16"):
        gelu_gemm.fc_gemm_gelu(x, w, b, interpret=True, h_dtype=jnp.float16)
    with pytest.raises(gelu_gemm.GemmKernelError, match="recompute keeps none.*h_dtype bfloat16"):
        gelu_gemm.mlp(x, w, b, w.T, recompute=True, h_dtype=BF16)
    with pytest.raises(gelu_gemm.GemmKernelError, match=r"do not chain.*\(rows, d_ff\)"):
        gelu_gemm.proj_gemm_gelu_backward(x, w.T, jnp.ones((8, 16)), interpret=True)
    with pytest.raises(gelu_gemm.GemmKernelError, match="impl = 'triton'"):
        gelu_gemm.mlp(x, w, b, w.T, impl="triton")
    with pytest.raises(gelu_gemm.GemmKernelError, match="out_dtype bfloat16.*kernels.mlp: xla"):
        gelu_gemm.mlp(x, w, b, w.T, out_dtype=BF16)


def _plain_mlp(x, w_fc, b_fc, w_proj, dtype):
    """The plain MLP path of jaxgpt.model without c_proj's bias: Linear, jax.nn.gelu in fp32, Linear."""
    h = ops.matmul(x, w_fc, dtype=dtype)
    return ops.matmul(jax.nn.gelu(h + b_fc if b_fc is not None else h, approximate=True), w_proj, dtype=dtype)


def _grads(f, *args):
    dy = args[-1]

    @jax.jit
    def run(*a):
        def loss(x, w_fc, b_fc, w_proj):
            y = f(x, w_fc, b_fc, w_proj)
            return jnp.sum(y * dy), y
        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*a)
        return y, *grads
    return run(*args[:-1])


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mlp_vjp_against_autodiff_of_the_plain_mlp(dtype, with_bias):
    """gelu_gemm.mlp's value and gradients against autodiff of the plain path, (2, 24, 32) -> 128 -> 32: with XLA's
    path (the CPU's) the value, dx, dW_fc and dW_proj bit for bit and d(b_fc) within a sum-order bound; with the
    kernels (interpreted; bf16) every gradient within the bound one bf16 ulp of dh (or of gelu(h)) carries through
    the GEMMs, plus twice their fp32 accumulation bound."""
    r = np.random.default_rng(2)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(r.standard_normal((2, 24, 32)), jnp.float32)
    w_fc = jnp.asarray(0.3 * r.standard_normal((32, 128)), jnp.float32)
    b_fc = jnp.asarray(0.5 * r.standard_normal(128), jnp.float32) if with_bias else None
    w_proj = jnp.asarray(0.1 * r.standard_normal((128, 32)), jnp.float32)
    dy = jnp.asarray(r.standard_normal((2, 24, 32)), jnp.float32)
    args = (x, w_fc, b_fc, w_proj, dy)
    y_p, dx_p, dwf_p, db_p, dwp_p = _grads(lambda *a: _plain_mlp(*a, dt), *args)
    y_x, dx_x, dwf_x, db_x, dwp_x = _grads(lambda *a: gelu_gemm.mlp(*a, dtype=dt, impl="xla"), *args)
    for name, got, want in (("y", y_x, y_p), ("dx", dx_x, dx_p), ("dW_fc", dwf_x, dwf_p), ("dW_proj", dwp_x, dwp_p)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    h = _f64(ops.matmul(x, w_fc, dtype=dt)).reshape(-1, 128) + (0.0 if b_fc is None else _f64(b_fc))
    g = _f64(jnp.asarray(dy).reshape(-1, 32).astype(dt)) @ _f64(w_proj.astype(dt)).T
    dh, s = _truth(g, h)
    rows = dh.shape[0]
    if with_bias:
        _check("xla d(bias)", db_x, db_p, 2 * _gamma(rows) * np.abs(dh).sum(0) + 32 * U * s.sum(0) + 1e-30)
    else:
        assert db_x is None and db_p is None
    if dt != jnp.bfloat16:
        return  # the kernels take bf16 operands only (the policy's fp32 compute runs XLA's path on GPUs too)
    y_k, dx_k, dwf_k, db_k, dwp_k = _grads(lambda *a: gelu_gemm.mlp(*a, dtype=dt, impl="interpret"), *args)
    xc, wf, wp = (np.abs(_f64(a.astype(dt))) for a in (x.reshape(-1, 32), w_fc, w_proj))
    gc = np.abs(_f64(dy.reshape(-1, 32).astype(dt)))
    act = np.abs(_f64(jax.nn.gelu(jnp.asarray(h, jnp.float32), approximate=True)))
    # the two h differ by the GEMM's sum order: dh_ <= 2 gamma_33 (sum |x| |w| + |b|); each gelu(h) carries its own
    # fp32 evaluation error; then one bf16 rounding each (two ulps cover either side of a rounding boundary)
    d_h = 2 * _gamma(33) * (xc @ wf + (0.0 if b_fc is None else np.abs(_f64(b_fc))))
    ulp_y = _bf16_ulp(act, act) * 2 + 1.13 * d_h + 2 * _gelu_err(np.abs(h) + d_h)
    _check("kernel y", np.asarray(y_k).reshape(-1, 32), np.asarray(y_p).reshape(-1, 32),
           ulp_y @ wp + 2 * _gamma(128) * act @ wp + 1e-30)
    _check("kernel dW_proj", dwp_k, dwp_p, ulp_y.T @ gc + 2 * _gamma(rows) * act.T @ gc + 1e-30)
    # dh = g gelu'(h): g's sum order (slope below 1.13), h's (|gelu''| <= K = 0.798, its value at 0), both fp32
    # evaluations (16 u S each), one bf16 rounding each
    ulp = _bf16_ulp(dh, dh) * 2 + 2 * _gamma(32) * (gc @ wp.T) * 1.13 + np.abs(g) * 0.8 * d_h + 32 * U * s
    _check("kernel dx", np.asarray(dx_k).reshape(-1, 32), np.asarray(dx_p).reshape(-1, 32),
           ulp @ wf.T + 2 * _gamma(128) * np.abs(dh) @ wf.T + 1e-30)
    _check("kernel dW_fc", dwf_k, dwf_p, xc.T @ ulp + 2 * _gamma(rows) * xc.T @ np.abs(dh) + 1e-30)
    if with_bias:
        _check("kernel d(bias)", db_k, db_p, 2 * _gamma(rows) * np.abs(dh).sum(0) + ulp.sum(0) + 1e-30)


@pytest.mark.slow  # the op is held to the plain MLP by test_mlp_vjp_against_autodiff_of_the_plain_mlp (XLA's path and
# the kernels), and a tiny GPT trains through the same kernels (interpreted) to XLA's path's losses in
# test_bf16h_policy_and_its_h100_step_reads_and_writes_half_of_h
def test_tiny_gpt_trains_to_the_plain_policys_losses(monkeypatch):
    """A tiny GPT (2 layers, n_embd 32) under Policy(kernels={"mlp": 'pallas-gemm'}), bf16: with the CPU's own path (XLA) its 3
    AdamW losses are the plain policy's bit for bit; with the GPU's kernels (interpreted) within 1e-4 relative."""
    plain = tiny_adamw_losses(Policy.bf16(), 3)
    assert plain[-1] < plain[0] - 0.05, plain
    assert tiny_adamw_losses(Policy.bf16(kernels={"mlp": "pallas-gemm"}), 3) == plain
    monkeypatch.setattr(gelu_gemm, "_resolve", lambda impl, dtype: "interpret")
    np.testing.assert_allclose(tiny_adamw_losses(Policy.bf16(kernels={"mlp": "pallas-gemm"}), 3), plain, rtol=1e-4)


def test_policy_field_and_train_config():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    cfg = TrainConfig.load(None, {"kernels.mlp": "pallas-gemm", "precision": "auto"})
    assert resolve_policy(cfg, "gpu") == Policy.bf16(kernels={"mlp": "pallas-gemm"})
    assert resolve_policy(cfg, "cpu").kernel("mlp") == "pallas-gemm"  # fp32 or bf16 compute: XLA's path there
    assert resolve_policy(TrainConfig.load(None, {"kernels": "pallas"}), "gpu").kernel("mlp") == "pallas-gemm"
    with pytest.raises(ConfigError, match="kernels.mlp = 'gemm': valid choices are xla, pallas-gemm, pallas-recompute"):
        Policy(kernels={"mlp": "gemm"})
    with pytest.raises(ConfigError, match="gelu: replaced by kernels.*--kernels.mlp=NAME"):
        TrainConfig.load(None, {"gelu": "pallas-gemm"})  # the old flag: refused, naming the new one
    for kw, why in (({"gemm_output": "bfloat16"}, "gemm_output float32"), ({"fp8": "mlp"}, "no fp8 mlp GEMMs"),
                    ({"fast_kernels": False}, "fast_kernels")):
        with pytest.raises(ConfigError, match=f"kernels.mlp = 'pallas-gemm' needs {why}.*; valid choices with this precision are xla$"):
            Policy(compute_dtype="bfloat16", **kw, kernels={"mlp": "pallas-gemm"})
        # the preset takes the reference where the numerics rule its kernels out
        assert Policy(compute_dtype="bfloat16", **kw, kernels="pallas").kernel("mlp") == "xla"


def test_tiny_h100_step_reads_the_kernels_as_gemms_at_the_slowest_measured_rate():
    """The tiny step compiled for the H100 under kernels.mlp=pallas-gemm: two Pallas GEMMs per layer (c_fc + bias + GELU in
    the forward, c_proj's input gradient times gelu'(h) in the backward), each read as a GEMM with the FLOPs of the
    plain program's GEMM it replaces (the step's GEMM FLOPs are the plain step's) plus its epilogue's extra bytes;
    the GEMM part is priced at the least efficient measured GEMM rate, the epilogue at the least efficient fusion
    rate; no XLA fusion is left in gelu's scope but the reduction of the bias gradient's partial sums."""
    cs, ks, kp = tiny_h100.kernels_beside_plain(("kernels.mlp=pallas-gemm",))
    pallas = [k for k in ks if k.gemm.startswith("pallas")]
    epilogues = [k for k in ks if k.name.endswith(" epilogue")]
    layers = cs.cfg.model.n_layer
    assert sorted(k.gemm for k in pallas) == ["pallas bf16->bf16 NT"] * layers + ["pallas bf16->f32 NN"] * layers
    assert len(epilogues) == 2 * layers and all(k.category == "GELU" and k.bytes > 0 for k in epilogues)
    assert {k.category for k in pallas} == {"matmuls fwd", "matmuls bwd"}
    # equal but for the elementwise ops XLA fuses into its GEMMs (the plain program's bias add: rows x 128 per layer)
    assert tiny_h100.gemm_flops(ks) == pytest.approx(tiny_h100.gemm_flops(kp), rel=1e-4)
    others = [k for k in ks if k.category == "GELU" and k not in epilogues]
    assert all(k.opcode == "kInput" and "transpose(" in k.op_name for k in others), others
    (cal, gemm_rate), (_, fusion_rate) = tiny_h100.slowest("gemm"), tiny_h100.slowest("fusion")
    assert all(cal.rate(k) == (gemm_rate, False) for k in pallas)
    assert all(cal.rate(k) == (fusion_rate, False) for k in epilogues)
    assert all(cal.rate(k)[1] for k in ks if k.gemm and k not in pallas)  # XLA's GEMMs: measured classes
    # a trace times each kernel whole: a calibration fitted on one takes GEMM and epilogue as one class of its own,
    # by the kernel's name (tests/test_calibration_devices.py fits one)
    from jaxgpt.compile import calibrated

    assert {calibrated.kernel_class(k) for k in pallas + epilogues} == {
        ("pallas-gemm", "gemm_nn_bias_gelu"), ("pallas-gemm", "gemm_nt_gelu_backward")}


# ---- kernels.mlp: pallas-recompute: the backward computes h again instead of the forward keeping it ----------------------
def mlp_inputs(seed: int, rows: int = 168, d: int = 48, f: int = 96):
    """fp32 (x, w_fc, b_fc, w_proj, b_proj, output cotangent) of an MLP on 168 rows (two 128-row tiles, one ragged)."""
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((rows, d)), jnp.float32)
    wf, wp = (jnp.asarray(r.standard_normal(sh) / 8, jnp.float32) for sh in ((d, f), (f, d)))
    bf, bp = (jnp.asarray(r.standard_normal(n) / 8, jnp.float32) for n in (f, d))
    return x, wf, bf, wp, bp, jnp.asarray(r.standard_normal((rows, d)), jnp.float32)


@pytest.mark.parametrize("m, k, n, block", [(100, 48, 200, SMALL), (256, 128, 256, None)], ids=["padded", "tiles"])
def test_recomputing_backward_kernel_is_the_kernel_handed_h(m, k, n, block):
    """proj_gemm_gelu_backward(fc=(x, w_fc, b_fc)) (interpreted) against the same kernel handed the forward kernel's h:
    dh and its column sums bit for bit (h is computed again with the forward's tiles and K steps); the forward kernel
    without h writes the same gelu(h)."""
    x, w_fc, b = _fwd_inputs(m, k, n, seed=5)
    r = np.random.default_rng(6)
    g = jnp.asarray(r.standard_normal((m, k)), jnp.float32)
    w = _bf16(r.standard_normal((n, k)) / np.sqrt(n))
    h, y = gelu_gemm.fc_gemm_gelu(x, w_fc, b, interpret=True, block=block)
    none, y2 = gelu_gemm.fc_gemm_gelu(x, w_fc, b, interpret=True, block=block, keep_h=False)
    assert none is None
    np.testing.assert_array_equal(_f64(y2), _f64(y))
    want = gelu_gemm.proj_gemm_gelu_backward(g.astype(BF16), w, h, interpret=True, block=block)
    got = gelu_gemm.proj_gemm_gelu_backward(g.astype(BF16), w, None, fc=(x, w_fc, b), interpret=True, block=block)
    assert len(got) == len(want) == 2
    for u, v in zip(got, want, strict=True):
        np.testing.assert_array_equal(_f64(u), _f64(v))
    with pytest.raises(gelu_gemm.GemmKernelError, match="takes h or fc="):
        gelu_gemm.proj_gemm_gelu_backward(g.astype(BF16), w, h, fc=(x, w_fc, b), interpret=True)
    with pytest.raises(gelu_gemm.GemmKernelError, match="w_fc must be bfloat16"):
        gelu_gemm.proj_gemm_gelu_backward(g.astype(BF16), w, None, fc=(x, w_fc.astype(jnp.float32), b), interpret=True)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_recomputing_mlp_is_the_mlp_that_keeps_h(impl):
    """gelu_gemm.mlp(recompute=True) against recompute=False, values and every gradient bit for bit, on XLA's path
    and the kernels' (interpreted)."""
    x, wf, bf, wp, bp, ct = mlp_inputs(seed=7)
    outs = []
    for recompute in (False, True):
        def run(x, wf, bf, wp, bp, recompute=recompute):
            return gelu_gemm.mlp(x, wf, bf, wp, impl=impl, recompute=recompute) + bp
        y, vjp = jax.vjp(run, x, wf, bf, wp, bp)
        outs.append((y, *vjp(ct)))
    for u, v in zip(*outs, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_recompute_policy_and_its_h100_step_reads_two_gemms():
    """kernels.mlp: pallas-recompute is a Policy and TrainConfig value; the tiny step compiled for the H100 under it beside
    kernels.mlp: pallas-gemm: c_proj's input-gradient kernel is read as two GEMMs (its FLOPs are the pallas-gemm kernel's
    plus the c_fc GEMM's it recomputes), the forward kernel writes half as many bytes less (no fp32 h), the backward
    reads no h, and the step needs less memory by h's (rows, 4 x embed) fp32 per layer."""
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    cfg = TrainConfig.load(None, {"kernels.mlp": "pallas-recompute", "precision": "auto"})
    assert resolve_policy(cfg, "gpu") == Policy.bf16(kernels={"mlp": "pallas-recompute"})
    with pytest.raises(ConfigError, match="kernels.mlp = 'recompute': valid choices are xla, pallas-gemm, pallas-recompute"):
        Policy(kernels={"mlp": "recompute"})
    cs, ks, _ = tiny_h100.kernels_beside_plain(("kernels.mlp=pallas-recompute",))
    cg, kg, _ = tiny_h100.kernels_beside_plain(("kernels.mlp=pallas-gemm",))
    rows, embed, layers = cs.micro_batch * cs.cfg.seq_len, cs.cfg.model.n_embd, cs.cfg.model.n_layer
    two = [k for k in ks if "gemm2_ntnn_gelu_backward" in k.op_name and k.gemm]
    one = [k for k in kg if "gemm_nt_gelu_backward" in k.op_name and k.gemm]
    assert len(two) == len(one) == layers and {k.gemm for k in two} == {"pallas bf16->bf16 NT"}
    fc_flops = 2.0 * rows * embed * 4 * embed
    assert all(a.flops == pytest.approx(b.flops + fc_flops) for a, b in zip(two, one, strict=True))
    h_bytes = rows * 4 * embed * 4
    fwd = sum(k.bytes for k in ks if "gemm_nn_bias_gelu" in k.op_name)
    fwd0 = sum(k.bytes for k in kg if "gemm_nn_bias_gelu" in k.op_name)
    bwd = sum(k.bytes for k in ks if "gelu_backward" in k.op_name)
    bwd0 = sum(k.bytes for k in kg if "gelu_backward" in k.op_name)
    x_fc = rows * embed * 2 + embed * 4 * embed * 2 + 4 * embed * 4  # what the recompute reads instead: x, w_fc, b_fc
    assert (fwd0 - fwd, bwd0 - bwd) == (h_bytes * layers, (h_bytes - x_fc) * layers)
    steps = cs.micro_steps  # each kernel runs once per micro-step
    assert tiny_h100.gemm_flops(ks) == pytest.approx(tiny_h100.gemm_flops(kg) + steps * layers * fc_flops, rel=1e-9)
    assert cg.memory()["temp"] - cs.memory()["temp"] >= h_bytes * layers


# ---- gelu_h_dtype: bfloat16: h kept in bf16 for the backward (torch autocast's saved GELU input) ----------------
@pytest.mark.parametrize("m, k, n, block", [
    (100, 48, 200, SMALL),
    # h's rounding does not depend on the tiles: "padded" runs it over several tiles and K steps, and the default
    # tiles are held to the truth in test_forward_kernel_against_the_truth_and_xla and
    # test_backward_kernel_against_the_truth_and_xla
    pytest.param(256, 128, 256, None, marks=pytest.mark.slow)], ids=["padded", "tiles"])
def test_bf16h_kernels_are_the_kernels_with_h_rounded(m, k, n, block):
    """fc_gemm_gelu(h_dtype=bfloat16) writes the fp32 kernel's h rounded to bf16 and the same gelu(h) (computed from
    the fp32 h), bit for bit; proj_gemm_gelu_backward handed that bf16 h computes exactly what it computes from the
    same values widened to fp32 (dh and its column sums), and not what it
    computes from the unrounded h."""
    x, w_fc, b = _fwd_inputs(m, k, n, seed=8)
    h, y = gelu_gemm.fc_gemm_gelu(x, w_fc, b, interpret=True, block=block)
    h16, y16 = gelu_gemm.fc_gemm_gelu(x, w_fc, b, interpret=True, block=block, h_dtype=BF16)
    assert (h16.dtype, y16.dtype) == (BF16, BF16)
    np.testing.assert_array_equal(_f64(h16), _f64(h.astype(BF16)))
    np.testing.assert_array_equal(_f64(y16), _f64(y))
    r = np.random.default_rng(9)
    g = jnp.asarray(r.standard_normal((m, k)), jnp.float32)
    w = _bf16(r.standard_normal((n, k)) / np.sqrt(n))
    for gi in (g.astype(BF16),):
        got = gelu_gemm.proj_gemm_gelu_backward(gi, w, h16, interpret=True, block=block)
        want = gelu_gemm.proj_gemm_gelu_backward(gi, w, h16.astype(jnp.float32), interpret=True, block=block)
        for u, v in zip(got, want, strict=True):
            np.testing.assert_array_equal(_f64(u), _f64(v))
        unrounded = gelu_gemm.proj_gemm_gelu_backward(gi, w, h, interpret=True, block=block)
        assert np.any(_f64(got[0]) != _f64(unrounded[0]))  # the rounding reaches dh


def _mlp_run(impl, h_dtype, seed=10):
    x, wf, bf, wp, bp, ct = mlp_inputs(seed=seed)

    def run(x, wf, bf, wp, bp):
        return gelu_gemm.mlp(x, wf, bf, wp, impl=impl, h_dtype=h_dtype) + bp
    y, vjp = jax.vjp(run, x, wf, bf, wp, bp)
    return (x, wf, bf, wp, ct), (y, *vjp(ct))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_bf16h_mlp_moves_only_the_backward_and_by_one_rounding_of_h(impl):
    """gelu_gemm.mlp(h_dtype=bfloat16) against the mlp that keeps the fp32 h, on XLA's path and the kernels'
    (interpreted): the value and c_proj's gradients (dW_proj, its bias) bit for bit (the forward is unchanged);
    dx, dW_fc and d(b_fc) differ (the rounding reaches them), by at most what rounding h moves dh by, carried through
    the GEMMs: h to bf16 moves it by at most u |h| (u = 2^-8, round to nearest), gelu'(h) by |gelu''(xi)| u |h| for
    some xi between the two, at most u max_x |x gelu''(x)| / (1 - u) <= 0.34 u (max |x gelu''(x)| = 0.3309, at
    |x| = 0.662, for the tanh form), so dh = g gelu'(h) by 0.34 u |g|, plus one bf16 ulp of dh either side (a rounding
    boundary between them) and two fp32 evaluations of gelu' (16 u_32 S each, tests/kernels/test_gelu.py). On XLA's
    path the gradients are also the plain expressions' on the rounded h, bit for bit."""
    (x, wf, bf, wp, ct), keep = _mlp_run(impl, jnp.float32)
    _, half = _mlp_run(impl, BF16)
    names = ("y", "dx", "dW_fc", "d(b_fc)", "dW_proj", "d(b_proj)")
    for name in ("y", "dW_proj", "d(b_proj)"):
        i = names.index(name)
        if keep[i] is not None:
            np.testing.assert_array_equal(np.asarray(half[i]), np.asarray(keep[i]), err_msg=name)
    xc, wfc = (np.abs(_f64(a.astype(BF16))) for a in (x, wf))
    h = _f64(ops.matmul(x, wf, dtype=BF16)) + _f64(bf)
    g = _f64(ct.astype(BF16)) @ _f64(wp.astype(BF16)).T
    dh, s = _truth(g, h)
    d_dh = 0.34 * 2.0 ** -8 * np.abs(g) + 2 * _bf16_ulp(dh, dh) + 32 * U * s
    rows = dh.shape[0]
    bounds = {"dx": d_dh @ wfc.T + 2 * _gamma(wfc.shape[1]) * np.abs(dh) @ wfc.T,
              "dW_fc": xc.T @ d_dh + 2 * _gamma(rows) * xc.T @ np.abs(dh),
              "d(b_fc)": d_dh.sum(0) + 2 * _gamma(rows) * np.abs(dh).sum(0)}
    for name, bound in bounds.items():
        i = names.index(name)
        assert np.any(np.asarray(half[i]) != np.asarray(keep[i])), name
        _check(name, half[i], keep[i], bound + 1e-30)
    if impl == "xla":  # the spec, spelled out: h rounded to bf16, then GELU's VJP at it in fp32, dh rounded to bf16
        xb, wfb, wpb = (a.astype(BF16) for a in (x, wf, wp))
        h16 = (ops._dot(xb, wfb, BF16, None) + bf).astype(BF16).astype(jnp.float32)
        gx = ops._dot(ct.astype(BF16), ops.transpose_operand(wpb), BF16, None)
        dh16 = jax.vjp(lambda v: jax.nn.gelu(v, approximate=True), h16)[1](gx)[0].astype(BF16)
        np.testing.assert_array_equal(np.asarray(half[1]), np.asarray(ops._dot(dh16, ops.transpose_operand(wfb),
                                                                                 BF16, None)))
        np.testing.assert_array_equal(np.asarray(half[2]),
                                      np.asarray(ops._dot(ops.transpose_operand(xb), dh16, BF16, None)))


def test_bf16h_policy_and_its_h100_step_reads_and_writes_half_of_h(monkeypatch):
    """gelu_h_dtype: bfloat16 is a Policy and TrainConfig value of bf16 policies (refused with fp32 compute); a tiny
    GPT under it starts from the plain bf16 policy's loss bit for bit (the forward is unchanged) and trains to within
    1e-3 of its losses, with the kernels (interpreted) as with XLA's path; the tiny step compiled for the H100 beside
    kernels.mlp: pallas-gemm alone: the same kernels, the forward one writing and the backward one reading h in bf16 (h's
    (rows, 4 x embed) bytes halved in each, per layer), and the step needs less memory by that much."""
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    cfg = TrainConfig.load(None, {"kernels.mlp": "pallas-gemm", "gelu_h_dtype": "bfloat16", "precision": "auto"})
    assert resolve_policy(cfg, "gpu") == Policy.bf16(gelu_h_dtype="bfloat16", kernels={"mlp": "pallas-gemm"})
    with pytest.raises(ConfigError, match="gelu_h_dtype = 'bfloat16' keeps h in bf16.*compute_dtype 'float32'.*"
                                          "gelu_h_dtype: float32"):
        Policy.fp32(gelu_h_dtype="bfloat16", kernels={"mlp": "pallas-gemm"})
    with pytest.raises(ConfigError, match="kernels.mlp = 'bf16h': valid choices are xla, pallas-gemm, pallas-recompute"):
        Policy(kernels={"mlp": "bf16h"})
    # the CPU's checks first (the compiled H100 step below needs JAX's CUDA plugin, and skips without it)
    plain = tiny_adamw_losses(Policy.bf16(), 3)
    xla = tiny_adamw_losses(Policy.bf16(gelu_h_dtype="bfloat16", kernels={"mlp": "pallas-gemm"}), 3)
    with monkeypatch.context() as m:
        m.setattr(gelu_gemm, "_resolve", lambda impl, dtype: "interpret")
        kernels = tiny_adamw_losses(Policy.bf16(gelu_h_dtype="bfloat16", kernels={"mlp": "pallas-gemm"}), 3)
    assert xla[0] == plain[0] and xla != plain
    np.testing.assert_allclose(xla, plain, rtol=1e-3)
    np.testing.assert_allclose(kernels, xla, rtol=1e-4)
    cs, ks, _ = tiny_h100.kernels_beside_plain(("kernels.mlp=pallas-gemm", "gelu_h_dtype=bfloat16",))
    cg, kg, _ = tiny_h100.kernels_beside_plain(("kernels.mlp=pallas-gemm",))
    rows, embed, layers = cs.micro_batch * cs.cfg.seq_len, cs.cfg.model.n_embd, cs.cfg.model.n_layer
    assert sorted(k.name for k in ks if k.gemm) == sorted(k.name for k in kg if k.gemm)
    half_h = rows * 4 * embed * 2
    for name in ("gemm_nn_bias_gelu", "gemm_nt_gelu_backward"):
        b16, b32 = (sum(k.bytes for k in kk if name in k.op_name) for kk in (ks, kg))
        assert b32 - b16 == half_h * layers, name
    assert cg.memory()["temp"] - cs.memory()["temp"] >= half_h * layers
