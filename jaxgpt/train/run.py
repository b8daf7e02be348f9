"""One training run, as named phases that read top-down: :meth:`Run.set_up` (lock the run directory; mesh, data,
model, optimizer, jitted steps), :meth:`Run.resume` (a checkpoint, the metrics log, ``config.yaml``),
:meth:`Run.announce`, :meth:`Run.step_loop` (train, evaluate, sample, checkpoint), :meth:`Run.finish` (the final
evaluation, sample and checkpoint) and :meth:`Run.close`; :func:`train` runs them in that order.

The step loop keeps the host ahead of the device: a step's metrics stay on the device until the loop next
synchronises (every ``log_interval`` steps, and before an evaluation, a sample or a checkpoint), and the next
batch is read and placed while a step runs (:mod:`jaxgpt.train.feed`). At each synchronisation every pending
step's loss and gradient norm go through the divergence guard (:mod:`jaxgpt.train.guard`), in order.

The run's other concerns live beside it, each mixed into :class:`Run`: resuming from a checkpoint
(:mod:`jaxgpt.train.resume`), saving only checked states and recovering from a divergence
(:mod:`jaxgpt.train.safety`), and the measurements between steps (:mod:`jaxgpt.train.evals`).

By hand: ``--resume_step=N`` resumes from checkpoint N (newer checkpoints are moved to
``checkpoints/superseded/``, newer metric records to ``metrics.superseded.jsonl``; nothing is deleted) and
``--skip_batches=K`` advances the data K global batches past N's position. Each such resume is recorded in the
checkpoints that follow (``lineage``), so re-running the same command continues the resumed run instead of
resuming from N again."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from jaxgpt.config import ConfigError, to_dict
from jaxgpt.train.config import TrainConfig
from jaxgpt.train.evals import InLoopEvals
from jaxgpt.train.guard import DivergenceGuard, Verdict
from jaxgpt.train.metrics import (count_params, device_peak_flops, e4m3_fraction, flops_per_step, plot_losses,
                                  read_metrics)
from jaxgpt.train.resume import Resuming
from jaxgpt.train.preempt import Preempted, Preemption
from jaxgpt.train.safety import Diverged, NonFiniteLoss, Safeguards
from jaxgpt.train.stopping import Stopping

__all__ = ["Diverged", "NonFiniteLoss", "Preempted", "Run", "build_model", "train"]


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
    preemption = Preemption().install()  # SIGTERM / SIGINT: jaxgpt.train.preempt
    try:
        run = Run.set_up(cfg, preemption=preemption)
        try:
            run.resume()
            run.note_untrained()  # a signal before the first step: names the checkpoint there is to resume from
            run.check_disk_space()
            run.announce()
            run.step_loop()
            run.finish()
        finally:
            run.close()
    finally:
        preemption.uninstall()
    return run.summarise()


class Run(Resuming, Safeguards, InLoopEvals, Stopping):
    """The state of one training run between its phases (see the module docstring)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg, self.t_start = cfg, time.perf_counter()
        self.lock = self.metrics = self.bar = self.ckpts = None
        self.created_run_dir = self.created_lock_file = self.stopped_early = False
        self.preemption: Preemption | None = None
        self.start_step, self.resumed_from, self.rollbacks, self.lineage = 0, None, 0, []
        self.rollback_skips: dict[int, int] = {}  # checkpoint step -> batches skipped past it so far
        self.last, self.val_loss, self.val_step, self.held, self.changes = {}, None, None, None, {}
        self.pending: list[tuple[int, Any]] = []  # (step, metrics still on the device)
        self.steady_tokens, self.steady_time, self.compile_s = 0, 0.0, None
        self.step_in_hand: int | None = None  # the newest step dispatched by the step loop
        self.guard = DivergenceGuard(loss_factor=cfg.spike_loss_factor, grad_norm_factor=cfg.spike_grad_norm_factor,
                                     window=cfg.spike_window)

    # ---- set-up ---------------------------------------------------------------------------------------------
    @classmethod
    def set_up(cls, cfg: TrainConfig, *, preemption: Preemption | None = None) -> "Run":
        """Everything before the first step: the run directory's lock, the mesh, the data, the model and its
        jitted steps. Configuration errors come before anything is written."""
        import jax

        from jaxgpt import mesh as mesh_lib

        run = cls(cfg)
        run.pcount, run.pindex = jax.process_count(), jax.process_index()
        run.preemption = preemption
        if preemption is not None:
            preemption.pindex, preemption.pcount = run.pindex, run.pcount
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

            run._check_tokenizer()
            data_lib.check_shards_for_model(run.data_dir, run.model_cfg.vocab_size,  # headers (and small shards)
                                            model_tokenizer=run.tokenizer_record, whose="the model")
            for loader in (run.train_loader, run.val_loader):  # and then every batch: a bad id names shard, offset
                loader.vocab_size = run.model_cfg.vocab_size
        except BaseException:
            run._unlock(abandon=True)
            raise
        return run

    def _lock_run_dir(self) -> None:
        from jaxgpt import rundir

        self.run_dir = Path(self.cfg.out_dir)
        self.created_run_dir = not self.run_dir.exists()
        try:
            rundir.make_dir(self.run_dir, what="run directory", option="out_dir")
            self.created_lock_file = not (self.run_dir / rundir.LOCK_NAME).exists()
            if self.is_main:  # one lock per run; the other processes of a multi-process run only write checkpoints
                self.lock = rundir.DirLock(self.run_dir, what="run directory", option="out_dir").acquire()
        except rundir.DirError as e:
            if self.created_run_dir:  # (e.g. the lock file could not be written on a full disk): leave no trace
                try:
                    self.run_dir.rmdir()
                except OSError:
                    pass
            raise ConfigError(str(e)) from None

    def _unlock(self, *, abandon: bool = False) -> None:
        """Release the run directory's lock. ``abandon`` (set-up failed): a run directory this run created and
        left holding nothing but the lock file is removed, and so is a lock file this run created in an existing
        directory, so a mistyped setting (or a batch too large for the GPU) leaves no trace."""
        if self.lock is None:
            return
        from jaxgpt import rundir

        empty = abandon and self.created_run_dir and {p.name for p in self.run_dir.iterdir()} <= {rundir.LOCK_NAME}
        if empty or (abandon and self.created_lock_file):
            self.lock.remove_file()
        self.lock.release()
        if empty:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass  # another process has written there since: leave it

    def _set_up_data(self) -> None:
        from jaxgpt import data as data_lib

        cfg = self.cfg
        self.data_dir = cfg.resolved_data_dir()
        hf = cfg.data_source.startswith(data_lib.HF_PREFIX)
        if hf and not data_lib.is_prepared(self.data_dir):  # large: prepared on purpose, with its options
            raise ConfigError(f"{self.data_dir} holds no prepared shards; prepare {cfg.data_source!r} first with "
                              f"`python -m jaxgpt.data --hf-dataset ... --out {self.data_dir}` (see the config file)")
        if not hf:  # prepared shards are used as they are (those without a manifest too), unless jaxgpt built them
            # from a text since replaced (jaxgpt.data.prepare._source_changed); another run preparing the same
            # directory holds its lock: wait for it, then use what it made
            data_lib.ensure_prepared(cfg.data_source, self.data_dir, option="data_dir", tokenizer=cfg.tokenizer)
        self.train_loader = data_lib.DataLoader(
            self.data_dir, "train", cfg.batch_size * self.micro_steps, cfg.seq_len, mode=cfg.loader_mode,
            seed=cfg.seed, process_index=self.pindex, process_count=self.pcount)
        self.val_loader = data_lib.DataLoader(
            self.data_dir, "val", cfg.batch_size, cfg.seq_len, mode="sequential", seed=cfg.seed,
            process_index=self.pindex, process_count=self.pcount)
        self.val_state = self.val_loader.state_dict()
        self.n_eval = min(cfg.eval_steps, self.val_loader.batches_per_epoch)  # never the same batch twice

    def _check_tokenizer(self) -> None:
        """The data's tokenizer is the config's, and (characters) the model has exactly its vocabulary; it is the
        model's from now on: recorded in every checkpoint and used to decode samples."""
        from jaxgpt import data as data_lib, tokenizer

        rec = data_lib.manifest_tokenizer(self.data_dir)
        name = (rec or {}).get("name", tokenizer.ENCODING_NAME)
        if self.cfg.resume != "never" and (self.run_dir / "checkpoints").is_dir():  # a run to continue: its ids
            from jaxgpt import checkpoint

            with checkpoint.Checkpoints(self.run_dir, read_only=True) as ckpts:
                saved = bool(ckpts.all_steps())
            if saved:  # (every step of a run has its tokenizer: resuming with another is refused)
                trained = checkpoint.saved_tokenizer(self.run_dir)
                data_lib.check_tokenizer_matches(self.data_dir, trained, f"the checkpoint in {self.run_dir}")
        if name != self.cfg.tokenizer:
            raise ConfigError(f"TrainConfig.tokenizer = {self.cfg.tokenizer!r}, but {self.data_dir} holds "
                              f"{tokenizer.describe(rec)}: set tokenizer: {name}, or point data_dir at shards made "
                              f"with --tokenizer {self.cfg.tokenizer}")
        self.tokenizer_record = rec if name == "char" else tokenizer.GPT2BPE().record()
        self.tokenizer = tokenizer.from_record(self.tokenizer_record)
        if name == "char" and self.model_cfg.vocab_size != rec["vocab_size"]:
            raise ConfigError(f"model.vocab_size = {self.model_cfg.vocab_size}, but the shards in {self.data_dir} have "
                              f"a {rec['vocab_size']}-character vocabulary: set model.vocab_size: {rec['vocab_size']} "
                              "(nanoGPT takes it from meta.pkl; padded_vocab_size may add rows)")

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
        from jaxgpt.optim import global_norm_fn, make_optimizer
        from jaxgpt.precision import Policy

        cfg = self.cfg
        options = cfg.policy_options()
        self.kernel_choice = None
        if cfg.kernels.preset == "auto":  # measured on this device, or a committed / cached choice (jaxgpt.tune)
            from jaxgpt.train.tune.auto import select

            self.kernel_choice = select(
                cfg, mesh=self.mesh, steps_to_train=cfg.max_steps, micro_steps=self.micro_steps, say=self.say,
                progress=cfg.progress and self.is_main, processes=self.pcount)
            options = {**options, "kernels": self.kernel_choice.kernels}
        self.policy = Policy.named(cfg.precision, **options)
        model = build_model(cfg, self.policy)
        self.model_cfg = model.config
        optimizer = make_optimizer(cfg.optim)
        self.graphdef, self.state = step_lib.init_train_state(model, optimizer, mesh=self.mesh)
        del model
        self.saved_config = {**cfg.to_dict(), "model": to_dict(self.model_cfg)}
        self.train_step = step_lib.make_train_step(self.graphdef, optimizer, micro_steps=self.micro_steps,
                                                   dropout=self.model_cfg.dropout > 0, mesh=self.mesh,
                                                   fsdp_reduce=cfg.fsdp_reduce,
                                                   grad_norm=global_norm_fn(cfg.optim))
        self.eval_step = step_lib.make_eval_step(self.graphdef, mesh=self.mesh)
        self.rng = jax.random.key(cfg.seed)
        self._check_device_memory(optimizer)

    def _check_device_memory(self, optimizer) -> None:
        """On a GPU, before anything is written: the compiled step against JAX's memory pool; a step that does not
        fit raises :class:`~jaxgpt.memory_fit.DeviceMemoryError` naming the largest micro-batch that does at the same
        tokens per step (:mod:`jaxgpt.memory_fit`). On the CPU: nothing (no pool to check)."""
        import jax

        from jaxgpt import memory_fit
        from jaxgpt import step as step_lib
        from jaxgpt.optim import global_norm_fn

        cfg = self.cfg
        local = [d for d in self.mesh.devices.flat if d.process_index == self.pindex]
        pool = memory_fit.device_pool(local)
        if pool is None:
            return
        shape = memory_fit.TrainShape(cfg.batch_size, self.micro_steps, cfg.seq_len, self.pcount)
        # the state and a step's key as the step function passes them (a key from split, placed as it places it:
        # lowered otherwise, the run's first call would not find the executable and compile it again)
        state = step_lib.shard_state(self.state, self.mesh)
        _, key = jax.random.split(self.rng)  # (unpacked as the step loop does: no other compile)
        key = step_lib._put_key(key, step_lib.replicated(self.mesh))

        def measure(rows: int, jitted=None) -> int:
            micro_steps = shape.rows_per_step // rows
            jitted = jitted or step_lib.make_train_step(
                self.graphdef, optimizer, micro_steps=micro_steps, dropout=self.model_cfg.dropout > 0,
                mesh=self.mesh, fsdp_reduce=cfg.fsdp_reduce, grad_norm=global_norm_fn(cfg.optim)).jitted
            return memory_fit.train_step_bytes(jitted, state, self.mesh, micro_steps=micro_steps,
                                               rows=rows * self.pcount, seq_len=cfg.seq_len, key=key)

        needs = measure(cfg.batch_size, self.train_step.jitted)  # the run's own step: its first call reuses this
        memory_fit.check_train_step(needs, pool, shape, measure, multiple_of=len(local),
                                    tokens_option=cfg.total_batch_tokens is None)

    def announce(self) -> None:
        """The run's header: model, batch, data, devices, peak FLOP/s, mesh, run directory."""
        import jax

        from jaxgpt import mesh as mesh_lib

        cfg, m = self.cfg, self.model_cfg
        n_params = count_params(self.state.params)
        self.step_flops = flops_per_step(m, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                         micro_steps=self.micro_steps) * self.pcount
        self.peak, peak_src = device_peak_flops(  # fp8: blended over its e4m3 and bf16 GEMMs' peaks
            self.policy.compute_dtype, e4m3_fraction=e4m3_fraction(m, seq_len=cfg.seq_len, fp8_gemms=self.policy.fp8))
        self.n_dev = jax.device_count()
        self.say(f"jaxgpt.train: {n_params / 1e6:.2f}M params ({m.n_layer}L {m.n_head}H {m.n_embd}C, vocab rows "
                 f"{m.vocab_rows}), "
                 + (f"resumed (run begun from {cfg.init_from})" if self.resumed_from is not None
                    else f"init {cfg.init_from}")
                 + f", {self.policy.compute_dtype} compute"
                 + (f" with e4m3 forward GEMMs (fp8_gemms {self.policy.fp8})" if self.policy.fp8 != "none" else "")
                 + f", {self.n_dev} x "
                 f"{jax.devices()[0].device_kind}, {self.pcount} process(es)")
        self.say(f"  batch: {self.tokens_per_step:,} tokens/step = {self.micro_steps} micro step(s) x "
                 f"{cfg.batch_size} x {cfg.seq_len} x {self.pcount} process(es); data {self.data_dir} "
                 f"({self.train_loader.num_tokens:,} train tokens); peak "
                 f"{'?' if self.peak is None else f'{self.peak / 1e12:.2f} TFLOP/s'} ({peak_src})")
        self.say(f"  {mesh_lib.summary(self.mesh, self.state.params, self.state.opt_state)}")
        self.say(f"  run dir {self.run_dir}" + (f"; resumed from step {self.start_step}"
                                                 if self.resumed_from is not None else ""))
        if self.kernel_choice is not None:  # kernels-auto.json / .txt, a `kernels` record in metrics.jsonl
            from jaxgpt.train.tune.auto import record_in_run

            record_in_run(self.kernel_choice, self.policy, self.run_dir, self.metrics if self.is_main else None,
                          say=self.say, step=self.start_step)
        if cfg.wandb.enabled and self.is_main and self.metrics is not None:
            from jaxgpt.train.wandb_log import WandbTracker

            self.metrics.tracker = WandbTracker.start(cfg.wandb, self.run_dir, self.saved_config,
                                                      resumed=self.resumed_from is not None, say=self.say)

    # ---- the step loop --------------------------------------------------------------------------------------
    def step_loop(self) -> None:
        """Optimizer steps from ``start_step`` to ``max_steps``, with evaluations, samples and checkpoints. XLA's
        out-of-memory error on the way becomes :class:`~jaxgpt.memory_fit.OutOfDeviceMemory`, naming the step and the
        checkpoint to resume from."""
        from jaxgpt import memory_fit

        try:
            self._step_loop()
        except Exception as e:
            if not memory_fit.out_of_memory(e):
                raise
            raise self.out_of_memory(e) from None

    def _step_loop(self) -> None:
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
            self.step_in_hand = step
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
                if verdict is None and step == cfg.max_steps:
                    verdict = self.check_final(step)  # no training step evaluates the final state
                if verdict is not None:
                    step = self.recover(verdict)  # the checkpoint rolled back to (or raises)
                    first = step + 1
                    continue
            if self.preemption is not None and self.preemption.mode == "raise" and not self.pending:
                # a step has completed (synced): a signal now stops after the step in hand, saved (between_steps);
                # until here it ended the run at once, with nothing trained to lose (jaxgpt.train.preempt)
                self.preemption.start_loop()
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
            if step < cfg.max_steps:
                self.between_steps(step)  # a failed checkpoint save; a signal (jaxgpt.train.stopping)
        self.bar.close()

    def sync(self) -> Verdict | None:
        """Fetch the pending steps' metrics (one device-to-host transfer), check each in order, log them, and
        write a held checkpoint once the step after it has passed. The first diverged step's verdict, if any."""
        import jax

        steps, fetched = [s for s, _ in self.pending], jax.device_get([m for _, m in self.pending])
        # timed once the metrics are on the host, i.e. the steps have run: dispatch returns at once (on a GPU
        # always; on the CPU after an evaluation), so a clock read before the fetch timed the dispatch alone
        now = time.perf_counter()
        dt = (now - self.t_mark) / len(steps)
        self.pending, self.t_mark, self.synced_at = [], now, steps[-1]  # (where processes agree on a signal)
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
                self.t_mark = time.perf_counter()  # the save's time is not the next step's (like the due ones')
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

    # ---- finish ---------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """The final evaluation, sample and checkpoint; or, for a run that was already done, its last figures."""
        cfg = self.cfg
        self.final_step = max(self.start_step, cfg.max_steps)
        if self.start_step < cfg.max_steps:
            self.val_loss, self.val_step = self.evaluate(), self.final_step
            self.metrics.write({"type": "eval", "step": self.final_step, "val_loss": self.val_loss})
            if not math.isfinite(self.val_loss):  # checked on a training batch already; the val data may differ
                self.recover(Verdict(self.final_step + 1, self.val_loss, math.nan, f"the final state's (step "
                                     f"{self.final_step}) validation loss is {self.val_loss}, not finite"),
                             may_roll_back=False)
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
                plot = self.cfg.plot and self.is_main and not self.stopped_early and not self.metrics.failed
                try:  # (not after a failed write: the disk is full, and the run is not finished)
                    png = plot_losses(self.run_dir) if plot else None
                except OSError as e:  # a full disk: the error that stopped the run is the one to report
                    png = None
                    self.say(f"  loss.png not written: {e.strerror or e}")
                if self.metrics.tracker is not None:
                    self.metrics.tracker.finish(png)
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
        evals = [r for r in read_metrics(self.run_dir) if r.get("type") == "eval"] if self.is_main else []
        best = min(evals, key=lambda r: r["val_loss"], default=None)  # nanoGPT's best_val_loss, over the run
        summary.update(best_val_loss=best and best["val_loss"], best_val_step=best and best["step"])
        self.say(f"done: step {self.final_step}, train loss {summary['train_loss']}, val loss {self.val_loss}, "
                 f"{wall:.1f} s wall, " + (f"{summary['tokens_per_s']:,.0f} tok/s (steady), " if self.steady_time
                                           else "") + f"run dir {self.run_dir}")
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _say(*args: Any, **kwargs: Any) -> None:
    from tqdm.auto import tqdm

    tqdm.write(*args, **kwargs)
