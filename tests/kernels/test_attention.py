"""jaxgpt.kernels.attention: the einsum implementation (query-blocked, hand-written backward: the CPUs' choice)
against the reference (plain einsums, causal mask, fp32 softmax), values and gradients; what ``auto`` picks where.
XLA's and cuDNN's paths against the reference: tests/test_model.py (xla) and the parity tests (GPUs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.kernels import attention
from jaxgpt.precision import Policy

from tests.test_ops import F32, HIGHEST, _rand, _rel  # the same helpers as the other ops' tests


@pytest.mark.parametrize("shape", [(2, 16, 2, 8), (1, 37, 3, 16)], ids=["tiny", "odd"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_causal_attention_matches_reference(shape, dtype):
    """Output and q/k/v gradients of attention.causal_attention (hand-written backward) equal the autodiff of
    reference_attention (plain einsums, causal mask, fp32 softmax)."""
    q, k, v, g = (_rand(i, shape) for i in range(4))
    policy = Policy(compute_dtype=dtype, matmul_precision="highest" if dtype == "float32" else "default")
    fast = lambda q, k, v: attention.causal_attention(q, k, v, dtype=policy.dtype, precision=policy.lax_precision)  # noqa: E731
    ref = lambda q, k, v: attention.reference_attention(q, k, v, policy=policy)  # noqa: E731
    yf, yr = jax.jit(fast)(q, k, v), jax.jit(ref)(q, k, v)
    gf = jax.jit(jax.grad(lambda *a: jnp.sum(fast(*a) * g), argnums=(0, 1, 2)))(q, k, v)
    gr = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * g), argnums=(0, 1, 2)))(q, k, v)
    if dtype == "float32":
        assert _rel(yf, yr) <= 1e-6
        for name, a, b in zip("qkv", gf, gr):
            assert _rel(a, b) <= 1e-5, name
    else:  # same bf16 products; the backward rounds g, P and dS to bf16 where the autodiff may keep fp32
        assert _rel(yf, yr) <= 1e-6
        for name, a, b in zip("qkv", gf, gr):
            assert _rel(a, b) <= 3e-2, name
    assert yf.dtype == F32 and all(a.dtype == F32 for a in gf)


@pytest.mark.parametrize("seq", [1, 5, 37, 256, 1024])
def test_query_blocks_cover_the_sequence(seq):
    """Near-equal, contiguous query blocks covering [0, seq); no empty block even when seq < the block count."""
    blocks = attention.query_blocks(seq)
    assert blocks[0][0] == 0 and blocks[-1][1] == seq
    assert all(b0[1] == b1[0] for b0, b1 in zip(blocks, blocks[1:]))
    sizes = [b - a for a, b in blocks]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert len(blocks) == min(attention.ATTENTION_QUERY_BLOCKS, seq)


@pytest.mark.parametrize("n_blocks", [1, 2, 3, 7])
def test_causal_attention_any_block_count(monkeypatch, n_blocks):
    """The query blocking is an implementation detail: 1 (dense), 2, 3 (uneven) or 7 blocks give the
    reference's output and gradients (fp32, highest precision)."""
    monkeypatch.setattr(attention, "ATTENTION_QUERY_BLOCKS", n_blocks)
    q, k, v, g = (_rand(i, (2, 23, 2, 8)) for i in range(4))
    policy = Policy(compute_dtype="float32", matmul_precision="highest")
    fast = lambda q, k, v: attention.causal_attention(q, k, v, dtype=policy.dtype, precision=policy.lax_precision)  # noqa: E731
    ref = lambda q, k, v: attention.reference_attention(q, k, v, policy=policy)  # noqa: E731
    assert _rel(jax.jit(fast)(q, k, v), jax.jit(ref)(q, k, v)) <= 1e-6
    gf = jax.jit(jax.grad(lambda *a: jnp.sum(fast(*a) * g), argnums=(0, 1, 2)))(q, k, v)
    gr = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * g), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", gf, gr):
        assert _rel(a, b) <= 1e-5, name


def test_causal_attention_is_causal():
    """Changing a later key/value never changes an earlier output, nor its gradient w.r.t. earlier inputs."""
    q, k, v = (_rand(i, (1, 8, 2, 4)) for i in range(3))
    f = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, dtype=F32, precision=HIGHEST))
    k2, v2 = k.at[:, 5:].add(10.0), v.at[:, 5:].add(10.0)
    np.testing.assert_array_equal(np.asarray(f(q, k, v)[:, :5]), np.asarray(f(q, k2, v2)[:, :5]))
    dq = jax.grad(lambda q: jnp.sum(f(q, k, v)[:, :5]))(q)
    assert not np.asarray(dq[:, 5:]).any()


def test_default_attention_per_backend():
    """auto: the einsum kernel on CPU (with fast_kernels), cuDNN for bf16 on GPU, XLA's path otherwise."""
    backend = jax.default_backend()
    on_cpu, on_gpu = backend == "cpu", backend == "gpu"
    assert Policy.bf16().attention_impl() == ("einsum" if on_cpu else "cudnn" if on_gpu else "xla")
    assert Policy.fp32().attention_impl() == ("einsum" if on_cpu else "xla")
    assert Policy.fp32(fast_kernels=False).attention_impl() == "xla"
    assert Policy.bf16(kernels={"attention": "xla"}).attention_impl() == "xla"
