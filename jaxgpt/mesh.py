"""The device mesh and every sharding rule of jaxgpt, in one place.

A run's devices form a 2-D mesh with axes ``('data', 'fsdp')`` (:class:`MeshConfig`, :func:`make_mesh`):

* the **batch** is split over both axes (axis ``micro_batch`` of ``(micro_steps, micro_batch, seq)``, axis
  ``batch`` of ``(batch, seq)``): every device gets ``1 / (data * fsdp)`` of the rows;
* every parameter with >= 2 axes, and every optimizer-state leaf shaped like one, is split over ``fsdp``
  along its largest axis divisible by the ``fsdp`` size (else the next largest, ...; none divisible:
  replicated); parameters with < 2 axes (biases, LayerNorm) and scalars are replicated. Over ``data`` all
  of them are replicated.

``data=-1, fsdp=1`` (the default) is pure data parallelism (the params and optimizer state replicated on
every device, gradients all-reduced); ``data=1, fsdp=-1`` is pure FSDP / ZeRO-3 (each device holds
``1 / fsdp`` of the params, accumulated gradients and optimizer state; the train step all-gathers the
weights inside each micro-step's forward/backward, which holds the full weights transiently, and
reduce-scatters the gradients); anything in between is a hybrid (FSDP inside groups of
``fsdp`` devices, data parallel across groups; keep ``fsdp`` within one host, where links are fast).

The rule depends only on an array's shape (and the ``fsdp`` size), so a param and its Adam moments always
get the same sharding, and the model code is the same for 1 device and for N: sharding is a property of the
arrays, XLA's SPMD partitioner inserts the collectives.

The mesh spans all processes' devices in ``jax.devices()`` order (process 0's devices first), so with
``fsdp`` dividing the per-host device count each FSDP group lives on one host.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.config import ConfigError

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
MESH_AXES = (DATA_AXIS, FSDP_AXIS)


# ---- configuration ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Axis sizes of the ``('data', 'fsdp')`` mesh. One of them may be ``-1``: the rest of the devices.

    ``data * fsdp`` must equal the number of devices (all processes together)."""

    data: int = -1
    fsdp: int = 1

    def __post_init__(self) -> None:
        n = type(self).__name__
        for field in MESH_AXES:
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or not (v == -1 or v >= 1):
                raise ConfigError(f"{n}.{field} = {v!r}: must be an integer >= 1, or -1 (the rest of the devices)")
        if self.data == -1 and self.fsdp == -1:
            raise ConfigError(f"{n}: data = -1 and fsdp = -1: at most one axis can be -1 (inferred); "
                              "give the other one a size")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MeshConfig":
        from jaxgpt.config import from_dict

        return from_dict(cls, data)

    @classmethod
    def parse(cls, text: str) -> "MeshConfig":
        """``"data=2,fsdp=4"`` (either may be left out or -1; ``""`` is the default: pure data parallel)."""
        fields: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            m = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", part)
            if not m:
                raise ConfigError(f"mesh {text!r}: expected comma-separated axis=size pairs, e.g. data=2,fsdp=4 "
                                  f"(axes {list(MESH_AXES)}; -1: the rest of the devices)")
            axis, size = m.group(1), int(m.group(2))
            if axis not in MESH_AXES:
                raise ConfigError(f"mesh {text!r}: unknown axis {axis!r}; the axes are {list(MESH_AXES)}")
            if axis in fields:
                raise ConfigError(f"mesh {text!r}: axis {axis!r} given twice")
            fields[axis] = size
        return cls(**fields)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def shape(self, num_devices: int) -> dict[str, int]:
        """``{'data': d, 'fsdp': f}`` with the ``-1`` resolved, for ``num_devices`` devices; raises
        ConfigError when the sizes do not multiply to ``num_devices``."""
        n = type(self).__name__
        if self.data == -1 or self.fsdp == -1:
            known_axis, known = (FSDP_AXIS, self.fsdp) if self.data == -1 else (DATA_AXIS, self.data)
            if num_devices % known:
                raise ConfigError(f"{n}.{known_axis} = {known}: must divide the number of devices ({num_devices}) "
                                  f"when the other axis is -1; divisors are {_divisors(num_devices)}")
            rest = num_devices // known
            return {DATA_AXIS: rest, FSDP_AXIS: known} if self.data == -1 else {DATA_AXIS: known, FSDP_AXIS: rest}
        if self.data * self.fsdp != num_devices:
            raise ConfigError(f"{n}: data * fsdp = {self.data} * {self.fsdp} = {self.data * self.fsdp} must equal "
                              f"the number of devices ({num_devices}); set one axis to -1 to infer it")
        return {DATA_AXIS: self.data, FSDP_AXIS: self.fsdp}

    def __str__(self) -> str:
        return f"data={self.data},fsdp={self.fsdp}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(cfg: MeshConfig | str | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``('data', 'fsdp')`` mesh over ``devices`` (default: ``jax.devices()``, every process's)."""
    if cfg is None:
        cfg = MeshConfig()
    elif isinstance(cfg, str):
        cfg = MeshConfig.parse(cfg)
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.shape(len(devices))
    return Mesh(np.array(devices, dtype=object).reshape(shape[DATA_AXIS], shape[FSDP_AXIS]), MESH_AXES)


