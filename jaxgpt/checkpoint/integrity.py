"""Checkpoint integrity: a content digest per array, and the damage a checkpoint can have.

:func:`tree_digests` gives every array of a pytree a 64-bit digest of its bytes: two sums, modulo 2**32, of
the array's elements as unsigned 32-bit words, each multiplied by an odd weight that depends on the element's
position. Because every weight is odd, any single flipped bit changes both sums (a flip adds or subtracts
2**k times an odd number, never a multiple of 2**32), and a swap of two elements changes the weighted sums;
other damage goes unnoticed with probability about 2**-64. The digest is computed on the device, by one jitted
function over the whole tree, on the *logical* array: a sharded array (FSDP, several processes) has the same
digest as the whole one, so a checkpoint saved on one mesh verifies when restored onto another. Words are
summed, so the reduction order, and with it the platform, does not matter.

A damaged step is reported as a :class:`CheckpointDamaged` naming the step, the item or array and the reason.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DIGEST_FORMAT = "jaxgpt-u32x2-v1"
# Odd multipliers of the two sums' position weights (the golden-ratio and a Murmur3 constant).
_W1, _W2 = np.uint32(0x9E3779B1), np.uint32(0x85EBCA6B)


class CheckpointDamaged(ValueError):
    """A checkpoint step that cannot be trusted: unreadable, truncated, garbage metadata, or an array whose
    bytes no longer match the digest recorded when it was saved."""

    def __init__(self, step: int, where: str, reason: str):
        super().__init__(f"checkpoint step {step} is damaged: {where}: {reason}")
        self.step, self.where, self.reason = step, where, reason


def _words(x: jax.Array) -> jax.Array:
    """The array's bytes as uint32 words (8-byte elements give two words along a new last axis)."""
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"cannot digest dtype {x.dtype}")


def _digest(x: jax.Array) -> jax.Array:
    """uint32[2] of one array (see the module docstring)."""
    w = _words(x)
    if w.ndim == 0:
        w = w[None]
    index = jnp.zeros(w.shape, jnp.uint32)  # row-major element index, without reshaping a sharded array
    stride = 1
    for axis in reversed(range(w.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * np.uint32(stride % 2**32)
        stride *= w.shape[axis]
    a = jnp.sum(w * (index * _W1 | np.uint32(1)), dtype=jnp.uint32)
    b = jnp.sum((w ^ (w >> 15)) * (index * _W2 + np.uint32(0x7F4A7C15) | np.uint32(1)), dtype=jnp.uint32)
    return jnp.stack([a, b])


@functools.partial(jax.jit)
def _tree_digest(tree: Any) -> Any:
    return jax.tree.map(_digest, tree)


def array_path(path: tuple[Any, ...]) -> str:
    """A leaf's path as ``a/b/0/c``: the same for the tree that was saved (attributes, tuples) and for the plain
    dicts orbax restores without a target."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def tree_digests(tree: Any) -> dict[str, str]:
    """``{array path: "xxxxxxxx-xxxxxxxx"}`` for every array leaf of ``tree`` (a collective with several
    processes: every process must call it)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        return {}
    digests = jax.device_get(_tree_digest([v for _, v in leaves]))
    return {array_path(path): f"{int(d[0]):08x}-{int(d[1]):08x}" for (path, _), d in zip(leaves, digests)}


def mismatches(saved: dict[str, str], actual: dict[str, str]) -> list[str]:
    """The arrays whose digest differs from (or is missing in) the saved record, described."""
    out = []
    for path in sorted(set(saved) | set(actual)):
        if path not in actual:
            out.append(f"{path}: recorded but not restored")
        elif path not in saved:
            out.append(f"{path}: restored but has no recorded digest")
        elif saved[path] != actual[path]:
            out.append(f"{path}: digest {actual[path]}, saved {saved[path]}")
    return out


def describe_error(e: BaseException) -> str:
    """One line for an exception raised while reading a damaged step (orbax, tensorstore, json, OS): the
    innermost cause, which names the file or array (orbax's own message embeds a whole TensorStore spec)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split("See full TensorStore details")[0].split())
    if isinstance(e, UnicodeDecodeError):
        text = f"not UTF-8 text ({e.reason} at byte {e.start})"
    if len(text) > 300:
        text = text[:300] + " ..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def quiet_abandoned_reads() -> None:
    """After a failed restore, orbax leaves its other array reads as coroutines that Python reports as
    "Exception ignored in: <coroutine ...>" with a TensorStore spec when they are collected. The failure is
    already reported (as :class:`CheckpointDamaged`): drop those reports, pass every other one on."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxgpt_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        obj, exc = getattr(unraisable, "object", None), getattr(unraisable, "exc_value", None)
        if getattr(obj, "__qualname__", "").startswith("_read_array_index_and_device_put"):
            return  # the abandoned read itself
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return  # TensorStore finishing an abandoned read after orbax closed its event loop
        previous(unraisable)

    hook._jaxgpt_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
