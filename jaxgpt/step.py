"""The jitted train and eval steps: gradient accumulation inside the jit, data parallel over all devices.

One optimizer update consumes a batch ``x, y`` of int32 token ids shaped ``(micro_steps, micro_batch, seq)``.
Inside one ``jit`` a ``lax.scan`` runs the micro-steps, summing fp32 gradients and dividing by
``micro_steps``: every micro-batch has the same number of tokens and the loss is a per-token mean, so the
mean of the micro-batch gradients is the gradient of the whole batch's mean loss.

Data parallelism and FSDP: a ``Mesh`` over ``jax.devices()``, either the 1-D ``'data'`` mesh of
:func:`data_mesh` or a ``('data', 'fsdp')`` mesh from :mod:`jaxgpt.mesh` (where every sharding rule lives).
The batch is split along its ``micro_batch`` axis over every device (``P(None, ('data', 'fsdp'), None)``);
the params and optimizer state are replicated over ``'data'`` and, with an ``fsdp`` axis larger than one,
each >= 2-D param and its optimizer moments are sharded over ``'fsdp'`` (:func:`jaxgpt.mesh.state_shardings`).
Inside the step a ``shard_map`` runs the micro-step loop on each device's rows: FSDP-sharded weights are
all-gathered inside every micro-step's loss (so their gradients come back reduce-scattered: the transpose
of the all-gather) and accumulate sharded; then one mean over devices per optimizer step
(:func:`jaxgpt.mesh.mean_grads`), and the optimizer update runs on the (sharded) state. One device is the
same code path with a mesh of one. Without dropout an N-device run and a 1-device run compute the same
numbers up to summation order; with dropout each device draws its own masks (the step key folded with the
device index), so the masks, not the rule, depend on the device count. With several processes each one
passes its own rows of the batch; the step assembles the global batch with
``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt import ops
from jaxgpt.kernels import fp8
from jaxgpt import mesh as mesh_lib
from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, TokenError, check_tokens
from jaxgpt.optim import current_lr
from jaxgpt.precision import Policy

DATA_AXIS = "data"


class TrainState(flax.struct.PyTreeNode):
    """Everything an optimizer update changes: the update count, the fp32 params, the optimizer state."""

    step: jax.Array  # int32 scalar: optimizer updates done so far
    params: nnx.State  # nnx.Param state of the model
    opt_state: optax.OptState


# ---- devices ---------------------------------------------------------------------------------------------
def data_mesh(devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis ``'data'`` over ``devices`` (default: all of ``jax.devices()``)."""
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(np.array(devices), (DATA_AXIS,))


replicated = mesh_lib.replicated
batch_sharding = mesh_lib.batch_sharding  # the batch axis split over every device of the mesh


def shard_state(state: Any, mesh: Mesh | None = None) -> Any:
    """Place a pytree (a TrainState, params) over ``mesh`` by :func:`jaxgpt.mesh.state_shardings`:
    replicated, or sharded over ``'fsdp'`` (a no-op for arrays already placed so)."""
    return mesh_lib.shard(state, mesh or data_mesh())