def axis_size(mesh: Mesh, axis: str) -> int:
    """Size of ``axis`` in ``mesh`` (1 for an axis the mesh does not have, e.g. a 1-D ``'data'`` mesh)."""
    return int(mesh.shape[axis]) if axis in mesh.axis_names else 1


def describe(mesh: Mesh) -> str:
    """``data=2 x fsdp=4 (8 devices, 2 processes)``."""
    shape = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    procs = len({d.process_index for d in mesh.devices.flat})
    return f"{shape} ({mesh.devices.size} devices, {procs} process{'es' if procs > 1 else ''})"


# ---- sharding rules --------------------------------------------------------------------------------------
def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over: ``('data', 'fsdp')`` (those of them the mesh has)."""
    return tuple(a for a in MESH_AXES if a in mesh.axis_names)


def batch_sharding(mesh: Mesh, ndim: int = 3) -> NamedSharding:
    """Split the batch axis over every device: axis 1 of ``(micro_steps, micro_batch, seq)``, axis 0 of
    ``(batch, seq)``."""
    axes = batch_axes(mesh)
    if ndim == 3:
        return NamedSharding(mesh, P(None, axes, None))
    if ndim == 2:
        return NamedSharding(mesh, P(axes, None))
    raise ValueError(f"batch arrays have 2 or 3 axes, got {ndim}")


def fsdp_spec(shape: Sequence[int], fsdp: int) -> P:
    """The PartitionSpec of an array of ``shape`` under FSDP of size ``fsdp``: ``'fsdp'`` on its largest
    axis divisible by ``fsdp`` (ties: the first such axis), for arrays with >= 2 axes; else replicated."""
    shape = tuple(int(s) for s in shape)
    if fsdp <= 1 or len(shape) < 2:
        return P()
    for axis in sorted(range(len(shape)), key=lambda a: (-shape[a], a)):
        if shape[axis] % fsdp == 0:
            return P(*(FSDP_AXIS if a == axis else None for a in range(len(shape))))
    return P()


def sharding_for(x: Any, mesh: Mesh) -> NamedSharding:
    """The sharding of one array (or ShapeDtypeStruct) under the rule above."""
    return NamedSharding(mesh, fsdp_spec(getattr(x, "shape", ()), axis_size(mesh, FSDP_AXIS)))


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """A pytree like ``params`` (an ``nnx.State``, a dict, ...) of NamedShardings: >= 2-D leaves sharded
    over ``'fsdp'``, the rest replicated."""
    return jax.tree.map(lambda x: sharding_for(x, mesh), params)


def state_shardings(train_state: Any, mesh: Mesh) -> Any:
    """NamedShardings for a whole train state (step, params, optimizer state) or any pytree of arrays: the
    params by :func:`param_shardings`; optimizer-state leaves shaped like a param (Adam's moments, ...)
    get that param's sharding, since the rule depends on the shape alone; scalars (the step count, the
    injected learning rate, Adam's count) are replicated."""
    return jax.tree.map(lambda x: sharding_for(x, mesh), train_state)


def shard(tree: Any, mesh: Mesh) -> Any:
    """``tree`` placed by :func:`state_shardings` (arrays already placed so are not copied). With several
    processes, a host array or a process-local jax.Array must hold the same value on every process (each
    keeps its own shards of it); global arrays are resharded."""
    shardings = state_shardings(tree, mesh)
    if spans_processes(mesh):  # a process-local array goes through the host: each process keeps its shards
        tree = jax.tree.map(lambda x, s: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable
                            and not x.sharding.is_equivalent_to(s, x.ndim) else x, tree, shardings)
    return jax.device_put(tree, shardings)


def spans_processes(mesh: Mesh) -> bool:
    """Whether ``mesh`` has devices of more than one process."""
    return len({d.process_index for d in mesh.devices.flat}) > 1


def abstract(tree: Any, mesh: Mesh) -> Any:
    """ShapeDtypeStructs of ``tree`` (arrays or ShapeDtypeStructs) carrying :func:`state_shardings` for
    ``mesh``: a restore target for orbax (each device reads only its shards) without allocating anything."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(x, mesh)), tree)


def constrain(tree: Any, mesh: Mesh) -> Any:
    """``with_sharding_constraint`` of a traced pytree to :func:`state_shardings` (inside jit)."""
    return jax.lax.with_sharding_constraint(tree, state_shardings(tree, mesh))


def gather(tree: Any, mesh: Mesh) -> Any:
    """``with_sharding_constraint`` of a traced pytree to replicated (inside jit): FSDP's all-gather of the
    weights before they are used. A no-op without an ``fsdp`` axis larger than one."""
    if axis_size(mesh, FSDP_AXIS) == 1:
        return tree
    return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: replicated(mesh), tree))


# ---- inside shard_map -------------------------------------------------------------------------------------
def param_specs(params: Any, mesh: Mesh) -> Any:
    """PartitionSpecs of ``params`` (shard_map's in/out specs): :func:`fsdp_spec` of every leaf."""
    fsdp = axis_size(mesh, FSDP_AXIS)
    return jax.tree.map(lambda x: fsdp_spec(getattr(x, "shape", ()), fsdp), params)


def all_gather_params(params: Any, specs: Any) -> Any:
    """Inside ``shard_map``: each FSDP-sharded leaf all-gathered over ``'fsdp'`` along its sharded axis (the
    full weight for the forward/backward); other leaves as they are. Differentiating through it gives
    the gradient's FSDP reduce-scatter (the transpose of ``all_gather`` is ``psum_scatter``)."""
    def one(x, spec):
        if FSDP_AXIS not in tuple(spec):
            return x
        return jax.lax.all_gather(x, FSDP_AXIS, axis=tuple(spec).index(FSDP_AXIS), tiled=True)

    return jax.tree.map(one, params, specs)


def scatter_grads(grads: Any, specs: Any) -> Any:
    """Inside ``shard_map``: each FSDP-sharded leaf of full-size gradients summed over ``'fsdp'`` and scattered
    along its sharded axis (``psum_scatter``: what the transpose of :func:`all_gather_params` does to the gradient
    of a gathered weight); other leaves as they are. For gradients taken w.r.t. weights gathered once per step
    (``fsdp_reduce: step``)."""
    def one(g, spec):
        if FSDP_AXIS not in tuple(spec):
            return g
        return jax.lax.psum_scatter(g, FSDP_AXIS, scatter_dimension=tuple(spec).index(FSDP_AXIS), tiled=True)

    return jax.tree.map(one, grads, specs)


def pmean(x: Any, axes: tuple[str, ...], mesh: Mesh) -> Any:
    """``jax.lax.pmean(x, axes)`` inside ``shard_map``, skipped when those axes hold one device: XLA:CPU
    still runs a one-device all-reduce as a copy (measured 7 ms/step on the small preset, 49 ms on gpt2)."""
    n = 1
    for a in axes:
        n *= axis_size(mesh, a)
    return x if n == 1 else jax.lax.pmean(x, axes)


def mean_grads(grads: Any, specs: Any, mesh: Mesh) -> Any:
    """Inside ``shard_map``: the mean over all devices of per-device gradients (each device's loss is the
    mean over its rows; all devices hold equally many). FSDP-sharded leaves already hold the sum over their
    ``'fsdp'`` group (the reduce-scatter of :func:`all_gather_params`' transpose, or :func:`scatter_grads`): divide
    by its size and
    average over ``'data'``; every other leaf is averaged over all batch axes."""
    axes = batch_axes(mesh)
    fsdp = axis_size(mesh, FSDP_AXIS)
    others = tuple(a for a in axes if a != FSDP_AXIS)

    def one(g, spec):
        if FSDP_AXIS not in tuple(spec):
            return pmean(g, axes, mesh)
        g = g / fsdp
        return pmean(g, others, mesh) if others else g

    return jax.tree.map(one, grads, specs)


# ---- what a device holds ---------------------------------------------------------------------------------
def device_bytes(tree: Any) -> dict[jax.Device, int]:
    """Bytes of ``tree``'s arrays held by each addressable device (from ``addressable_shards``)."""
    out: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for s in getattr(leaf, "addressable_shards", ()):
            out[s.device] = out.get(s.device, 0) + int(s.data.nbytes)
    return out


def max_device_bytes(tree: Any) -> int:
    """The most bytes of ``tree`` any addressable device holds."""
    return max(device_bytes(tree).values(), default=0)


def total_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays as global (logical) arrays."""
    return sum(int(math.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def summary(mesh: Mesh, params: Any, opt_state: Any = None) -> str:
    """One line for a run's log: the mesh, and per-device bytes of the params (and optimizer state)."""
    mib = lambda n: f"{n / 2**20:,.2f} MiB"  # noqa: E731
    text = (f"mesh {describe(mesh)}; per device: params {mib(max_device_bytes(params))} "
            f"of {mib(total_bytes(params))}")
    if opt_state is not None:
        text += f", optimizer state {mib(max_device_bytes(opt_state))} of {mib(total_bytes(opt_state))}"
    return text
