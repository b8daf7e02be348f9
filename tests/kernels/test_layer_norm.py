"""jaxgpt.kernels.layer_norm's LayerNorm (kernels.layer_norm = "fused") against the plain LayerNorm of jaxgpt.model: values and
gradients, in fp32, with bf16 inputs and in fp64, and its refusals.

Bounds (derived, not fitted): each result is a sum of products computed in the inputs' precision u (fp32: 2^-24,
fp64: 2^-53). By Higham's bound for a sum of n terms, |computed - exact| <= gamma_n * S with gamma_n = n u / (1 - n u)
and S the same sum over the terms' absolute values. For dx_i = rstd (g_i - mean(g) - x_hat_i mean(g x_hat)) the
means run over C terms and a handful of roundings follow: n = C + 8, S_i = rstd (|g_i| + mean|g| + |x_hat_i|
mean|g x_hat|) (plus rstd's own error, the same relative size, folded into the 8). d(scale) and d(bias) are sums
over R rows: n = R + 8, S = sum |dy x_hat| (resp. sum |dy|). Both implementations must lie within that bound of the
fp64 truth, so they lie within twice it of each other; a wrong formula is off by O(S).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgpt.kernels import layer_norm as norm
from jaxgpt.config import ConfigError, GPTConfig
from jaxgpt.model import GPT, LayerNorm
from jaxgpt.precision import Policy

EPS = 1e-5
U = {np.dtype(np.float32): 2.0 ** -24, np.dtype(np.float64): 2.0 ** -53}


def _inputs(rows: int, dim: int, seed: int = 0, *, offset: float = 3.0):
    """x with a per-row offset and spread (the statistics matter), dy, and a non-trivial scale and bias."""
    r = np.random.default_rng(seed)
    x = offset * r.standard_normal((rows, 1)) + r.uniform(0.5, 4.0, (rows, 1)) * r.standard_normal((rows, dim))
    dy = r.standard_normal((rows, dim))
    scale, bias = 1.0 + 0.3 * r.standard_normal(dim), 0.1 * r.standard_normal(dim)
    return x, dy, scale, bias


def _module(dim: int, impl: str, scale, bias, dtype=jnp.float32) -> LayerNorm:
    kernels = {"layer_norm": "xla" if impl == "plain" else impl}
    policy = Policy.fp64() if dtype == jnp.float64 else Policy(kernels=kernels)
    ln = LayerNorm(dim, bias=bias is not None, eps=EPS, policy=policy)
    ln.scale[...] = jnp.asarray(scale, dtype)
    if bias is not None:
        ln.bias[...] = jnp.asarray(bias, dtype)
    return ln


def _value_and_grads(ln: LayerNorm, x, dy):
    """y and the VJP of <y, dy> w.r.t. x, scale and bias, jitted (as the train step runs it)."""
    graphdef, params = nnx.split(ln)

    @jax.jit
    def f(params, x, dy):
        def loss(params, x):
            (y,) = nnx.merge(graphdef, params)(x, keep_residual=False)
            return jnp.sum(y.astype(jnp.float32 if y.dtype != jnp.float64 else y.dtype) * dy), y

        (_, y), (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return y, gx, gp["scale"][...], (gp["bias"][...] if ln.bias is not None else None)

    return f(params, x, dy)


def _truth(x, dy, scale, bias):
    """fp64 numpy: y, dx, d(scale), d(bias), and the bounds' sums of absolute terms (see the module docstring).

    x_hat = (x - mean) * rstd inherits the rounding of x - mean and of the mean relative to |x| + mean|x|, not to
    |x - mean| (a row offset cancels): a = rstd (|x| + mean|x|); rstd's relative error follows the variance's,
    r = 1 + mean(a |x_hat|); so S(x_hat) = a + |x_hat| r, and every product's S carries its factors' S."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPS)
    x_hat = (x - mean) * rstd
    b = bias if bias is not None else 0.0
    y = x_hat * scale + b
    g = dy * scale
    dx = rstd * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
    a = rstd * (np.abs(x) + np.abs(x).mean(-1, keepdims=True))
    r = 1.0 + (a * np.abs(x_hat)).mean(-1, keepdims=True)
    s_xhat = a + np.abs(x_hat) * r
    ag = np.abs(g)
    s_dx = rstd * (ag + ag.mean(-1, keepdims=True) + s_xhat * (ag * np.abs(x_hat)).mean(-1, keepdims=True)
                   + np.abs(x_hat) * (ag * s_xhat).mean(-1, keepdims=True)) + np.abs(dx) * r
    return dict(y=y, dx=dx, dscale=(dy * x_hat).sum(0), dbias=dy.sum(0), s_dx=s_dx,
                s_y=np.abs(scale) * s_xhat + np.abs(b), s_dscale=(np.abs(dy) * s_xhat).sum(0),
                s_dbias=np.abs(dy).sum(0))


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def _check(name, got, want, bound):
    err = np.abs(np.asarray(got, np.float64) - want)
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{name}: error up to {worst:.3g}x its derived bound (max abs error {err.max():.3g})"


