"""Does a compiled program fit the GPU's memory? Checked before the first step of ``jaxgpt.train``, ``jaxgpt.eval``
and ``jaxgpt.generate`` on a GPU, so that a batch too large for the device is one line (exit 2, nothing written)
instead of XLA's ``RESOURCE_EXHAUSTED`` traceback; and an out-of-memory error that still happens while running
(fragmentation, another process on the GPU) is recognised, so the callers can say it in one line too.

- needs: XLA's memory analysis of the compiled program, per device: arguments + temporaries + outputs not aliased
  to (donated) arguments + generated code. For gpt2's b64 train step on an H100 it said 29.1 GiB, and the H100
  measured a peak of 29.1 GiB (``shared/gpu/h100-2026-11-26``).
- pool: what JAX's allocator may hand out on the device, ``Device.memory_stats()["bytes_limit"]``
  (``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the GPU's memory, 75% by default); for a compile-only topology, where no
  device runs, the target's memory times that fraction (:func:`topology_pool`).
- A program that needs more than the pool cannot run: it is refused. The batch suggested instead keeps
  :data:`HEADROOM` of the pool free (the allocator's fragmentation, cuDNN/cuBLAS workspaces; ``python -m
  jaxgpt.compile``'s search keeps the same), so that the suggestion itself is not at the edge.
- The largest batch that fits is found by compiling: :func:`largest_fitting` walks down the candidates (halving
  the index) from the refused size until one fits, then bisects between it and the last that did not. Compiling
  is the only reliable oracle: XLA:GPU rematerialises to stay under the device's memory, so the need is not affine
  in the batch (gpt2 on an H100, compile-only: b64 29.1, b128 54.3, b256 62.2 GiB, remat'd from 106.5; an affine
  fit through b256 and b128 puts the slope 6x too low). Memory never shrinks as the batch grows, so the answer is
  exact: the batch returned was compiled and fits, the next larger candidate was compiled and does not (or is the
  refused one). Usually one or two compiles (each ~15-20 s for gpt2 on an H100), only when the check has failed.

On the CPU (no pool to check against: ``memory_stats()`` is None) nothing is compiled or checked.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from jaxgpt.config import ConfigError

GiB = 2**30
HEADROOM = 0.10  # of the pool kept free by a suggested batch (jaxgpt.compile's search keeps the same)
DEFAULT_MEM_FRACTION = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


class DeviceMemoryError(ConfigError):
    """The program needs more device memory than the pool holds (refused before it runs; exit 2). The message names
    what it needs, the pool, and the largest batch that fits."""


class OutOfDeviceMemory(RuntimeError):
    """XLA ran out of device memory while running (exit 2); the message names the step and what to resume from."""


# ---- the figures ------------------------------------------------------------------------------------------------
def program_bytes(compiled: Any) -> int:
    """Bytes per device a compiled program needs at its peak (``jax.stages.Compiled.memory_analysis()``), counted as
    ``jaxgpt.compile`` counts them."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.generated_code_size_in_bytes)


def device_pool(devices: Sequence[Any]) -> int | None:
    """JAX's memory pool on ``devices`` (the smallest ``bytes_limit`` among them), or None where they are not GPUs
    or report no pool: there is then nothing to check."""
    devices = list(devices)
    if not devices or devices[0].platform not in GPU_PLATFORMS:
        return None
    limits = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits)


def mem_fraction() -> float:
    """``XLA_PYTHON_CLIENT_MEM_FRACTION`` as JAX reads it (default 0.75)."""
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    except ValueError:
        return DEFAULT_MEM_FRACTION


def topology_pool(target: Any, fraction: float | None = None) -> int:
    """The pool a GPU of ``target`` (a :class:`jaxgpt.compile.targets.GpuTarget`) would give JAX: its device memory
    times ``fraction`` (default: :func:`mem_fraction`)."""
    return int(target.device_memory_size * (mem_fraction() if fraction is None else fraction))


# ---- the decision -----------------------------------------------------------------------------------------------
def fits(needs: int, pool: int) -> bool:
    """Can a program that needs ``needs`` bytes run in a pool of ``pool``?"""
    return needs <= pool


def suggestion_limit(pool: int) -> int:
    """The most a suggested batch may need: the pool less :data:`HEADROOM`."""
    return int(pool * (1 - HEADROOM))


