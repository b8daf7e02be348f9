"""Policy.c_proj = "pallas": the c_proj output gradients' bf16 rounding and bias-gradient sums written by the kernels
that make those gradients (jaxgpt.kernels.layer_norm's LayerNorm backward for the attention's c_proj, jaxgpt.kernels.mlp's input-
gradient GEMM for the MLP's), not by an XLA pass that reads the fp32 gradient back.

What is checked: each kernel's new results against the values it already wrote (the rounding bit for bit, the
column sums within Higham's bound gamma_{R} sum|g| of the float64 sums, u = 2^-24), every other result unchanged bit
for bit; the branch with a projection against the branch handed the Linear's output (everything bit for bit but
the bias gradient, a sum in another order); the MLP with the bias folded in against the MLP plus the bias; a tiny
GPT under the policy; the policy's checks; and the compiled tiny H100 step, where the passes are gone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import ops
from jaxgpt.kernels import mlp as gelu_gemm, layer_norm as norm
from jaxgpt.config import ConfigError
from jaxgpt.kernels.gemm import GemmKernelError
from jaxgpt.precision import Policy
from tests import tiny_h100
from tests.kernels.test_layer_norm import EPS, _gamma
from tests.tiny_training import tiny_adamw_losses

U = 2.0 ** -24
BF16 = jnp.bfloat16


def _sums_within_bound(name: str, partials, g) -> None:
    """``partials.sum(0)`` (per-block fp32 column sums, summed) within gamma_{R+1} sum|g| of g's float64 column sums."""
    g64 = np.asarray(g, np.float64)
    err = np.abs(np.asarray(partials, np.float64).sum(0) - g64.sum(0))
    bound = _gamma(g64.shape[0] + 1, U) * np.abs(g64).sum(0)
    assert (err <= bound).all(), f"{name}: {err.max()} > {bound[err.argmax()]}"


@pytest.mark.parametrize("rows, dim", [(300, 96), (256, 768)], ids=["ragged-rows", "gpt2-width"])
def test_layer_norm_backward_writes_its_output_rounded_and_its_column_sums(rows, dim):
    """layer_norm_backward(cast=bf16) (interpreted): dres + dx, d(scale) and d(bias) bit for bit as without ``cast``;
    the rounded copy is dres + dx rounded to bf16, bit for bit; the column sums, one row per 128-row block, sum to
    dres + dx's within the bound (ragged rows and widths masked out of them)."""
    r = np.random.default_rng(1)
    x, dy, dres = (jnp.asarray(r.standard_normal((rows, dim)), jnp.float32) for _ in range(3))
    scale = jnp.asarray(1 + r.standard_normal(dim) / 4, jnp.float32)
    mean, rstd = norm._stats(x, EPS)
    plain = norm.layer_norm_backward(x, dy, dres, mean, rstd, scale, interpret=True)
    out, ds, db, cast, sums = norm.layer_norm_backward(x, dy, dres, mean, rstd, scale, cast=BF16, interpret=True)
    for name, u, v in zip(("dres + dx", "d_scale", "d_bias"), (out, ds, db), plain, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=name)
    assert cast.dtype == BF16 and sums.shape == ds.shape and sums.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(cast, np.float32), np.asarray(out.astype(BF16), np.float32))
    _sums_within_bound("column sums", sums, out)


def _branch(backward: str, with_bias: bool, as_projection: bool, dtype=BF16):
    def f(x, y, w, b, s, lb):
        b = b if with_bias else None
        if as_projection:
            return norm.layer_norm_branch(x, s, lb, eps=EPS, backward=backward, proj=(y, w, b), dtype=dtype)
        a = ops.matmul(y, w, dtype=dtype)  # what Linear computes
        return norm.layer_norm_branch(x, s, lb, eps=EPS, backward=backward, add=a if b is None else a + b, dtype=dtype)
    return f


@pytest.mark.parametrize("backward", ["xla", "interpret"])
@pytest.mark.parametrize("with_bias, dtype", [(True, BF16), (False, BF16), (True, jnp.float32)],
                         ids=["bias", "no-bias", "fp32"])
