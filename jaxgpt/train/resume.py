"""How a run continues from a checkpoint (mixed into :class:`jaxgpt.train.run.Run`): which step to restore
(the newest intact one, or ``resume_step``), what the requested settings may change (:mod:`jaxgpt.train.changes`,
checked before any array is read), the restore itself (state, RNG, data position, guard history, lineage), and
the checkpoints a named resume step sets aside (never deleted)."""

from __future__ import annotations

import datetime
from typing import Any

import yaml

from jaxgpt.config import ConfigError
from jaxgpt.train.feed import BatchFeed
from jaxgpt.train.metrics import MetricsLog


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def loader_state_for(saved: dict[str, Any], loader: Any, say: Any) -> dict[str, Any]:
    """The checkpoint's loader position (process 0's, saved by process 0) for this process's loader.

    All processes advance in lockstep, so process 0's position is every process's. A run resumed with
    another process count keeps its place when the global batch is the same (``batch_size *
    process_count``): sequential mode then continues with the very same tokens each step (with one micro-step,
    the very same global batches); random mode continues at the same batch number with other random rows.
    Anything else is left to ``load_state_dict`` to refuse."""
    if not isinstance(saved, dict):
        return saved
    mine = loader.state_dict()
    keys = ("batch_size", "process_index", "process_count")
    if all(saved.get(k) == mine[k] for k in keys):
        return saved
    try:
        same_global = saved["batch_size"] * saved["process_count"] == mine["batch_size"] * mine["process_count"]
    except (KeyError, TypeError):
        return saved
    if not same_global:
        return saved
    if saved["process_count"] != mine["process_count"]:
        say(f"  resuming a {saved['process_count']}-process run with {mine['process_count']} process(es): the "
            f"data loader keeps its place ({loader.mode} mode" + (", other random rows from here on)"
                                                                   if loader.mode == "random" else ")"))
    return {**saved, **{k: mine[k] for k in keys}}


def saved_global_batch(config: dict[str, Any], loader_state: Any) -> int | None:
    """Tokens per optimizer step of a saved run (None for an older or foreign checkpoint: not compared)."""
    loader = loader_state if isinstance(loader_state, dict) else {}
    try:
        return int(loader["batch_size"]) * int(loader["process_count"]) * int(config["seq_len"])
    except (KeyError, TypeError, ValueError):
        return None


def same_request(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b[k] for k in ("resumed_from", "skip_batches", "reason"))


