"""Tiles: a Pallas GEMM's block sizes, warps and stages, chosen per shape from a small set by op-level timing.

A tunable op (:class:`TunableOp`) names its configurations and builds, for one configuration and one shape, a
jitted function and its inputs. :func:`tune` times every configuration at every shape (compiled first, then
``warmup`` runs and the median of ``repeats``, synchronised), drops one that fails with a line naming it and why,
and keeps the fastest; the op's default (its first configuration) stays unless another beats it by more than the
noise both measured. The choice is cached with the program's (:mod:`jaxgpt.train.tune.cache`, ``tiles``) and installed
for the run (:func:`install`); :func:`chosen` is what a kernel asks at trace time.

The Pallas GEMM core (``gemm``: :func:`jaxgpt.kernels.gemm.gemm_bias_cast`, on GPUs) is registered here; its shapes
are the ones the kernels trace while the chosen program is lowered (:func:`note`, called by
:func:`jaxgpt.kernels.gemm.blocks`), and its timing at a shape stands in for every Pallas GEMM of that shape.
On a CPU no Pallas GEMM runs (their XLA paths do), so there the mechanism is exercised with an op a test
registers; what tiles a GPU prefers only a GPU can show."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any


def one_line(e: BaseException, limit: int = 240) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    line = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."



@dataclasses.dataclass(frozen=True)
class Tile:
    """One Triton GEMM configuration: the (block_m, block_n, block_k) tile and the launch's warps and stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int

    @property
    def block(self) -> tuple[int, int, int]:
        return self.block_m, self.block_n, self.block_k

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.warps}/s{self.stages}"


# the default first (jaxgpt.kernels.gemm's BLOCK_* / NUM_WARPS / NUM_STAGES), then Triton's usual Hopper bf16 set
GEMM_TILES = (Tile(128, 128, 64, 8, 3), Tile(128, 256, 64, 8, 3), Tile(256, 128, 64, 8, 3), Tile(64, 128, 64, 4, 4),
              Tile(128, 64, 64, 4, 4), Tile(128, 128, 32, 4, 4), Tile(64, 64, 64, 4, 3))


@dataclasses.dataclass(frozen=True)
class TunableOp:
    """An op with configurations: ``make(config, shape) -> (jitted function, its arguments)``; ``encode`` /
    ``decode`` turn a configuration into JSON and back."""

    name: str
    platforms: tuple[str, ...]
    configs: tuple[Any, ...]
    make: Callable[[Any, tuple[int, ...]], tuple[Callable, tuple]]
    encode: Callable[[Any], Any] = dataclasses.asdict
    decode: Callable[[Any], Any] = lambda d: Tile(**d)


OPS: dict[str, TunableOp] = {}
_SEEN: dict[str, set[tuple[int, ...]]] = {}  # op -> the shapes traced since the last clear_seen()
_TABLE: dict[tuple[str, tuple[int, ...]], Any] = {}  # (op, shape) -> the configuration installed for the run
_FORCED: dict[str, Any] = {}  # op -> the configuration being timed (op-level timing only)


def register(op: TunableOp) -> TunableOp:
    OPS[op.name] = op
    return op


def note(op: str, shape: Iterable[int]) -> None:
    """A kernel of ``op`` was traced at ``shape`` (its tiles may be tuned there)."""
    _SEEN.setdefault(op, set()).add(tuple(int(s) for s in shape))


def seen(op: str) -> list[tuple[int, ...]]:
    return sorted(_SEEN.get(op, ()))


def clear_seen() -> None:
    _SEEN.clear()


def chosen(op: str, shape: Iterable[int] | None = None) -> Any | None:
    """The configuration ``op`` runs with at ``shape``: the one being timed, else the installed one for that shape,
    else None (the op's default)."""
    if op in _FORCED:
        return _FORCED[op]
    return None if shape is None else _TABLE.get((op, tuple(int(s) for s in shape)))


def install(tiles: dict[str, list[dict[str, Any]]] | None) -> int:
    """Install a cached ``tiles`` record ({op: [{"shape": [...], "config": {...}}, ...]}) for the run; returns the
    number of entries (ops no longer registered are skipped)."""
    _TABLE.clear()
    for name, entries in (tiles or {}).items():
        op = OPS.get(name)
        if op is None:
            continue
        for e in entries:
            _TABLE[(name, tuple(e["shape"]))] = op.decode(e["config"])
    return len(_TABLE)


def _time(fn: Callable, args: tuple, warmup: int, repeats: int) -> list[float]:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _iqr(times: list[float]) -> float:
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return q3 - q1


def tune(name: str, shapes: Iterable[tuple[int, ...]], *, warmup: int = 2, repeats: int = 5,
         say: Callable[[str], None] = print, deadline: float | None = None) -> list[dict[str, Any]]:
    """Time every configuration of op ``name`` at every shape; one entry per shape: ``shape``, the chosen
    ``config``, and every configuration's ``median_ms`` (None: dropped, with ``error``). ``deadline``
    (perf_counter time): shapes not reached by then keep the default."""
    op = OPS[name]
    out = []
    for shape in shapes:
        if deadline is not None and time.perf_counter() > deadline:
            say(f"auto: tiles: {name} {shape} and later shapes not tuned (the search's budget): defaults")
            break
        rows, best, best_t = [], None, None
        for config in op.configs:
            _FORCED[name] = config
            try:
                fn, args = op.make(config, shape)
                t = _time(fn, args, warmup, repeats)
                rows.append({"config": op.encode(config), "median_ms": statistics.median(t), "iqr_ms": _iqr(t)})
            except Exception as e:  # noqa: BLE001: a configuration that fails is dropped
                rows.append({"config": op.encode(config), "median_ms": None, "error": one_line(e)})
                say(f"auto: tiles: {name} {shape} {config} dropped: {one_line(e)}")
                continue
            finally:
                _FORCED.pop(name, None)
            r = rows[-1]
            if best is None or r["median_ms"] < best_t["median_ms"] - max(r["iqr_ms"], best_t["iqr_ms"]):
                best, best_t = config, r
        if best is not None:
            out.append({"shape": list(shape), "config": op.encode(best), "timings": rows})
    return out


def tune_seen(platform: str, *, say: Callable[[str], None] = print, deadline: float | None = None
              ) -> dict[str, list[dict[str, Any]]]:
    """Tune every registered op that runs on ``platform`` at the shapes it was traced at (:func:`note`)."""
    return {name: tune(name, seen(name), say=say, deadline=deadline)
            for name, op in OPS.items() if platform in op.platforms and seen(name)}


def _make_gemm(tile: Tile, shape: tuple[int, ...]) -> tuple[Callable, tuple]:
    """The Pallas GEMM core at ``shape`` = (m, n, k) with ``tile`` (bf16 operands, fp32 bias, bf16 output)."""
    import jax
    import jax.numpy as jnp

    from jaxgpt.kernels.gemm import gemm_bias_cast

    m, n, k = shape
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.bfloat16)
    b = jnp.zeros((n,), jnp.float32)
    # compiled at its first call, inside tune()'s timing, while _FORCED holds the tile (warps and stages: chosen())
    return jax.jit(lambda x, w, b: gemm_bias_cast(x, w, b, block=tile.block)), (x, w, b)


register(TunableOp("gemm", ("gpu",), GEMM_TILES, _make_gemm))
