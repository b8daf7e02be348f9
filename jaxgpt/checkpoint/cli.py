"""``python -m jaxgpt.checkpoint``: list a run's checkpoints with their state, export one."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jaxgpt.checkpoint.export import export
from jaxgpt.checkpoint.integrity import CheckpointDamaged
from jaxgpt.checkpoint.manager import ASIDE, Checkpoints
from jaxgpt.config import ConfigError
from jaxgpt.exportdir import ExportError


def _run_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    if args.run_dir_pos and args.run_dir and args.run_dir_pos != args.run_dir:
        parser.error(f"two run directories given: {args.run_dir_pos!r} and --run-dir {args.run_dir!r}")
    run_dir = args.run_dir or args.run_dir_pos
    if not run_dir:
        parser.error("give the run directory: RUN_DIR or --run-dir RUN_DIR")
    return run_dir


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _interrupted_export(targets: dict[str, str | None], before: dict[str, tuple[int, int] | None]) -> Exception:
    """What a Ctrl-C during an export leaves: each export is renamed into place whole (a new directory or file:
    a new inode), so a target whose inode changed was completed by this command."""
    from jaxgpt.interrupt import Interrupted

    done = [f"{opt} {path}" for opt, path in targets.items() if path and _identity(path) not in (None, before[opt])]
    if not done:
        return KeyboardInterrupt()
    rest = [f"{opt} {path}" for opt, path in targets.items() if path and f"{opt} {path}" not in done]
    return Interrupted(f"the export to {' and '.join(done)} was completed" + (
        f"; {', '.join(rest)} was not written (staged beside its target and removed; anything there before is "
        "untouched)" if rest else ""))


def _format_extra(extra: dict) -> str:
    keys = [k for k in ("loss", "val_loss") if isinstance(extra.get(k), (int, float))]
    return "  ".join(f"{k} {extra[k]:.4f}" for k in keys)


def list_steps(run_dir: str) -> int:
    """Print each step's state; 0 if the newest complete step is intact, 1 if it is not (or none is)."""
    with Checkpoints(run_dir, read_only=True) as ckpts:
        rows = ckpts.states()
        aside = {kind: ckpts.set_aside(kind) for kind in ASIDE}
    if not rows:
        print(f"{ckpts.directory}: no checkpoints")
    for r in rows:
        print(f"{r.step:>8}  {r.state:<10}  {_format_extra(r.extra)}" + (f"  ({r.reason})" if r.reason else ""))
    for kind, paths in aside.items():
        for p in paths:
            print(f"{'':>8}  {kind:<10}  {p}")
    complete = [r for r in rows if r.state != "incomplete"]
    return 0 if complete and complete[-1].state in ("ok", "unverified") else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxgpt.checkpoint",
                                     description="List a training run's checkpoints, or export one.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="each checkpoint step and its state: ok, unverified (saved without digests), "
                        "damaged (why), incomplete (an interrupted save); steps moved aside. Reads and verifies "
                        "every array. Exit 1 if the newest complete step is not intact")
    ex = sub.add_parser("export", help="export a checkpoint (default: the newest intact one) to Hugging Face "
                        "and/or torch_ref format")
    for p in (ls, ex):
        p.add_argument("run_dir_pos", nargs="?", metavar="RUN_DIR", help="the training run directory")
        p.add_argument("--run-dir", help="the same, as an option")
    ex.add_argument("--step", type=int, default=None, help="this step only (an error if it is damaged)")
    ex.add_argument("--to-hf", metavar="DIR", help="write a Hugging Face GPT-2 directory here (with tokenizer files)")
    ex.add_argument("--to-torch", metavar="FILE", help="write a torch_ref state_dict (torch.save) here")
    ex.add_argument("--overwrite", action="store_true",
                    help="replace a target that is not an earlier export of ours, or one to which files were "
                    "added (never the run directory, its checkpoints or anything already in it)")
    args = parser.parse_args(argv)
    run_dir = _run_dir(parser, args)
    if not os.path.exists(run_dir):  # a typo of a run directory: said as such, with the nearest one
        from jaxgpt.localpath import no_such_directory

        print(f"error: run directory {run_dir}: {no_such_directory(run_dir)}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "list":
            return list_steps(run_dir)
        if not (args.to_hf or args.to_torch):
            parser.error("export needs --to-hf DIR and/or --to-torch FILE")
        targets = {"--to-hf": args.to_hf, "--to-torch": args.to_torch}
        before = {opt: _identity(path) for opt, path in targets.items() if path}
        try:
            written = export(run_dir, to_hf=args.to_hf, to_torch=args.to_torch, step=args.step,
                             overwrite=args.overwrite)
        except KeyboardInterrupt:  # Ctrl-C: say which exports were already renamed into place
            raise _interrupted_export(targets, before) from None
        for kind, path in written.items():
            print(f"wrote {kind}: {path}")
        return 0
    except (ConfigError, ExportError, CheckpointDamaged, OSError, ValueError) as e:  # all name the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
