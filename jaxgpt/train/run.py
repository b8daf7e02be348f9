"""One training run, as named phases that read top-down: :meth:`Run.set_up` (lock the run directory; mesh, data,
model, optimizer, jitted steps), :meth:`Run.resume` (a checkpoint, the metrics log, ``config.yaml``),
:meth:`Run.announce`, :meth:`Run.step_loop` (train, evaluate, sample, checkpoint), :meth:`Run.finish` (the final
evaluation, sample and checkpoint) and :meth:`Run.close`; :func:`train` runs them in that order.

The step loop keeps the host ahead of the device: a step's metrics stay on the device until the loop next
synchronises (every ``log_interval`` steps, and before an evaluation, a sample or a checkpoint), and the next
batch is read and placed while a step runs (:mod:`jaxgpt.train.feed`). At each synchronisation every pending
step's loss and gradient norm go through the divergence guard (:mod:`jaxgpt.train.guard`), in order.

Only checked states are saved: the params after step ``s`` are first evaluated by step ``s + 1``'s loss. So at a
checkpoint step the state is copied on the device (one extra copy of params and optimizer state, for one step),
and written once step ``s + 1``'s loss and gradient norm have passed the guard; had they not, the copy is
dropped. The final state is checked by the final validation loss (finite). Every saved checkpoint is therefore a
state that was seen healthy, and "the last good checkpoint" in any message is one.

On divergence the run stops (exit 3), naming the newest healthy state and checkpoint, or with ``on_divergence:
rollback`` restores the newest checkpoint, skips the batches that followed it up to the diverged step (PaLM's
remedy for loss spikes) and continues, at most ``max_rollbacks`` times. By hand: ``--resume_step=N`` resumes
from checkpoint N (newer checkpoints are moved to ``checkpoints/superseded/``, newer metric records to
``metrics.superseded.jsonl``; nothing is deleted) and ``--skip_batches=K`` advances the data K global batches
past N's position. Each such resume is recorded in the checkpoints that follow (``lineage``), so re-running
the same command continues the resumed run instead of resuming from N again."""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import yaml

from jaxgpt.config import ConfigError, to_dict
from jaxgpt.train.config import TrainConfig
from jaxgpt.train.feed import BatchFeed
from jaxgpt.train.guard import DivergenceGuard, Verdict
from jaxgpt.train.metrics import MetricsLog, count_params, device_peak_flops, flops_per_step, plot_losses, read_metrics


class NonFiniteLoss(RuntimeError):
    """Training diverged (a non-finite or spiking loss or gradient norm) and could not roll back; the message
    names the step, the rule, the newest healthy state and the newest checkpoint."""


Diverged = NonFiniteLoss


def _on_one_device(tree: Any) -> Any:
    """``tree`` (sharded over a mesh, maybe over several processes) whole on this process's first device:
    what generation runs on. With several processes every process must call it (an all-gather)."""
    import jax

    device = jax.local_devices()[0]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        tree = multihost_utils.process_allgather(tree, tiled=True)  # numpy, whole, on every process
    return jax.device_put(tree, device)


def _loader_state_for(saved: dict[str, Any], loader: Any, say: Any) -> dict[str, Any]:
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