@pytest.mark.parametrize("gpu_path", [False, True], ids=["cpu-sums", "gpu-variadic-reduce"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_matches_plain_and_truth(monkeypatch, dtype, with_bias, gpu_path):
    """Both implementations within the derived bound of the fp64 truth (fp32 and, under 64-bit jax, fp64: what the
    fp64 reference policy computes LayerNorm in); x of 40 rows x 96 features with large row offsets. ``gpu_path``:
    d(scale) and d(bias) as the one variadic reduce GPUs get (the CPU's two sums otherwise)."""
    if gpu_path:
        monkeypatch.setattr(norm.ops, "platform", lambda: "gpu")
    rows, dim = 40, 96
    x, dy, scale, bias = _inputs(rows, dim)
    bias = bias if with_bias else None
    with jax.enable_x64(dtype == "float64"):
        dt = jnp.dtype(dtype)
        u = U[np.dtype(dtype)]
        t = _truth(x, dy, scale, bias)
        results = {impl: _value_and_grads(_module(dim, impl, scale, bias, dt), jnp.asarray(x, dt),
                                          jnp.asarray(dy, dt)) for impl in ("plain", "fused")}
        for impl, (y, dx, dscale, dbias) in results.items():
            assert y.dtype == dt and dx.dtype == dt and dscale.dtype == dt
            _check(f"{impl} y", y, t["y"], _gamma(dim + 8, u) * t["s_y"])
            _check(f"{impl} dx", dx, t["dx"], _gamma(dim + 8, u) * t["s_dx"])
            _check(f"{impl} dscale", dscale, t["dscale"], _gamma(rows + 8, u) * t["s_dscale"])
            if with_bias:
                _check(f"{impl} dbias", dbias, t["dbias"], _gamma(rows + 8, u) * t["s_dbias"])
            else:
                assert dbias is None


def test_fused_with_bf16_inputs_matches_plain():
    """bf16 x (what a bf16 caller would pass): both cast to fp32 first, so y (fp32) agrees within twice the fp32
    bound, and dx (rounded back to x's bf16) within one bf16 ulp of the value on top of it."""
    rows, dim = 64, 128
    x, dy, scale, bias = _inputs(rows, dim, seed=1)
    xb = jnp.asarray(x, jnp.bfloat16)
    out = {impl: _value_and_grads(_module(dim, impl, scale, bias), xb, jnp.asarray(dy, jnp.float32))
           for impl in ("plain", "fused")}
    t = _truth(np.asarray(xb, np.float64), dy, scale, bias)
    (yp, dxp, dsp, dbp), (yf, dxf, dsf, dbf) = out["plain"], out["fused"]
    assert yf.dtype == yp.dtype == jnp.float32 and dxf.dtype == dxp.dtype == jnp.bfloat16
    u32 = U[np.dtype(np.float32)]
    _check("bf16 y", yf, np.asarray(yp, np.float64), 2 * _gamma(dim + 8, u32) * t["s_y"])
    dxp64, dxf64 = np.asarray(dxp, np.float64), np.asarray(dxf, np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(dxp64), 1e-30))) - 7)  # bf16: 8 significant bits
    _check("bf16 dx", dxf64, dxp64, ulp + 2 * _gamma(dim + 8, u32) * t["s_dx"])
    _check("bf16 dscale", dsf, np.asarray(dsp, np.float64), 2 * _gamma(rows + 8, u32) * t["s_dscale"])
    _check("bf16 dbias", dbf, np.asarray(dbp, np.float64), 2 * _gamma(rows + 8, u32) * t["s_dbias"])


