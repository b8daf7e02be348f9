"""The checkpoints of one run directory: :class:`Checkpoints`, an orbax ``CheckpointManager`` that records a
digest of every array, verifies it on restore, falls back past damaged steps and moves them aside."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxgpt import diskspace
from jaxgpt.checkpoint.integrity import (DIGEST_FORMAT, CheckpointDamaged, describe_error, mismatches,
                                         quiet_abandoned_reads, tree_digests)
from jaxgpt.config import ConfigError

CHECKPOINT_SUBDIR = "checkpoints"
ITEMS = ("params", "opt_state", "meta", "config")
ASIDE = ("damaged", "superseded")  # checkpoints/<kind>/<step>-<time>/: steps moved out of orbax's sight
# what an interrupted save leaves: ``<step>.orbax-checkpoint-tmp`` (orbax 0.12.x) or with a suffix after ``-tmp``
# (``-<timestamp>``, older and newer orbax versions)
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp(?:-.*)?$")
# GPTConfig fields that may differ between a checkpoint and the model it is restored into (they change no
# array): a fine-tune may turn dropout on.
_FREE_MODEL_FIELDS = frozenset({"dropout"})


class CheckpointMismatchError(ConfigError):
    """The checkpoint was written for a different model (or optimizer) than the one it is restored into: a
    mismatched config field, or a saved tree (``params`` / ``opt_state``) whose structure differs from the
    requested one. The step is intact; it is never called damaged nor moved aside."""


class CheckpointWriteFailed(diskspace.WriteFailed):
    """A checkpoint save failed (a full disk, a quota, any write error). The message names the directory, the
    bytes the save needed, the free space and the newest intact step; the earlier steps are untouched."""

    def __init__(self, message: str, *, step: int, latest: int | None):
        super().__init__(message)
        self.step, self.latest = step, latest


class _QuietOrbaxSaveErrors(logging.Filter):
    """Drop orbax's own ERROR records (with tracebacks) about a failed background save: the failure reaches the
    caller as one :class:`CheckpointWriteFailed` instead of hundreds of stderr lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "/orbax/" not in record.pathname.replace(os.sep, "/"):
            return True
        text = record.getMessage() + (f" {record.exc_info[1]}" if record.exc_info and record.exc_info[1] else "")
        return diskspace.write_failure(Exception(text)) is None


_QUIET = _QuietOrbaxSaveErrors()


class NoCheckpointError(FileNotFoundError):
    """No (complete, intact) checkpoint exists where one was required."""


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
    verified: bool = True  # False: an older checkpoint without digests (read, but nothing to check against)
    skipped: list[CheckpointDamaged] = dataclasses.field(default_factory=list)  # newer damaged steps passed over