def _check_batch_shape(x, y, mesh: Mesh, *, ndim: int) -> None:
    for name, a in (("x", x), ("y", y)):
        shape = tuple(getattr(a, "shape", ()))
        if len(shape) != ndim:
            want = "(micro_steps, micro_batch, seq)" if ndim == 3 else "(batch, seq)"
            raise TokenError(f"{name} must have shape {want}, got {shape}")
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TokenError(f"{name} must hold integer token ids, got dtype {a.dtype}")
    if tuple(x.shape) != tuple(y.shape):
        raise TokenError(f"x and y must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    n = mesh.devices.size
    rows = x.shape[ndim - 2]
    axis = "micro_batch" if ndim == 3 else "batch"
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already a global batch (several processes)
        if rows % n:
            raise TokenError(f"{axis} = {rows} must be divisible by the number of devices in the mesh ({n})")
        return
    local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    if local == n and rows % n:
        raise TokenError(f"{axis} = {rows} must be divisible by the number of devices in the mesh ({n}); "
                         f"use a multiple of {n}")
    if rows % max(local, 1):
        raise TokenError(f"{axis} = {rows} (this process's rows of the batch) must be divisible by the number "
                         f"of this process's devices in the mesh ({local}); use a multiple of {local}")


def check_batch(x, y, config: GPTConfig, *, mesh: Mesh | None = None) -> None:
    """Validate a batch outside jit: shapes ``(micro_steps, micro_batch, seq)`` (or ``(batch, seq)``), the
    sequence length against ``block_size``, ids of both x and y in ``[0, vocab_size)``, and (with ``mesh``)
    the batch axis divisible by the device count."""
    ndim = len(getattr(x, "shape", ()))
    if ndim not in (2, 3):
        raise TokenError(f"x must have shape (micro_steps, micro_batch, seq) or (batch, seq), "
                         f"got {tuple(getattr(x, 'shape', ()))}")
    _check_batch_shape(x, y, mesh or data_mesh(jax.devices()[:1]), ndim=ndim)
    seq = x.shape[-1]
    check_tokens(np.asarray(x).reshape(-1, seq), config, name="x")
    check_tokens(np.asarray(y).reshape(-1, seq), config, name="y")


# ---- state -----------------------------------------------------------------------------------------------
def init_train_state(model: GPT, optimizer: optax.GradientTransformation, *, mesh: Mesh | None = None
                     ) -> tuple[nnx.GraphDef, TrainState]:
    """Split ``model`` into its graph definition and fp32 params, initialise the optimizer state, and
    place the result over ``mesh`` (default: all devices, data parallel) by
    :func:`jaxgpt.mesh.state_shardings`. The state holds copies of the model's parameters: training never
    touches ``model`` (``nnx.merge(graphdef, state.params)`` gives the trained one). With several processes
    every one passes the same ``model`` (the same seed or weights).
    """
    try:
        graphdef, params = nnx.split(model, nnx.Param)
    except ValueError as e:  # non-exhaustive filters: the model holds non-Param state
        raise ValueError(f"the model holds state other than nnx.Param (e.g. RNG or batch statistics), "
                         f"which the train step does not carry: {e}") from e
    bad = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(params)
           if v.dtype != jnp.float32]
    if bad:
        raise ValueError(f"parameters must be float32 (the policy's param_dtype); not: {bad[:5]}")
    # One jitted init: fresh, placed buffers (the state never aliases the model's arrays, so donating
    # it in the train step leaves ``model`` usable) and no eager op-by-op initialisation.
    mesh = mesh or data_mesh()
    # Placed first, so the jit runs on the mesh (with several processes each keeps its own shards).
    return graphdef, _init_state(optimizer, mesh, mesh_lib.shard(params, mesh))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_state(optimizer: optax.GradientTransformation, mesh: Mesh, params: nnx.State) -> TrainState:
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
    return mesh_lib.constrain(state, mesh)


# ---- gradients -------------------------------------------------------------------------------------------
def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, x, y, dropout_key=None) -> jax.Array:
    """Mean fp32 cross-entropy of one (micro-)batch ``x, y: (batch, seq)``."""
    model = nnx.merge(graphdef, params)
    return model.loss(x, y, dropout_key=dropout_key)