def test_forward_is_the_plain_expression():
    """Outside differentiation the fused LayerNorm is the same expression: the same numbers bit for bit."""
    x, _, scale, bias = _inputs(16, 64, seed=2)
    xs = jnp.asarray(x, jnp.float32)[None]  # (1, rows, C): the module reshapes to rows
    ys = [jax.jit(lambda m, v: m(v, keep_residual=False)[0])(_module(64, impl, scale, bias), xs)
          for impl in ("plain", "fused")]
    np.testing.assert_array_equal(np.asarray(ys[0]), np.asarray(ys[1]))


def test_model_with_fused_layer_norm():
    """A tiny GPT under kernels.layer_norm = "fused": the same loss as the plain policy's and gradients within the
    fp32 bound's scale (every LayerNorm's backward changed, the rest of the model not)."""
    cfg = GPTConfig.preset("tiny")
    idx = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    tgt = jnp.roll(idx, -1, axis=1)
    out = {}
    for impl in ("plain", "fused"):
        kernels = {"layer_norm": "xla" if impl == "plain" else impl}
        model = GPT(cfg, policy=Policy(matmul_precision="highest", kernels=kernels), rngs=nnx.Rngs(params=0))
        graphdef, params = nnx.split(model, nnx.Param)
        out[impl] = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(idx, tgt)))(params)
    (lp, gp), (lf, gf) = out["plain"], out["fused"]
    assert abs(float(lp) - float(lf)) <= 1e-6 * abs(float(lp))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gp), jax.tree_util.tree_leaves(gf)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        # fp32 sums over <= 32 rows/features of the tiny model, through 2 blocks: 1e-5 of the largest gradient
        # element is ~80 fp32 ulps, far below what a wrong backward changes (O(1) of it)
        assert np.abs(a - b).max() <= 1e-5 * max(np.abs(a).max(), 1e-12), jax.tree_util.keystr(path)


def test_bad_inputs_are_refused():
    x = jnp.ones((4, 8))
    with pytest.raises(norm.LayerNormError, match=r"\(rows, embed\).*reshape"):
        norm.layer_norm(jnp.ones((2, 4, 8)), jnp.ones(8), None, eps=EPS)
    with pytest.raises(norm.LayerNormError, match=r"scale has shape \(7,\).*must have shape \(8,\)"):
        norm.layer_norm(x, jnp.ones(7), None, eps=EPS)
    with pytest.raises(norm.LayerNormError, match=r"bias has shape \(8, 1\)"):
        norm.layer_norm(x, jnp.ones(8), jnp.ones((8, 1)), eps=EPS)
    with pytest.raises(norm.LayerNormError, match="floating-point"):
        norm.layer_norm(jnp.ones((4, 8), jnp.int32), jnp.ones(8), None, eps=EPS)
    with pytest.raises(ConfigError, match="kernels.layer_norm = 'welford': valid choices are xla, fused, pallas"):
        Policy(kernels={"layer_norm": "welford"})


def test_train_config_selects_it():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    assert resolve_policy(TrainConfig.load(None, {}), "gpu").kernel("layer_norm") == "xla"  # the default: unchanged
    assert resolve_policy(TrainConfig.load(None, {"kernels.layer_norm": "fused"}), "gpu").kernel("layer_norm") == "fused"
    with pytest.raises(ConfigError, match="kernels.layer_norm = 'fast': valid choices are xla, fused, pallas"):
        TrainConfig.load(None, {"kernels.layer_norm": "fast"})
    with pytest.raises(ConfigError, match="layer_norm: replaced by kernels.*--kernels.layer_norm=NAME"):
        TrainConfig.load(None, {"layer_norm": "fused"})  # the old flag: refused, naming the new one
