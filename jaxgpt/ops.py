"""Fast, exact-in-intent building blocks that the precision policy switches on (``Policy.fast_kernels``).

Each function here computes the same mathematical result as the plain expression named in its docstring;
what changes is how XLA is allowed to run it. The parity tests check them against the plain expressions.

* :func:`matmul` — ``x @ w`` in the compute dtype with fp32 accumulation, with a backward whose matmuls
  take their transposed operands the way XLA:CPU runs fastest. XLA:CPU's ``operand-upcaster`` pass turns a
  bf16 dot into an fp32 dot whenever an operand arrives in a transposed (column-major) layout, which
  autodiff's ``dX = g W^T`` and ``dW = X^T g`` always do; on CPU the custom VJP therefore hands XLA real row-major transposed copies
  (:func:`transpose_operand`). In fp32 the VJP hands the transposed operands straight to the dots, which
  avoids the copies XLA otherwise places around autodiff's backward dots: measured on a 2-core Intel
  Xeon, the fp32 train step of gpt2 124M at T=1024 went from 7.4 s (autodiff) to 5.7 s (this VJP with
  row-major copies) to 5.2 s (transposed operands), 1.42x in all.
(The blocked causal attention with a hand-written backward is :mod:`jaxgpt.kernels.attention`'s ``einsum``; the fused
lm_head + cross-entropy, the loss's own building block, is :mod:`jaxgpt.kernels.loss`.)

What each one saved is measured in ``BENCHMARKS.md`` and in the docstrings below; ``tests/test_ops.py`` checks
each against the plain expression, values and gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float


_TRACED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxgpt_traced_for", default=None)


def platform() -> str:
    """The platform ("cpu", "gpu", "tpu") whose kernels computations traced now get: inside
    :func:`traced_for` the platform of the devices the computation is being traced for (the train and eval steps
    trace under their mesh's devices, so a step compiled from a CPU process for compile-only H100 devices gets
    the GPU program); else the device set by ``jax.default_device(...)`` (or ``JAX_DEFAULT_DEVICE``) where there
    is one, else JAX's default backend. A CPU computation on a machine with a GPU
    (``with jax.default_device(jax.devices("cpu")[0])``) must get the CPU's kernels, not cuDNN's."""
    traced = _TRACED_FOR.get()
    if traced is not None:
        return traced
    dev = jax.config.jax_default_device
    if dev is None:
        return jax.default_backend()
    return _canonical(dev if isinstance(dev, str) else dev.platform)


def _canonical(name: str) -> str:
    return "gpu" if name in ("cuda", "rocm") else name


def devices_platform(devices) -> str:
    """The one platform of ``devices`` (a ``Mesh``, or an iterable of ``jax.Device``); refuses a mixture."""
    flat = list(devices.devices.flat) if hasattr(devices, "devices") else list(devices)
    found = {_canonical(d.platform) for d in flat}
    if len(found) != 1:
        raise ValueError(f"devices of one computation must share a platform, got {sorted(found)}")
    return found.pop()


@contextlib.contextmanager
def traced_for(devices):
    """Trace the computations inside for ``devices`` (a ``Mesh`` or ``jax.Device`` iterable): :func:`platform`
    answers their platform, whatever the process's default backend."""
    token = _TRACED_FOR.set(devices_platform(devices))
    try:
        yield
    finally:
        _TRACED_FOR.reset(token)


def materialize_transpose(a: Float[Array, "*batch m n"]) -> Float[Array, "*batch n m"]:
    """``a`` with its last two axes swapped, as a real row-major array. A plain ``.T`` (or a copy of it) is
    folded by XLA into the consumer as a layout change, which makes XLA:CPU upcast a bf16 dot to fp32;
    flattening behind an optimization barrier forces the physical transpose."""
    swapped = jnp.swapaxes(a, -1, -2)
    if platform() != "cpu":
        return swapped  # GPU/TPU matmul units take transposed operands at full speed
    return lax.optimization_barrier(swapped.reshape(-1)).reshape(swapped.shape)


