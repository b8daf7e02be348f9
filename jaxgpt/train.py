"""Train GPT-2: ``python -m jaxgpt.train [--config configs/NAME.yaml] [--field=value ...]``.

Without ``--config`` the default preset ``configs/shakespeare-cpu.yaml`` is used. Any field of
:class:`TrainConfig` can be overridden on the command line, nested ones with dots, values parsed as YAML
scalars::

    python -m jaxgpt.train --config configs/gpt2-124m.yaml --optim.lr=3e-4 --max_steps=100 --model.n_layer=2

Other flags: ``--print-config`` (print the resolved config as YAML and exit), ``-h/--help``.

The run directory (``out_dir``) gets ``config.yaml``, ``metrics.jsonl`` (one JSON record per logged step and
per evaluation), ``samples.txt``, ``loss.png``, TensorBoard events under ``tb/`` (when tensorboardX or
torch's tensorboard is installed) and orbax checkpoints under ``checkpoints/`` (see :mod:`jaxgpt.checkpoint`).
With ``resume: auto`` (the default) a run directory that holds a checkpoint is resumed from it: the
continued run repeats the uninterrupted one's losses bit for bit on CPU.

Several devices and hosts: ``--mesh.data=D --mesh.fsdp=F`` (or ``--mesh=data=2,fsdp=4``) lays the devices out
as a ``('data', 'fsdp')`` mesh (default: all devices data parallel; see :mod:`jaxgpt.mesh`); a multi-process
run starts every process with ``JAXGPT_COORDINATOR`` / ``JAXGPT_NUM_PROCESSES`` / ``JAXGPT_PROCESS_ID`` (or
``--distributed.*``, or under SLURM's ``srun``; see :mod:`jaxgpt.distributed` and docs/scaling.md). Each
process reads its own part of the data; process 0 alone writes the run directory's files; all processes
save the (sharded) checkpoints together.

Exit codes: 0 done, 2 bad configuration or command line, 3 a non-finite loss stopped the run (the last good
checkpoint is kept), 4 the processes of a multi-process run did not all join, 130 interrupted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxgpt.config import PRESETS, ConfigError, GPTConfig, _type_name, from_dict, load_yaml, to_dict
from jaxgpt.distributed import EXIT_DISTRIBUTED, DistributedConfig
from jaxgpt.mesh import MeshConfig
from jaxgpt.optim import OptimConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "shakespeare-cpu.yaml"
# glibc's malloc hands XLA:CPU fresh pages for its big per-step buffers every step; these settings keep them
# (+25-40% tokens/s on our 2-core CPUs, shared/notes/cpu-performance.md). They must be set before start-up,
# so `main` re-executes the process once with them on CPU-only installs (JAXGPT_NO_MALLOC_TUNING=1: don't).
MALLOC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"

EXIT_CONFIG, EXIT_NONFINITE, EXIT_INTERRUPTED = 2, 3, 130


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs. Build it with :meth:`from_dict` (validates every field)."""

    # ---- model ------------------------------------------------------------------------------------------
    model_preset: str | None = None  # a jaxgpt.config.PRESETS name; `model` fields override its values
    model: GPTConfig | None = None  # the model shape (init_from: scratch); resolved from model_preset
    init_from: str = "scratch"  # "scratch", a Hugging Face name ("gpt2", "gpt2-medium", ...) or a local HF dir
    dropout: float | None = None  # overrides the model's dropout (e.g. 0.0 to fine-tune gpt2); None: keep it
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # matmul operands; auto: bf16 where it is fast
    attention: Literal["auto", "xla", "cudnn", "reference"] = "auto"
    # ---- optimizer --------------------------------------------------------------------------------------
    optim: OptimConfig = OptimConfig()
    # ---- data -------------------------------------------------------------------------------------------
    data_source: str = "shakespeare"  # a jaxgpt.data source: "shakespeare", "hf:NAME_OR_FILES", text globs
    data_dir: str | None = None  # shards directory (prepared there if missing); None: data_cache/<source>
    loader_mode: Literal["sequential", "random"] = "random"
    batch_size: int = 8  # micro batch (rows per forward/backward), per process
    seq_len: int = 256
    total_batch_tokens: int | None = None  # tokens per optimizer step; None: batch_size * seq_len * processes
    # ---- schedule ---------------------------------------------------------------------------------------
    max_steps: int = 1000  # optimizer steps
    log_interval: int = 1  # steps between metrics.jsonl / TensorBoard records
    eval_interval: int = 100  # steps between validation losses (0: only at the end)
    eval_steps: int = 20  # validation batches per evaluation (always the same first ones)
    sample_interval: int = 0  # steps between samples (0: only at the end; -1: never)
    sample_prompt: str = "\n"
    sample_num: int = 2
    sample_len: int = 64  # new tokens per sample
    sample_temperature: float = 0.8
    sample_top_k: int | None = 200
    checkpoint_interval: int = 100  # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 3  # the last K checkpoints are kept
    async_checkpoint: bool = True
    # ---- run --------------------------------------------------------------------------------------------
    out_dir: str = "runs/default"
    resume: Literal["auto", "never", "must"] = "auto"
    seed: int = 1337
    tensorboard: bool = True  # when tensorboardX or torch.utils.tensorboard (+ tensorboard) is importable
    plot: bool = True  # loss.png at the end
    progress: bool = True  # the tqdm progress bar
    # ---- devices and processes --------------------------------------------------------------------------
    mesh: MeshConfig = MeshConfig()  # data x fsdp axis sizes (-1: the rest); default all devices data parallel
    distributed: DistributedConfig = DistributedConfig()  # multi-process settings; unset: $JAXGPT_* / SLURM

    def __post_init__(self) -> None:
        n = type(self).__name__

        def check(field: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"{n}.{field} = {getattr(self, field)!r}: {allowed}")

        for field in ("batch_size", "seq_len", "max_steps", "log_interval", "eval_steps", "sample_num",
                      "keep_checkpoints"):
            check(field, getattr(self, field) >= 1, "must be an integer >= 1")
        for field in ("eval_interval", "checkpoint_interval", "sample_len", "seed"):
            check(field, getattr(self, field) >= 0, "must be an integer >= 0")
        check("sample_interval", self.sample_interval >= -1, "must be an integer >= -1 (-1: never sample)")
        check("sample_temperature", self.sample_temperature >= 0, "must be >= 0 (0: greedy)")
        check("sample_top_k", self.sample_top_k is None or self.sample_top_k >= 0, "must be null or >= 0")
        check("dropout", self.dropout is None or 0.0 <= self.dropout < 1.0, "must be null or in [0, 1)")
        check("total_batch_tokens", self.total_batch_tokens is None or self.total_batch_tokens >= 1,
              "must be null or an integer >= 1")
        if self.model_preset is not None and self.model_preset not in PRESETS:
            raise ConfigError(f"{n}.model_preset = {self.model_preset!r}: valid presets are {sorted(PRESETS)}")
        if self.init_from == "scratch":
            check("model", self.model is not None, "init_from: scratch needs a model shape: set model_preset "
                  f"(one of {sorted(PRESETS)}) and/or model fields")
            check("seq_len", self.seq_len <= self.model.block_size,
                  f"must be <= model.block_size ({self.model.block_size})")
        else:
            check("model", self.model is None and self.model_preset is None,
                  f"init_from: {self.init_from} takes the model shape from the checkpoint; leave model and "
                  "model_preset unset (use `dropout` to change the dropout rate)")

    # ---- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """Validate and build; ``model`` fields are merged over ``model_preset``'s, numbers given as strings
        (YAML reads ``3e-4`` as a string) become numbers where the field is numeric."""
        if not isinstance(data, dict):
            raise ConfigError(f"TrainConfig: expected a mapping of fields, got {type(data).__name__}")
        data = dict(data)
        if isinstance(data.get("mesh"), str):  # --mesh=data=2,fsdp=4
            data["mesh"] = MeshConfig.parse(data["mesh"]).to_dict()
        preset = data.get("model_preset")
        if isinstance(preset, str) and preset in PRESETS:
            model = data.get("model") or {}
            if isinstance(model, GPTConfig):
                model = to_dict(model)
            if isinstance(model, dict):
                data["model"] = {**PRESETS[preset], **model}
        data = _coerce_numbers(cls, data)
        if isinstance(data.get("model"), dict):  # built here: from_dict's `X | None` hides the nested error
            data["model"] = GPTConfig.from_dict(data["model"])
        return from_dict(cls, data)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        data = load_yaml(path or DEFAULT_CONFIG)
        for dotted, value in (overrides or {}).items():
            set_dotted(data, dotted, value)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    # ---- derived ----------------------------------------------------------------------------------------
    def micro_steps(self, process_count: int = 1) -> int:
        """Gradient-accumulation steps per optimizer step."""
        per_micro = self.batch_size * self.seq_len * process_count
        if self.total_batch_tokens is None:
            return 1
        if self.total_batch_tokens % per_micro:
            lo = max(per_micro, self.total_batch_tokens // per_micro * per_micro)
            raise ConfigError(
                f"TrainConfig.total_batch_tokens = {self.total_batch_tokens:,}: must be a multiple of "
                f"batch_size * seq_len * processes = {self.batch_size} * {self.seq_len} * {process_count} = "
                f"{per_micro:,} (e.g. {lo:,} or {lo + per_micro:,})")
        return self.total_batch_tokens // per_micro

    def resolved_data_dir(self) -> Path:
        if self.data_dir is not None:
            return Path(self.data_dir)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.data_source.removeprefix("hf:"))
        return Path("data_cache") / safe


def _accepts(tp: Any, kind: type) -> bool:
    """Whether the annotation ``tp`` (possibly a union) admits ``kind``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_accepts(a, kind) for a in typing.get_args(tp))
    return tp is kind


