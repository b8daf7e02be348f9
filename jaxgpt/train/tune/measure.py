"""Timing one candidate program: the run's own train step (its model, precision, micro-batch and mesh) built with a
candidate's kernel choices, lowered, compiled, run from the same initial state on the same batch, and timed.

Each candidate's step is compiled once (``jit(...).lower(...).compile()``: the compile time is measured apart),
run ``warmup`` times (the first run's loss is the one checked against the reference program's), then ``repeats``
times, each synchronised with ``block_until_ready``; its figure is the median. Candidates whose lowered program is
another's, text for text (e.g. ``attention: auto``, which is ``einsum`` on CPUs), are that candidate and are not
compiled again. Whatever fails (the policy refusing the choice, lowering, compiling, running out of memory, running)
drops the candidate with one line naming why."""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
from typing import Any

from jaxgpt.kernels.registry import OPS, Kernels
from jaxgpt.kernels.tiles import one_line


@dataclasses.dataclass
class Measurement:
    """One candidate's result. ``error``: why it was dropped; ``same_as``: the candidate whose program it is."""

    name: str
    kernels: Kernels
    impls: dict[str, str] = dataclasses.field(default_factory=dict)  # what each op ran (the policy's resolution)
    compile_s: float | None = None
    times_ms: list[float] = dataclasses.field(default_factory=list)
    loss: float | None = None
    error: str | None = None
    same_as: str | None = None
    program: str | None = None  # a hash of the lowered program's text
    spent_s: float = 0.0  # wall time this candidate cost the search (lowering, compiling, running)
    shapes: dict[str, list[tuple[int, ...]]] = dataclasses.field(default_factory=dict)  # tunable ops' shapes traced

    @property
    def ok(self) -> bool:
        return self.error is None and self.same_as is None and bool(self.times_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def iqr_ms(self) -> float:
        """The interquartile range of its repeats: the timing noise it measured."""
        if len(self.times_ms) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times_ms, n=4, method="inclusive")
        return q3 - q1

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kernels": {k: v for k, v in dataclasses.asdict(self.kernels).items()
                                               if v is not None},
                "impls": self.impls, "compile_s": self.compile_s, "times_ms": self.times_ms,
                "median_ms": self.median_ms if self.times_ms else None, "iqr_ms": self.iqr_ms, "loss": self.loss,
                "error": self.error, "same_as": self.same_as}


class Bench:
    """The run's step, for any kernel choice: one initial state, one batch, one key, shared by every candidate."""

    def __init__(self, cfg, *, mesh=None, warmup: int = 2, repeats: int = 5):
        import jax
        import numpy as np

        from jaxgpt import mesh as mesh_lib
        from jaxgpt import step as step_lib
        from jaxgpt.optim import global_norm_fn, make_optimizer
        from jaxgpt.train.run import build_model

        if warmup < 1 or repeats < 1:
            raise ValueError(f"warmup = {warmup}, repeats = {repeats}: both must be >= 1")
        self.cfg, self.warmup, self.repeats = cfg, warmup, repeats
        self.mesh = mesh if mesh is not None else mesh_lib.make_mesh(cfg.mesh)
        self.optimizer, self.grad_norm = make_optimizer(cfg.optim), global_norm_fn(cfg.optim)
        policy = self.policy_for(Kernels("xla", **pinned(cfg.kernels)))
        model = build_model(cfg, policy)
        self.model_cfg = model.config
        _, self.state0 = step_lib.init_train_state(model, self.optimizer, mesh=self.mesh)
        del model
        rng = np.random.default_rng(cfg.seed)
        x = rng.integers(0, self.model_cfg.vocab_size, (1, cfg.batch_size, cfg.seq_len), dtype=np.int32)
        y = rng.integers(0, self.model_cfg.vocab_size, (1, cfg.batch_size, cfg.seq_len), dtype=np.int32)
        self.x, self.y = step_lib.place_batch(x, y, self.mesh)
        self.key = step_lib._put_key(jax.random.key(cfg.seed), step_lib.replicated(self.mesh))
        self.programs: dict[str, str] = {}  # program hash -> the first candidate that lowered to it

    def policy_for(self, kernels: Kernels):
        """The run's policy (precision and its numerics options) with ``kernels``."""
        from jaxgpt.precision import Policy

        options = {**self.cfg.policy_options(), "kernels": kernels}
        return Policy.named(self.cfg.precision, **options)

    def _graphdef(self, policy):
        from flax import nnx

        from jaxgpt.model import GPT

        abstract = nnx.eval_shape(lambda: GPT(self.model_cfg, policy=policy, rngs=nnx.Rngs(params=0)))
        return nnx.split(abstract, nnx.Param)[0]

    def measure(self, name: str, kernels: Kernels) -> Measurement:
        """Lower, compile, run and time the run's step under ``kernels``; never raises for the candidate's own
        failures (they come back as ``error``)."""
        import jax

        from jaxgpt import step as step_lib
        from jaxgpt.kernels import tiles

        m = Measurement(name, kernels)
        start = time.perf_counter()
        try:
            policy = self.policy_for(kernels)
            m.impls = {op: policy.kernel(op) for op in OPS}
            if m.impls["attention"] == "auto":
                m.impls["attention"] = f"auto ({policy.attention_impl()})"
            step = step_lib.make_train_step(self._graphdef(policy), self.optimizer, micro_steps=1,
                                            dropout=self.model_cfg.dropout > 0, mesh=self.mesh,
                                            fsdp_reduce=self.cfg.fsdp_reduce, grad_norm=self.grad_norm)
            tiles.clear_seen()
            lowered = step.jitted.lower(self.state0, self.x, self.y, self.key)
            m.shapes = {name: tiles.seen(name) for name in tiles.OPS if tiles.seen(name)}
            m.program = hashlib.sha256(lowered.as_text().encode()).hexdigest()
            if m.program in self.programs:
                m.same_as = self.programs[m.program]
                return m
            compiled = lowered.compile()
            m.compile_s = time.perf_counter() - start
            self.programs[m.program] = name
            state = jax.tree.map(lambda a: a.copy(), self.state0)  # the step donates its state: a copy each
            for i in range(self.warmup):
                state, metrics = compiled(state, self.x, self.y, self.key)
                if i == 0:
                    m.loss = float(metrics["loss"])  # the first step: from the shared initial state
            jax.block_until_ready(state)
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                state, metrics = compiled(state, self.x, self.y, self.key)
                jax.block_until_ready((state, metrics))
                m.times_ms.append((time.perf_counter() - t0) * 1e3)
            del state, compiled
        except Exception as e:  # noqa: BLE001: a candidate that fails is dropped, whatever failed
            m.error, m.times_ms = one_line(e), []
        finally:
            m.spent_s = time.perf_counter() - start
        return m


def pinned(kernels: Kernels) -> dict[str, str]:
    """The ops a config fixes under ``kernels: auto`` (e.g. ``--kernels=auto --kernels.mlp=xla``): never searched."""
    return {op: name for op, name in kernels.overrides().items() if name is not None}