# ---- the run --------------------------------------------------------------------------------------------
def build_model(cfg: TrainConfig, policy):
    """The GPT to train: fresh (init_from: scratch) or with Hugging Face weights."""
    from flax import nnx

    from jaxgpt.model import GPT

    if cfg.init_from == "scratch":
        model_cfg = cfg.model if cfg.dropout is None else cfg.model.replace(dropout=cfg.dropout)
        return GPT(model_cfg, policy=policy, rngs=nnx.Rngs(params=cfg.seed))
    from jaxgpt import weights

    hf_config, ref = weights.load_hf(cfg.init_from)
    if cfg.dropout is not None:
        hf_config = hf_config.replace(dropout=cfg.dropout)
    if cfg.seq_len > hf_config.block_size:
        raise ConfigError(f"TrainConfig.seq_len = {cfg.seq_len}: must be <= the checkpoint's block_size "
                          f"({hf_config.block_size})")
    return weights.from_torch_state_dict(ref, hf_config, policy=policy)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training; returns a summary. Raises :class:`NonFiniteLoss` when training diverged."""
    run = Run.set_up(cfg)
    try:
        run.resume()
        run.announce()
        run.step_loop()
        run.finish()
    finally:
        run.close()
    return run.summarise()


class Run:
    """The state of one training run between its phases (see the module docstring)."""

    # ---- set-up ---------------------------------------------------------------------------------------------
    @classmethod
    def set_up(cls, cfg: TrainConfig) -> "Run":
        """Everything before the first step: the run directory's lock, the mesh, the data, the model and its
        jitted steps. Configuration errors come before anything is written."""
        import jax

        from jaxgpt import mesh as mesh_lib

        run = cls()
        run.cfg, run.t_start = cfg, time.perf_counter()
        run.lock = run.metrics = run.bar = run.ckpts = None
        run.pcount, run.pindex = jax.process_count(), jax.process_index()
        run.mesh = mesh_lib.make_mesh(cfg.mesh)
        local_devices = sum(d.process_index == run.pindex for d in run.mesh.devices.flat)
        if cfg.batch_size % local_devices:
            raise ConfigError(f"TrainConfig.batch_size = {cfg.batch_size}: must be a multiple of the devices per "
                              f"process ({local_devices}): every device takes the same number of rows of each "
                              "micro-batch")
        run.is_main = run.pindex == 0  # writes the run directory's files (all processes save checkpoints together)
        run._lock_run_dir()
        try:
            run.micro_steps = cfg.micro_steps(run.pcount)
            run.tokens_per_step = run.micro_steps * cfg.batch_size * cfg.seq_len * run.pcount
            run.say = _say if run.is_main else (lambda *_a, **_k: None)
            run._set_up_data()
            run._set_up_hellaswag()
            run._set_up_model()
            from jaxgpt import data as data_lib

            data_lib.check_shards_for_model(run.data_dir, run.model_cfg.vocab_size)  # headers only
        except BaseException:
            run._unlock()
            raise
        run.start_step, run.resumed_from, run.rollbacks, run.lineage = 0, None, 0, []
        run.last, run.val_loss, run.val_step, run.held, run.changes = {}, None, None, None, {}
        run.pending: list[tuple[int, Any]] = []  # (step, metrics still on the device)
        run.steady_tokens, run.steady_time, run.compile_s = 0, 0.0, None
        run.guard = DivergenceGuard(loss_factor=cfg.spike_loss_factor, grad_norm_factor=cfg.spike_grad_norm_factor,
                                    window=cfg.spike_window)
        return run

    def _lock_run_dir(self) -> None:
        from jaxgpt import rundir

        self.run_dir = Path(self.cfg.out_dir)
        try:
            rundir.make_dir(self.run_dir, what="run directory", option="out_dir")
            if self.is_main:  # one lock per run; the other processes of a multi-process run only write checkpoints
                self.lock = rundir.DirLock(self.run_dir, what="run directory", option="out_dir").acquire()
        except rundir.DirError as e:
            raise ConfigError(str(e)) from None

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def _set_up_data(self) -> None:
        from jaxgpt import data as data_lib

        cfg = self.cfg
        self.data_dir = cfg.resolved_data_dir()
        handmade = any(self.data_dir.glob("*_train_[0-9]*.bin"))  # shards without a manifest: used as they are
        if not (self.data_dir / data_lib.MANIFEST_NAME).exists() and not handmade:
            if cfg.data_source.startswith(data_lib.HF_PREFIX):  # large: prepared on purpose, with its options
                raise ConfigError(f"{self.data_dir} holds no prepared shards; prepare {cfg.data_source!r} first with "
                                  f"`python -m jaxgpt.data --hf-dataset ... --out {self.data_dir}` (see the config "
                                  "file)")
            data_lib.prepare(cfg.data_source, self.data_dir)
        self.train_loader = data_lib.DataLoader(
            self.data_dir, "train", cfg.batch_size * self.micro_steps, cfg.seq_len, mode=cfg.loader_mode,
            seed=cfg.seed, process_index=self.pindex, process_count=self.pcount)
        self.val_loader = data_lib.DataLoader(
            self.data_dir, "val", cfg.batch_size, cfg.seq_len, mode="sequential", seed=cfg.seed,
            process_index=self.pindex, process_count=self.pcount)
        self.val_state = self.val_loader.state_dict()
        self.n_eval = min(cfg.eval_steps, self.val_loader.batches_per_epoch)  # never the same batch twice

    def _set_up_hellaswag(self) -> None:
        """The HellaSwag items, read (or downloaded) now, so a missing file fails before the first step."""
        self.hellaswag_items, self.hellaswag_scorer = None, None
        if self.cfg.hellaswag_interval:
            from jaxgpt.eval import EvalError, hellaswag

            try:
                path = hellaswag.find_or_download(self.cfg.hellaswag_file)
                self.hellaswag_items = hellaswag.load(path, limit=self.cfg.hellaswag_limit)
            except EvalError as e:
                raise ConfigError(f"TrainConfig.hellaswag_interval = {self.cfg.hellaswag_interval}: {e} (set "
                                  "hellaswag_file, or hellaswag_interval: 0)") from None

    def _set_up_model(self) -> None:
        import jax

        from jaxgpt import step as step_lib
        from jaxgpt.optim import make_optimizer
        from jaxgpt.precision import Policy

        cfg = self.cfg
        self.policy = Policy.named(cfg.precision, attention=cfg.attention)
        model = build_model(cfg, self.policy)
        self.model_cfg = model.config
        optimizer = make_optimizer(cfg.optim)
        self.graphdef, self.state = step_lib.init_train_state(model, optimizer, mesh=self.mesh)
        del model
        self.saved_config = {**cfg.to_dict(), "model": to_dict(self.model_cfg)}
        self.train_step = step_lib.make_train_step(self.graphdef, optimizer, micro_steps=self.micro_steps,
                                                   dropout=self.model_cfg.dropout > 0, mesh=self.mesh)
        self.eval_step = step_lib.make_eval_step(self.graphdef, mesh=self.mesh)
        self.rng = jax.random.key(cfg.seed)

    # ---- resume ---------------------------------------------------------------------------------------------
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
            target = self.restore(target, resuming=True)  # None: the newest intact step
            self.resumed_from = target
        self.feed = self._new_feed()
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
        is none, or when the newest checkpoint records that this very request was applied already)."""
        from jaxgpt.checkpoint import NoCheckpointError

        cfg = self.cfg
        latest = steps[-1] if steps else None
        if cfg.resume_step is None:
            return None, None
        if cfg.resume_step not in steps:
            raise NoCheckpointError(f"resume_step = {cfg.resume_step}: {self.ckpts.directory} holds no checkpoint for "
                                    f"that step; the saved steps are {steps}")
        request = {"resumed_from": cfg.resume_step, "skip_batches": cfg.skip_batches, "reason": "resume_step"}
        applied = (self.ckpts.saved_meta(latest).get("extra") or {}).get("lineage", [])
        if latest > cfg.resume_step and any(_same_request(r, request) for r in applied):
            self.say(f"  resume_step {cfg.resume_step} (skip_batches {cfg.skip_batches}) was applied by an earlier "
                     f"run of this command; continuing from its newest checkpoint, step {latest}")
            return None, None
        return cfg.resume_step, {**request, "time": _now()}

    def restore(self, step: int | None, *, resuming: bool = False) -> int:
        """The train state, RNG, data position, guard history and lineage of checkpoint ``step`` (None: the newest
        intact one; damaged newer steps are reported and moved to ``checkpoints/damaged/``). The step restored.
        ``resuming``: first compare the saved settings with the requested ones (:mod:`jaxgpt.train.changes`)."""
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
            self._sync_processes("damaged checkpoints moved aside")
        self.state = self.state.replace(step=jax.numpy.asarray(r.step, dtype=self.state.step.dtype),
                                        params=r.params, opt_state=r.opt_state)
        self.rng = r.rng_key
        self.train_loader.load_state_dict(_loader_state_for(r.loader_state, self.train_loader, self.say))
        self.guard.load_state_dict(r.extra.get("guard"))
        self.lineage = list(r.extra.get("lineage", []))
        self.start_step = r.step
        self.pending, self.held = [], None
        return r.step

    def _check_changes(self, r: Any) -> dict[str, list[Any]]:
        """Refuse settings that would break the exact continuation of checkpoint ``r``; return the allowed
        changes (printed now, recorded in metrics.jsonl once it is open)."""
        from jaxgpt.train import changes

        loader = r.loader_state if isinstance(r.loader_state, dict) else {}
        try:
            saved_global = int(loader["batch_size"]) * int(loader["process_count"]) * int(r.config["seq_len"])
        except (KeyError, TypeError, ValueError):
            saved_global = None  # an older or foreign checkpoint: the loader's own check still applies
        allowed = changes.check_resume(r.config, self.saved_config, step=r.step, where=str(self.run_dir),
                                       saved_global_batch=saved_global, global_batch=self.tokens_per_step)
        if allowed:
            self.say(f"  resuming step {r.step} with changed settings: {changes.describe(allowed)}")
        return allowed

    def _new_feed(self) -> BatchFeed:
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
                                      f"step at {_now()}")
        self._sync_processes("superseded checkpoints moved aside")

    def _sync_processes(self, what: str) -> None:
        """With several processes: wait until process 0 has moved steps aside, then re-read the step list."""
        if self.pcount > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxgpt.train: {what}")
            self.ckpts.manager.reload()

    def announce(self) -> None:
        """The run's header: model, batch, data, devices, peak FLOP/s, mesh, run directory."""
        import jax

        from jaxgpt import mesh as mesh_lib

        cfg, m = self.cfg, self.model_cfg
        n_params = count_params(self.state.params)
        self.step_flops = flops_per_step(m, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                         micro_steps=self.micro_steps) * self.pcount
        self.peak, peak_src = device_peak_flops(self.policy.compute_dtype)
        self.n_dev = jax.device_count()
        self.say(f"jaxgpt.train: {n_params / 1e6:.2f}M params ({m.n_layer}L {m.n_head}H {m.n_embd}C, vocab rows "
                 f"{m.vocab_rows}), init {cfg.init_from}, {self.policy.compute_dtype} compute, {self.n_dev} x "
                 f"{jax.devices()[0].device_kind}, {self.pcount} process(es)")
        self.say(f"  batch: {self.tokens_per_step:,} tokens/step = {self.micro_steps} micro step(s) x "
                 f"{cfg.batch_size} x {cfg.seq_len} x {self.pcount} process(es); data {self.data_dir} "
                 f"({self.train_loader.num_tokens:,} train tokens); peak "
                 f"{'?' if self.peak is None else f'{self.peak / 1e12:.2f} TFLOP/s'} ({peak_src})")
        self.say(f"  {mesh_lib.summary(self.mesh, self.state.params, self.state.opt_state)}")
        self.say(f"  run dir {self.run_dir}" + (f"; resumed from step {self.start_step}"
                                                 if self.resumed_from is not None else ""))

    # ---- the step loop --------------------------------------------------------------------------------------
    def step_loop(self) -> None:
        """Optimizer steps from ``start_step`` to ``max_steps``, with evaluations, samples and checkpoints."""
        import jax
        from tqdm.auto import tqdm

        cfg = self.cfg
        self.bar = tqdm(total=cfg.max_steps, initial=self.start_step, unit="step", disable=not cfg.progress,
                        dynamic_ncols=True, mininterval=1.0)
        if self.start_step == 0 and cfg.eval_interval > 0:
            self.val_loss = self.evaluate()
            self.metrics.write({"type": "eval", "step": 0, "val_loss": self.val_loss})
            self.say(f"step 0: val loss {self.val_loss:.4f}")
        debug_sleep = float(os.environ.get("JAXGPT_DEBUG_STEP_SLEEP", "0"))  # a test kills a run mid-way
        step, first = self.start_step, self.start_step + 1
        self.t_mark = time.perf_counter()
        while step < cfg.max_steps:
            step += 1
            if debug_sleep:
                time.sleep(debug_sleep)
            x, y = self.feed.next()
            self.rng, key = jax.random.split(self.rng)
            self.state, m = self.train_step(self.state, x, y, key)  # dispatched: the device runs it ...
            self.pending.append((step, m))
            self.bar.update(1)
            if step < cfg.max_steps:
                self.feed.read_ahead()  # ... while the host prepares the next batch
            due = {name: bool(every) and step % every == 0 and step != cfg.max_steps
                   for name, every in (("eval", cfg.eval_interval), ("checkpoint", cfg.checkpoint_interval),
                                       ("sample", max(cfg.sample_interval, 0)),
                                       ("hellaswag", cfg.hellaswag_interval))}
            if (step == first or step % cfg.log_interval == 0 or step == cfg.max_steps or any(due.values())
                    or self.held is not None):
                verdict = self.sync()
                if verdict is not None:
                    step = self.recover(verdict)  # the checkpoint rolled back to (or raises)
                    first = step + 1
                    continue
            if due["eval"]:
                self.val_loss, self.val_step = self.evaluate(), step
                self.metrics.write({"type": "eval", "step": step, "val_loss": self.val_loss})
                self.say(f"step {step}: train loss {self.last['loss']:.4f}, val loss {self.val_loss:.4f}")
            if due["hellaswag"]:
                self.score_hellaswag(step)
            if due["sample"]:
                self.sample(step)
            if due["checkpoint"]:
                self.hold(step)
            if any(due.values()):
                self.t_mark = time.perf_counter()  # their time is not the steps'
        self.bar.close()

    def sync(self) -> Verdict | None:
        """Fetch the pending steps' metrics (one device-to-host transfer), check each in order, log them, and
        write a held checkpoint once the step after it has passed. The first diverged step's verdict, if any."""
        import jax

        now = time.perf_counter()
        steps, fetched = [s for s, _ in self.pending], jax.device_get([m for _, m in self.pending])
        dt = (now - self.t_mark) / len(steps)
        self.pending, self.t_mark = [], now
        if self.compile_s is None:
            self.compile_s = dt  # the first step after (re)starting: trace + compile + run
        else:
            self.steady_tokens += self.tokens_per_step * len(steps)
            self.steady_time += dt * len(steps)
        for step, m in zip(steps, fetched):
            loss, grad_norm, lr = float(m["loss"]), float(m["grad_norm"]), float(m["lr"])
            verdict = self.guard.check(step, loss, grad_norm)
            if verdict is not None:
                return verdict
            if self.held is not None and self.held["step"] == step - 1:
                self.write_held()
            self.log_step({"type": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                           "step_time": dt, "tokens_per_s": self.tokens_per_step / dt,
                           "flops_per_s": self.step_flops / dt,
                           "mfu": self.step_flops / dt / (self.peak * self.n_dev) if self.peak else None,
                           "tokens": step * self.tokens_per_step})
        return None

    def log_step(self, record: dict[str, Any]) -> None:
        self.last = record
        if record["step"] % self.cfg.log_interval == 0 or record["step"] == self.cfg.max_steps:
            self.metrics.write(record)
        mfu = record["mfu"]
        self.bar.set_postfix({"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
                              "tok/s": f"{record['tokens_per_s']:,.0f}",
                              **({"mfu": f"{mfu:.1%}"} if mfu is not None else {})}, refresh=False)

    def recover(self, verdict: Verdict, *, may_roll_back: bool = True) -> int:
        """After a diverged step: roll back to the newest checkpoint and skip the data up to the diverged step
        (``on_divergence: rollback``, while rollbacks remain), returning the step rolled back to; else raise
        :class:`NonFiniteLoss` naming the newest healthy state and checkpoint."""
        cfg, v = self.cfg, verdict
        self.pending, self.held = [], None
        self.ckpts.wait()
        last = self.ckpts.latest_step()
        self.metrics.write({"type": "divergence", "step": v.step, "loss": _json_number(v.loss),
                            "grad_norm": _json_number(v.grad_norm), "reason": v.reason})
        if may_roll_back and cfg.on_divergence == "rollback" and last is not None \
                and self.rollbacks < cfg.max_rollbacks:
            self.rollbacks += 1
            last = self.restore(None)  # the newest intact checkpoint
            skip = v.step - last  # the batches of steps last+1 .. v.step
            self.feed = self._new_feed()
            self.feed.skip(skip)
            self.lineage.append({"resumed_from": last, "skip_batches": skip, "time": _now(),
                                 "reason": f"rollback after step {v.step}: {v.reason}"})
            self.metrics.write({"type": "rollback", "step": last, "from_step": v.step, "skip_batches": skip})
            self.bar.n = last
            self.say(f"step {v.step}: {v.reason}; rolled back to checkpoint {last} and skipped its next {skip} "
                     f"batch(es) (rollback {self.rollbacks} of {cfg.max_rollbacks})")
            self.t_mark = time.perf_counter()
            return last
        healthy = (f"The newest healthy state is step {v.step - 2} (its loss, at step {v.step - 1}, passed)"
                   if v.step >= 2 else "No state was seen healthy")
        where = (f"the last good checkpoint is step {last} in {self.ckpts.directory}: resume from it with a lower "
                 f"optim.lr, or skip the data that followed it with --resume_step={last} "
                 f"--skip_batches={v.step - last}, or set on_divergence: rollback" if last is not None else
                 "no checkpoint was written before it")
        why = f" ({self.rollbacks} rollback(s) done)" if self.rollbacks else ""
        raise NonFiniteLoss(f"step {v.step}: {v.reason}: training diverged{why} (lower optim.lr or raise "
                            f"optim.warmup_steps). {healthy}; {where}")

    def evaluate(self) -> float:
        """Mean loss of the same first ``eval_steps`` validation batches every time."""
        import numpy as np

        self.val_loader.load_state_dict(self.val_state)
        losses = []
        for _ in range(self.n_eval):
            x, y = self.val_loader.next_batch()
            losses.append(self.eval_step(self.state.params, x, y))
        return float(np.mean([float(v) for v in losses]))

    def score_hellaswag(self, step: int) -> None:
        """HellaSwag accuracy of the current params (build-nanogpt's scoring), logged to metrics.jsonl."""
        from flax import nnx

        from jaxgpt.eval import hellaswag

        params = _on_one_device(self.state.params)  # every process takes part (a collective with several)
        if not self.is_main:
            return
        if self.hellaswag_scorer is None:  # compiled once, reused at every interval
            self.hellaswag_scorer = hellaswag.Scorer(nnx.merge(self.graphdef, params))
        r = self.hellaswag_scorer.evaluate(self.hellaswag_items, params=params)
        self.metrics.write({"type": "hellaswag", "step": step, "acc": r["acc"], "acc_norm": r["acc_norm"],
                            "n": r["n"], "seconds": r["seconds"]})
        self.say(f"step {step}: HellaSwag acc_norm {r['acc_norm']:.4f} (acc {r['acc']:.4f}, {r['n']} items)")

    def sample(self, step: int) -> None:
        """``sample_num`` samples from the current params, appended to samples.txt and printed."""
        from flax import nnx

        from jaxgpt.generate import generate_text

        cfg = self.cfg
        params = _on_one_device(self.state.params)  # every process takes part (a collective with several)
        if not self.is_main:
            return
        texts = generate_text(nnx.merge(self.graphdef, params), cfg.sample_prompt, max_new_tokens=cfg.sample_len,
                              temperature=cfg.sample_temperature, top_k=cfg.sample_top_k,
                              seed=(cfg.seed + step) % 2**32, num_samples=cfg.sample_num)
        block = "".join(f"--- sample {i} (step {step}) ---\n{t}\n" for i, t in enumerate(texts))
        with open(self.run_dir / "samples.txt", "a") as f:
            f.write(block)
        self.say(block.rstrip())

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def _checkpoint(self, step: int, params: Any, opt_state: Any, extra: dict[str, Any]) -> dict[str, Any]:
        val = {"val_loss": self.val_loss} if self.val_step == step and self.val_loss is not None else None
        return {"step": step, "params": params, "opt_state": opt_state, "rng_key": self.rng,
                "loader_state": self.feed.position, "metrics": val,  # the val loss of this very state, if measured
                "extra": {**extra, "guard": self.guard.state_dict(), "lineage": list(self.lineage)}}

    def hold(self, step: int) -> None:
        """Keep a device copy of the state after ``step`` (its RNG, data position and guard history too), to be
        written once the next step has checked it."""
        params, opt_state = _copy_on_device((self.state.params, self.state.opt_state))
        self.held = self._checkpoint(step, params, opt_state, {"loss": self.last.get("loss"), "checked": True})

    def write_held(self) -> None:
        held, self.held = self.held, None
        if self.ckpts.latest_step() != held["step"]:
            self.ckpts.save(held.pop("step"), config=self.saved_config, **held)

    def save_now(self, step: int, extra: dict[str, Any]) -> None:
        """Save the current state (only for a state already checked: the final one, after its validation)."""
        if self.ckpts.latest_step() != step:
            c = self._checkpoint(step, self.state.params, self.state.opt_state, extra)
            self.ckpts.save(c.pop("step"), config=self.saved_config, **c)

    # ---- finish ---------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """The final evaluation, sample and checkpoint; or, for a run that was already done, its last figures."""
        cfg = self.cfg
        self.final_step = max(self.start_step, cfg.max_steps)
        if self.start_step < cfg.max_steps:
            self.val_loss, self.val_step = self.evaluate(), self.final_step
            self.metrics.write({"type": "eval", "step": self.final_step, "val_loss": self.val_loss})
            if not math.isfinite(self.val_loss):  # the final state's check: no training step evaluates it
                self.recover(Verdict(self.final_step + 1, self.val_loss, math.nan, f"the final validation loss "
                                     f"is {self.val_loss}, not finite"), may_roll_back=False)
            if cfg.hellaswag_interval:
                self.score_hellaswag(self.final_step)
            if cfg.sample_interval >= 0:
                self.sample(self.final_step)
            self.save_now(self.final_step, {"loss": self.last.get("loss"), "val_loss": self.val_loss,
                                            "checked": True})
        else:  # resumed a finished run: nothing to do
            self.say(f"the run in {self.run_dir} already reached step {self.start_step} (max_steps {cfg.max_steps})")
            done = read_metrics(self.run_dir)
            self.val_loss = next((r["val_loss"] for r in reversed(done) if r["type"] == "eval"), None)
            self.last = next((r for r in reversed(done) if r["type"] == "train"), {})

    def close(self) -> None:
        """Wait for the last checkpoint, close the files, draw loss.png, release the lock (also after an error)."""
        try:
            if self.bar is not None:
                self.bar.close()
            if self.ckpts is not None:
                self.ckpts.close()
        finally:
            if self.metrics is not None:
                self.metrics.close()
                if self.cfg.plot and self.is_main:
                    plot_losses(self.run_dir)
            self._unlock()

    def summarise(self) -> dict[str, Any]:
        """The summary dict (also printed, and written to summary.json)."""
        cfg, wall = self.cfg, time.perf_counter() - self.t_start
        summary = {"steps": cfg.max_steps, "start_step": self.start_step, "train_loss": self.last.get("loss"),
                   "val_loss": self.val_loss, "wall_s": wall, "compile_s": self.compile_s,
                   "tokens_per_s": self.steady_tokens / self.steady_time if self.steady_time else None,
                   "tokens": cfg.max_steps * self.tokens_per_step, "run_dir": str(self.run_dir),
                   "mesh": {k: int(v) for k, v in self.mesh.shape.items()}, "processes": self.pcount,
                   "rollbacks": self.rollbacks}
        self.say(f"done: step {self.final_step}, train loss {summary['train_loss']}, val loss {self.val_loss}, "
                 f"{wall:.1f} s wall, " + (f"{summary['tokens_per_s']:,.0f} tok/s (steady), " if self.steady_time
                                           else "") + f"run dir {self.run_dir}")
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _copy_on_device(tree: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.copy, tree)


def _same_request(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b[k] for k in ("resumed_from", "skip_batches", "reason"))


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _json_number(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)


def _say(*args: Any, **kwargs: Any) -> None:
    from tqdm.auto import tqdm

    tqdm.write(*args, **kwargs)