@dataclasses.dataclass(frozen=True)
class StepState:
    """One row of ``checkpoint list``."""

    step: int
    state: Literal["ok", "unverified", "damaged", "incomplete"]
    reason: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir).absolute() / CHECKPOINT_SUBDIR


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays: the target orbax restores into. A leaf without a
    sharding (e.g. from ``nnx.eval_shape``) goes to this process's first device, so the restore never depends on
    the step's ``_sharding`` file (which holds no data and is not covered by the digests)."""
    def one(x: Any) -> Any:
        sds = ocp.utils.to_shape_dtype_struct(x)
        if isinstance(sds, jax.ShapeDtypeStruct) and sds.sharding is None:
            sds = jax.ShapeDtypeStruct(sds.shape, sds.dtype,
                                       sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        return sds

    return jax.tree.map(one, tree)


Path_ = tuple[str, ...]  # a leaf's path in orbax's tree metadata: its keys as strings


def _show(path: Path_) -> str:
    return "/".join(path) or "(the root)"


def _tree_differences(saved: set[Path_], requested: set[Path_], *, limit: int = 6) -> list[str]:
    """The leaf paths (empty nodes included) found in only one of two trees, grouped by their first four keys."""
    out = []
    for paths, where in ((saved - requested, "only in the checkpoint"), (requested - saved, "only requested")):
        if not paths:
            continue
        groups: dict[str, int] = {}
        for p in sorted(paths):
            key = _show(p[:4]) + ("/..." if len(p) > 4 else "")
            groups[key] = groups.get(key, 0) + 1
        shown = [k + (f" ({n} leaves)" if n > 1 else "") for k, n in list(groups.items())[:limit]]
        more = f", and {len(groups) - limit} more" if len(groups) > limit else ""
        out.append(f"{where} ({len(paths)} leaves): " + ", ".join(shown) + more)
    return out


_STRUCTURE_HINT = {
    "params": "the model's shape differs (use the checkpoint's model settings)",
    "opt_state": "the optimizer is configured so that its state has another shape: optim.name, optim.grad_clip "
                 "0 vs > 0, optim.weight_decay 0 vs > 0 (any optimizer but adamw) or optim.momentum 0 vs > 0 "
                 "(sgd). Use the checkpoint's optimizer settings, or start a fresh run in another out_dir",
}


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


def _numpy_args(saved: dict[Path_, dict[str, Any]]) -> Any:
    """orbax ``restore_args`` that read every array of a saved tree as a numpy array (no sharding needed), in the
    tree's own shape: dicts for dict keys, lists for sequence keys (orbax's key_type 1), None for empty nodes."""
    def container(key_type: int) -> Any:
        return [] if key_type == 1 else {}

    root: Any = None
    for path, entry in saved.items():
        kinds, value_type = entry["key_types"], entry["value_type"]
        leaf = None if value_type == "None" else ocp.RestoreArgs(
            restore_type=np.ndarray if value_type in ("jax.Array", "np.ndarray") else None)
        if not path:
            return leaf
        if root is None:
            root = container(kinds[0])
        node = root
        for i, key in enumerate(path):
            nxt = leaf if i == len(path) - 1 else container(kinds[i + 1])
            if isinstance(node, list):
                idx = int(key)
                node.extend([None] * (idx + 1 - len(node)))
                if node[idx] is None:
                    node[idx] = nxt
                node = node[idx]
            else:
                node = node.setdefault(key, nxt)
    return root


class Checkpoints:
    """An orbax ``CheckpointManager`` over ``<run_dir>/checkpoints`` keeping the last ``keep`` steps (and, with
    ``keep_best``, the one with the lowest ``val_loss`` metric besides them)."""

    def __init__(self, run_dir: str | os.PathLike, *, keep: int | None = 3, async_save: bool = True,
                 read_only: bool = False, keep_best: bool = False):
        self.directory = checkpoint_dir(run_dir)
        if read_only and not self.directory.is_dir():
            raise NoCheckpointError(f"{self.directory}: no checkpoints here (is {run_dir} a run directory?)")
        logging.getLogger("absl").setLevel(logging.ERROR)  # orbax logs every save (and read-only notes)
        if _QUIET not in logging.getLogger("absl").filters:
            logging.getLogger("absl").addFilter(_QUIET)
        self._in_flight: tuple[int, int] | None = None  # (step, bytes) of the save being written
        policy = ocp.checkpoint_managers.LatestN(n=keep)
        if keep_best:
            policy = ocp.checkpoint_managers.AnyPreservationPolicy([policy, ocp.checkpoint_managers.BestN(
                get_metric_fn=lambda m: m["val_loss"], reverse=True, n=1, keep_checkpoints_without_metrics=False)])
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_names=ITEMS,
            options=ocp.CheckpointManagerOptions(
                preservation_policy=None if read_only else policy,
                # with keep_best, orbax writes each step's metrics (val_loss) beside it only when best_fn is set:
                # without them a restarted run no longer knows which older step was the best, and deletes it
                best_fn=(lambda m: m["val_loss"]) if keep_best else None, best_mode="min",
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

    def incomplete_steps(self) -> list[int]:
        """Steps whose save was interrupted (orbax's temporary directories; a writer removes them on start)."""
        names = os.listdir(self.directory) if self.directory.is_dir() else []
        return sorted({int(m.group(1)) for n in names if (m := _TMP.match(n))})

    def _read_json_item(self, step: int, item: str) -> dict[str, Any]:
        try:
            value = self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]
        except Exception as e:  # orbax, json and OS errors: all mean this step's item cannot be read
            raise CheckpointDamaged(step, f"{item}/ (JSON)", describe_error(e)) from e
        if not isinstance(value, dict):
            raise CheckpointDamaged(step, f"{item}/ (JSON)", f"holds {type(value).__name__}, not a mapping")
        return value

    def tree_metadata(self, step: int, item: str) -> dict[Path_, dict[str, Any]]:
        """The leaves of an array item (``params`` / ``opt_state``) as orbax recorded them in its ``_METADATA``:
        ``{path: {"key_types": [...], "value_type": ...}}``. Raises :class:`CheckpointDamaged` naming the file if
        it is missing, not JSON or without a usable ``tree_metadata``; nothing else of the step is read."""
        f = self.directory / str(step) / item / "_METADATA"
        where = f"{item}/_METADATA"
        try:
            text = f.read_bytes()
        except FileNotFoundError:
            raise CheckpointDamaged(step, where, "missing") from None
        except OSError as e:
            raise CheckpointDamaged(step, where, f"unreadable ({describe_error(e)})") from e
        try:
            doc = json.loads(text)
        except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError
            raise CheckpointDamaged(step, where, f"not JSON ({describe_error(e)})") from e
        tree = doc.get("tree_metadata") if isinstance(doc, dict) else None
        if not isinstance(tree, dict):
            raise CheckpointDamaged(step, where, "has no tree_metadata")
        if not tree:
            raise CheckpointDamaged(step, where, "has an empty tree_metadata")
        out: dict[Path_, dict[str, Any]] = {}
        for name, entry in tree.items():
            try:
                keys = entry["key_metadata"]
                path = tuple(str(k["key"]) for k in keys)
                out[path] = {"key_types": [int(k["key_type"]) for k in keys],
                             "value_type": str(entry["value_metadata"]["value_type"])}
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointDamaged(step, where, f"malformed tree_metadata entry {str(name)[:80]!r} "
                                        f"({describe_error(e)})") from e
        return out

    def _check_structure(self, step: int, item: str, saved: dict[Path_, Any], target: Any) -> None:
        """:class:`CheckpointMismatchError` if ``target``'s tree (leaf paths, empty nodes included, as orbax writes
        them) is not the saved one: an intact step that cannot be restored into what was requested."""
        requested = set(ocp.tree.to_flat_dict(target, keep_empty_nodes=True))
        if requested == set(saved):
            return
        raise CheckpointMismatchError(
            f"checkpoint {self.directory / str(step)}: {item}/ was saved with another tree structure than the "
            f"requested one, so it cannot be restored into it (the step is intact; nothing was read or moved):\n  "
            + "\n  ".join(_tree_differences(set(saved), requested))
            + f"\nLikely cause: {_STRUCTURE_HINT.get(item, 'a different configuration')}."
        )

    def saved_config(self, step: int | None = None) -> dict[str, Any]:
        """The ``config`` item of ``step`` (raises :class:`CheckpointDamaged` if it cannot be read)."""
        return self._read_json_item(self._step(step), "config")

    def saved_meta(self, step: int | None = None) -> dict[str, Any]:
        """The ``meta`` item of ``step`` (its step, RNG key, loader position, extras, digests) without any array."""
        return self._read_json_item(self._step(step), "meta")

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise NoCheckpointError(f"{self.directory}: no complete checkpoint to restore")
            return steps[-1]
        if step not in steps:
            raise NoCheckpointError(f"{self.directory}: no checkpoint for step {step}; saved steps are {steps}")
        return step

    # ---- save ---------------------------------------------------------------------------------------------
    def save(self, step: int, *, params: Any, opt_state: Any, config: dict[str, Any],
             rng_key: jax.Array | None = None, loader_state: Any = None,
             extra: dict[str, Any] | None = None, metrics: dict[str, float] | None = None) -> None:
        """Start saving ``step`` (waits for the previous save first; returns once arrays are on the host). The
        meta item records a digest of every array; ``metrics`` (e.g. ``val_loss``) feed ``keep_best``."""
        self.wait()  # the previous save: its failure is reported as its own, before this one starts
        quiet_abandoned_reads()  # a failed write (full disk) leaves TensorStore writes ending on a closed loop
        self._in_flight = (int(step), diskspace.tree_nbytes((params, opt_state)))
        digests = {"format": DIGEST_FORMAT, "params": tree_digests(params), "opt_state": tree_digests(opt_state)}
        meta = {"step": int(step), "rng_key": None if rng_key is None else key_to_json(rng_key),
                "loader_state": loader_state, "extra": extra or {}, "digests": digests}
        self._guarded(self.manager.save, int(step), force=True, metrics=metrics, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta),
            config=ocp.args.JsonSave(config),
        ))

    # ---- restore ------------------------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, params: Any, opt_state: Any | None = None,
                requested_config: dict[str, Any] | None = None) -> Restored:
        """Restore ``step`` (default: the latest complete one) into the structure, dtypes and shardings of
        ``params`` / ``opt_state`` (real arrays or ShapeDtypeStructs), and verify every array against its
        recorded digest. With ``requested_config`` the saved config is checked against it first
        (:func:`check_compatible`). ``opt_state=None`` skips it. Before any array is read, each item's orbax
        metadata is checked (missing or garbage: damaged) and its tree compared with the requested one (another
        structure: :class:`CheckpointMismatchError`, naming the differing paths). A damaged step raises
        :class:`CheckpointDamaged`; no other step is tried (see :meth:`restore_newest`)."""
        step = self._step(step)
        saved = self.saved_config(step)
        if requested_config is not None:
            check_compatible(saved, requested_config, where=f"checkpoint {self.directory / str(step)}")
        meta = self.saved_meta(step)
        items = {"params": _abstract(params)} if opt_state is None else \
            {"params": _abstract(params), "opt_state": _abstract(opt_state)}
        saved_trees = {item: self.tree_metadata(step, item) for item in items}  # damage first: falls back
        for item, target in items.items():
            self._check_structure(step, item, saved_trees[item], target)
        arrays = self._read_arrays(step, items)
        verified = self._verify(step, meta, arrays)
        try:
            rng_key = None if meta.get("rng_key") is None else key_from_json(meta["rng_key"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointDamaged(step, "meta/ rng_key", describe_error(e)) from e
        return Restored(step=int(meta.get("step", step)), params=arrays["params"], opt_state=arrays.get("opt_state"),
                        rng_key=rng_key, loader_state=meta.get("loader_state"), extra=meta.get("extra") or {},
                        config=saved, verified=verified)

    def restore_newest(self, *, params: Any, opt_state: Any | None = None,
                       requested_config: dict[str, Any] | None = None) -> Restored:
        """:meth:`restore` the newest step that is complete and intact. Each damaged newer step is recorded in
        ``Restored.skipped``; nothing is moved (a writer moves them with :meth:`move_aside` once it has accepted
        the restored step, as training does). Raises :class:`NoCheckpointError` when no step is
        intact (naming why each one failed); a :class:`CheckpointMismatchError` (an intact step saved for another
        model or optimizer) ends the search at once, since older steps of the run have the same structure."""
        skipped: list[CheckpointDamaged] = []
        for step in reversed(self.all_steps()):
            try:
                r = self.restore(step, params=params, opt_state=opt_state, requested_config=requested_config)
            except CheckpointDamaged as e:
                skipped.append(e)
                continue
            r.skipped = skipped
            return r
        why = "".join(f"\n  {e}" for e in skipped)
        raise NoCheckpointError(f"{self.directory}: no intact checkpoint to restore" + (why or " (none saved)"))

    def _read_arrays(self, step: int, items: dict[str, Any]) -> dict[str, Any]:
        """Read each item into its target (ShapeDtypeStructs with shardings), one item at a time so a failure
        names the item it happened in."""
        # installed before the read, not after it fails: TensorStore's threads can report an abandoned read
        # (through sys.unraisablehook) before the failure reaches this thread (seen in CI)
        quiet_abandoned_reads()
        out = {}
        for item, target in items.items():
            try:
                out[item] = self.manager.restore(
                    step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(target)}))[item]
            except Exception as e:  # orbax / tensorstore / OS: truncated or garbage array files
                raise CheckpointDamaged(step, f"{item}/", describe_error(e)) from e
        return out

    def _read_arrays_as_saved(self, step: int, item: str, saved: dict[Path_, dict[str, Any]]) -> Any:
        """Read an item without a target, as host numpy arrays in the tree its ``_METADATA`` records (plain dicts
        and lists): nothing depends on the ``_sharding`` file, which holds no data."""
        quiet_abandoned_reads()
        try:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
                return reader.restore(self.directory / str(step) / item,
                                      args=ocp.args.PyTreeRestore(restore_args=_numpy_args(saved)))
        except Exception as e:  # orbax / tensorstore / OS: truncated or garbage array files
            raise CheckpointDamaged(step, f"{item}/", describe_error(e)) from e

    def _unreadable_sharding(self, step: int, items: tuple[str, ...]) -> list[str]:
        """The items whose ``_sharding`` file (where orbax records each array's device layout, data-free) is
        missing or not JSON. Restores here never read it (every target carries its sharding)."""
        bad = []
        for item in items:
            try:
                json.loads((self.directory / str(step) / item / "_sharding").read_bytes())
            except (OSError, ValueError):
                bad.append(f"{item}/_sharding")
        return bad

    @staticmethod
    def _verify(step: int, meta: dict[str, Any], arrays: dict[str, Any]) -> bool:
        recorded = meta.get("digests")
        if recorded is None:
            return False  # saved before digests existed: nothing to check against
        if not isinstance(recorded, dict) or not str(recorded.get("format", "")).startswith("jaxgpt-"):
            raise CheckpointDamaged(step, "meta/ digests", f"unknown digest record {str(recorded)[:80]!r}")
        if recorded["format"] != DIGEST_FORMAT:
            return False  # another jaxgpt's digest: nothing this one can check against
        for item, tree in arrays.items():
            saved = recorded.get(item) or {}
            bad = mismatches(saved, tree_digests(tree, like=saved))
            if bad:
                more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
                raise CheckpointDamaged(step, f"{item}/", "the bytes read differ from the ones saved: "
                                        + "; ".join(bad[:3]) + more)
        return True

    def verify(self, step: int) -> StepState:
        """Read all of ``step`` (without a target: the tree from its own metadata, as host arrays) and check every
        digest. A missing or garbage ``_sharding`` file is a note, not damage: it holds no data, and no restore
        here reads it."""
        items = ("params", "opt_state")
        try:
            meta, _ = self.saved_meta(step), self.saved_config(step)
            saved = {item: self.tree_metadata(step, item) for item in items}
            arrays = {item: self._read_arrays_as_saved(step, item, saved[item]) for item in items}
            verified = self._verify(step, meta, arrays)
        except CheckpointDamaged as e:
            return StepState(step, "damaged", f"{e.where}: {e.reason}")
        extra = meta.get("extra") or {}
        notes = [] if verified else ["saved without digests (an older jaxgpt): read, not checked"]
        bad = self._unreadable_sharding(step, items)
        if bad:
            notes.append(f"{', '.join(bad)} unreadable: ignored (layout only, no data; the arrays verified)"
                         if verified else f"{', '.join(bad)} unreadable: ignored (layout only, no data)")
        return StepState(step, "ok" if verified else "unverified", "; ".join(notes), extra)

    def states(self) -> list[StepState]:
        """Every step's state, oldest first: complete steps verified, interrupted saves as incomplete."""
        rows = [self.verify(s) for s in self.all_steps()]
        rows += [StepState(s, "incomplete", "an interrupted save (orbax's temporary directory)")
                 for s in self.incomplete_steps()]
        return sorted(rows, key=lambda r: (r.step, r.state != "incomplete"))

    # ---- moving steps aside ---------------------------------------------------------------------------------
    def move_aside(self, step: int, kind: str, reason: str) -> Path:
        """Move ``step`` to ``checkpoints/<kind>/<step>-<time>/`` (never deleted; orbax no longer sees it, so
        keep-K cannot count it or rotate the intact steps out for it), with ``reason.txt``."""
        if kind not in ASIDE:
            raise ValueError(f"kind = {kind!r}: one of {ASIDE}")
        self.wait()
        dest = self.directory / kind / f"{step}-{datetime.datetime.now().strftime('%Y%m%dT%H%M%S%f')}"
        dest.parent.mkdir(exist_ok=True)
        (self.directory / str(step)).rename(dest)
        (dest / "reason.txt").write_text(reason.rstrip() + "\n")
        self.manager.reload()
        return dest

    def set_aside(self, kind: str) -> list[Path]:
        """The steps moved to ``checkpoints/<kind>/``."""
        d = self.directory / kind
        return sorted(d.iterdir()) if d.is_dir() else []

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def _guarded(self, fn, *args, **kwargs):
        """Run a manager call that may surface a failed (background) save; on failure re-read the steps from
        disk, since the manager already dropped the steps the failed save was to replace from its list
        (they are still on disk: orbax deletes them only once a save commits). A failed write (a full disk,
        whatever exception type orbax reports it with) becomes :class:`CheckpointWriteFailed`."""
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            self.manager.reload()
            why = diskspace.write_failure(e) if isinstance(e, Exception) else None
            if why is None:
                raise
            raise self._write_failed(why, e) from e

    def _write_failed(self, why: tuple[int, str], e: BaseException) -> CheckpointWriteFailed:
        step, need = self._in_flight or (None, None)
        self._in_flight = None
        steps = self.all_steps()
        latest = steps[-1] if steps else None
        kept = (f"The newest intact checkpoint is step {latest} (steps {steps}, untouched)" if latest is not None
                else "No checkpoint was saved before it")
        what = f"saving checkpoint step {step}" if step is not None else "a checkpoint save"
        return CheckpointWriteFailed(
            f"{what} into {self.directory} failed: {why[1]} (errno {why[0]}); "
            + diskspace.describe_space(self.directory, need)
            + f". {kept}; the half-written step is left as orbax's temporary directory (`checkpoint list` shows it "
            "as incomplete; the next run removes it). Free space on that disk (or move out_dir to a larger one), "
            "then re-run the same command: it resumes from the newest intact step.",
            step=step if step is not None else -1, latest=latest)

    def check(self) -> None:
        """Cheap, once per training step: if the save in flight has ended, wait for it, so that a failed save
        (:class:`CheckpointWriteFailed`) is reported now rather than at the next save or the end of the run."""
        if self._in_flight is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until the last save is on disk (raises if it failed)."""
        self._guarded(self.manager.wait_until_finished)
        self._in_flight = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            # orbax removes old temporary directories in a background thread started with the manager: a process
            # that stops right after (a refused run) must let it end, or it dies at interpreter shutdown, loudly
            try:
                getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
            except Exception:  # (its own failure is not this caller's error)
                pass
            self.manager.close()

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

