"""``python -m jaxgpt.train``: parse ``--config`` and ``--field=value`` overrides, run, map errors to exit codes."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxgpt.config import ConfigError, _type_name
from jaxgpt import gpu_env
from jaxgpt.distributed import EXIT_DISTRIBUTED
from jaxgpt.train.config import TrainConfig

# glibc's malloc hands XLA:CPU fresh pages for its big per-step buffers every step; these settings keep them
# (+25-40% tokens/s on our 2-core CPUs, shared/notes/cpu-performance.md). They must be set before start-up,
# so `main` re-executes the process once with them on CPU-only installs (JAXGPT_NO_MALLOC_TUNING=1: don't).
MALLOC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"

EXIT_CONFIG, EXIT_NONFINITE, EXIT_INTERRUPTED = 2, 3, 130  # and 128 + signal after a SIGTERM (143) / SIGINT


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
    doc = sys.modules["jaxgpt.train"].__doc__  # the package's docstring: what the command does
    return (doc.split("\n\n")[0] + "\n\nusage: python -m jaxgpt.train [--config FILE] [--print-config] "
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
        if key in ("allow-low-disk", "allow_low_disk") and not eq:  # a flag: train on a disk found too small
            overrides["allow_low_disk"] = True
            continue
        if key == "wandb":  # --wandb alone, or --wandb=true|false: W&B tracking on or off
            overrides["wandb.enabled"] = yaml.safe_load(value) if eq else True
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


class CliConfig(typing.NamedTuple):
    path: Path | None  # --config (None: the default config)
    overrides: dict[str, Any]  # the --field=value overrides
    cfg: TrainConfig  # the config they make, checked
    print_config: bool  # --print-config


def load_config(argv: list[str]) -> CliConfig:
    """The run's config from ``--config`` and ``--field=value`` overrides, checked before anything starts, and
    whether ``--print-config`` was asked; bad input raises :class:`ConfigError` (jaxgpt.train and torch_ref.train)."""
    config_path, overrides, print_config = parse_args(argv)
    cfg = TrainConfig.load(config_path, overrides)
    cfg.micro_steps()  # divisibility
    return CliConfig(config_path, overrides, cfg, print_config)


def _maybe_reexec_with_malloc_tuning(argv: list[str]) -> None:
    if os.environ.get("GLIBC_TUNABLES") or os.environ.get("JAXGPT_NO_MALLOC_TUNING") or sys.platform != "linux":
        return
    if importlib.util.find_spec("libtpu") or (
            any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
            and gpu_env.cuda_driver_present()):
        return  # an accelerator that can run: the host allocator is not the bottleneck (the CUDA plugin alone,
        # e.g. after `make gpu-compile` on a CPU machine, still trains on the CPU and keeps the tuning)
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES}
    os.execve(sys.executable, [sys.executable, "-m", "jaxgpt.train", *argv], env)


def main(argv: list[str] | None = None) -> int:
    from_cli = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    try:
        _, _, cfg, print_config = load_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        try:  # what each op runs with these numerics (jaxgpt.kernels.registry), where the kernels run (GPUs)
            from jaxgpt.precision import Policy

            policy = Policy.named("bf16" if cfg.precision == "auto" else cfg.precision, **cfg.policy_options())
            auto = cfg.kernels.preset == "auto"  # measured at the run's start (jaxgpt.tune, docs/auto.md)
            print("# kernels (GPUs; precision auto as bf16" + ("; auto: measured at the run's start, this is the "
                                                               "default program it starts from" if auto else "")
                  + "): " + ", ".join(f"{op}={name}" for op, name in policy.implementations.items()))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_CONFIG
        return 0
    if from_cli:
        _maybe_reexec_with_malloc_tuning(argv)  # (re-runs main in a new process: say nothing before it)
    if cfg.schedule_warning():
        print(cfg.schedule_warning(), file=sys.stderr)
    from jaxgpt import distributed
    from jaxgpt.checkpoint import CheckpointDamaged, NoCheckpointError
    from jaxgpt.data import DataError
    from jaxgpt.diskspace import WriteFailed, write_failure
    from jaxgpt.memory_fit import OutOfDeviceMemory, oom_summary, out_of_memory
    from jaxgpt.train.preempt import InterruptedBeforeTraining, Preempted
    from jaxgpt.train.run import NonFiniteLoss, train
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
    except (ConfigError, NoCheckpointError, CheckpointDamaged, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except Preempted as e:  # SIGTERM / SIGINT in the step loop: the step in hand saved (jaxgpt.train.preempt)
        print(f"jaxgpt.train: {e}", file=sys.stderr)
        return e.code
    except WriteFailed as e:  # a full disk (a checkpoint save, metrics.jsonl, the pre-flight check)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except OutOfDeviceMemory as e:  # XLA's RESOURCE_EXHAUSTED in the step loop: the step, the checkpoint to resume
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except InterruptedBeforeTraining as e:  # before the first step completed: nothing trained, nothing to save
        print(f"jaxgpt.train: {e.message}", file=sys.stderr)
        if from_cli:  # (the run's files are closed) end now: an interpreter shutdown with XLA mid-way can crash
            from jaxgpt.interrupt import exit_now

            exit_now(e.code)
        return e.code
    except KeyboardInterrupt:  # (train() not called from the main thread: no signal handlers of its own)
        print("jaxgpt.train: interrupted (Ctrl-C); the checkpoints already saved are intact", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RuntimeError as e:  # XLA's RESOURCE_EXHAUSTED outside the step loop (set-up, the final evaluation)
        if not out_of_memory(e):
            raise
        print(f"error: out of device memory outside the step loop ({oom_summary(e)}); free the GPU's memory "
              "(another process on it?) or lower batch_size, then re-run the same command (it resumes from the newest "
              "checkpoint)", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        why = write_failure(e)
        if why is None:
            raise
        print(f"error: writing {e.filename or 'a file of the run'} failed: {why[1]}; free space (or choose an "
              f"out_dir on another disk), then re-run the same command to resume from the newest checkpoint",
              file=sys.stderr)
        return EXIT_CONFIG
    return 0
