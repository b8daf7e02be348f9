"""Which tile configuration each Pallas kernel was built with: every ``pallas_call`` made while :func:`recording`
is active is described (its name, grid, block shapes, the kernel's own tile arguments such as a GEMM's K step
``bk``, and Triton's ``num_warps`` / ``num_stages``), once per distinct configuration.

The bench worker records the step it measures (``pallas_kernels`` in each jaxgpt row), the profile the step it
traces, and the on-device kernel checks (:mod:`benchmarks.gpu.kernel_check`) every kernel their tests built, so a
result says which tiles a measured Pallas GEMM ran with. ``compiled=True`` also turns a call that asked for
Pallas' interpreter into a compiled kernel (the kernel checks run the CPU tests' interpreted kernels for real on a
GPU). It wraps ``jax.experimental.pallas.pallas_call``, which jaxgpt's kernel modules look up at call time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any


def _plain(v: Any) -> Any:
    """A JSON-able form of a tile argument (ints, floats, strings, tuples of them; else its repr)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return repr(v)


def _blocks(specs: Any) -> list | None:
    if specs is None:
        return None
    specs = specs if isinstance(specs, (list, tuple)) else [specs]
    return [_plain(getattr(s, "block_shape", None)) for s in specs]


def describe(kernel: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One ``pallas_call``'s configuration: name, grid, in/out block shapes, the kernel's bound keyword arguments
    (``functools.partial``: a GEMM's ``bk``), and its compiler parameters (None: Pallas' defaults)."""
    params = kwargs.get("compiler_params")
    fields = {k: _plain(getattr(params, k)) for k in ("num_warps", "num_stages") if hasattr(params, k)}
    bound = kernel.keywords if isinstance(kernel, functools.partial) else {}
    name = kwargs.get("name") or getattr(getattr(kernel, "func", kernel), "__name__", "?")
    return {"name": name, "grid": _plain(kwargs.get("grid")), "in_blocks": _blocks(kwargs.get("in_specs")),
            "out_blocks": _blocks(kwargs.get("out_specs")), "kernel_args": {k: _plain(v) for k, v in bound.items()},
            "compiler_params": fields or None, "interpret": bool(kwargs.get("interpret"))}


@contextlib.contextmanager
def recording(*, compiled: bool = False) -> Iterator[list[dict[str, Any]]]:
    """Record every ``pallas_call`` made inside: yields the list the descriptions go to (distinct ones, in the
    order first made). ``compiled``: a call asking for the interpreter gets a compiled kernel instead (recorded
    with ``"forced_compiled": True``; its compiler parameters are Pallas' defaults unless it passed its own)."""
    from jax.experimental import pallas as pl

    real, seen = pl.pallas_call, []

    def wrapped(kernel, *args, **kwargs):
        forced = compiled and kwargs.get("interpret")
        if forced:
            kwargs = {**kwargs, "interpret": False}
        d = {**describe(kernel, kwargs), **({"forced_compiled": True} if forced else {})}
        if d not in seen:
            seen.append(d)
        return real(kernel, *args, **kwargs)

    pl.pallas_call = wrapped
    try:
        yield seen
    finally:
        pl.pallas_call = real


def gemm_tiles(seen: list[dict[str, Any]]) -> list[str]:
    """One line per Pallas GEMM (``gemm*``) configuration: ``name bm x bn x bk, W warps, S stages, grid``."""
    out = []
    for d in seen:
        if not str(d["name"]).startswith("gemm"):
            continue
        tile = (d["out_blocks"] or [None])[0]
        bk = d["kernel_args"].get("bk")
        cp = d["compiler_params"] or {}
        shape = " x ".join(str(x) for x in [*(tile or ["?"]), *([bk] if bk else [])])
        out.append(f"{d['name']} {shape}, {cp.get('num_warps', 'default')} warps, {cp.get('num_stages', 'default')} "
                   f"stages, grid {d['grid']}")
    return out
