"""Training checkpoints with orbax: save, keep the last K, verify, fall back past damage, resume bit-identically,
export to Hugging Face.

A run directory holds its checkpoints under ``<run_dir>/checkpoints/<step>/``, one orbax step directory each,
with four items:

* ``params``    -- the model parameters (an ``nnx.State`` of fp32 arrays);
* ``opt_state`` -- the optax optimizer state;
* ``meta``      -- JSON: the step, the raw data of the JAX RNG key, the data loader's position, free-form
  extras (the loss, the divergence guard's history, the run's lineage of rollbacks) and a digest of every
  array: XXH3-128 of its bytes on the host, or a 96-bit digest computed on the devices for an array spread over
  several processes (:mod:`jaxgpt.checkpoint.integrity`);
* ``config``    -- JSON: the run's configuration, with the *resolved* model shape under ``"model"``.

Orbax writes each step into ``<step>.orbax-checkpoint-tmp-*`` and renames it into place once every item is on
disk, so a process killed mid-save leaves the previous checkpoints untouched and the half-written directory is
ignored ("incomplete"; removed the next time a writer opens the directory). Saves are asynchronous: the arrays
are copied to host memory before :meth:`Checkpoints.save` returns, the files are written in the background,
and the next save (and :meth:`Checkpoints.close`) waits for the previous one.

Restoring checks, *before* reading any array: the saved model shape and optimizer kind against the requested
ones, each array item's orbax metadata (``params/_METADATA``: missing, not JSON or without a tree is damage,
named so), and the saved tree structure of ``params`` and ``opt_state`` against the requested ones (optax's state
changes shape with some settings, e.g. ``grad_clip`` 0 vs > 0). A mismatch is :class:`CheckpointMismatchError`,
naming each mismatched field or tree path: the step is intact, never called damaged, never moved. Then every
array is read, one item at a time, and verified against its digest. A step that cannot be read (truncated or
garbage array files, lost or garbage orbax metadata, undecodable JSON) or whose bytes changed (a flipped bit) is
:class:`CheckpointDamaged`, naming the step, the file, item or array and the reason; never a traceback, never a
silent wrong load. ``_sharding`` files (each array's device layout, no data) are never read: every restore
gives its target a sharding, so an unreadable one is only noted by ``list``. :meth:`Checkpoints.restore_newest`
restores the newest intact step; only training moves each damaged newer step to
``checkpoints/damaged/<step>-<time>/`` (never deleted; orbax's keep-K no longer counts it); readers
(``generate``, ``export``, ``list``) report and skip it without moving anything, and an explicit step
(``--step N``) that is damaged is an error, with no fallback. Which settings a resumed run may change is
:mod:`jaxgpt.train.changes`'s business.

    python -m jaxgpt.checkpoint list   runs/shakespeare-cpu      # each step: ok / unverified / damaged / incomplete
    python -m jaxgpt.checkpoint export runs/shakespeare-cpu --to-hf out/hf [--to-torch out/sd.pt] [--step N]

Exports never destroy (:mod:`jaxgpt.exportdir`): the target must be new, empty or an earlier export of ours
holding nothing else unless ``--overwrite``; the run directory, its checkpoints and anything already inside it
but an export of ours are refused even then; the target's parent must be writable before the model is loaded;
each export is written beside its target and renamed into place.

Modules: :mod:`~jaxgpt.checkpoint.manager` (:class:`Checkpoints`), :mod:`~jaxgpt.checkpoint.integrity`
(digests, damage), :mod:`~jaxgpt.checkpoint.export` (model, Hugging Face, torch_ref), :mod:`~jaxgpt.checkpoint.cli`.
"""

from jaxgpt.checkpoint.cli import main
from jaxgpt.checkpoint.export import export, load_model, load_model_and_step, saved_tokenizer
from jaxgpt.checkpoint.integrity import CheckpointDamaged, tree_digests
from jaxgpt.checkpoint.manager import (ASIDE, CHECKPOINT_SUBDIR, ITEMS, CheckpointMismatchError, Checkpoints,
                                       NoCheckpointError, Restored, StepState, check_compatible, checkpoint_dir,
                                       config_mismatches, key_from_json, key_to_json)

__all__ = [
    "main", "export", "load_model", "load_model_and_step", "saved_tokenizer", "CheckpointDamaged", "tree_digests", "ASIDE",
    "CHECKPOINT_SUBDIR", "ITEMS", "CheckpointMismatchError", "Checkpoints", "NoCheckpointError", "Restored",
    "StepState", "check_compatible", "checkpoint_dir", "config_mismatches", "key_from_json", "key_to_json",
]
