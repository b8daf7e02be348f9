"""Loading the model to sample from and its tokenizer, from what ``--init-from`` names: a training run directory
(its checkpoint), a Hugging Face GPT-2 directory or name, an export, or ``random:PRESET``."""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from jaxgpt.config import PRESETS, GPTConfig
from jaxgpt.generate.errors import GenerateError
from jaxgpt.localpath import missing_directory
from jaxgpt.model import GPT
from jaxgpt.precision import Policy

__all__ = ["load_checkpoint", "load_model", "load_tokenizer"]


def load_checkpoint(path: str | Path, *, policy: Policy, step: int | None = None) -> GPT:
    """The model of a jaxgpt training run (``jaxgpt.checkpoint``): ``path`` is the run directory (or its
    ``checkpoints/`` subdirectory); ``step`` defaults to the newest intact checkpoint."""
    from jaxgpt import checkpoint

    path = Path(path)
    if path.name == checkpoint.CHECKPOINT_SUBDIR and not (path / checkpoint.CHECKPOINT_SUBDIR).is_dir():
        path = path.parent
    try:
        return checkpoint.load_model(path, step=step, policy=policy)
    except checkpoint.CheckpointDamaged as e:  # --step N named a damaged step (no fallback then)
        raise GenerateError(f"--init-from {str(path)!r} --step {step}: {e}; leave out --step to use the newest "
                            "intact step") from e
    except (OSError, ValueError) as e:  # NoCheckpointError, CheckpointMismatchError, unreadable files
        if (path / checkpoint.CHECKPOINT_SUBDIR).is_dir():  # a run directory: its checkpoints are the problem
            raise GenerateError(f"--init-from {str(path)!r}: {e}") from e
        raise GenerateError(f"--init-from {str(path)!r}: not a Hugging Face GPT-2 directory (no config.json), "
                            f"and no jaxgpt training checkpoint could be loaded from it: {e}") from e


def load_tokenizer(init_from: str, *, step: int | None = None):
    """The tokenizer of the model ``load_model(init_from)`` loads: a training run's checkpoint records it, an
    export records it in ``jaxgpt_export.json``; Hugging Face models and ``random:`` presets use GPT-2's BPE."""
    from jaxgpt import tokenizer

    path = Path(init_from)
    record = None
    if path.is_dir() and not _is_hf_dir(path):
        from jaxgpt import checkpoint

        if path.name == checkpoint.CHECKPOINT_SUBDIR and not (path / checkpoint.CHECKPOINT_SUBDIR).is_dir():
            path = path.parent
        record = checkpoint.saved_tokenizer(path, step=step)
    elif path.is_dir():
        from jaxgpt.exportdir import export_tokenizer

        record = export_tokenizer(path)
    return tokenizer.from_record(record)


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or any((path / f).is_file() for f in
                                                   ("model.safetensors", "pytorch_model.bin"))


def load_model(init_from: str, *, policy: Policy, seed: int = 0, step: int | None = None) -> GPT:
    """A GPT from ``init_from``: ``random:PRESET`` (random init with ``seed``), a directory (a Hugging Face
    GPT-2 directory if it holds config.json or weights, else a jaxgpt training run directory, whose
    checkpoint ``step`` is loaded, default the latest), or a Hugging Face model name ("gpt2", ...)."""
    path = Path(init_from)
    missing = None if init_from.startswith("random:") else missing_directory(init_from)
    if missing:  # a path (runs/typo), not a hub name: said before the hub is asked
        raise GenerateError(f"--init-from {init_from!r}: {missing}; give a training run directory, a Hugging Face "
                            "GPT-2 directory or name (gpt2, ...), or random:PRESET")
    is_run_dir = path.is_dir() and not _is_hf_dir(path)
    if step is not None and not is_run_dir:
        raise GenerateError(f"--step {step}: only a training run directory has steps; "
                            f"--init-from {init_from!r} is not one")
    if init_from.startswith("random:"):
        preset = init_from.split(":", 1)[1]
        if preset not in PRESETS:
            raise GenerateError(f"--init-from {init_from!r}: unknown preset {preset!r}; "
                                f"valid presets are {sorted(PRESETS)}")
        return GPT(GPTConfig.preset(preset), policy=policy, rngs=nnx.Rngs(seed))
    if is_run_dir:
        return load_checkpoint(path, policy=policy, step=step)
    try:
        from jaxgpt.weights import from_hf
    except ImportError as e:
        raise GenerateError(f"--init-from {init_from!r}: loading Hugging Face weights needs "
                            f"jaxgpt.weights, which is not available ({e})") from e
    try:
        return from_hf(init_from, policy=policy)
    except (OSError, ValueError) as e:  # missing files, no network, not GPT-2, ...
        hint = (f" (for a randomly initialised {init_from!r} model use --init-from random:{init_from})"
                if init_from in PRESETS and not init_from.startswith("gpt2") else "")
        raise GenerateError(f"--init-from {init_from!r}: could not load Hugging Face weights{hint}: {e}") from e

