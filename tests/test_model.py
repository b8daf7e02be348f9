"""Tests for jaxgpt.model: shapes and dtypes, GPT-2's initialisation, token validation, the two attention
paths, the KV cache, dropout, the bf16 precision policy as it appears in the compiled program, and LayerNorm.
Cross-implementation numerics (torch_ref, transformers) live in parity_tests/."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgpt.config import GPTConfig
from jaxgpt.kernels import attention as attention_op
from jaxgpt.model import GPT, KVCache, LayerNorm, TokenError, check_cache_positions, check_tokens, dropout
from jaxgpt.precision import Policy, cpu_bf16_is_fast, default_compute

TINY = GPTConfig.preset("tiny")  # 2 layers, 2 heads, C=32, block 64
ODD = GPTConfig(n_layer=3, n_head=3, n_embd=48, block_size=37)  # 3 heads, block size not a power of two
# fp32 jaxgpt against itself (two attention formulations, cache vs full): differences come only from
# summation order in O(1)-sized logits over C <= 48, i.e. ~1e-7; 1e-5 leaves room without hiding a bug
# (a wrong mask, scale or position shifts logits by >= 1e-3 at these shapes).
SELF_FP32_ATOL = 1e-5


def tokens(batch: int, seq: int, vocab: int = 50257, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=(batch, seq)), dtype=jnp.int32)


def fresh_model(config: GPTConfig = TINY, *, seed: int = 0, attention: str | None = None, **policy) -> GPT:
    if attention is not None:  # the attention op's implementation (Policy.kernels)
        policy["kernels"] = {"attention": attention}
    return GPT(config, policy=Policy.fp32(**policy) if "compute_dtype" not in policy else Policy(**policy),
               rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=None)
def _cached_model(config: GPTConfig, seed: int, policy: tuple) -> GPT:
    return fresh_model(config, seed=seed, **dict(policy))


def model(config: GPTConfig = TINY, *, seed: int = 0, **policy) -> GPT:
    """A shared model per (config, seed, policy): eager initialisation compiles op by op and costs seconds.
    Tests only read these models; tests about initialisation itself use fresh_model."""
    return _cached_model(config, seed, tuple(sorted(policy.items())))


# Compiled entry points (eager NNX dispatches and compiles op by op, ~10x slower here); one compile per model
# structure and input shape. The validation that needs concrete values (token ids, decode positions) is
# exercised eagerly where it matters.
fwd = nnx.jit(lambda m, idx, key=None: m(idx, dropout_key=key))
fwd_and_loss = nnx.jit(lambda m, idx, targets, key=None: (m(idx, dropout_key=key),
                                                          m.loss(idx, targets, dropout_key=key)))
decode = nnx.jit(lambda m, idx, cache, pos: m.decode(idx, cache, pos))


def flat_params(m: GPT) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}


@pytest.fixture(autouse=True)
def highest_precision():
    """fp32 comparisons mean fp32 (no reduced-precision matmul passes on any backend)."""
    with jax.default_matmul_precision("highest"):
        yield


# ---- shapes and dtypes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_shapes_and_dtypes(compute):
    m = model(compute_dtype=compute)
    idx = tokens(2, 16)
    cache = m.init_cache(2, 20)
    assert cache.k.shape == (TINY.n_layer, 2, TINY.n_head, 20, TINY.head_dim)
    assert cache.k.dtype == jnp.dtype(compute) and cache.v.dtype == jnp.dtype(compute)

    @nnx.jit
    def everything(m, idx, targets, cache):
        return m(idx), m.hidden(idx), m.loss(idx, targets), m.decode(idx[:, :3], cache, 0)

    logits, (h, no_cache), loss, (step_logits, cache2) = everything(m, idx, tokens(2, 16, seed=1), cache)
    assert logits.shape == (2, 16, TINY.vocab_size) and logits.dtype == jnp.float32
    assert h.shape == (2, 16, TINY.n_embd) and h.dtype == jnp.float32 and no_cache is None
    assert loss.shape == () and loss.dtype == jnp.float32 and np.isfinite(float(loss))
    # parameters stay fp32 whatever the compute dtype
    assert {v.dtype for v in flat_params(m).values()} == {np.dtype(np.float32)}
    assert step_logits.shape == (2, 3, TINY.vocab_size) and step_logits.dtype == jnp.float32
    assert isinstance(cache2, KVCache) and cache2.k.shape == cache.k.shape and cache2.k.dtype == cache.k.dtype


def test_parameter_names_and_count():
    params = flat_params(model())
    C, L = TINY.n_embd, TINY.n_layer
    assert params["wte/embedding"].shape == (TINY.vocab_size, C)
    assert params["wpe/embedding"].shape == (TINY.block_size, C)
    assert params["h/0/attn/c_attn/kernel"].shape == (C, 3 * C)  # (in, out), HF Conv1D layout
    assert params["h/1/mlp/c_proj/kernel"].shape == (4 * C, C)
    n = sum(v.size for v in params.values())
    per_layer = 12 * C * C + 13 * C  # attn 4C^2+4C, mlp 8C^2+5C, two LayerNorms 4C
    assert n == TINY.vocab_size * C + TINY.block_size * C + L * per_layer + 2 * C


# ---- initialisation ------------------------------------------------------------------------------------
def test_gpt2_init_statistics():
    # Big enough that the sample std of every matrix is within ~0.3% (1/sqrt(2N)) of the true one.
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, padded_vocab_size=50304)
    params = flat_params(fresh_model(cfg))
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: residual projections scaled by 1/sqrt(2 L)

    def check_std(name, array, std):
        n = array.size
        assert abs(array.std() / std - 1) < 0.02, f"{name}: std {array.std():.5f}, want {std:.5f}"
        assert abs(array.mean()) < 6 * std / math.sqrt(n), f"{name}: mean {array.mean():.2e} not ~0"

    check_std("wte", params["wte/embedding"][: cfg.vocab_size], 0.02)
    check_std("wpe", params["wpe/embedding"], 0.02)
    for i in range(cfg.n_layer):
        check_std(f"h.{i}.attn.c_attn", params[f"h/{i}/attn/c_attn/kernel"], 0.02)
        check_std(f"h.{i}.mlp.c_fc", params[f"h/{i}/mlp/c_fc/kernel"], 0.02)
        check_std(f"h.{i}.attn.c_proj", params[f"h/{i}/attn/c_proj/kernel"], resid_std)
        check_std(f"h.{i}.mlp.c_proj", params[f"h/{i}/mlp/c_proj/kernel"], resid_std)
    for name, value in params.items():
        if name.endswith("/bias"):
            assert not value.any(), f"{name} is not zero-initialised"
        if name.endswith("/scale"):
            assert (value == 1.0).all(), f"{name} is not one-initialised"
    # every layer is drawn independently
    assert not np.array_equal(params["h/0/attn/c_attn/kernel"], params["h/1/attn/c_attn/kernel"])


def test_seeding():
    a, b, c = flat_params(fresh_model(seed=0)), flat_params(fresh_model(seed=0)), flat_params(fresh_model(seed=1))
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        if name.endswith(("kernel", "embedding")):  # random tensors (biases/scales are constants)
            assert not np.array_equal(a[name], c[name]), f"{name} identical for seeds 0 and 1"


def test_padded_vocab_rows_are_zero_and_logits_have_vocab_columns():
    cfg = TINY.replace(padded_vocab_size=50304)
    m = model(cfg)
    wte = flat_params(m)["wte/embedding"]
    assert wte.shape == (50304, cfg.n_embd)
    assert not wte[cfg.vocab_size:].any() and (wte[: cfg.vocab_size] != 0).all(axis=1).all()
    logits = fwd(m, tokens(2, 8))
    assert logits.shape == (2, 8, cfg.vocab_size)


# ---- token validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,words", [
    (np.array([[1, 2, 50257]]), ["outside [0, 50257)", "50257"]),
    (np.array([[1, -1, 2]]), ["outside [0, 50257)", "-1"]),
    (np.array([[3, 60000, -7]]), ["outside [0, 50257)", "60000", "-7", "min -7", "max 60000"]),
    (np.zeros((1, 65), np.int32), ["sequence length 65", "block_size is 64"]),
    (np.zeros((1, 4), np.float32), ["integer token ids", "float32"]),
    (np.zeros((4,), np.int32), ["shape (batch, seq)", "(4,)"]),
])
@pytest.mark.parametrize("as_jax", [False, True])
def test_bad_tokens_raise(bad, words, as_jax):
    m = model()
    idx = jnp.asarray(bad) if as_jax else bad
    for call in (lambda: m(idx), lambda: m.hidden(idx), lambda: m.loss(idx, idx)):
        with pytest.raises(TokenError) as info:
            call()
        for w in words:
            assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


def test_padded_rows_are_not_valid_ids():
    """Ids in [vocab_size, padded_vocab_size) index real (zero) embedding rows: refused, not looked up."""
    m = model(TINY.replace(padded_vocab_size=50304))
    with pytest.raises(TokenError, match=r"outside \[0, 50257\).*50300"):
        m(np.array([[0, 50300]]))


def test_bad_targets_raise():
    """A -1 / -100 'ignore' target would wrap around to the last columns, an id past the vocab would gather
    out of range: both are refused instead of giving a silently wrong loss."""
    m = model()
    idx = tokens(1, 4)
    for bad in ([[1, 2, 3, -100]], [[1, 2, 3, 50257]]):
        with pytest.raises(TokenError, match="targets holds token ids outside"):
            m.loss(idx, jnp.asarray(bad))


def test_out_of_range_ids_are_never_clamped():
    """What the checks protect against: without them, JAX's gather clamps/wraps/fills. Every id that would
    be clamped onto a valid row is refused, and a valid id is never altered."""
    m = model()
    last = fwd(m, jnp.array([[TINY.vocab_size - 1]]))
    for bad in (TINY.vocab_size, TINY.vocab_size + 10, -1):
        with pytest.raises(TokenError):
            m(np.array([[bad]]))
    np.testing.assert_array_equal(np.asarray(fwd(m, jnp.array([[TINY.vocab_size - 1]]))), np.asarray(last))


def test_checks_are_static_under_jit():
    """Inside jit only shapes are known: valid batches trace fine, and shape errors still raise."""
    m = model()
    assert fwd(m, tokens(2, 8)).shape == (2, 8, TINY.vocab_size)
    with pytest.raises(TokenError, match="sequence length 65"):
        fwd(m, jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(TokenError, match="integer token ids"):
        fwd(m, jnp.zeros((1, 4), jnp.float32))
    check_tokens(jnp.zeros((0, 0), jnp.int32), TINY)  # empty is fine


# ---- attention paths and the KV cache --------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["xla", "einsum"])
@pytest.mark.parametrize("config", [TINY, ODD], ids=["tiny", "odd"])
def test_fused_attention_equals_reference_fp32(config, attention):
    idx = tokens(2, config.block_size, seed=3)
    fused = model(config, attention=attention)
    ref = model(config, attention="reference")
    (a, loss_a), (b, loss_b) = fwd_and_loss(fused, idx, idx), fwd_and_loss(ref, idx, idx)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() <= SELF_FP32_ATOL
    assert abs(float(loss_a) - float(loss_b)) <= SELF_FP32_ATOL


@pytest.mark.parametrize("config,chunks,attention", [
    (TINY, [5, 1, 10], "xla"),
    (TINY, [5, 1, 10], "reference"),
    (ODD, [1, 12, 24], "xla"),  # 3 heads; the chunks fill the whole block
], ids=["tiny-xla", "tiny-reference", "odd-xla"])
def test_kv_cache_decode_equals_full_forward(config, chunks, attention):
    m = model(config, attention=attention)
    T = sum(chunks)
    idx = tokens(2, T, seed=4)
    full = np.asarray(fwd(m, idx))
    cache = m.init_cache(2, T)
    pos, pieces = 0, []
    for n in chunks:  # positions 0..T-1 fed in chunks of different sizes, including single tokens
        logits, cache = decode(m, idx[:, pos:pos + n], cache, pos)
        pieces.append(np.asarray(logits))
        pos += n
    stepped = np.concatenate(pieces, axis=1)
    assert np.abs(stepped - full).max() <= SELF_FP32_ATOL
    assert np.abs(np.asarray(cache.k)).min(axis=(0, 1, 2, 4)).all()  # every position was written


def test_decode_refuses_positions_past_the_cache():
    """Without the check, dynamic_update_slice clamps the write position and wpe returns NaN rows."""
    m = model()
    idx = tokens(1, 8)
    cache = m.init_cache(1, 8)
    _, cache = decode(m, idx[:, :6], cache, 0)
    with pytest.raises(TokenError, match=r"positions \[6, 9\).*KV cache holds 8"):
        m.decode(idx[:, :3], cache, 6)
    with pytest.raises(TokenError, match="position -1"):
        m.decode(idx[:, :1], cache, -1)
    big = m.init_cache(1, TINY.block_size + 8)  # a cache longer than the position table
    with pytest.raises(TokenError, match="block_size is 64"):
        m.decode(idx[:, :2], big, TINY.block_size - 1)
    check_cache_positions(6, 2, 8, TINY)  # exactly filling the cache is fine
    check_cache_positions(jnp.int32(0), 8, 8, TINY)
    with pytest.raises(TokenError):
        check_cache_positions(jnp.int32(1), 8, 8, TINY)


# ---- dropout -----------------------------------------------------------------------------------------
def test_dropout():
    cfg = TINY.replace(dropout=0.1, n_layer=1)
    m = model(cfg)
    idx = tokens(2, 16)
    ref = np.asarray(fwd(m, idx))
    # dropout() takes any PRNG key; "rbg" keys compile ~3x faster than the default threefry on XLA:CPU
    # (4.6 s vs 1.5 s for this forward), which is all this test would otherwise spend its time on.
    k1, k2 = jax.random.key(1, impl="rbg"), jax.random.key(2, impl="rbg")
    (a, loss_a), (a_again, loss_a_again), (b, _) = (fwd_and_loss(m, idx, idx, k) for k in (k1, k1, k2))
    a, a_again, b = np.asarray(a), np.asarray(a_again), np.asarray(b)
    assert np.abs(a - ref).max() > 1e-3  # a key switches dropout on
    np.testing.assert_array_equal(a, a_again)  # and the same key reproduces it exactly
    assert np.abs(a - b).max() > 1e-3  # another key, another mask
    np.testing.assert_array_equal(np.asarray(fwd(m, idx)), ref)  # no key: deterministic evaluation
    assert float(loss_a) == float(loss_a_again)
    eval_loss = float(jnp.mean(jax.nn.logsumexp(ref, -1) - jnp.take_along_axis(ref, idx[..., None], -1)[..., 0]))
    assert abs(float(loss_a) - eval_loss) > 1e-4
    # rate 0 (the config's dropout = 0) ignores the key; inverted dropout keeps the expectation
    x = jnp.ones((1000, 100))
    np.testing.assert_array_equal(np.asarray(dropout(x, 0.0, k1)), np.asarray(x))
    dropped = np.asarray(dropout(x, 0.1, k1))
    values = np.unique(dropped)
    assert len(values) == 2 and values[0] == 0.0 and np.isclose(values[1], 1 / 0.9)
    assert abs((dropped == 0).mean() - 0.1) < 0.005


# ---- precision: auto ----------------------------------------------------------------------------------------
def _cpuinfo(vendor: str, flags: str) -> str:
    block = f"processor\t: {{}}\nvendor_id\t: {vendor}\nmodel name\t: some CPU\nflags\t\t: fpu sse2 {flags}\n"
    return "\n".join(block.format(i) for i in range(2))


@pytest.mark.parametrize("vendor,flags,fast", [
    ("AuthenticAMD", "avx2 avx512f avx512_bf16", True),  # Zen 4 / Zen 5: bf16 GEMMs ~2x fp32
    ("GenuineIntel", "avx2 avx512f avx512_bf16 avx512_fp16", False),  # Xeon, AMX not exposed: bf16 ~0.5x fp32
    ("GenuineIntel", "avx512_bf16 amx_bf16 amx_tile", True),
    ("AuthenticAMD", "avx2 avx512f", False),  # no bf16 dot instructions: bf16 is emulated
    ("GenuineIntel", "avx2", False),
    ("", "", False),  # no flags line at all (another architecture's /proc/cpuinfo)
], ids=["amd-avx512bf16", "intel-avx512bf16-no-amx", "intel-amx", "amd-no-bf16", "intel-avx2", "unknown"])
def test_cpu_bf16_is_fast(vendor, flags, fast):
    info = _cpuinfo(vendor, flags) if vendor else "processor\t: 0\nBogoMIPS\t: 50.00\n"
    assert cpu_bf16_is_fast(info) is fast


def test_auto_precision_follows_the_cpu():
    with open("/proc/cpuinfo") as f:
        expect = "bf16" if cpu_bf16_is_fast(f.read()) else "fp32"
    assert default_compute("cpu") == expect
    assert default_compute("gpu") == "bf16"
    if jax.default_backend() == "cpu":
        assert Policy.named("auto").compute_dtype == {"bf16": "bfloat16", "fp32": "float32"}[expect]


# ---- the bf16 precision policy, read from the compiled program -------------------------------------------
_DOT = re.compile(r"stablehlo\.dot(?:_general)?\b.*:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")


def _dots(hlo: str) -> list[tuple[str, str, str, str]]:
    """(lhs dtype, rhs dtype, result dtype, result type) of every dot in a StableHLO module."""
    out = []
    for line in hlo.splitlines():
        if "stablehlo.dot" in line:
            m = _DOT.search(line)
            assert m, f"unparsed dot: {line.strip()}"
            dt = [t[len("tensor<"):-1].split("x")[-1] for t in m.groups()]
            out.append((*dt, m.group(3)))
    return out


@pytest.mark.parametrize("attention", ["reference", "xla", "einsum"])
def test_bf16_policy_every_dot_is_bf16_in_fp32_out(attention):
    """Every matmul of the forward pass and the loss takes bf16 operands and accumulates into an fp32 result;
    no fp32 x fp32 dot sneaks in (that would be a silent 2x slowdown and a different numerics)."""
    cfg = TINY
    m = model(cfg, compute_dtype="bfloat16", attention=attention)
    graphdef, state = nnx.split(m)
    idx = tokens(2, 16)

    def fwd(state, idx):
        return nnx.merge(graphdef, state)(idx)

    def loss(state, idx):
        return nnx.merge(graphdef, state).loss(idx, idx)

    for name, fn, n_lm_head in (("forward", fwd, 1), ("loss", loss, None)):
        dots = _dots(jax.jit(fn).lower(state, idx).as_text())
        # c_attn, c_proj, c_fc, mlp c_proj; q k^T and p v (per query block for the blocked einsum attention)
        per_layer = 4 + 2 * (len(attention_op.query_blocks(idx.shape[1])) if attention == "einsum" else 1)
        if n_lm_head is not None:
            assert len(dots) == per_layer * cfg.n_layer + n_lm_head, f"{name}: {len(dots)} dots"
        else:  # the loss may compute the lm_head in chunks
            assert len(dots) >= per_layer * cfg.n_layer + 1, f"{name}: {len(dots)} dots"
        for lhs, rhs, res, res_type in dots:
            assert (lhs, rhs) == ("bf16", "bf16"), f"{name}: dot with {lhs} x {rhs} operands: {res_type}"
        bf16_out = [t for *_, res, t in dots if res != "f32"]
        if attention in ("reference", "einsum"):
            assert not bf16_out, f"{name}: dots without an fp32 result: {bf16_out}"
        else:
            # jax.nn.dot_product_attention(implementation="xla") computes probs @ v with a bf16 result (jax's
            # code, not ours): exactly one dot per layer, shaped (B, N, T, 1, D). c_proj casts that output to
            # bf16 anyway, so no precision is lost; test_bf16_xla_attention_matches_reference checks it.
            B, T, N, D = 2, 16, cfg.n_head, cfg.head_dim
            assert bf16_out == [f"tensor<{B}x{N}x{T}x1x{D}xbf16>"] * cfg.n_layer, bf16_out


def test_bf16_xla_attention_matches_reference():
    """The bf16-result P@V dot of XLA's attention costs nothing: both bf16 paths agree to fp32 rounding
    (on CPU they are bit-identical: XLA accumulates the bf16 dot in fp32, and c_proj rounds to bf16 anyway)."""
    idx = tokens(2, 32, seed=5)
    a = np.asarray(fwd(model(compute_dtype="bfloat16", attention="xla"), idx))
    b = np.asarray(fwd(model(compute_dtype="bfloat16", attention="reference"), idx))
    assert np.abs(a - b).max() <= SELF_FP32_ATOL


# ---- LayerNorm -----------------------------------------------------------------------------------------
def test_layer_norm_matches_torch_with_gpt2_eps():
    import torch

    C = 64
    rng = np.random.default_rng(0)
    # Small-variance rows (var ~1e-6, below eps) make eps matter: 1e-5 and Flax's default 1e-6 differ by ~30%.
    x = np.concatenate([rng.normal(0.0, 1e-3, (4, C)), rng.normal(0.5, 1.0, (4, C))]).astype(np.float32)
    scale = rng.normal(1, 0.1, C).astype(np.float32)
    bias = rng.normal(0, 0.1, C).astype(np.float32)

    m = model()
    assert TINY.layer_norm_epsilon == 1e-5
    lns = [m.ln_f, *(b.ln_1 for b in m.h), *(b.ln_2 for b in m.h)]
    assert all(ln.eps == 1e-5 for ln in lns)

    ln = LayerNorm(C, bias=True, eps=TINY.layer_norm_epsilon)
    ln.scale[...], ln.bias[...] = jnp.asarray(scale), jnp.asarray(bias)
    ours = np.asarray(ln(jnp.asarray(x))[1])  # (x, ln(x))

    tln = torch.nn.LayerNorm(C, eps=1e-5)
    with torch.no_grad():
        tln.weight.copy_(torch.from_numpy(scale))
        tln.bias.copy_(torch.from_numpy(bias))
        theirs = tln(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-6, rtol=0)

    tln_flax_eps = torch.nn.LayerNorm(C, eps=1e-6)  # the check can tell the epsilons apart
    with torch.no_grad():
        tln_flax_eps.weight.copy_(torch.from_numpy(scale))
        tln_flax_eps.bias.copy_(torch.from_numpy(bias))
        other = tln_flax_eps(torch.from_numpy(x)).numpy()
    assert np.abs(ours - other).max() > 0.1

    no_bias = LayerNorm(C, bias=False, eps=1e-5)
    assert no_bias.bias is None
    np.testing.assert_allclose(np.asarray(no_bias(jnp.asarray(x), keep_residual=False)[0]),
                               torch.nn.functional.layer_norm(torch.from_numpy(x), (C,), eps=1e-5).numpy(),
                               atol=2e-6, rtol=0)