def test_branch_with_a_projection_is_the_branch_of_the_linears_output(backward, with_bias, dtype):
    """layer_norm_branch(proj=(y, w, b)) against layer_norm_branch(add=Linear's y @ w + b) with random cotangents
    for both outputs, on 168 rows (two 128-row blocks, the second ragged): the outputs and the gradients of x, y, w
    and the LayerNorm's scale and bias bit for bit (the projection's backward GEMMs read the same bf16 rounding of the
    same fp32 gradient; under fp32 compute the gradient itself, which the kernel then does not copy); the
    projection's bias gradient within the bound of the sum of that gradient."""
    r = np.random.default_rng(2)
    rows, dim, d_in = 168, 48, 40
    x = jnp.asarray(r.standard_normal((rows, dim)), jnp.float32)
    y = jnp.asarray(r.standard_normal((rows, d_in)), dtype)
    w = jnp.asarray(r.standard_normal((d_in, dim)) / 8, jnp.float32)
    b, lb = (jnp.asarray(r.standard_normal(dim) / 4, jnp.float32) for _ in range(2))
    s = jnp.asarray(1 + r.standard_normal(dim) / 4, jnp.float32)
    cts = tuple(jnp.asarray(r.standard_normal((rows, dim)), jnp.float32) for _ in range(2))
    got_out, got_vjp = jax.vjp(_branch(backward, with_bias, True, dtype), x, y, w, b, s, lb)
    want_out, want_vjp = jax.vjp(_branch(backward, with_bias, False, dtype), x, y, w, b, s, lb)
    got, want = got_vjp(cts), want_vjp(cts)
    for name, u, v in zip(("x + a", "ln", "d_x", "d_y", "d_w", "d_b", "d_scale", "d_ln_bias"),
                          (*got_out, *got), (*want_out, *want), strict=True):
        assert u.dtype == v.dtype, name
        if name != "d_b":
            np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32), err_msg=name)
    if with_bias:
        _sums_within_bound("d_b", got[3][None], got[0])  # the bias gradient is the sum of d(x + a) = d_x
    else:
        assert not np.asarray(got[3]).any()  # b took no part: its cotangent is zeros