def grads_fn(graphdef: nnx.GraphDef, params: nnx.State, x, y, key: jax.Array | None = None, *,
             dropout: bool = False, gather: Callable | None = None) -> tuple[jax.Array, nnx.State]:
    """(mean loss, mean gradient) over the micro-steps of ``x, y: (micro_steps, micro_batch, seq)``, both fp32.

    Pure and traceable (the train step calls it inside its jit; tests jit it themselves). Micro-step ``i``
    uses dropout key ``fold_in(key, i)`` when ``dropout`` is set, and no dropout otherwise. ``gather``
    (inside shard_map, FSDP) maps the params to the full weights inside each micro-step's loss."""
    micro_steps = x.shape[0]
    if dropout and key is None:
        raise ValueError("dropout=True needs a PRNG key")
    gather = gather or (lambda p: p)
    value_and_grad = jax.value_and_grad(lambda p, xb, yb, k: loss_fn(graphdef, gather(p), xb, yb, k))

    def micro_step(i, xb, yb):
        k = jax.random.fold_in(key, i) if dropout else None
        loss, grads = value_and_grad(params, xb, yb, k)
        return loss.astype(jnp.float32), jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    def body(carry, inputs):
        loss, grads = micro_step(*inputs)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    if ops.platform() == "cpu" or micro_steps == 1:
        # micro-step 0 starts the sums (no zero-filled accumulator, and no loop at all for a single micro-step:
        # a 64 MB zero fill and add per step for the small preset); the same sums as starting from zeros
        init, first = micro_step(0, x[0], y[0]), 1
    else:
        # GPUs: every micro-step inside the loop, so the forward and backward are compiled once (peeling
        # micro-step 0 compiled them twice: 1,728 fusions against 966 in the H100 step); the zero fill is ~0.1 ms
        init, first = (jnp.zeros((), jnp.float32), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)), 0
    (loss_sum, grad_sum), _ = jax.lax.scan(body, init, (jnp.arange(first, micro_steps), x[first:], y[first:]))
    scale = 1.0 / micro_steps
    return loss_sum * scale, jax.tree.map(lambda g: g * scale, grad_sum)


def _put_tokens(a, sharding: NamedSharding) -> jax.Array:
    """int32 token ids placed with ``sharding``. A host array is this process's rows of the batch (all of
    it with one process) and goes straight to its shards; a jax.Array is resharded if needed."""
    if isinstance(a, jax.Array):
        a = a if a.dtype == jnp.int32 else a.astype(jnp.int32)
        if a.sharding.is_equivalent_to(sharding, a.ndim):
            return a
        if jax.process_count() == 1:
            return jax.device_put(a, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(a, np.int32))