def candidates(rows: int, below: int, multiple_of: int = 1) -> list[int]:
    """Batch sizes under ``below`` that divide ``rows`` (so accumulation makes the same total) and are multiples of
    ``multiple_of`` (the devices that split each batch), ascending."""
    return [b for b in range(multiple_of, min(below, rows + 1), multiple_of) if rows % b == 0]


def halvings(batch: int) -> list[int]:
    """``batch // 2``, ``batch // 4``, ... down to 1, ascending: the smaller batches a refusal tries."""
    out = []
    while batch > 1:
        batch //= 2
        out.append(batch)
    return out[::-1]


def largest_fitting(sizes: Sequence[int], measure: Callable[[int], int], limit: int,
                    known: dict[int, int] | None = None) -> tuple[int | None, dict[int, int]]:
    """The largest of ``sizes`` (ascending) whose ``measure(size)`` (compiled bytes) is at most ``limit``, and every
    size measured. Walks down from the largest by doubling steps until one fits, then bisects between it and the
    smallest size seen not to fit; ``measure`` must not decrease with the size (memory never shrinks as the batch
    grows). The answer was measured to fit and its next larger size to not fit (unless it is the largest)."""
    measured = dict(known or {})

    def ok(i: int) -> bool:
        size = sizes[i]
        if size not in measured:
            measured[size] = int(measure(size))
        return measured[size] <= limit

    if not sizes:
        return None, measured
    hi, step = len(sizes), 1  # sizes[hi:] do not fit (hi == len: none seen yet)
    i = len(sizes) - 1
    while not ok(i):
        hi = i
        if i == 0:
            return None, measured
        i, step = max(0, i - step), step * 2
    lo = i  # sizes[lo] fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return sizes[lo], measured


@dataclasses.dataclass(frozen=True)
class TrainShape:
    """A train step's batch: ``micro_batch`` rows per process per micro-step (``batch_size``), ``micro_steps`` of
    them per optimizer step, ``processes`` processes."""

    micro_batch: int
    micro_steps: int
    seq_len: int
    processes: int = 1

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.micro_steps * self.seq_len * self.processes

    @property
    def rows_per_step(self) -> int:
        """Rows per process per optimizer step: every micro-batch that keeps the tokens per step divides it."""
        return self.micro_batch * self.micro_steps


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def train_step_verdict(needs: int, pool: int, shape: TrainShape, *, best: int | None, best_needs: int | None,
                       smallest_needs: int | None = None, tokens_option: bool = False) -> str | None:
    """None when the train step fits the pool; else the one-line refusal: what the step needs per device, the pool,
    and ``best``, the largest micro-batch that fits (with :data:`HEADROOM` free) at the same tokens per step, with
    its micro-steps and the options that ask for it. ``tokens_option``: the config does not set
    ``total_batch_tokens`` (the tokens per step follow from ``batch_size``), so the suggestion sets it too.
    ``smallest_needs``: what the smallest micro-batch needs, named when even it does not fit."""
    if fits(needs, pool):
        return None
    head = (f"micro-batch {shape.micro_batch} x {shape.seq_len} ({shape.micro_steps} micro-step(s), "
            f"{shape.tokens_per_step:,} tokens per step) does not fit the GPU: the compiled train step needs "
            f"{_gib(needs)} per device, JAX's memory pool is {_gib(pool)} (XLA_PYTHON_CLIENT_MEM_FRACTION of the "
            "device's memory)")
    if best is None:
        least = "" if smallest_needs is None else f" (the smallest, {_gib(smallest_needs)})"
        return (f"{head}; no micro-batch that keeps {shape.tokens_per_step:,} tokens per step fits with "
                f"{HEADROOM:.0%} of the pool free{least}: shard the params and optimizer state over more GPUs "
                "(mesh: data=1,fsdp=N), or train a smaller model")
    steps = shape.rows_per_step // best
    options = f"--batch_size={best}" + (f" --total_batch_tokens={shape.tokens_per_step}" if tokens_option else "")
    return (f"{head}; the largest micro-batch that fits at the same tokens per step is {best} ({_gib(best_needs)}, "
            f"{HEADROOM:.0%} of the pool kept free; {steps} micro-steps): {options}")


