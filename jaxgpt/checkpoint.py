"""Training checkpoints with orbax: save, keep the last K, resume bit-identically, export to Hugging Face.

A run directory holds its checkpoints under ``<run_dir>/checkpoints/<step>/``, one orbax step directory each,
with four items:

* ``params``    -- the model parameters (an ``nnx.State`` of fp32 arrays);
* ``opt_state`` -- the optax optimizer state;
* ``meta``      -- JSON: the step, the raw data of the JAX RNG key, the data loader's position, and free-form
  extras (e.g. the last loss);
* ``config``    -- JSON: the run's configuration, with the *resolved* model shape under ``"model"``.

Orbax writes each step into ``<step>.orbax-checkpoint-tmp-*`` and renames it into place once every item is on
disk (then writes ``commit_success.txt``), so a process killed mid-save leaves the previous checkpoints
untouched and the half-written directory is ignored (and cleaned up the next time a manager opens the
directory). Saves are asynchronous: the arrays are copied to host memory before :meth:`Checkpoints.save`
returns, the files are written in the background, and the next save (and :meth:`Checkpoints.close`) waits for
the previous one to finish.

Restoring compares the saved configuration with the requested one *before* reading any array, and raises
:class:`CheckpointMismatchError` naming every field that differs.

    python -m jaxgpt.checkpoint list   --run-dir runs/shakespeare
    python -m jaxgpt.checkpoint export --run-dir runs/shakespeare --to-hf out/hf [--to-torch out/sd.pt] [--step N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxgpt.config import ConfigError, GPTConfig

CHECKPOINT_SUBDIR = "checkpoints"
ITEMS = ("params", "opt_state", "meta", "config")
# GPTConfig fields that may differ between a checkpoint and the model it is restored into (they change no
# array): a fine-tune may turn dropout on.
_FREE_MODEL_FIELDS = frozenset({"dropout"})


class CheckpointMismatchError(ConfigError):
    """The checkpoint was written for a different model (or optimizer) than the one it is restored into."""


class NoCheckpointError(FileNotFoundError):
    """No (complete) checkpoint exists where one was required."""


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpoints.restore` returns."""

    step: int
    params: Any
    opt_state: Any
    rng_key: jax.Array | None  # a typed PRNG key (jax.random.key), or None if none was saved
    loader_state: Any
    extra: dict[str, Any]
    config: dict[str, Any]


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir).absolute() / CHECKPOINT_SUBDIR


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays: the target orbax restores into."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def key_to_json(key: jax.Array) -> dict[str, Any]:
    """A JAX PRNG key (typed or raw uint32) as JSON: its implementation name and its raw uint32 words."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(key))
        data = jax.random.key_data(key)
    else:
        impl, data = None, key
    return {"impl": impl, "data": np.asarray(data, dtype=np.uint32).tolist()}


def key_from_json(d: dict[str, Any]) -> jax.Array:
    data = jnp.asarray(np.asarray(d["data"], dtype=np.uint32))
    return data if d["impl"] is None else jax.random.wrap_key_data(data, impl=d["impl"])


def config_mismatches(saved: dict[str, Any], requested: dict[str, Any], *, prefix: str = "") -> list[str]:
    """``field: saved -> requested`` for every leaf that differs between two config dicts."""
    out = []
    for k in sorted(set(saved) | set(requested)):
        a, b = saved.get(k, "<absent>"), requested.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_mismatches(a, b, prefix=f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: checkpoint has {a!r}, requested {b!r}")
    return out


def check_compatible(saved: dict[str, Any], requested: dict[str, Any], *, where: str = "checkpoint") -> None:
    """Raise :class:`CheckpointMismatchError` if ``requested`` (a config dict with ``"model"`` and optionally
    ``"optim": {"name": ...}``) cannot take the arrays of the checkpoint whose config is ``saved``."""
    strip = lambda m: {k: v for k, v in (m or {}).items() if k not in _FREE_MODEL_FIELDS}  # noqa: E731
    problems = config_mismatches(strip(saved.get("model")), strip(requested.get("model")), prefix="model.")
    saved_opt = (saved.get("optim") or {}).get("name")
    req_opt = (requested.get("optim") or {}).get("name")
    if "optim" in requested and saved_opt != req_opt:
        problems.append(f"optim.name: checkpoint has {saved_opt!r}, requested {req_opt!r}")
    if problems:
        raise CheckpointMismatchError(
            f"{where} was written for a different model or optimizer than the one requested; mismatched "
            "fields:\n  " + "\n  ".join(problems)
            + "\nUse the checkpoint's settings, or start a fresh run in another out_dir."
        )


class Checkpoints:
    """An orbax ``CheckpointManager`` over ``<run_dir>/checkpoints`` keeping the last ``keep`` steps."""

    def __init__(self, run_dir: str | os.PathLike, *, keep: int | None = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = checkpoint_dir(run_dir)
        if read_only and not self.directory.is_dir():
            raise NoCheckpointError(f"{self.directory}: no checkpoints here (is {run_dir} a run directory?)")
        logging.getLogger("absl").setLevel(logging.ERROR)  # orbax logs every save (and read-only notes)
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_names=ITEMS,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=not read_only,
                read_only=read_only,
                cleanup_tmp_directories=not read_only,  # remove what a killed save left behind
            ),
        )

    # ---- queries ------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def saved_config(self, step: int | None = None) -> dict[str, Any]:
        step = self._step(step)
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def saved_meta(self, step: int | None = None) -> dict[str, Any]:
        """The ``meta`` item of ``step`` (its step, RNG key, loader position and extras) without any array."""
        step = self._step(step)
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise NoCheckpointError(f"{self.directory}: no complete checkpoint to restore")
            return steps[-1]
        if step not in steps:
            raise NoCheckpointError(f"{self.directory}: no checkpoint for step {step}; saved steps are {steps}")
        return step

    # ---- save / restore -----------------------------------------------------------------------------------
    def save(self, step: int, *, params: Any, opt_state: Any, config: dict[str, Any],
             rng_key: jax.Array | None = None, loader_state: Any = None,
             extra: dict[str, Any] | None = None) -> None:
        """Start saving ``step`` (waits for the previous save first; returns once arrays are on the host)."""
        meta = {"step": int(step), "rng_key": None if rng_key is None else key_to_json(rng_key),
                "loader_state": loader_state, "extra": extra or {}}
        self._guarded(self.manager.save, int(step), force=True, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta),
            config=ocp.args.JsonSave(config),
        ))

    def restore(self, step: int | None = None, *, params: Any, opt_state: Any | None = None,
                requested_config: dict[str, Any] | None = None) -> Restored:
        """Restore ``step`` (default: the latest complete one) into the structure, dtypes and shardings of
        ``params`` / ``opt_state`` (real arrays or ShapeDtypeStructs). With ``requested_config`` the saved
        config is checked against it first (:func:`check_compatible`). ``opt_state=None`` skips it."""
        step = self._step(step)
        saved = self.saved_config(step)
        if requested_config is not None:
            check_compatible(saved, requested_config, where=f"checkpoint {self.directory / str(step)}")
        items = dict(params=ocp.args.StandardRestore(_abstract(params)), meta=ocp.args.JsonRestore())
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(_abstract(opt_state))
        r = self.manager.restore(step, args=ocp.args.Composite(**items))
        meta = r["meta"]
        return Restored(
            step=int(meta["step"]), params=r["params"], opt_state=r.get("opt_state") if opt_state is not None
            else None, rng_key=None if meta.get("rng_key") is None else key_from_json(meta["rng_key"]),
            loader_state=meta.get("loader_state"), extra=meta.get("extra") or {}, config=saved,
        )

    def _guarded(self, fn, *args, **kwargs):
        """Run a manager call that may surface a failed (background) save; on failure re-read the steps from
        disk, since the manager already dropped the steps the failed save was to replace from its list
        (they are still on disk: orbax deletes them only once a save commits)."""
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.manager.reload()
            raise

    def wait(self) -> None:
        """Block until the last save is on disk (raises if it failed)."""
        self._guarded(self.manager.wait_until_finished)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- export -------------------------------------------------------------------------------------------------
def load_model(run_dir: str | os.PathLike, *, step: int | None = None, policy=None):
    """The GPT (jaxgpt.model) stored in a run directory's checkpoint ``step`` (default: latest)."""
    from flax import nnx

    from jaxgpt.model import GPT

    with Checkpoints(run_dir, read_only=True) as ckpts:
        step = ckpts._step(step)
        config = GPTConfig.from_dict(ckpts.saved_config(step)["model"])
        abstract = nnx.eval_shape(lambda: GPT(config, policy=policy, rngs=nnx.Rngs(0)))
        graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        params = ckpts.restore(step, params=abstract_params).params
    return nnx.merge(graphdef, params)