def _coerce_numbers(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """Strings that spell numbers, in numeric fields, become numbers (recursively into nested configs)."""
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for k, v in data.items():
        tp = hints.get(k)
        if tp is None:
            continue
        nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if nested and isinstance(v, dict):
            out[k] = _coerce_numbers(nested[0], v)
        elif isinstance(v, str) and not _accepts(tp, str):
            try:
                out[k] = int(v) if _accepts(tp, int) and v.strip().lstrip("+-").isdigit() else float(v)
            except ValueError:
                pass  # left for from_dict to reject with the field's name
    return out


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``data["a"]["b"] = value`` for ``dotted = "a.b"`` (creating the nested mapping)."""
    *parents, leaf = dotted.split(".")
    node = data
    for i, p in enumerate(parents):
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: {'.'.join(parents[: i + 1])} is not a mapping of fields")
        node = child
    node[leaf] = value


# ---- command line ---------------------------------------------------------------------------------------
class UsageError(ConfigError):
    pass


def _field_help(cls: type, prefix: str = "") -> list[str]:
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if nested:
            lines += _field_help(nested[0], f"{prefix}{f.name}.")
        else:
            lines.append(f"  --{prefix}{f.name}=<{_type_name(tp)}>")
    return lines


def usage() -> str:
    return (__doc__.split("\n\n")[0] + "\n\nusage: python -m jaxgpt.train [--config FILE] [--print-config] "
            "[--FIELD=VALUE ...]\n\nfields:\n" + "\n".join(_field_help(TrainConfig)))


def parse_args(argv: list[str]) -> tuple[Path | None, dict[str, Any], bool]:
    """``--config FILE``, ``--print-config`` and ``--dotted.field=value`` / ``--dotted.field value``."""
    config_path, overrides, print_config = None, {}, False
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            raise UsageError(f"unexpected argument {arg!r}: overrides look like --field=value; see --help")
        key, eq, value = arg[2:].partition("=")
        if key == "print-config":
            print_config = True
            continue
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                raise UsageError(f"--{key} needs a value (--{key}=VALUE)")
            value = argv[i]
            i += 1
        if key == "config":
            config_path = Path(value)
            continue
        try:
            overrides[key.replace("-", "_")] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            overrides[key.replace("-", "_")] = value
    return config_path, overrides, print_config


# ---- helpers --------------------------------------------------------------------------------------------
def count_params(params: Any) -> int:
    import jax

    return sum(int(x.size) for x in jax.tree.leaves(params))


def flops_per_step(config: GPTConfig, *, seq_len: int, batch_size: int, micro_steps: int) -> float:
    """Model (matmul) FLOPs of one optimizer step on one process (jaxgpt.flops: forward + backward, full
    T x T attention, the lm_head over the padded vocabulary)."""
    from jaxgpt.flops import count_flops

    return float(count_flops(config, seq_len, batch_size=batch_size, grad_accum=micro_steps).training_per_step)


def device_peak_flops(dtype: str) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device for MFU (jaxgpt.account: a table for accelerators, a GEMM probe
    measured once per process on CPU), and where the number came from; None for a device it doesn't know."""
    import jax

    from jaxgpt import account

    dev = jax.local_devices()[0]
    if dev.platform == "gpu" and dtype == "float32" and jax.config.jax_default_matmul_precision in (None, "default"):
        dtype = "tf32"  # JAX runs fp32 matmuls on TF32 tensor cores unless precision is pinned
    try:
        peak = float(account.peak_flops(dev, dtype))
    except account.AccountError as e:  # an unknown device: no MFU, but train anyway
        return None, f"unknown: {e}"
    return peak, "measured GEMM probe" if dev.platform == "cpu" else f"{dev.device_kind} {dtype} table"


class MetricsLog:
    """metrics.jsonl (+ TensorBoard when importable); a no-op unless ``enabled`` (process 0 writes)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, truncate_after: int | None, enabled: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.file = self.tb = None
        if not enabled:
            return
        if truncate_after is not None and self.path.exists():  # resumed: drop what the killed run logged later
            keep = [r for r in read_metrics(run_dir) if r.get("step", 0) <= truncate_after]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            tmp.replace(self.path)
        elif truncate_after is None and self.path.exists():
            self.path.unlink()
        self.file = open(self.path, "a", buffering=1)
        if tensorboard:
            self.tb = _summary_writer(run_dir / "tb")

    def write(self, record: dict[str, Any]) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            kind = record["type"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step",) and v is not None:
                    self.tb.add_scalar(f"{kind}/{k}", v, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _summary_writer(logdir: Path):
    for mod in ("tensorboardX", "torch.utils.tensorboard"):
        try:
            return __import__(mod, fromlist=["SummaryWriter"]).SummaryWriter(str(logdir))
        except Exception:  # not installed (torch's needs the tensorboard package)
            continue
    return None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (a line torn by a killed process is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_losses(run_dir: str | Path) -> Path | None:
    """loss.png: train and val loss against step, from metrics.jsonl."""
    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r["type"] == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r["type"] == "eval"]
    if not train and not val:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(run_dir) / "loss.png"
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


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
    import jax
    import numpy as np
    from tqdm.auto import tqdm

    from jaxgpt import data as data_lib
    from jaxgpt import mesh as mesh_lib
    from jaxgpt import step as step_lib
    from jaxgpt.checkpoint import Checkpoints, NoCheckpointError
    from jaxgpt.optim import make_optimizer
    from jaxgpt.precision import Policy

    t_start = time.perf_counter()
    pcount, pindex = jax.process_count(), jax.process_index()
    mesh = mesh_lib.make_mesh(cfg.mesh)  # (configuration errors before anything is written)
    local_devices = sum(d.process_index == pindex for d in mesh.devices.flat)
    if cfg.batch_size % local_devices:
        raise ConfigError(f"TrainConfig.batch_size = {cfg.batch_size}: must be a multiple of the devices per process "
                          f"({local_devices}): every device takes the same number of rows of each micro-batch")
    run_dir = Path(cfg.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    is_main = pindex == 0  # writes the run directory's files (all processes save checkpoints together)
    micro_steps = cfg.micro_steps(pcount)
    tokens_per_step = micro_steps * cfg.batch_size * cfg.seq_len * pcount
    say = tqdm.write if is_main else (lambda *_a, **_k: None)

    # ---- data -----------------------------------------------------------------------------------------
    data_dir = cfg.resolved_data_dir()
    if not (data_dir / data_lib.MANIFEST_NAME).exists():
        if cfg.data_source.startswith(data_lib.HF_PREFIX):  # large: prepared on purpose, with its options
            raise ConfigError(f"{data_dir} holds no prepared shards; prepare {cfg.data_source!r} first with "
                              f"`python -m jaxgpt.data --hf-dataset ... --out {data_dir}` (see the config file)")
        data_lib.prepare(cfg.data_source, data_dir)
    train_loader = data_lib.DataLoader(data_dir, "train", cfg.batch_size * micro_steps, cfg.seq_len,
                                       mode=cfg.loader_mode, seed=cfg.seed, process_index=pindex,
                                       process_count=pcount)
    val_loader = data_lib.DataLoader(data_dir, "val", cfg.batch_size, cfg.seq_len, mode="sequential",
                                     seed=cfg.seed, process_index=pindex, process_count=pcount)

    # ---- model, optimizer, state ----------------------------------------------------------------------
    policy = Policy.named(cfg.precision, attention=cfg.attention)
    model = build_model(cfg, policy)
    model_cfg = model.config
    optimizer = make_optimizer(cfg.optim)
    graphdef, state = step_lib.init_train_state(model, optimizer, mesh=mesh)
    del model
    saved_config = {**cfg.to_dict(), "model": to_dict(model_cfg)}
    train_step = step_lib.make_train_step(graphdef, optimizer, micro_steps=micro_steps,
                                          dropout=model_cfg.dropout > 0, mesh=mesh)
    eval_step = step_lib.make_eval_step(graphdef, mesh=mesh)
    rng = jax.random.key(cfg.seed)

    # ---- resume ---------------------------------------------------------------------------------------
    ckpts = Checkpoints(run_dir, keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoint)
    metrics = bar = None
    try:
        start_step, latest = 0, ckpts.latest_step()
        if cfg.resume == "must" and latest is None:
            raise NoCheckpointError(f"resume: must, but {ckpts.directory} holds no complete checkpoint")
        if cfg.resume == "never" and latest is not None:
            raise ConfigError(f"resume: never, but {run_dir} already holds checkpoints (steps {ckpts.all_steps()}); "
                              "use resume: auto to continue that run, or another out_dir")
        if latest is not None:
            r = ckpts.restore(latest, params=state.params, opt_state=state.opt_state, requested_config=saved_config)
            state = state.replace(step=jax.numpy.asarray(r.step, dtype=state.step.dtype), params=r.params,
                                  opt_state=r.opt_state)
            rng = r.rng_key
            train_loader.load_state_dict(_loader_state_for(r.loader_state, train_loader, say))
            start_step = r.step
        if is_main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(saved_config, sort_keys=False))
        metrics = MetricsLog(run_dir, tensorboard=cfg.tensorboard, truncate_after=start_step if latest else None,
                             enabled=is_main)
        n_params = count_params(state.params)
        step_flops = flops_per_step(model_cfg, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                    micro_steps=micro_steps) * pcount
        peak, peak_src = device_peak_flops(policy.compute_dtype)
        n_dev = jax.device_count()
        say(f"jaxgpt.train: {n_params / 1e6:.2f}M params ({model_cfg.n_layer}L {model_cfg.n_head}H "
            f"{model_cfg.n_embd}C, vocab rows {model_cfg.vocab_rows}), init {cfg.init_from}, {policy.compute_dtype} "
            f"compute, {n_dev} x {jax.devices()[0].device_kind}, {pcount} process(es)")
        say(f"  batch: {tokens_per_step:,} tokens/step = {micro_steps} micro step(s) x {cfg.batch_size} x "
            f"{cfg.seq_len} x {pcount} process(es); data {data_dir} ({train_loader.num_tokens:,} train tokens); "
            f"peak {'?' if peak is None else f'{peak / 1e12:.2f} TFLOP/s'} ({peak_src})")
        say(f"  {mesh_lib.summary(mesh, state.params, state.opt_state)}")
        say(f"  run dir {run_dir}" + (f"; resumed from step {start_step}" if latest else ""))

        val_state = val_loader.state_dict()
        n_eval = min(cfg.eval_steps, val_loader.batches_per_epoch)  # never the same batch twice

        def evaluate(params) -> float:
            val_loader.load_state_dict(val_state)  # the same batches every time
            losses = []
            for _ in range(n_eval):
                x, y = val_loader.next_batch()
                losses.append(eval_step(params, x, y))
            return float(np.mean([float(v) for v in losses]))

        def sample(params, step: int) -> None:
            from flax import nnx

            from jaxgpt.generate import generate_text

            params = _on_one_device(params)  # every process takes part (a collective with several)
            if not is_main:
                return
            texts = generate_text(nnx.merge(graphdef, params), cfg.sample_prompt, max_new_tokens=cfg.sample_len,
                                  temperature=cfg.sample_temperature, top_k=cfg.sample_top_k,
                                  seed=(cfg.seed + step) % 2**32, num_samples=cfg.sample_num)
            block = "".join(f"--- sample {i} (step {step}) ---\n{t}\n" for i, t in enumerate(texts))
            with open(run_dir / "samples.txt", "a") as f:
                f.write(block)
            say(block.rstrip())

        def save(step: int, extra: dict[str, Any]) -> None:
            if ckpts.latest_step() == step:
                return
            ckpts.save(step, params=state.params, opt_state=state.opt_state, config=saved_config, rng_key=rng,
                       loader_state=train_loader.state_dict(), extra=extra)

        # Test hook: seconds to sleep before every step, so a test can kill a run mid-way.
        debug_sleep = float(os.environ.get("JAXGPT_DEBUG_STEP_SLEEP", "0"))
        last: dict[str, Any] = {}
        val_loss = None
        steady_tokens, steady_time, compile_s = 0, 0.0, None
        bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps, unit="step",
                   disable=not cfg.progress, dynamic_ncols=True, mininterval=1.0)
        if start_step == 0 and cfg.eval_interval > 0:
            val_loss = evaluate(state.params)
            metrics.write({"type": "eval", "step": 0, "val_loss": val_loss})
            say(f"step 0: val loss {val_loss:.4f}")
        for i in bar:
            step = i + 1
            x, y = train_loader.next_batch()
            x = x.reshape(micro_steps, cfg.batch_size, cfg.seq_len)
            y = y.reshape(micro_steps, cfg.batch_size, cfg.seq_len)
            step_lib.check_batch(x, y, model_cfg)
            rng, key = jax.random.split(rng)
            if debug_sleep:
                time.sleep(debug_sleep)
            t0 = time.perf_counter()
            state, m = train_step(state, x, y, key)
            loss, grad_norm, lr = float(m["loss"]), float(m["grad_norm"]), float(m["lr"])
            dt = time.perf_counter() - t0
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                ckpts.wait()
                raise NonFiniteLoss(
                    f"step {step}: loss {loss}, grad norm {grad_norm}: training diverged (lower optim.lr or "
                    f"raise optim.warmup_steps). The last good checkpoint is step {ckpts.latest_step()} in "
                    f"{ckpts.directory}" if ckpts.latest_step() is not None else
                    f"step {step}: loss {loss}, grad norm {grad_norm}: training diverged before any checkpoint "
                    "was written (lower optim.lr or raise optim.warmup_steps)")
            if compile_s is None:
                compile_s = dt
            else:
                steady_tokens += tokens_per_step
                steady_time += dt
            tok_s = tokens_per_step / dt
            mfu = step_flops / dt / (peak * n_dev) if peak else None
            last = {"type": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                    "step_time": dt, "tokens_per_s": tok_s, "flops_per_s": step_flops / dt, "mfu": mfu,
                    "tokens": step * tokens_per_step}
            if step % cfg.log_interval == 0 or step == cfg.max_steps:
                metrics.write(last)
            bar.set_postfix({"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tok_s:,.0f}",
                             **({"mfu": f"{mfu:.1%}"} if mfu is not None else {})}, refresh=False)
            if cfg.eval_interval and step % cfg.eval_interval == 0 and step != cfg.max_steps:
                val_loss = evaluate(state.params)
                metrics.write({"type": "eval", "step": step, "val_loss": val_loss})
                say(f"step {step}: train loss {loss:.4f}, val loss {val_loss:.4f}")
            if cfg.sample_interval > 0 and step % cfg.sample_interval == 0 and step != cfg.max_steps:
                sample(state.params, step)
            if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0:
                save(step, {"loss": loss})
        bar.close()
        final_step = max(start_step, cfg.max_steps)
        if start_step < cfg.max_steps:
            val_loss = evaluate(state.params)
            metrics.write({"type": "eval", "step": final_step, "val_loss": val_loss})
            if cfg.sample_interval >= 0:
                sample(state.params, final_step)
            save(final_step, {"loss": last.get("loss")})
        else:  # resumed a finished run: nothing to do
            say(f"the run in {run_dir} already reached step {start_step} (max_steps {cfg.max_steps})")
            done = read_metrics(run_dir)
            val_loss = next((r["val_loss"] for r in reversed(done) if r["type"] == "eval"), None)
            last = next((r for r in reversed(done) if r["type"] == "train"), {})
    finally:
        if bar is not None:
            bar.close()
        ckpts.close()
        if metrics is not None:
            metrics.close()
            if cfg.plot and is_main:
                plot_losses(run_dir)
    wall = time.perf_counter() - t_start
    summary = {"steps": cfg.max_steps, "start_step": start_step, "train_loss": last.get("loss"),
               "val_loss": val_loss, "wall_s": wall, "compile_s": compile_s,
               "tokens_per_s": steady_tokens / steady_time if steady_time else None,
               "tokens": cfg.max_steps * tokens_per_step, "run_dir": str(run_dir),
               "mesh": {k: int(v) for k, v in mesh.shape.items()}, "processes": pcount}
    say(f"done: step {final_step}, train loss {summary['train_loss']}, val loss {val_loss}, "
        f"{wall:.1f} s wall, " + (f"{summary['tokens_per_s']:,.0f} tok/s (steady), " if steady_time else "")
        + f"run dir {run_dir}")
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _maybe_reexec_with_malloc_tuning(argv: list[str]) -> None:
    if os.environ.get("GLIBC_TUNABLES") or os.environ.get("JAXGPT_NO_MALLOC_TUNING") or sys.platform != "linux":
        return
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu")):
        return  # an accelerator install: the host allocator is not the bottleneck
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES}
    os.execve(sys.executable, [sys.executable, "-m", "jaxgpt.train", *argv], env)


def main(argv: list[str] | None = None) -> int:
    from_cli = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    try:
        config_path, overrides, print_config = parse_args(argv)
        cfg = TrainConfig.load(config_path, overrides)
        cfg.micro_steps()  # divisibility, before anything starts
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    if from_cli:
        _maybe_reexec_with_malloc_tuning(argv)
    from jaxgpt import distributed
    from jaxgpt.checkpoint import NoCheckpointError
    from jaxgpt.data import DataError
    from jaxgpt.weights import CheckpointError

    try:  # before anything starts JAX's backends
        distributed.initialize_from_env(cfg.distributed)
    except (ConfigError, distributed.DistributedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DISTRIBUTED if isinstance(e, distributed.DistributedError) else EXIT_CONFIG
    try:
        train(cfg)
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except (ConfigError, NoCheckpointError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
