"""One training run, as named phases that read top-down: :meth:`Run.set_up` (mesh, data, model, optimizer,
jitted steps, checkpoint manager), :meth:`Run.resume` (the newest checkpoint, the metrics log, ``config.yaml``),
:meth:`Run.announce`, :meth:`Run.step_loop` (train, evaluate, sample, checkpoint), :meth:`Run.finish` (the final
evaluation, sample and checkpoint) and :meth:`Run.close`; :func:`train` runs them in that order."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import yaml

from jaxgpt.config import ConfigError, to_dict
from jaxgpt.train.config import TrainConfig
from jaxgpt.train.metrics import MetricsLog, count_params, device_peak_flops, flops_per_step, plot_losses, read_metrics


class NonFiniteLoss(RuntimeError):
    pass


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
    """Run (or resume) training; returns a summary. Raises NonFiniteLoss on a NaN/inf loss."""
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
        """Everything before the first file is written: the mesh, the data, the model and its jitted steps."""
        import jax

        from jaxgpt import mesh as mesh_lib
        from jaxgpt import step as step_lib
        from jaxgpt.optim import make_optimizer
        from jaxgpt.precision import Policy

        run = cls()
        run.cfg, run.t_start = cfg, time.perf_counter()
        run.pcount, run.pindex = jax.process_count(), jax.process_index()
        run.mesh = mesh_lib.make_mesh(cfg.mesh)  # (configuration errors before anything is written)
        local_devices = sum(d.process_index == run.pindex for d in run.mesh.devices.flat)
        if cfg.batch_size % local_devices:
            raise ConfigError(f"TrainConfig.batch_size = {cfg.batch_size}: must be a multiple of the devices per "
                              f"process ({local_devices}): every device takes the same number of rows of each "
                              "micro-batch")
        run.run_dir = Path(cfg.out_dir)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        run.is_main = run.pindex == 0  # writes the run directory's files (all processes save checkpoints together)
        run.micro_steps = cfg.micro_steps(run.pcount)
        run.tokens_per_step = run.micro_steps * cfg.batch_size * cfg.seq_len * run.pcount
        run.say = _say if run.is_main else (lambda *_a, **_k: None)
        run._set_up_data()

        run.policy = Policy.named(cfg.precision, attention=cfg.attention)
        model = build_model(cfg, run.policy)
        run.model_cfg = model.config
        optimizer = make_optimizer(cfg.optim)
        run.graphdef, run.state = step_lib.init_train_state(model, optimizer, mesh=run.mesh)
        del model
        run.saved_config = {**cfg.to_dict(), "model": to_dict(run.model_cfg)}
        run.train_step = step_lib.make_train_step(run.graphdef, optimizer, micro_steps=run.micro_steps,
                                                  dropout=run.model_cfg.dropout > 0, mesh=run.mesh)
        run.eval_step = step_lib.make_eval_step(run.graphdef, mesh=run.mesh)
        run.rng = jax.random.key(cfg.seed)
        run.start_step, run.latest = 0, None
        run.metrics = run.bar = None
        run.last, run.val_loss = {}, None
        run.steady_tokens, run.steady_time, run.compile_s = 0, 0.0, None
        return run

    def _set_up_data(self) -> None:
        from jaxgpt import data as data_lib

        cfg = self.cfg
        self.data_dir = cfg.resolved_data_dir()
        if not (self.data_dir / data_lib.MANIFEST_NAME).exists():
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

    # ---- resume ---------------------------------------------------------------------------------------------
    def resume(self) -> None:
        """Continue from the newest checkpoint (``resume: auto/must``), then open the run's files."""
        import jax

        from jaxgpt.checkpoint import Checkpoints, NoCheckpointError

        cfg = self.cfg
        self.ckpts = Checkpoints(self.run_dir, keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoint)
        self.latest = latest = self.ckpts.latest_step()
        if cfg.resume == "must" and latest is None:
            raise NoCheckpointError(f"resume: must, but {self.ckpts.directory} holds no complete checkpoint")
        if cfg.resume == "never" and latest is not None:
            raise ConfigError(f"resume: never, but {self.run_dir} already holds checkpoints (steps "
                              f"{self.ckpts.all_steps()}); use resume: auto to continue that run, or another out_dir")
        if latest is not None:
            r = self.ckpts.restore(latest, params=self.state.params, opt_state=self.state.opt_state,
                                   requested_config=self.saved_config)
            self.state = self.state.replace(step=jax.numpy.asarray(r.step, dtype=self.state.step.dtype),
                                            params=r.params, opt_state=r.opt_state)
            self.rng = r.rng_key
            self.train_loader.load_state_dict(_loader_state_for(r.loader_state, self.train_loader, self.say))
            self.start_step = r.step
        if self.is_main:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.saved_config, sort_keys=False))
        self.metrics = MetricsLog(self.run_dir, tensorboard=cfg.tensorboard,
                                  truncate_after=self.start_step if latest else None, enabled=self.is_main)

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
        self.say(f"  run dir {self.run_dir}" + (f"; resumed from step {self.start_step}" if self.latest else ""))

    # ---- the step loop --------------------------------------------------------------------------------------
    def step_loop(self) -> None:
        """Optimizer steps from ``start_step`` to ``max_steps``, with evaluations, samples and checkpoints."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        self.bar = tqdm(range(self.start_step, cfg.max_steps), initial=self.start_step, total=cfg.max_steps,
                        unit="step", disable=not cfg.progress, dynamic_ncols=True, mininterval=1.0)
        if self.start_step == 0 and cfg.eval_interval > 0:
            self.val_loss = self.evaluate()
            self.metrics.write({"type": "eval", "step": 0, "val_loss": self.val_loss})
            self.say(f"step 0: val loss {self.val_loss:.4f}")
        debug_sleep = float(os.environ.get("JAXGPT_DEBUG_STEP_SLEEP", "0"))  # a test kills a run mid-way
        for i in self.bar:
            step = i + 1
            if debug_sleep:
                time.sleep(debug_sleep)
            record = self.train_one_step(step)
            self.log_step(record)
            if cfg.eval_interval and step % cfg.eval_interval == 0 and step != cfg.max_steps:
                self.val_loss = self.evaluate()
                self.metrics.write({"type": "eval", "step": step, "val_loss": self.val_loss})
                self.say(f"step {step}: train loss {record['loss']:.4f}, val loss {self.val_loss:.4f}")
            if cfg.sample_interval > 0 and step % cfg.sample_interval == 0 and step != cfg.max_steps:
                self.sample(step)
            if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0:
                self.save(step, {"loss": record["loss"]})
        self.bar.close()

    def train_one_step(self, step: int) -> dict[str, Any]:
        """Draw the batch, run the jitted step, check the loss; the step's metrics record."""
        import jax

        from jaxgpt import step as step_lib

        cfg = self.cfg
        x, y = self.train_loader.next_batch()
        x = x.reshape(self.micro_steps, cfg.batch_size, cfg.seq_len)
        y = y.reshape(self.micro_steps, cfg.batch_size, cfg.seq_len)
        step_lib.check_batch(x, y, self.model_cfg)
        self.rng, key = jax.random.split(self.rng)
        t0 = time.perf_counter()
        self.state, m = self.train_step(self.state, x, y, key)
        loss, grad_norm, lr = float(m["loss"]), float(m["grad_norm"]), float(m["lr"])
        dt = time.perf_counter() - t0
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._diverged(step, loss, grad_norm)
        if self.compile_s is None:
            self.compile_s = dt
        else:
            self.steady_tokens += self.tokens_per_step
            self.steady_time += dt
        mfu = self.step_flops / dt / (self.peak * self.n_dev) if self.peak else None
        return {"type": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time": dt,
                "tokens_per_s": self.tokens_per_step / dt, "flops_per_s": self.step_flops / dt, "mfu": mfu,
                "tokens": step * self.tokens_per_step}

    def _diverged(self, step: int, loss: float, grad_norm: float) -> None:
        self.ckpts.wait()
        last = self.ckpts.latest_step()
        if last is None:
            raise NonFiniteLoss(f"step {step}: loss {loss}, grad norm {grad_norm}: training diverged before any "
                                "checkpoint was written (lower optim.lr or raise optim.warmup_steps)")
        raise NonFiniteLoss(f"step {step}: loss {loss}, grad norm {grad_norm}: training diverged (lower optim.lr or "
                            f"raise optim.warmup_steps). The last good checkpoint is step {last} in "
                            f"{self.ckpts.directory}")

    def log_step(self, record: dict[str, Any]) -> None:
        self.last = record
        if record["step"] % self.cfg.log_interval == 0 or record["step"] == self.cfg.max_steps:
            self.metrics.write(record)
        mfu = record["mfu"]
        self.bar.set_postfix({"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
                              "tok/s": f"{record['tokens_per_s']:,.0f}",
                              **({"mfu": f"{mfu:.1%}"} if mfu is not None else {})}, refresh=False)

    def evaluate(self) -> float:
        """Mean loss of the same first ``eval_steps`` validation batches every time."""
        import numpy as np

        self.val_loader.load_state_dict(self.val_state)
        losses = []
        for _ in range(self.n_eval):
            x, y = self.val_loader.next_batch()
            losses.append(self.eval_step(self.state.params, x, y))
        return float(np.mean([float(v) for v in losses]))

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

    def save(self, step: int, extra: dict[str, Any]) -> None:
        if self.ckpts.latest_step() == step:
            return
        self.ckpts.save(step, params=self.state.params, opt_state=self.state.opt_state, config=self.saved_config,
                        rng_key=self.rng, loader_state=self.train_loader.state_dict(), extra=extra)

    # ---- finish ---------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """The final evaluation, sample and checkpoint; or, for a run that was already done, its last figures."""
        cfg = self.cfg
        self.final_step = max(self.start_step, cfg.max_steps)
        if self.start_step < cfg.max_steps:
            self.val_loss = self.evaluate()
            self.metrics.write({"type": "eval", "step": self.final_step, "val_loss": self.val_loss})
            if cfg.sample_interval >= 0:
                self.sample(self.final_step)
            self.save(self.final_step, {"loss": self.last.get("loss")})
        else:  # resumed a finished run: nothing to do
            self.say(f"the run in {self.run_dir} already reached step {self.start_step} (max_steps {cfg.max_steps})")
            done = read_metrics(self.run_dir)
            self.val_loss = next((r["val_loss"] for r in reversed(done) if r["type"] == "eval"), None)
            self.last = next((r for r in reversed(done) if r["type"] == "train"), {})

    def close(self) -> None:
        """Wait for the last checkpoint, close the files, draw loss.png (also after an error)."""
        if self.bar is not None:
            self.bar.close()
        ckpts = getattr(self, "ckpts", None)
        try:
            if ckpts is not None:
                ckpts.close()
        finally:
            if self.metrics is not None:
                self.metrics.close()
                if self.cfg.plot and self.is_main:
                    plot_losses(self.run_dir)

    def summarise(self) -> dict[str, Any]:
        """The summary dict (also printed, and written to summary.json)."""
        cfg, wall = self.cfg, time.perf_counter() - self.t_start
        summary = {"steps": cfg.max_steps, "start_step": self.start_step, "train_loss": self.last.get("loss"),
                   "val_loss": self.val_loss, "wall_s": wall, "compile_s": self.compile_s,
                   "tokens_per_s": self.steady_tokens / self.steady_time if self.steady_time else None,
                   "tokens": cfg.max_steps * self.tokens_per_step, "run_dir": str(self.run_dir),
                   "mesh": {k: int(v) for k, v in self.mesh.shape.items()}, "processes": self.pcount}
        self.say(f"done: step {self.final_step}, train loss {summary['train_loss']}, val loss {self.val_loss}, "
                 f"{wall:.1f} s wall, " + (f"{summary['tokens_per_s']:,.0f} tok/s (steady), " if self.steady_time
                                           else "") + f"run dir {self.run_dir}")
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _say(*args: Any, **kwargs: Any) -> None:
    from tqdm.auto import tqdm

    tqdm.write(*args, **kwargs)