def export(run_dir: str | os.PathLike, *, to_hf: str | os.PathLike | None = None,
           to_torch: str | os.PathLike | None = None, step: int | None = None) -> dict[str, Path]:
    """Write a checkpoint as a Hugging Face GPT-2 directory and/or a torch_ref ``state_dict`` file."""
    from jaxgpt import weights

    model = load_model(run_dir, step=step)
    out: dict[str, Path] = {}
    if to_hf is not None:
        out["hf"] = weights.save_hf(model, to_hf)
    if to_torch is not None:
        import torch

        path = Path(to_torch)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(weights.to_torch_state_dict(model), tmp)
        tmp.replace(path)
        out["torch"] = path
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxgpt.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="list the complete checkpoints of a run")
    ls.add_argument("--run-dir", required=True)
    ex = sub.add_parser("export", help="export a checkpoint to Hugging Face and/or torch_ref format")
    ex.add_argument("--run-dir", required=True)
    ex.add_argument("--step", type=int, default=None, help="default: the latest complete checkpoint")
    ex.add_argument("--to-hf", metavar="DIR", help="write a Hugging Face GPT-2 directory here")
    ex.add_argument("--to-torch", metavar="FILE", help="write a torch_ref state_dict (torch.save) here")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "list":
            with Checkpoints(args.run_dir, read_only=True) as ckpts:
                for s in ckpts.all_steps():
                    print(s)
            return 0
        if not (args.to_hf or args.to_torch):
            parser.error("export needs --to-hf DIR and/or --to-torch FILE")
        for kind, path in export(args.run_dir, to_hf=args.to_hf, to_torch=args.to_torch, step=args.step).items():
            print(f"wrote {kind}: {path}")
        return 0
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