def _put_key(key: jax.Array, sharding: NamedSharding) -> jax.Array:
    """A PRNG key replicated with ``sharding`` (every process passes the same key)."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.device_put(key, sharding)
    if key.sharding.is_equivalent_to(sharding, key.ndim):
        return key
    # device_put refuses typed keys for shardings spanning other processes: move the raw words instead.
    return jax.random.wrap_key_data(jax.device_put(jax.random.key_data(key), sharding),
                                    impl=jax.random.key_impl(key))


def place_batch(x, y, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """``x, y: (micro_steps, micro_batch, seq)`` placed as the train step built for ``mesh`` takes them (host
    arrays: this process's rows), so the copy to the devices can run ahead of the step that uses them."""
    batch = batch_sharding(mesh, 3)
    return _put_tokens(x, batch), _put_tokens(y, batch)


jit_grads = jax.jit(grads_fn, static_argnums=0, static_argnames=("dropout",))
jit_grads.__doc__ = """``grads_fn`` jitted with ``graphdef`` static: calls with equal graph definitions (same config and
policy) and shapes share one compile."""


# ---- steps -----------------------------------------------------------------------------------------------
FSDP_REDUCE = ("micro_step", "step")


def compiler_options(graphdef: nnx.GraphDef, mesh: Mesh) -> dict[str, Any] | None:
    """The XLA options the train and eval steps of ``graphdef``'s model are jitted with on ``mesh``'s devices (None:
    XLA's defaults): :func:`platform_compiler_options` for the mesh's platform."""
    return platform_compiler_options(graphdef, ops.devices_platform(mesh))


def platform_compiler_options(graphdef: nnx.GraphDef, platform: str) -> dict[str, Any] | None:
    """The XLA options a program of ``graphdef``'s model is jitted with on ``platform`` (None: XLA's defaults): a
    model with fp8 GEMMs gets :func:`jaxgpt.kernels.fp8.compiler_options` on GPUs (cuBLASLt fp8 GEMMs); every other program is
    compiled as it always was. The policy is read from the graphdef (a static attribute of every module), so
    training, ``jaxgpt.compile``, the GPU benchmarks and generation (jaxgpt.generate) compile their programs alike."""
    gemms = {a.value.fp8 for _, a in graphdef.attributes if isinstance(getattr(a, "value", None), Policy)}
    options: dict[str, Any] = {}
    for g in sorted(gemms):
        options.update(fp8.compiler_options(g, platform))
    return options or None


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, *, micro_steps: int,
                    dropout: bool = False, mesh: Mesh | None = None,
                    lr_schedule: optax.Schedule | None = None, fsdp_reduce: str = "micro_step",
                    grad_norm: Callable = optax.tree.norm) -> Callable:
    """``step_fn(state, x, y, key) -> (new_state, metrics)``, jitted, donating ``state``.

    ``x, y``: int32 ``(micro_steps, micro_batch, seq)``, ``micro_batch`` divisible by the device count
    (with several processes: host arrays are this process's rows, divisible by its device count);
    ``key``: the step's dropout key (ignored, and may be None, when ``dropout`` is False). ``metrics``:
    ``loss`` (mean over the micro-steps, fp32), ``grad_norm`` (global norm of the averaged gradient, before
    clipping) and ``lr`` (the learning rate this update used; from the optimizer state for optimizers built
    by :func:`jaxgpt.optim.make_optimizer`, else from ``lr_schedule``, else NaN). Token ids are not
    range-checked here: call :func:`check_batch` on host batches.

    ``fsdp_reduce`` (a mesh with ``fsdp`` > 1): ``"micro_step"`` all-gathers the weights inside every micro-step
    and reduce-scatters its gradients there (the accumulator stays sharded: 1/fsdp of the gradient memory, the
    gradient traffic once per micro-step); ``"step"`` all-gathers them once per step and reduce-scatters the
    summed gradients once, after the accumulation loop (PyTorch FSDP's ``no_sync``: the full weights and a full
    fp32 gradient accumulator live on every device, 4 N bytes more each, for one gradient reduction per optimizer
    step). Either way the ``data`` axis's all-reduce runs once per step.

    ``grad_norm``: the function of the ``grad_norm`` metric; give the optimizer's clipping norm
    (:func:`jaxgpt.optim.global_norm_fn`) so the two are one computation.
    """
    if not (isinstance(micro_steps, int) and micro_steps >= 1):
        raise ValueError(f"micro_steps = {micro_steps!r}: must be an integer >= 1")
    if fsdp_reduce not in FSDP_REDUCE:
        raise ValueError(f"fsdp_reduce = {fsdp_reduce!r}: allowed values are {list(FSDP_REDUCE)}")
    mesh = mesh or data_mesh()
    repl, batch = replicated(mesh), batch_sharding(mesh, 3)
    axes = mesh_lib.batch_axes(mesh)
    rows = P(None, axes, None)

    def sharded_grads(params, x, y, key):
        specs = mesh_lib.param_specs(params, mesh)  # FSDP-sharded or replicated, from the shapes

        def local_grads(params, x, y, key):
            """On each device: its rows of every micro-batch, all micro-steps, then one mean over devices."""
            if dropout:  # independent masks per device (the same key would repeat one mask on every device)
                key = jax.random.fold_in(key, jax.lax.axis_index(axes))
            if fsdp_reduce == "step":  # gathered once; full-size gradients summed locally, scattered once
                loss, grads = grads_fn(graphdef, mesh_lib.all_gather_params(params, specs), x, y, key,
                                       dropout=dropout)
                grads = mesh_lib.scatter_grads(grads, specs)
            else:  # gathered in each micro-step, whose gradient's reduce-scatter is the gather's transpose
                loss, grads = grads_fn(graphdef, params, x, y, key, dropout=dropout,
                                       gather=lambda p: mesh_lib.all_gather_params(p, specs))
            # equal shards: mean of means == global mean
            return mesh_lib.pmean(loss, axes, mesh), mesh_lib.mean_grads(grads, specs, mesh)

        # shard_map, not sharding propagation: left to itself, XLA all-reduces the gradients inside the
        # micro-step loop (once per micro-step); here each device accumulates locally and there is one
        # all-reduce per optimizer step (FSDP with fsdp_reduce="micro_step": the sharded leaves' reduce-scatter,
        # the transpose of their all-gather, runs per micro-step: it is what keeps the accumulator sharded).
        # check_vma=False: gradients w.r.t. replicated params stay local (no implicit psum) until the explicit
        # mean.
        return jax.shard_map(local_grads, mesh=mesh, in_specs=(specs, rows, rows, P()), out_specs=(P(), specs),
                             check_vma=False)(params, x, y, key)

    @ops.traced_for(mesh)  # kernels for the mesh's devices (cuDNN attention on GPUs), not the default backend's
    def step(state: TrainState, x, y, key):
        state = mesh_lib.constrain(state, mesh)  # as init_train_state / shard_state placed it
        loss, grads = sharded_grads(state.params, x, y, key)
        with jax.named_scope("optimizer"):
            norm = grad_norm(grads)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        lr = current_lr(opt_state)
        if lr is None:
            lr = lr_schedule(state.step) if lr_schedule is not None else jnp.nan
        metrics = dict(loss=loss, grad_norm=norm, lr=jnp.asarray(lr, jnp.float32))
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        return mesh_lib.constrain(new_state, mesh), metrics

    # The state's shardings follow from its shapes (jaxgpt.mesh.state_shardings) and are applied inside
    # the step; None: "as the argument is placed" (step_fn places it) / "as constrained".
    jitted = jax.jit(step, in_shardings=(None, batch, batch, repl), out_shardings=(None, repl),
                     donate_argnums=0, compiler_options=compiler_options(graphdef, mesh))
    returned: list[weakref.ref | None] = [None]  # the state the last call returned (weakly: never kept alive)

    def step_fn(state: TrainState, x, y, key: jax.Array | None = None):
        _check_batch_shape(x, y, mesh, ndim=3)
        if x.shape[0] != micro_steps:
            raise TokenError(f"x has {x.shape[0]} micro-steps but the step was built for "
                             f"micro_steps = {micro_steps}")
        if key is None:
            if dropout:
                raise ValueError("this train step uses dropout: pass a PRNG key")
            key = jax.random.key(0)  # unused
        # the state this step returned is placed as the step places it (constrained inside the jit): placing it
        # again walked its 449 gpt2 leaves through device_put on every call, 92-204 ms per step on a loaded 2-core
        # EPYC and 40 of the 58 ms of each step_fn call in the H100 profile's host trace (b16's kernels: ~43 ms)
        if returned[0] is None or returned[0]() is not state:
            state = shard_state(state, mesh)
        new_state, metrics = jitted(state, _put_tokens(x, batch), _put_tokens(y, batch), _put_key(key, repl))
        returned[0] = weakref.ref(new_state)
        return new_state, metrics

    step_fn.jitted = jitted  # for lowering / cost analysis
    step_fn.mesh = mesh
    return step_fn


def make_eval_step(graphdef: nnx.GraphDef, *, mesh: Mesh | None = None) -> Callable:
    """``eval_fn(params, x, y) -> mean loss`` (fp32, no dropout) for ``x, y: (batch, seq)``, jitted, with
    the batch sharded over ``mesh`` (``batch`` divisible by the device count; with several processes,
    host arrays are this process's rows). FSDP-sharded params are all-gathered for the forward."""
    mesh = mesh or data_mesh()
    repl, batch = replicated(mesh), batch_sharding(mesh, 2)

    @ops.traced_for(mesh)
    def loss(params, x, y):
        return loss_fn(graphdef, mesh_lib.gather(mesh_lib.constrain(params, mesh), mesh), x, y)

    jitted = jax.jit(loss, in_shardings=(None, batch, batch), out_shardings=repl,
                     compiler_options=compiler_options(graphdef, mesh))

    def eval_fn(params: nnx.State, x, y) -> jax.Array:
        _check_batch_shape(x, y, mesh, ndim=2)
        return jitted(shard_state(params, mesh), _put_tokens(x, batch), _put_tokens(y, batch))

    eval_fn.jitted = jitted
    eval_fn.mesh = mesh
    return eval_fn
