"""Checkpoint integrity: a content digest per array, and the damage a checkpoint can have.

:func:`tree_digests` gives every array of a pytree a digest of the bytes of the whole (logical) array:

* ``xxh3:<128 bits>``: XXH3-128 of the array's C-order bytes on the host, for arrays this process holds whole
  (one process; sharded over local devices too). xxHash runs at ~10 GB/s on one core, about 12x faster than an
  integer reduction in XLA:CPU here, and any change of the bytes changes it but with probability 2**-128.
* ``dev:<96 bits>``: for arrays spread over several processes, three sums computed on the devices by one jitted
  function, on the logical array (so independent of the layout): as unsigned 32-bit words ``w[i, j]`` (``j``
  along the last axis, ``i`` the row-major index of the others), ``T = sum w``, ``A = sum i w`` and ``B = sum
  j w``, modulo 2**32. A flipped bit changes ``w[i, j]`` by ``d = +-2**k`` and ``T`` by ``d``, never a multiple
  of 2**32; a value moved to another row or column changes ``A`` or ``B``.

A checkpoint restored onto another layout is verified all the same: a host digest of an array that is now
spread over processes is recomputed from the gathered array. A damaged step is reported as a
:class:`CheckpointDamaged` naming the step, the item or array and the reason.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DIGEST_FORMAT = "jaxgpt-digest-v1"


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
    """uint32[3] (T, A, B) of one array (see the module docstring)."""
    w = _words(x)
    if w.ndim == 0:
        w = w[None]
    j = jax.lax.broadcasted_iota(jnp.uint32, w.shape, w.ndim - 1)
    rows = jnp.sum(w, axis=-1, dtype=jnp.uint32)  # (leading dims)
    b = jnp.sum(j * w, dtype=jnp.uint32)
    i = jnp.zeros(rows.shape, jnp.uint32)  # row-major index of the leading dims, without reshaping a sharded array
    stride = 1
    for axis in reversed(range(rows.ndim)):
        i = i + jax.lax.broadcasted_iota(jnp.uint32, rows.shape, axis) * np.uint32(stride % 2**32)
        stride *= rows.shape[axis]
    return jnp.stack([jnp.sum(rows, dtype=jnp.uint32), jnp.sum(i * rows, dtype=jnp.uint32), b])


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


def _host_digest(x: Any) -> str:
    import xxhash

    a = np.ascontiguousarray(np.asarray(x))
    return "xxh3:" + xxhash.xxh3_128_hexdigest(memoryview(a.reshape(-1).view(np.uint8)))


def tree_digests(tree: Any, *, like: dict[str, str] | None = None) -> dict[str, str]:
    """``{array path: digest}`` for every array leaf of ``tree``: a host digest for arrays this process holds
    whole, a device digest otherwise (a collective with several processes: every process must call it). With
    ``like`` (the digests recorded at save time) each array gets the kind recorded for it, so a checkpoint
    restored onto another layout is checked with the digest it was saved with."""
    leaves = [(array_path(p), v) for p, v in jax.tree_util.tree_leaves_with_path(tree)]
    kinds = {path: (like or {}).get(path, "").split(":")[0] or
             ("xxh3" if getattr(v, "is_fully_addressable", True) else "dev") for path, v in leaves}
    out: dict[str, str] = {}
    device = [(path, v) for path, v in leaves if kinds[path] == "dev"]
    if device:
        digests = jax.device_get(_tree_digest([v for _, v in device]))
        out.update({path: "dev:" + "-".join(f"{int(w):08x}" for w in d) for (path, _), d in zip(device, digests)})
    host = []
    for path, v in leaves:
        if kinds[path] == "xxh3":
            if not getattr(v, "is_fully_addressable", True):  # saved whole, now spread over processes
                from jax.experimental import multihost_utils

                v = multihost_utils.process_allgather(v, tiled=True)  # a collective: in order, on every process
            host.append((path, v))
    # XXH3 releases the GIL: the arrays hash concurrently (10 -> 14 GB/s on 2 cores for gpt2's 1.5 GB)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        out.update(zip([path for path, _ in host], pool.map(_host_digest, [v for _, v in host])))
    return out


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


ABANDONED_READ = "_read_array_index_and_device_put"  # orbax's coroutine that reads one array
# orbax's coroutine that writes one array's fragments: when a save fails (a full disk), the first failure reaches
# the save's future and is reported (Checkpoints.check); its sibling writes that failed too are never retrieved.
# Their fragments are written by its inner coroutine ``write_fragment`` under an ``asyncio.gather``: when several
# fail, asyncio logs "_GatheringFuture exception was never retrieved" with a traceback of that frame alone (CI,
# 2026-11-26).
ABANDONED_WRITE = ("async_serialize_from_host", "write_fragment")
ABANDONED = (ABANDONED_READ, *ABANDONED_WRITE)


def _from_abandoned_read(exc: BaseException | None, text: str = "") -> bool:
    """Whether a report concerns one of orbax's abandoned array reads or writes (the failure itself is reported
    once, by the restore or the save): its text names the coroutine, or one of the exception's traceback frames
    (through its causes) is that coroutine."""
    if any(name in text for name in ABANDONED):
        return True
    seen = 0
    while exc is not None and seen < 8:
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name in ABANDONED:
                return True
            tb = tb.tb_next
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class _AbandonedReadFilter(logging.Filter):
    """asyncio logs "Task/Future exception was never retrieved" for a read that failed after orbax gave up on it,
    and for the sibling writes of a failed save."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not _from_abandoned_read(exc, record.getMessage())


def quiet_abandoned_reads() -> None:
    """After a failed restore, orbax leaves its other array reads as coroutines that Python reports as
    "Exception ignored in: <coroutine ...>" with a TensorStore spec when they are collected, asyncio may log
    "exception was never retrieved" for them, and TensorStore's threads may report "Event loop is closed" for
    reads that finish after orbax closed its loop, possibly before the failure itself reaches the reading thread.
    The failure is reported (as :class:`CheckpointDamaged`): drop exactly those reports, pass every other one on.
    The same for a failed save's sibling writes (a full disk fails several at once; the first is reported by
    :meth:`Checkpoints.check`). Installed once, before any restore or save."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxgpt_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        obj, exc = getattr(unraisable, "object", None), getattr(unraisable, "exc_value", None)
        if getattr(obj, "__qualname__", "").startswith(ABANDONED) or _from_abandoned_read(exc, repr(obj)):
            return  # the abandoned read itself (a coroutine, or a task wrapping it)
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return  # TensorStore finishing an abandoned read after orbax closed its event loop
        previous(unraisable)

    hook._jaxgpt_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_AbandonedReadFilter())
