"""The config's real train step, built over abstract inputs and compiled for a mesh of (compile-only) devices.

Nothing is allocated: the model, its params and the optimizer state are ``jax.eval_shape``'d, given the
shardings :mod:`jaxgpt.mesh` gives them, and the jitted step that training runs (:func:`jaxgpt.step.make_train_step`,
with its optimizer, gradient accumulation, mesh and donated state) is lowered and compiled against them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgpt import mesh as mesh_lib
from jaxgpt import step as step_lib
from jaxgpt.compile.targets import CompileError
from jaxgpt.config import ConfigError
from jaxgpt.model import GPT
from jaxgpt.optim import global_norm_fn, make_optimizer
from jaxgpt.precision import Policy, default_compute
from jaxgpt.train.config import TrainConfig


@dataclasses.dataclass
class CompiledStep:
    """One compiled train step and what it was built from."""

    cfg: TrainConfig
    micro_batch: int  # per-device rows of each micro-step
    micro_steps: int
    n_devices: int
    mesh: Any
    policy: Policy
    compiled: Any  # jax.stages.Compiled
    lower_s: float
    compile_s: float

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.n_devices * self.micro_steps * self.cfg.seq_len

    def memory(self) -> dict[str, int]:
        """Per device, from XLA: arguments, outputs, temporaries, aliased (donated) and generated code bytes; total
        is what the step needs at its peak (arguments + temporaries + outputs not aliased to arguments)."""
        m = self.compiled.memory_analysis()
        out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, temp=m.temp_size_in_bytes,
                   alias=m.alias_size_in_bytes, code=m.generated_code_size_in_bytes)
        out["total"] = out["argument"] + out["temp"] + out["output"] - out["alias"] + out["code"]
        return out

    def hlo_text(self) -> str:
        return self.compiled.as_text()


def resolve_policy(cfg: TrainConfig, platform: str) -> Policy:
    """The precision policy a run of ``cfg`` gets on ``platform`` (``precision: auto`` is bf16 on GPUs)."""
    precision = default_compute(platform) if cfg.precision == "auto" else cfg.precision
    return Policy.named(precision, **cfg.policy_options())


def _abstract_state(cfg: TrainConfig, policy: Policy, optimizer, mesh):
    """(graphdef, TrainState of ShapeDtypeStructs carrying the mesh's shardings): nothing allocated."""
    model_cfg = cfg.model if cfg.dropout is None else cfg.model.replace(dropout=cfg.dropout)
    if model_cfg is None:
        raise CompileError("the config has no model shape (model_preset / model): compiling needs one; "
                           "init_from a Hugging Face name is compiled with its preset's shape, e.g. model_preset: gpt2")
    abstract_model = nnx.eval_shape(lambda: GPT(model_cfg, policy=policy, rngs=nnx.Rngs(params=0)))
    graphdef, params = nnx.split(abstract_model, nnx.Param)
    state = jax.eval_shape(lambda p: step_lib.TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                                         opt_state=optimizer.init(p)), params)
    return graphdef, mesh_lib.abstract(state, mesh), model_cfg


def compile_train_step(cfg: TrainConfig, devices: list, *, micro_batch: int | None = None) -> CompiledStep:
    """Compile ``cfg``'s train step for ``devices`` with ``micro_batch`` rows per device per micro-step
    (default: the config's ``batch_size`` split over the devices). Gradient accumulation makes up
    ``total_batch_tokens`` as training would; a micro-batch that does not divide it is refused."""
    n = len(devices)
    if cfg.init_from != "scratch" and cfg.model is None:
        raise CompileError(f"init_from: {cfg.init_from} without model_preset: add the checkpoint's preset "
                           f"(e.g. --model_preset=gpt2) so the shape is known without loading it")
    rows = micro_batch * n if micro_batch is not None else cfg.batch_size
    if rows % n:
        raise CompileError(f"batch_size = {rows} rows per micro-step cannot be split over {n} devices: use a "
                           f"multiple of {n} (or --micro-batch, per device)")
    try:
        cfg = dataclasses.replace(cfg, batch_size=rows // n)  # training's batch_size is per process: one per device
        micro_steps = cfg.micro_steps(n)
    except ConfigError as e:
        raise CompileError(str(e)) from None
    try:
        mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    except ConfigError as e:
        raise CompileError(f"{e} (compiling for --devices {n}: give a mesh of {n} devices, or --devices to match "
                           "the mesh)") from None
    policy = resolve_policy(cfg, "gpu" if devices[0].platform in ("gpu", "cuda", "rocm") else devices[0].platform)
    optimizer = make_optimizer(cfg.optim)
    graphdef, state, model_cfg = _abstract_state(cfg, policy, optimizer, mesh)
    if cfg.seq_len > model_cfg.block_size:
        raise CompileError(f"seq_len = {cfg.seq_len} is longer than the model's block_size {model_cfg.block_size}")
    step_fn = step_lib.make_train_step(graphdef, optimizer, micro_steps=micro_steps, dropout=model_cfg.dropout > 0,
                                       mesh=mesh, fsdp_reduce=cfg.fsdp_reduce,
                                       grad_norm=global_norm_fn(cfg.optim))
    batch = step_lib.batch_sharding(mesh, 3)
    tokens = jax.ShapeDtypeStruct((micro_steps, rows, cfg.seq_len), jnp.int32, sharding=batch)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=step_lib.replicated(mesh))
    t0 = time.perf_counter()
    lowered = step_fn.jitted.lower(state, tokens, tokens, key)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return CompiledStep(cfg=cfg, micro_batch=rows // n, micro_steps=micro_steps, n_devices=n, mesh=mesh,
                        policy=policy, compiled=compiled, lower_s=t1 - t0, compile_s=t2 - t1)