def batch_verdict(what: str, needs: int, pool: int, *, option: str, best: int | None,
                  best_needs: int | None) -> str | None:
    """None when a program of ``what`` fits; else the one-line refusal naming the need, the pool and the largest
    value of ``option`` (a batch size) that fits with :data:`HEADROOM` free."""
    if fits(needs, pool):
        return None
    head = (f"{what} does not fit the GPU: the compiled program needs {_gib(needs)} per device, JAX's memory pool "
            f"is {_gib(pool)} (XLA_PYTHON_CLIENT_MEM_FRACTION of the device's memory)")
    if best is None:
        return f"{head}; not even {option} 1 fits: use a smaller model or a GPU with more memory"
    return (f"{head}; the largest {option} that fits (halving it) is {best} ({_gib(best_needs)}, {HEADROOM:.0%} of "
            "the pool kept free)")


# ---- checks -----------------------------------------------------------------------------------------------------
def check_train_step(needs: int, pool: int, shape: TrainShape, measure: Callable[[int], int], *,
                     multiple_of: int = 1, tokens_option: bool = False) -> None:
    """Raise :class:`DeviceMemoryError` when a train step of ``shape`` that needs ``needs`` bytes per device does
    not fit ``pool``, naming the largest micro-batch that does (``measure(micro_batch)``: the compiled step's bytes
    at that micro-batch and as many micro-steps as keep the tokens per step; called only when the step does not
    fit). ``multiple_of``: the devices per process that split each micro-batch."""
    if fits(needs, pool):
        return
    sizes = candidates(shape.rows_per_step, shape.micro_batch, multiple_of)
    best, measured = largest_fitting(sizes, measure, suggestion_limit(pool), {shape.micro_batch: needs})
    raise DeviceMemoryError(train_step_verdict(
        needs, pool, shape, best=best, best_needs=measured.get(best), tokens_option=tokens_option,
        smallest_needs=measured.get(sizes[0]) if sizes else None))


def check_batch(what: str, needs: int, pool: int, batch: int, measure: Callable[[int], int], *, option: str,
                sizes: Sequence[int] | None = None) -> None:
    """Raise :class:`DeviceMemoryError` when a program of ``what`` at batch ``batch`` does not fit ``pool``, naming
    the largest of ``sizes`` (default: the halvings of ``batch``, down to 1) that fits (``measure(size)``: its
    compiled bytes)."""
    if fits(needs, pool):
        return
    sizes = halvings(batch) if sizes is None else list(sizes)
    best, measured = largest_fitting(sizes, measure, suggestion_limit(pool), {batch: needs})
    raise DeviceMemoryError(batch_verdict(what, needs, pool, option=option, best=best, best_needs=measured.get(best)))


def out_of_memory(e: BaseException) -> bool:
    """Is ``e`` XLA's out-of-memory error (``jax.errors.JaxRuntimeError`` with status ``RESOURCE_EXHAUSTED``)?"""
    import jax

    return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


def oom_summary(e: BaseException) -> str:
    """The first line of XLA's out-of-memory message, shortened (it can be a page long)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return first if len(first) <= 160 else first[:157] + "..."


def report_out_of_memory(e: RuntimeError, *, smaller: str) -> int:
    """A command line's answer to a ``RuntimeError`` raised while running: XLA's out-of-memory error becomes one
    line on stderr naming the fix (``smaller``: the option to lower, e.g. ``"--batch-size"``) and exit status 2;
    any other error is raised again."""
    import sys

    if not out_of_memory(e):
        raise e
    print(f"error: out of device memory ({oom_summary(e)}); free the GPU's memory (another process on it?) or use a "
          f"smaller {smaller}, and run it again", file=sys.stderr)
    return 2


# ---- the train step's figure --------------------------------------------------------------------------------------
def train_step_bytes(jitted: Any, state: Any, mesh: Any, *, micro_steps: int, rows: int, seq_len: int,
                     key: Any = None) -> int:
    """What ``jitted`` (a :func:`jaxgpt.step.make_train_step`'s ``.jitted``) needs per device for a batch of
    ``micro_steps`` x ``rows`` (global rows per micro-step) x ``seq_len``, lowered against ``state`` (arrays, or
    ShapeDtypeStructs with shardings) and ``key`` (default: a replicated one) and compiled. Given the arguments
    exactly as the step function passes them (the state and key placed as it places them; the batch is placed with
    the batch sharding), the run's first call finds this executable in JAX's cache instead of compiling again."""
    import jax
    import jax.numpy as jnp

    from jaxgpt import mesh as mesh_lib

    tokens = jax.ShapeDtypeStruct((micro_steps, rows, seq_len), jnp.int32, sharding=mesh_lib.batch_sharding(mesh, 3))
    if key is None:
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=mesh_lib.replicated(mesh))
    return program_bytes(jitted.lower(state, tokens, tokens, key).compile())