class Resuming:
    """``resume`` and ``restore`` of a :class:`~jaxgpt.train.run.Run`."""

    def resume(self) -> None:
        """Continue from a checkpoint (``resume`` / ``resume_step``), then open the run's files."""
        from jaxgpt.checkpoint import Checkpoints, NoCheckpointError

        cfg = self.cfg
        self.ckpts = Checkpoints(self.run_dir, keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoint,
                                 keep_best=cfg.keep_best_checkpoint)
        steps = self.ckpts.all_steps()
        if cfg.resume == "must" and not steps:
            raise NoCheckpointError(f"resume: must, but {self.ckpts.directory} holds no complete checkpoint")
        if cfg.resume == "never" and steps:
            raise ConfigError(f"resume: never, but {self.run_dir} already holds checkpoints (steps {steps}); use "
                              "resume: auto to continue that run, or another out_dir")
        target, request = self._resume_target(steps)
        if steps:
            self._refuse_breaking_changes(target if target is not None else steps[-1])
            target = self.restore(target, resuming=True)  # None: the newest intact step
            self.resumed_from = target
        self.feed = self.new_feed()
        superseded = [s for s in self.ckpts.all_steps() if target is not None and s > target]
        if request is not None:  # a named resume step applied now (not by an earlier run of this command)
            self._supersede(superseded)
            self.feed.skip(cfg.skip_batches)
            self.lineage.append(request)
        if self.is_main:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.saved_config, sort_keys=False))
        self.metrics = MetricsLog(self.run_dir, tensorboard=cfg.tensorboard,
                                  truncate_after=self.start_step if target is not None else None,
                                  enabled=self.is_main)
        if self.changes:
            self.metrics.write({"type": "config_change", "step": self.start_step, "changes": self.changes})
        if request is not None:
            self.metrics.write({"type": "resume", **request})
            self.say(f"  resumed from step {target} by resume_step" + (
                f", skipping {cfg.skip_batches} batch(es) of data" if cfg.skip_batches else "")
                + (f"; newer checkpoints {superseded} moved to {self.ckpts.directory / 'superseded'}" if superseded
                   else ""))

    def _resume_target(self, steps: list[int]) -> tuple[int | None, dict[str, Any] | None]:
        """The step to restore, and the lineage record of a ``resume_step`` request to apply now (None when there
        is none, or when the newest readable checkpoint records that this very request was applied already)."""
        from jaxgpt.checkpoint import CheckpointDamaged, NoCheckpointError

        cfg = self.cfg
        if cfg.resume_step is None:
            return None, None
        if cfg.resume_step not in steps:
            raise NoCheckpointError(f"resume_step = {cfg.resume_step}: {self.ckpts.directory} holds no checkpoint for "
                                    f"that step; the saved steps are {steps}")
        request = {"resumed_from": cfg.resume_step, "skip_batches": cfg.skip_batches, "reason": "resume_step"}
        for newer in reversed([s for s in steps if s > cfg.resume_step]):
            try:  # a damaged newer step cannot say what was applied: ask the next older one
                applied = (self.ckpts.saved_meta(newer).get("extra") or {}).get("lineage", [])
            except CheckpointDamaged:
                continue
            if any(same_request(r, request) for r in applied):
                self.say(f"  resume_step {cfg.resume_step} (skip_batches {cfg.skip_batches}) was applied by an "
                         f"earlier run of this command; continuing from its newest checkpoint, step {newer}")
                return None, None
            break
        return cfg.resume_step, {**request, "time": now_iso()}

    def _refuse_breaking_changes(self, step: int) -> None:
        """Before any array is read: refuse requested settings that would break the exact continuation of
        ``step`` (a damaged step is left to the restore, which reports it and falls back)."""
        from jaxgpt.checkpoint import CheckpointDamaged
        from jaxgpt.train import changes

        try:
            saved, meta = self.ckpts.saved_config(step), self.ckpts.saved_meta(step)
        except CheckpointDamaged:
            return
        from jaxgpt import data as data_lib

        trained = (meta.get("extra") or {}).get("tokenizer")  # None: GPT-2 (checkpoints from before it was recorded)
        data_lib.check_tokenizer_matches(self.data_dir, trained, f"the checkpoint in {self.run_dir} (step {step})")
        changes.check_resume(saved, self.saved_config, step=step, where=str(self.run_dir),
                             saved_global_batch=saved_global_batch(saved, meta.get("loader_state")),
                             global_batch=self.tokens_per_step)

    def restore(self, step: int | None, *, resuming: bool = False) -> int:
        """The train state, RNG, data position, guard history and lineage of checkpoint ``step`` (None: the newest
        intact one; damaged newer steps are reported and moved to ``checkpoints/damaged/``). The step restored.
        ``resuming``: compare the saved settings with the requested ones (:mod:`jaxgpt.train.changes`)."""
        import jax

        if step is None:
            r = self.ckpts.restore_newest(params=self.state.params, opt_state=self.state.opt_state,
                                          requested_config=self.saved_config)
        else:
            r = self.ckpts.restore(step, params=self.state.params, opt_state=self.state.opt_state,
                                   requested_config=self.saved_config)
        if not r.verified:
            self.say(f"  note: checkpoint step {r.step} was saved without digests (an older jaxgpt): not verified")
        if resuming:
            self.changes = self._check_changes(r)  # (refused: nothing has been moved or written yet)
        for e in r.skipped:
            if self.is_main:
                self.ckpts.move_aside(e.step, "damaged", str(e))
            self.say(f"  warning: {e}; moved to {self.ckpts.directory / 'damaged'}, resuming from an older step")
        if r.skipped:
            self.sync_processes("damaged checkpoints moved aside")
        self.state = self.state.replace(step=jax.numpy.asarray(r.step, dtype=self.state.step.dtype),
                                        params=r.params, opt_state=r.opt_state)
        self.rng = r.rng_key
        self.train_loader.load_state_dict(loader_state_for(r.loader_state, self.train_loader, self.say))
        self.guard.load_state_dict(r.extra.get("guard"))
        self.lineage = list(r.extra.get("lineage", []))
        self.start_step = r.step
        self.pending, self.held = [], None
        return r.step

    def _check_changes(self, r: Any) -> dict[str, list[Any]]:
        """Refuse settings that would break the exact continuation of checkpoint ``r``; return the allowed
        changes (printed now, recorded in metrics.jsonl once it is open)."""
        from jaxgpt.train import changes

        allowed = changes.check_resume(r.config, self.saved_config, step=r.step, where=str(self.run_dir),
                                       saved_global_batch=saved_global_batch(r.config, r.loader_state),
                                       global_batch=self.tokens_per_step)
        if allowed:
            self.say(f"  resuming step {r.step} with changed settings: {changes.describe(allowed)}")
        return allowed

    def new_feed(self) -> BatchFeed:
        return BatchFeed(self.train_loader, micro_steps=self.micro_steps, batch_size=self.cfg.batch_size,
                         seq_len=self.cfg.seq_len, model_config=self.model_cfg, mesh=self.mesh)

    def _supersede(self, steps: list[int]) -> None:
        """Move checkpoints newer than the resumed one aside (never delete them): the run continues from an
        older step and would otherwise mix two histories."""
        if not steps:
            return
        if self.is_main:
            for s in steps:
                self.ckpts.move_aside(s, "superseded", f"resume_step {self.cfg.resume_step} continued from an older "
                                      f"step at {now_iso()}")
        self.sync_processes("superseded checkpoints moved aside")

    def sync_processes(self, what: str) -> None:
        """With several processes: wait until process 0 has moved steps aside, then re-read the step list."""
        if self.pcount > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxgpt.train: {what}")
            self.ckpts.manager.reload()
