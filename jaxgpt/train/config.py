"""The training configuration: :class:`TrainConfig` (typed, frozen, validated field by field), loading it from a
YAML preset with dotted overrides, and the default preset's path."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

from jaxgpt.config import PRESETS, ConfigError, GPTConfig, from_dict, load_yaml, to_dict
from jaxgpt.distributed import DistributedConfig
from jaxgpt.kernels import registry
from jaxgpt.kernels.registry import Kernels
from jaxgpt.localpath import missing_directory
from jaxgpt.mesh import MeshConfig
from jaxgpt.optim import OptimConfig
from jaxgpt.train.wandb_log import WandbConfig

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "shakespeare-char-cpu.yaml"  # nanoGPT's first run


# the per-op flags the kernel layer replaced (issue 44): refused with the flag that replaces them
RENAMED = {"layer_norm": "layer_norm", "gelu": "mlp", "qkv": "qkv", "lm_head": "loss", "c_proj": "layer_norm",
           "attention": "attention"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs. Build it with :meth:`from_dict` (validates every field)."""

    # ---- model ------------------------------------------------------------------------------------------
    model_preset: str | None = None  # a jaxgpt.config.PRESETS name; `model` fields override its values
    model: GPTConfig | None = None  # the model shape (init_from: scratch); resolved from model_preset
    init_from: str = "scratch"  # "scratch", a Hugging Face name ("gpt2", "gpt2-medium", ...) or a local HF dir
    dropout: float | None = None  # overrides the model's dropout (e.g. 0.0 to fine-tune gpt2); None: keep it
    # matmul dtypes (jaxgpt.precision.Policy.named); auto: bf16 where fast; bf16-autocast: torch.autocast's bf16
    precision: Literal["auto", "fp32", "bf16", "bf16-autocast", "fp8"] = "auto"
    # precision: fp8 only: which forward GEMMs take e4m3 operands (jaxgpt.kernels.fp8); None: its DEFAULT_GEMMS
    fp8_gemms: Literal["lm_head", "mlp", "mlp+lm_head", "all"] | None = None
    # which implementation each op of the kernel layer runs (jaxgpt.kernels.registry, docs/kernels.md): a preset,
    # --kernels=xla (the reference paths) or --kernels=pallas (the Pallas kernels where they run: GPUs; the same
    # numerics), and per-op choices over it, e.g. --kernels.mlp=pallas-recompute (9.0 GiB less at gpt2 b64);
    # auto (the default): the program measured fastest on this device for this run's shape (jaxgpt.tune,
    # docs/auto.md): a committed or cached choice, else a bounded search (kernels_search_s), else the xla preset
    kernels: Kernels = Kernels(preset="auto")
    # kernels: auto's search at a run's start: null: on GPUs/TPUs for runs of >= 500 steps, within min(300 s, 10% of
    # the run's expected time), never on CPUs (cached/committed choices only); 0: never; N: always, within N seconds
    kernels_search_s: float | None = None
    # Policy.gelu_h_dtype: bfloat16 keeps the MLP's h in bf16 for GELU's backward (as torch autocast's; 403 MB less
    # per layer at gpt2 b64; precision bf16 only)
    gelu_h_dtype: Literal["float32", "bfloat16"] = "float32"
    # Policy.logits_dtype: the dtype the lm_head writes its logits in, the loss and its gradient then computed in fp32
    # from them; bfloat16 halves the loss's passes over them (GPUs). null: the precision's own (bf16 under
    # bf16-autocast, torch.autocast's numerics, which refuses float32; fp32 otherwise)
    logits_dtype: Literal["float32", "bfloat16"] | None = None
    # ---- optimizer --------------------------------------------------------------------------------------
    optim: OptimConfig = OptimConfig()
    # ---- data -------------------------------------------------------------------------------------------
    data_source: str = "shakespeare"  # a jaxgpt.data source: "shakespeare", "hf:NAME_OR_FILES", text globs
    data_dir: str | None = None  # shards directory (prepared there if missing); None: data_cache/<source>[-char]
    tokenizer: Literal["gpt2", "char"] = "gpt2"  # of data_dir's shards: GPT-2 BPE, or characters (jaxgpt.chars)
    loader_mode: Literal["sequential", "random"] = "random"
    batch_size: int = 8  # micro batch (rows per forward/backward), per process
    seq_len: int = 256
    total_batch_tokens: int | None = None  # tokens per optimizer step; None: batch_size * seq_len * processes
    # ---- schedule ---------------------------------------------------------------------------------------
    max_steps: int = 1000  # optimizer steps
    log_interval: int = 1  # steps between metrics.jsonl / TensorBoard records
    eval_interval: int = 100  # steps between validation losses (0: only at the end)
    eval_steps: int = 20  # validation batches per evaluation (always the same first ones)
    hellaswag_interval: int = 0  # steps between HellaSwag scores (build-nanogpt's acc_norm; 0: never)
    hellaswag_file: str | None = None  # the official hellaswag_val.jsonl (None: the cached copy, or download it)
    hellaswag_limit: int | None = None  # score only the first N items (None: all 10,042)
    sample_interval: int = 0  # steps between samples (0: only at the end; -1: never)
    sample_prompt: str = "\n"
    sample_num: int = 2
    sample_len: int = 64  # new tokens per sample
    sample_temperature: float = 0.8
    sample_top_k: int | None = 200
    checkpoint_interval: int = 100  # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 3  # the last K checkpoints are kept
    keep_best_checkpoint: bool = False  # besides them, the one with the lowest val loss (saved at an eval step)
    async_checkpoint: bool = True
    allow_low_disk: bool = False  # a disk too small for keep_checkpoints checkpoints: warn and train (default: refuse)
    # ---- divergence (jaxgpt.train.guard) --------------------------------------------------------------------
    spike_loss_factor: float = 3.0  # a loss above this times the median of the recent ones diverged (0: off)
    spike_grad_norm_factor: float = 0.0  # likewise for the gradient norm (0: off; see jaxgpt.train.guard)
    spike_window: int = 100  # healthy steps in the running medians
    on_divergence: Literal["stop", "rollback"] = "stop"  # rollback: back to the last checkpoint, skip the data
    max_rollbacks: int = 3  # automatic rollbacks per process before the run stops
    resume_step: int | None = None  # resume from this checkpoint (newer ones are moved aside, not deleted)
    skip_batches: int = 0  # with resume_step: advance the data K global batches past that checkpoint's position
    # ---- run --------------------------------------------------------------------------------------------
    out_dir: str = "runs/default"
    resume: Literal["auto", "never", "must"] = "auto"
    seed: int = 1337
    tensorboard: bool = True  # when tensorboardX or torch.utils.tensorboard (+ tensorboard) is importable
    plot: bool = True  # loss.png at the end
    progress: bool = True  # the tqdm progress bar
    wandb: WandbConfig = WandbConfig()  # --wandb: Weights & Biases tracking (jaxgpt.train.wandb_log)
    # ---- devices and processes --------------------------------------------------------------------------
    mesh: MeshConfig = MeshConfig()  # data x fsdp axis sizes (-1: the rest); default all devices data parallel
    # fsdp > 1: reduce-scatter the gradients per micro-step (sharded accumulator) or once per step (full weights
    # and a full gradient accumulator per device: 4 N bytes more each); jaxgpt.step.make_train_step
    fsdp_reduce: Literal["micro_step", "step"] = "micro_step"
    distributed: DistributedConfig = DistributedConfig()  # multi-process settings; unset: $JAXGPT_* / SLURM

    def __post_init__(self) -> None:
        n = type(self).__name__

        def check(field: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"{n}.{field} = {getattr(self, field)!r}: {allowed}")

        for field in ("batch_size", "seq_len", "max_steps", "log_interval", "eval_steps", "sample_num",
                      "keep_checkpoints"):
            check(field, getattr(self, field) >= 1, "must be an integer >= 1")
        check("hellaswag_limit", self.hellaswag_limit is None or self.hellaswag_limit >= 1, "must be null or >= 1")
        for field in ("eval_interval", "checkpoint_interval", "sample_len", "seed", "hellaswag_interval"):
            check(field, getattr(self, field) >= 0, "must be an integer >= 0")
        for field in ("spike_loss_factor", "spike_grad_norm_factor"):
            check(field, getattr(self, field) == 0 or getattr(self, field) > 1, "must be 0 (off) or a factor > 1")
        check("spike_window", self.spike_window >= 1, "must be an integer >= 1")
        check("tokenizer", self.tokenizer in ("gpt2", "char"), "allowed values are ['gpt2', 'char']")
        missing = None if self.init_from == "scratch" else missing_directory(self.init_from)
        check("init_from", missing is None, f"{missing}; init_from takes scratch, a Hugging Face GPT-2 name (gpt2, "
              "gpt2-medium, ...) or a Hugging Face directory (`python -m jaxgpt.checkpoint export --to-hf` writes "
              "one); a training run continues from its checkpoints when run again with the same out_dir")
        finetune = f"fine-tune with --config configs/finetune-gpt2.yaml --init_from={self.init_from}"
        check("tokenizer", self.tokenizer == "gpt2" or self.init_from == "scratch",
              f"init_from: {self.init_from} is a GPT-2 model, whose ids are GPT-2 BPE tokens, not characters; "
              f"{finetune}")
        check("fsdp_reduce", self.fsdp_reduce in ("micro_step", "step"), "allowed values are ['micro_step', 'step']")
        check("logits_dtype", self.precision != "bf16-autocast" or self.logits_dtype != "float32",
              "precision: bf16-autocast is torch.autocast's numerics, whose lm_head writes bf16 logits; drop "
              "logits_dtype (null) or use precision: bf16 for fp32 logits")
        registry.check_names(self.kernels)
        check("kernels_search_s", self.kernels_search_s is None or self.kernels_search_s >= 0,
              "must be null (the default rule), 0 (never search) or seconds > 0")
        check("max_rollbacks", self.max_rollbacks >= 0, "must be an integer >= 0")
        check("resume_step", self.resume_step is None or self.resume_step >= 0, "must be null or a step >= 0")
        check("skip_batches", self.skip_batches >= 0, "must be an integer >= 0")
        check("skip_batches", self.skip_batches == 0 or self.resume_step is not None,
              "needs resume_step, the checkpoint whose data position the skip starts from (e.g. "
              "--resume_step=N --skip_batches=K); a skip keyed to a named step is applied once, however often "
              "the command is re-run")
        check("resume", self.resume_step is None or self.resume != "never",
              "resume: never cannot resume from resume_step; use resume: auto or must")
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
                  f"model_preset unset (use `dropout` to change the dropout rate), e.g. {finetune}")

    # ---- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """Validate and build; ``model`` fields are merged over ``model_preset``'s, numbers given as strings
        (YAML reads ``3e-4`` as a string) become numbers where the field is numeric."""
        if not isinstance(data, dict):
            raise ConfigError(f"TrainConfig: expected a mapping of fields, got {type(data).__name__}")
        data = dict(data)
        for old, op in RENAMED.items():
            if old in data:
                raise ConfigError(f"{old}: replaced by kernels (docs/kernels.md): --kernels=pallas selects the Pallas "
                                  f"set, --kernels.{op}=NAME one op's implementation")
        if isinstance(data.get("kernels"), (str, Kernels)):  # --kernels=pallas
            data["kernels"] = Kernels.parse(data["kernels"])
        if isinstance(data.get("kernels"), Kernels):
            data["kernels"] = to_dict(data["kernels"])
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
        if isinstance(data.get("kernels"), str):  # kernels: pallas, so that --kernels.mlp=... lands beside it
            data["kernels"] = {"preset": data["kernels"]}
        for dotted, value in (overrides or {}).items():
            set_dotted(data, "kernels.preset" if dotted == "kernels" and isinstance(value, str) else dotted, value)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def policy_options(self) -> dict[str, Any]:
        """What Policy.named takes from this config besides the precision. ``kernels: auto`` gives the default program
        (the xla preset, with the config's per-op choices) here: what a run measures instead is jaxgpt.tune's (the
        run replaces it with its choice)."""
        kernels = self.kernels
        if kernels.preset == registry.AUTO:
            kernels = dataclasses.replace(kernels, preset="xla")
        return dict(fp8_gemms=self.fp8_gemms, logits_dtype=self.logits_dtype, kernels=kernels,
                    gelu_h_dtype=self.gelu_h_dtype)

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

    def schedule_warning(self) -> str | None:
        """One line when ``max_steps`` ends the run inside the learning-rate schedule's warm-up, or (cosine) before
        its decay ends, naming the ``optim`` flags that fit the schedule to the run; None when it fits."""
        o, steps = self.optim, self.max_steps
        cosine = o.schedule == "cosine"
        in_warmup, in_decay = steps < o.warmup_steps, cosine and steps < o.decay_steps
        if not (in_warmup or in_decay):
            return None
        # the schedule scaled to the run (cosine: warm-up keeps its share of the decay; it must end before it)
        warmup = min(steps - 1, o.warmup_steps * steps // o.decay_steps) if cosine else steps // 10
        fix = " ".join(([f"--optim.warmup_steps={warmup}"] if in_warmup or steps <= o.warmup_steps else [])
                       + ([f"--optim.decay_steps={steps}"] if cosine else []))
        where = (f"inside the learning-rate warm-up (optim.warmup_steps {o.warmup_steps}: the rate never reaches "
                 "optim.lr)" if in_warmup else
                 f"before the cosine decay ends (optim.decay_steps {o.decay_steps}: the rate never decays to "
                 "optim.min_lr_ratio x optim.lr)")
        return f"warning: max_steps {steps} ends the run {where}; to fit the schedule to the run set {fix}"

    def resolved_data_dir(self) -> Path:
        if self.data_dir is not None:
            return Path(self.data_dir)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.data_source.removeprefix("hf:"))
        return Path("data_cache") / (safe + ("-char" if self.tokenizer == "char" else ""))


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