def transpose_operand(a: Float[Array, "*batch m n"]) -> Float[Array, "*batch n m"]:
    """``a`` with its last two axes swapped, to be a dot operand: a real row-major copy
    (:func:`materialize_transpose`) for bf16 on CPU, whose transposed-operand dots XLA:CPU would run in fp32;
    otherwise a plain swap that XLA folds into the dot (fp32 dots take transposed operands directly, faster
    than copies: see :func:`matmul` in the module docstring)."""
    if a.dtype == jnp.bfloat16:
        return materialize_transpose(a)
    return jnp.swapaxes(a, -1, -2)


def round_to(x: Float[Array, "*dims"], dtype) -> Float[Array, "*dims"]:
    """``x`` rounded to ``dtype``'s precision (round to nearest even), kept in its own dtype: the value of
    ``x.astype(dtype).astype(x.dtype)`` as one ``reduce_precision`` op, which no fusion mistakes for a no-op (XLA:CPU's
    YNNPACK fusions, jax 0.10.2, dropped such a convert pair where an fp32 op consumed it: a gradient then saw the
    unrounded value)."""
    info, own = jnp.finfo(dtype), jnp.finfo(x.dtype)
    if info.nmant >= own.nmant and info.nexp >= own.nexp:  # x's dtype holds no more than ``dtype``: nothing to round
        return x
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _dot(a, b, dtype, precision, out=jnp.float32):
    """``a @ b`` with operands in ``dtype``, fp32 accumulation, the result rounded to ``out``: on GPUs one GEMM that
    writes ``out`` (cuBLAS accumulates bf16 products in fp32); elsewhere an fp32 result, then rounded."""
    a, b = a.astype(dtype), b.astype(dtype)
    if out != jnp.float32 and platform() == "gpu":
        return lax.dot(a, b, precision=precision, preferred_element_type=out)
    # rounded by reduce_precision first: its convert to ``out`` is then exact, and the rounding cannot be fused away
    return round_to(lax.dot(a, b, precision=precision, preferred_element_type=jnp.float32), out).astype(out)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul2d(x, w, dtype, precision, out):
    return _dot(x, w, dtype, precision, out)


def _matmul2d_fwd(x, w, dtype, precision, out):
    xc, wc = x.astype(dtype), w.astype(dtype)
    return _dot(xc, wc, dtype, precision, out), (xc, wc, jnp.zeros((), x.dtype))


def _matmul2d_bwd(dtype, precision, out, res, g):
    xc, wc, x_like = res
    gc = g.astype(dtype)
    dx = _dot(gc, transpose_operand(wc), dtype, precision, out)  # (M, N) @ (N, K), rounded as the forward's output
    dw = _dot(transpose_operand(xc), gc, dtype, precision)  # (K, M) @ (M, N): weight gradients stay fp32
    return dx.astype(x_like.dtype), dw


_matmul2d.defvjp(_matmul2d_fwd, _matmul2d_bwd)


def matmul(x: Float[Array, "... d_in"], w: Float[Array, "d_in d_out"], *, dtype,
           precision=None, out_dtype=jnp.float32) -> Float[Array, "... d_out"]:
    """``x @ w``: operands in ``dtype``, fp32 accumulation, the result (and the backward's ``dx``) rounded to
    ``out_dtype`` (fp32: not rounded; bf16: torch.autocast's GEMM output), bf16-friendly backward."""
    lead = x.shape[:-1]
    y = _matmul2d(x.reshape(-1, x.shape[-1]), w, jnp.dtype(dtype), precision, jnp.dtype(out_dtype))
    return y.reshape(*lead, w.shape[-1])


def dropout(x: Array, rate: float, key: jax.Array | None) -> Array:
    """Inverted dropout; a no-op when ``key`` is None (evaluation) or the rate is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def add_bias(y: Float[Array, "... d"], bias: Float[Array, " d"] | None) -> Float[Array, "... d"]:
    """``y + bias`` (``y`` where there is none): a Linear's bias add, as the kernel layer's ops write it (the FLOP
    counts of parity_tests/test_flops_parity.py find bias adds by this name)."""
    return y if bias is None else y + bias
