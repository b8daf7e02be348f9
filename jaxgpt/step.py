"""The jitted train and eval steps: gradient accumulation inside the jit, data parallel over all devices.

One optimizer update consumes a batch ``x, y`` of int32 token ids shaped ``(micro_steps, micro_batch, seq)``.
Inside one ``jit`` a ``lax.scan`` runs the micro-steps, summing fp32 gradients and dividing by
``micro_steps``: every micro-batch has the same number of tokens and the loss is a per-token mean, so the
mean of the micro-batch gradients is the gradient of the whole batch's mean loss.

Data parallelism: a ``Mesh`` over ``jax.devices()`` with one ``'data'`` axis; the params and optimizer state
are replicated (``NamedSharding(mesh, P())``), the batch is split along its ``micro_batch`` axis
(``P(None, 'data', None)``). Inside the step a ``shard_map`` runs the micro-step loop on each device's rows
and averages loss and gradients with one ``pmean`` per optimizer step; the optimizer update then runs
replicated. One device is the same code path with a mesh of one. Without dropout a 4-device run and a
1-device run compute the same numbers up to summation order; with dropout each device draws its own masks
(the step key folded with the device index), so the masks, not the rule, depend on the device count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.config import GPTConfig
from jaxgpt.model import GPT, TokenError, check_tokens
from jaxgpt.optim import current_lr

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


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int = 3) -> NamedSharding:
    """Shard the batch axis: axis 1 of ``(micro_steps, micro_batch, seq)``, axis 0 of ``(batch, seq)``."""
    if ndim == 3:
        return NamedSharding(mesh, P(None, DATA_AXIS, None))
    if ndim == 2:
        return NamedSharding(mesh, P(DATA_AXIS, None))
    raise ValueError(f"batch arrays have 2 or 3 axes, got {ndim}")


def shard_state(state: Any, mesh: Mesh | None = None) -> Any:
    """Replicate a pytree (a TrainState, params) over ``mesh`` (a no-op for arrays already placed so)."""
    return jax.device_put(state, replicated(mesh or data_mesh()))


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
    if rows % n:
        axis = "micro_batch" if ndim == 3 else "batch"
        raise TokenError(f"{axis} = {rows} must be divisible by the number of devices in the mesh ({n}); "
                         f"use a multiple of {n}")


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
    replicate the result over ``mesh`` (default: all devices). The state holds copies of the model's
    parameters: training never touches ``model`` (``nnx.merge(graphdef, state.params)`` gives the trained one).
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
    # One jitted init: fresh, replicated buffers (the state never aliases the model's arrays, so donating
    # it in the train step leaves ``model`` usable) and no eager op-by-op initialisation.
    return graphdef, _init_state(optimizer, replicated(mesh or data_mesh()), params)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_state(optimizer: optax.GradientTransformation, sharding: NamedSharding, params: nnx.State) -> TrainState:
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
    return jax.lax.with_sharding_constraint(state, sharding)


# ---- gradients -------------------------------------------------------------------------------------------
def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, x, y, dropout_key=None) -> jax.Array:
    """Mean fp32 cross-entropy of one (micro-)batch ``x, y: (batch, seq)``."""
    model = nnx.merge(graphdef, params)
    return model.loss(x, y, dropout_key=dropout_key)


def grads_fn(graphdef: nnx.GraphDef, params: nnx.State, x, y, key: jax.Array | None = None, *,
             dropout: bool = False) -> tuple[jax.Array, nnx.State]:
    """(mean loss, mean gradient) over the micro-steps of ``x, y: (micro_steps, micro_batch, seq)``, both fp32.

    Pure and traceable (the train step calls it inside its jit; tests jit it themselves). Micro-step ``i``
    uses dropout key ``fold_in(key, i)`` when ``dropout`` is set, and no dropout otherwise."""
    micro_steps = x.shape[0]
    if dropout and key is None:
        raise ValueError("dropout=True needs a PRNG key")
    value_and_grad = jax.value_and_grad(lambda p, xb, yb, k: loss_fn(graphdef, p, xb, yb, k))

    def body(carry, inputs):
        loss_sum, grad_sum = carry
        i, xb, yb = inputs
        k = jax.random.fold_in(key, i) if dropout else None
        loss, grads = value_and_grad(params, xb, yb, k)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        return (loss_sum + loss.astype(jnp.float32), grad_sum), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    init = (jnp.zeros((), jnp.float32), zeros)
    (loss_sum, grad_sum), _ = jax.lax.scan(body, init, (jnp.arange(micro_steps), x, y))
    scale = 1.0 / micro_steps
    return loss_sum * scale, jax.tree.map(lambda g: g * scale, grad_sum)


def _put_tokens(a, sharding: NamedSharding) -> jax.Array:
    """int32 token ids placed with ``sharding`` (host arrays go straight to their shards)."""
    if isinstance(a, jax.Array):
        a = a if a.dtype == jnp.int32 else a.astype(jnp.int32)
    else:
        a = np.asarray(a, np.int32)
    return jax.device_put(a, sharding)


jit_grads = jax.jit(grads_fn, static_argnums=0, static_argnames=("dropout",))
jit_grads.__doc__ = """``grads_fn`` jitted with ``graphdef`` static: calls with equal graph definitions (same config and
policy) and shapes share one compile."""


# ---- steps -----------------------------------------------------------------------------------------------
def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, *, micro_steps: int,
                    dropout: bool = False, mesh: Mesh | None = None,
                    lr_schedule: optax.Schedule | None = None) -> Callable:
    """``step_fn(state, x, y, key) -> (new_state, metrics)``, jitted, donating ``state``.

    ``x, y``: int32 ``(micro_steps, micro_batch, seq)``, ``micro_batch`` divisible by the device count;
    ``key``: the step's dropout key (ignored, and may be None, when ``dropout`` is False). ``metrics``:
    ``loss`` (mean over the micro-steps, fp32), ``grad_norm`` (global norm of the averaged gradient, before
    clipping) and ``lr`` (the learning rate this update used; from the optimizer state for optimizers built
    by :func:`jaxgpt.optim.make_optimizer`, else from ``lr_schedule``, else NaN). Token ids are not
    range-checked here: call :func:`check_batch` on host batches.
    """
    if not (isinstance(micro_steps, int) and micro_steps >= 1):
        raise ValueError(f"micro_steps = {micro_steps!r}: must be an integer >= 1")
    mesh = mesh or data_mesh()
    repl, batch = replicated(mesh), batch_sharding(mesh, 3)
    rows = P(None, DATA_AXIS, None)

    def local_grads(params, x, y, key):
        """On each device: its rows of every micro-batch, all micro-steps, then one mean over devices."""
        if dropout:  # independent masks per device (the same key would repeat one mask on every device)
            key = jax.random.fold_in(key, jax.lax.axis_index(DATA_AXIS))
        loss, grads = grads_fn(graphdef, params, x, y, key, dropout=dropout)
        return jax.lax.pmean((loss, grads), DATA_AXIS)  # equal shards: mean of means == global mean

    # shard_map, not sharding propagation: left to itself, XLA all-reduces the gradients inside the
    # micro-step loop (once per micro-step); here each device accumulates locally and there is one
    # all-reduce per optimizer step. check_vma=False: gradients w.r.t. the replicated params stay local
    # (no implicit psum) until the explicit pmean.
    sharded_grads = jax.shard_map(local_grads, mesh=mesh, in_specs=(P(), rows, rows, P()),
                                  out_specs=(P(), P()), check_vma=False)

    def step(state: TrainState, x, y, key):
        loss, grads = sharded_grads(state.params, x, y, key)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        lr = current_lr(opt_state)
        if lr is None:
            lr = lr_schedule(state.step) if lr_schedule is not None else jnp.nan
        metrics = dict(loss=loss, grad_norm=grad_norm, lr=jnp.asarray(lr, jnp.float32))
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    jitted = jax.jit(step, in_shardings=(repl, batch, batch, repl), out_shardings=(repl, repl),
                     donate_argnums=0)

    def step_fn(state: TrainState, x, y, key: jax.Array | None = None):
        _check_batch_shape(x, y, mesh, ndim=3)
        if x.shape[0] != micro_steps:
            raise TokenError(f"x has {x.shape[0]} micro-steps but the step was built for "
                             f"micro_steps = {micro_steps}")
        if key is None:
            if dropout:
                raise ValueError("this train step uses dropout: pass a PRNG key")
            key = jax.random.key(0)  # unused
        return jitted(shard_state(state, mesh), _put_tokens(x, batch), _put_tokens(y, batch),
                      jax.device_put(key, repl))

    step_fn.jitted = jitted  # for lowering / cost analysis
    step_fn.mesh = mesh
    return step_fn


def make_eval_step(graphdef: nnx.GraphDef, *, mesh: Mesh | None = None) -> Callable:
    """``eval_fn(params, x, y) -> mean loss`` (fp32, no dropout) for ``x, y: (batch, seq)``, jitted, with
    the batch sharded over ``mesh`` (``batch`` divisible by the device count)."""
    mesh = mesh or data_mesh()
    repl, batch = replicated(mesh), batch_sharding(mesh, 2)
    jitted = jax.jit(lambda params, x, y: loss_fn(graphdef, params, x, y),
                     in_shardings=(repl, batch, batch), out_shardings=repl)

    def eval_fn(params: nnx.State, x, y) -> jax.Array:
        _check_batch_shape(x, y, mesh, ndim=2)
        return jitted(shard_state(params, mesh), _put_tokens(x, batch), _put_tokens(y, batch))

    eval_fn.jitted = jitted
    eval_fn.mesh = mesh
    return eval_fn
