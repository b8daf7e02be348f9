"""A run's checkpoint as a model, a Hugging Face directory or a torch_ref ``state_dict`` file."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from jaxgpt.checkpoint.manager import Checkpoints
from jaxgpt.config import GPTConfig, to_dict


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def load_model(run_dir: str | os.PathLike, *, step: int | None = None, policy=None,
               report: Callable[[str], None] = _stderr):
    """The GPT (jaxgpt.model) stored in a run directory's checkpoint ``step``; by default the newest intact one,
    passing over (and ``report``-ing) damaged newer steps without moving them (only training moves them). An
    explicit ``step`` that is damaged raises :class:`~jaxgpt.checkpoint.CheckpointDamaged`."""
    return load_model_and_step(run_dir, step=step, policy=policy, report=report)[0]


def load_model_and_step(run_dir: str | os.PathLike, *, step: int | None = None, policy=None,
                        report: Callable[[str], None] = _stderr):
    """:func:`load_model`, and the step it loaded."""
    from flax import nnx

    from jaxgpt.model import GPT

    with Checkpoints(run_dir, read_only=True) as ckpts:
        def abstract_params(s: int):
            config = GPTConfig.from_dict(ckpts.saved_config(s)["model"])
            abstract = nnx.eval_shape(lambda: GPT(config, policy=policy, rngs=nnx.Rngs(0)))
            return nnx.split(abstract, nnx.Param)

        if step is not None:
            graphdef, params = abstract_params(step)
            r = ckpts.restore(step, params=params)
        else:
            r = _restore_newest_params(ckpts, abstract_params, report)
            graphdef, _ = abstract_params(r.step)
        if not r.verified:
            report(f"note: checkpoint step {r.step} was saved without digests (an older jaxgpt): not verified")
    return nnx.merge(graphdef, r.params), r.step


def saved_tokenizer(run_dir: str | os.PathLike, *, step: int | None = None) -> dict | None:
    """The tokenizer record a run's checkpoint ``step`` (default: the newest readable one) was trained with
    (``meta.extra.tokenizer``); None for GPT-2 (checkpoints from before it was recorded say nothing: GPT-2)."""
    from jaxgpt.checkpoint.integrity import CheckpointDamaged

    with Checkpoints(run_dir, read_only=True) as ckpts:
        for s in [step] if step is not None else reversed(ckpts.all_steps()):
            try:
                return (ckpts.saved_meta(s).get("extra") or {}).get("tokenizer")
            except CheckpointDamaged:
                continue
    return None


def _restore_newest_params(ckpts: Checkpoints, abstract_params, report):
    from jaxgpt.checkpoint.integrity import CheckpointDamaged
    from jaxgpt.checkpoint.manager import NoCheckpointError

    skipped = []
    for s in reversed(ckpts.all_steps()):
        try:
            _, params = abstract_params(s)
            r = ckpts.restore(s, params=params)
        except CheckpointDamaged as e:
            skipped.append(e)
            report(f"warning: {e}; using an older step")
            continue
        return r
    why = "".join(f"\n  {e}" for e in skipped)
    raise NoCheckpointError(f"{ckpts.directory}: no intact checkpoint" + (why or " (none saved)"))


def export(run_dir: str | os.PathLike, *, to_hf: str | os.PathLike | None = None,
           to_torch: str | os.PathLike | None = None, step: int | None = None, overwrite: bool = False,
           report: Callable[[str], None] = _stderr) -> dict[str, Path]:
    """Write a checkpoint (default: the newest intact one) as a Hugging Face GPT-2 directory and/or a torch_ref
    ``state_dict`` file. Both targets are checked before anything is read or written
    (:func:`jaxgpt.exportdir.check_target`: new, empty or an earlier export of ours unless ``overwrite``; never
    the run directory, its checkpoints or anything already in it but an export of ours; a writable parent); each
    is written beside its target and renamed into place. Refusals and write errors are
    :class:`~jaxgpt.exportdir.ExportError`."""
    from jaxgpt import exportdir, weights

    hf = None if to_hf is None else exportdir.check_target(to_hf, kind="dir", overwrite=overwrite,
                                                           run_dir=run_dir, option="--to-hf")
    pt = None if to_torch is None else exportdir.check_target(to_torch, kind="file", overwrite=overwrite,
                                                              run_dir=run_dir, option="--to-torch")
    if hf is not None and pt is not None and (pt.resolve() == hf.resolve() or hf.resolve() in pt.resolve().parents):
        raise exportdir.ExportError(f"--to-torch {str(to_torch)!r} is inside --to-hf {str(to_hf)!r}, which the "
                                    "Hugging Face export replaces as a whole; put the state_dict elsewhere")
    model, loaded = load_model_and_step(run_dir, step=step, report=report)
    source = {"run_dir": str(Path(run_dir).absolute()), "step": loaded,
              "tokenizer": saved_tokenizer(run_dir, step=loaded)}  # (a character vocabulary travels with it)
    out: dict[str, Path] = {}
    if hf is not None:
        out["hf"] = weights.save_hf(model, hf, overwrite=True, source=source)  # the target was checked above
    if pt is not None:
        import torch

        state_dict = weights.to_torch_state_dict(model)
        need = sum(t.numel() * t.element_size() for t in state_dict.values())
        mark = exportdir.marker("torch_ref state_dict", **source, model=to_dict(model.config))  # torch_ref.load.from_export
        with exportdir.staged_file(pt, mark, need=need) as tmp:
            torch.save(state_dict, tmp)
        out["torch"] = pt
    return out