def test_mlp_gradient_gemm_rounds_and_sums_an_fp32_output_gradient():
    """proj_gemm_gelu_backward with an fp32 g (interpreted), on shapes the tiles do not divide (zero-padded): dh and
    its column sums bit for bit as with g rounded to bf16 first; g rounded to bf16 bit for bit; g's column sums (one
    row per row block) within the bound."""
    from tests.kernels.test_mlp import SMALL

    r = np.random.default_rng(3)
    m, k, n = 100, 48, 200
    g = jnp.asarray(r.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(r.standard_normal((n, k)) / 8, BF16)
    h = jnp.asarray(r.standard_normal((m, n)), jnp.float32)
    dh0, sums0 = gelu_gemm.proj_gemm_gelu_backward(g.astype(BF16), w, h, interpret=True, block=SMALL)
    dh, sums, gc, g_sums = gelu_gemm.proj_gemm_gelu_backward(g, w, h, interpret=True, block=SMALL)
    np.testing.assert_array_equal(np.asarray(dh, np.float32), np.asarray(dh0, np.float32))
    np.testing.assert_array_equal(np.asarray(sums), np.asarray(sums0))
    assert gc.shape == g.shape and gc.dtype == BF16
    np.testing.assert_array_equal(np.asarray(gc, np.float32), np.asarray(g.astype(BF16), np.float32))
    assert g_sums.shape == (-(-m // SMALL[0]), k)
    _sums_within_bound("g's column sums", g_sums, g)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_mlp_with_the_bias_folded_in_is_the_mlp_plus_the_bias(impl):
    """gelu_gemm.mlp(b_proj=b, fold=True) against mlp(...) + b, values and gradients: bit for bit but c_proj's bias
    gradient (XLA's path: bit for bit too), which lies within the bound of the sum of the output gradient."""
    from tests.kernels.test_mlp import mlp_inputs

    x, wf, bf, wp, bp, ct = mlp_inputs(seed=4)

    def folded(x, wf, bf, wp, bp):
        return gelu_gemm.mlp(x, wf, bf, wp, impl=impl, b_proj=bp, fold=True)

    got_out, got_vjp = jax.vjp(folded, x, wf, bf, wp, bp)
    want_out, want_vjp = jax.vjp(lambda x, wf, bf, wp, bp: gelu_gemm.mlp(x, wf, bf, wp, impl=impl) + bp,
                                 x, wf, bf, wp, bp)
    np.testing.assert_array_equal(np.asarray(got_out), np.asarray(want_out))
    got, want = got_vjp(ct), want_vjp(ct)
    for name, u, v in zip(("d_x", "d_w_fc", "d_b_fc", "d_w_proj"), got[:4], want[:4], strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=name)
    if impl == "xla":
        np.testing.assert_array_equal(np.asarray(got[4]), np.asarray(want[4]))
    _sums_within_bound("d_b_proj", got[4][None], ct)
    # a c_proj without a bias: the kernel still writes the rounding the weight gradient reads
    no_bias, no_bias_vjp = jax.vjp(lambda x: gelu_gemm.mlp(x, wf, bf, wp, impl=impl, fold=True), x)
    plain, plain_vjp = jax.vjp(lambda x: gelu_gemm.mlp(x, wf, bf, wp, impl=impl), x)
    np.testing.assert_array_equal(np.asarray(no_bias), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(no_bias_vjp(ct)[0]), np.asarray(plain_vjp(ct)[0]))


def test_kernels_and_policy_refuse_what_they_cannot_take():
    ones = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(norm.LayerNormKernelError, match="as add= or as proj=, not both"):
        norm.layer_norm_branch(ones, jnp.ones(8), None, eps=EPS, add=ones, proj=(ones, jnp.ones((8, 8)), None))
    with pytest.raises(norm.LayerNormKernelError, match=r"proj is \(y, w, b\)"):
        norm.layer_norm_branch(ones, jnp.ones(8), None, eps=EPS, proj=(ones, jnp.ones((8, 8))))
    with pytest.raises(norm.LayerNormKernelError, match=r"do not make x's \(4, 8\).*\(d_in, 8\)"):
        norm.layer_norm_branch(ones, jnp.ones(8), None, eps=EPS, proj=(ones, jnp.ones((8, 6)), None))
    with pytest.raises(GemmKernelError, match="only with fold=True"):
        gelu_gemm.mlp(ones, jnp.ones((8, 16)), None, jnp.ones((16, 8)), b_proj=jnp.ones(8))
    with pytest.raises(GemmKernelError, match=r"b_proj has shape \(1,\).*must have shape \(8,\)"):
        gelu_gemm.mlp(ones, jnp.ones((8, 16)), None, jnp.ones((16, 8)), b_proj=jnp.ones(1), fold=True)
    with pytest.raises(GemmKernelError, match="g must be bfloat16 .or float32.*got float16"):
        gelu_gemm.proj_gemm_gelu_backward(ones.astype(jnp.float16), jnp.ones((16, 8), BF16), jnp.ones((4, 16)),
                                          interpret=True)
    with pytest.raises(ConfigError, match="'plain', 'pallas'"):
        Policy(c_proj="triton")
    for kw in ({"layer_norm": "fused"}, {"layer_norm": "pallas", "gemm_output": "bfloat16"},
               {"layer_norm": "pallas", "fp8": "all"}, {"layer_norm": "pallas", "fast_kernels": False}):
        with pytest.raises(ConfigError, match="Policy.c_proj = 'pallas' hands.*c_proj: plain"):
            Policy(compute_dtype="bfloat16", c_proj="pallas", **kw)


def test_policy_field_and_train_config():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    assert Policy().c_proj == "plain" and TrainConfig.load(None, {}).c_proj == "plain"
    cfg = TrainConfig.load(None, {"layer_norm": "pallas", "c_proj": "pallas", "precision": "auto"})
    assert resolve_policy(cfg, "gpu") == Policy.bf16(layer_norm="pallas", c_proj="pallas")
    with pytest.raises(ConfigError, match="c_proj"):
        TrainConfig.load(None, {"c_proj": "fast"})
    with pytest.raises(ConfigError, match="set layer_norm: pallas"):
        resolve_policy(TrainConfig.load(None, {"c_proj": "pallas", "precision": "bf16"}), "gpu")


def _losses(policy: Policy, impl: str, monkeypatch) -> list[float]:
    """tests.tiny_training's AdamW losses with the LayerNorm and MLP kernels forced to XLA's path or interpreted."""
    monkeypatch.setattr(norm, "_resolve", lambda b: impl)
    monkeypatch.setattr(gelu_gemm, "_resolve", lambda i, dtype: impl)
    return tiny_adamw_losses(policy, 3)


def test_tiny_gpt_trains_as_without_it(monkeypatch):
    """A tiny GPT (2 layers, n_embd 32), bf16, layer_norm: pallas and gelu: pallas-gemm (so both c_projs take the
    change: the attention's in ln_2's kernel, the MLP's in its GEMM): with c_proj: pallas its 3 AdamW losses are
    those without it, on XLA's path (the CPU's) to 1e-6 relative (only the bias gradients' sums change order) and
    with the kernels interpreted to 1e-6 relative of the interpreted kernels without it (which
    tests/kernels/test_layer_norm_kernel.py and tests/kernels/test_mlp.py hold to the plain policy's)."""
    base = Policy.bf16(layer_norm="pallas", gelu="pallas-gemm")
    with_it = Policy.bf16(layer_norm="pallas", gelu="pallas-gemm", c_proj="pallas")
    without = _losses(base, "xla", monkeypatch)
    assert without[-1] < without[0] - 0.05, without
    np.testing.assert_allclose(_losses(with_it, "xla", monkeypatch), without, rtol=1e-6)
    np.testing.assert_allclose(_losses(with_it, "interpret", monkeypatch), _losses(base, "interpret", monkeypatch),
                               rtol=1e-6)


def test_decoding_and_dropout_take_the_plain_projection():
    """Under c_proj: pallas the KV-cache decode and a dropout step take the Linear's own c_proj: the tiny GPT's
    cached logits equal its full forward's, and with dropout (its residual dropout after c_proj kept) its loss and
    gradients are those of layer_norm: pallas without c_proj: pallas under the same key."""
    import dataclasses

    from flax import nnx

    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT

    cfg = dataclasses.replace(GPTConfig.preset("tiny"), vocab_size=256, dropout=0.1)
    model = GPT(cfg, policy=Policy.fp32(layer_norm="pallas", c_proj="pallas"), rngs=nnx.Rngs(params=0))
    base = GPT(cfg, policy=Policy.fp32(layer_norm="pallas"), rngs=nnx.Rngs(params=0))
    idx = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    full = model(idx)
    cache = model.init_cache(2, 8)
    step, _ = model.decode(idx, cache, 0)
    np.testing.assert_allclose(np.asarray(step), np.asarray(full), rtol=1e-5, atol=1e-5)
    def loss_and_grads(m):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(idx, idx, dropout_key=jax.random.key(2)))(m)
        return [loss, *jax.tree.leaves(nnx.state(grads))]

    got, want = loss_and_grads(model), loss_and_grads(base)
    assert len(got) == len(want) > 10
    for u, v in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    no_dropout = GPT(dataclasses.replace(cfg, dropout=0.0), policy=model.policy, rngs=nnx.Rngs(params=0))
    assert float(no_dropout.loss(idx, idx, dropout_key=jax.random.key(2))) != float(got[0])  # the dropout is there


def test_tiny_h100_step_writes_the_rounded_gradients_in_the_kernels():
    """The tiny step compiled for the H100 with c_proj: pallas beside the one without (layer_norm: pallas and
    gelu: pallas-gemm in both): ln_2's backward kernel writes a bf16 (rows, embed) array and a row of partial sums
    per 128 rows more; the MLP's input-gradient GEMM reads an fp32 g (read by the reader as its bf16 GEMM operand
    plus 2 bytes per element of epilogue) and writes g's rounding and partial sums; no XLA reduction reading a
    (rows, embed) gradient for a bias is left (there were two per layer); the step moves fewer bytes."""
    base = ("layer_norm=pallas", "gelu=pallas-gemm")
    cs, ks, kp = tiny_h100.kernels_beside_plain(("c_proj=pallas",), base)
    rows, embed, layers = cs.micro_batch * cs.cfg.seq_len, cs.cfg.model.n_embd, cs.cfg.model.n_layer
    block = min(norm.BLOCK_ROWS, max(norm.SUB_ROWS, 1 << (rows - 1).bit_length()))
    partials = -(-rows // block) * embed * 4

    def ln_bwd(kernels):  # the blocks' (ln_f's, which reads no residual gradient, is the smallest: left out)
        found = sorted(k.bytes for k in kernels if "layer_norm_backward_residual" in k.op_name)
        assert len(found) == 2 * layers + 1
        return found[1:]

    # ln_2's kernels (the smaller half: ln_1's read q, k and v's gradients as well) write the two new results
    assert ln_bwd(ks)[:layers] == [b + rows * embed * 2 + partials for b in ln_bwd(kp)[:layers]]
    assert ln_bwd(ks)[layers:] == ln_bwd(kp)[layers:]
    gelu_bwd = [k for k in ks if k.name.endswith(" epilogue") and "gemm_nt_gelu_backward" in k.op_name]
    gelu_bwd0 = [k for k in kp if k.name.endswith(" epilogue") and "gemm_nt_gelu_backward" in k.op_name]
    assert len(gelu_bwd) == len(gelu_bwd0) == layers
    from jaxgpt.kernels import gemm

    bm, _, bk = gemm.blocks(rows, 4 * embed, embed)  # the GEMM's tiles: g's partial sums, one row per row tile
    assert all(a.bytes == b.bytes + rows * embed * (2 + 2) + -(-rows // bm) * -(-embed // bk) * bk * 4
               for a, b in zip(gelu_bwd, gelu_bwd0, strict=True))
    assert {k.gemm for k in ks if "gemm_nt_gelu_backward" in k.op_name and k.gemm} == {"pallas bf16->bf16 NT"}
    assert tiny_h100.gemm_flops(ks) == pytest.approx(tiny_h100.gemm_flops(kp), rel=1e-6)

    def gradient_reductions(kernels):  # autodiff's bias sums (with the rounding where a GEMM reads it) of a gradient
        return [k for k in kernels if k.opcode == "kInput" and k.op_name.endswith("transpose(jvp())/reduce_sum")
                and k.bytes >= rows * embed * 4]

    assert len(gradient_reductions(kp)) == 2 * layers and gradient_reductions(ks) == []
    assert sum(k.bytes * k.count for k in ks) < sum(k.bytes * k.count for k in kp)
