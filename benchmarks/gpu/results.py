"""Results as measured: one directory per GPU run, ``benchmarks/results/<device>-<date>/`` (``h100-2026-11-26``),
holding the run's files as the GPU wrote them and ``run.json``, what they were measured with: the device (name,
driver, memory), the jax / jaxlib / CUDA plugin / torch versions, the git revision, the host, and each command with
the files it wrote. ``python -m benchmarks.report`` renders BENCHMARKS.md from these directories.

    python -m benchmarks.gpu.results unpack h200-2026-12-01.tar   # a session's files into benchmarks/results/
    python -m benchmarks.gpu.results list                         # the runs and their files

A session part (:mod:`benchmarks.gpu.compare`, :mod:`benchmarks.gpu.kernel_check`) writes into a run directory in
the scratch space and, after every step, packs it into ``$OUT/<run>[-<part>].tar`` (one file, whatever the number
of results: the device tool brings back 8). ``unpack`` puts its members under ``benchmarks/results/<run>/``, never
over a file already there, and merges ``run.json``'s commands when two parts of one run arrive one after the other.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

RUN_JSON = "run.json"
PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt", "nvidia-cudnn-cu12",
           "nvidia-cudnn-cu13", "triton")


def short_device(name: str | None, dry: bool = False) -> str:
    """``h100``, ``h200``, ``a100`` from a GPU's name (``gpu`` for another; ``dry``: the CPU rehearsal)."""
    if dry:
        return "dry"
    k = (name or "").lower()
    return next((d for d in ("h200", "h100", "a100") if d in k), "gpu")


def run_name(device_name: str | None, date: str, dry: bool = False) -> str:
    return f"{short_device(device_name, dry)}-{date}"


def versions() -> dict[str, str]:
    """common.versions() and the GPU side's packages (JAX's CUDA plugin, cuDNN, Triton) where installed."""
    out = dict(common.versions())
    for pkg in PLUGINS:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def metadata(command: str, *, dry: bool) -> dict[str, Any]:
    """What a run is measured with (no import of jax or torch: nvidia-smi and package metadata)."""
    from benchmarks.gpu.bench import gpu_info

    gpu = gpu_info()
    date = time.strftime("%Y-%m-%d")
    return {"run": run_name(gpu.get("name"), date, dry), "dry": dry, "date": date,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": gpu or {"name": None},
            "host": common.cpu_info(), "versions": versions(),
            "git": os.environ.get("JAXGPT_GIT_REV") or common.git_rev(), "env": common.recorded_env(os.environ),
            "commands": [{"command": command, "files": []}]}


def write_meta(run_dir: Path, meta: dict[str, Any]) -> None:
    """``run.json`` with the files the directory holds now listed under the (last) command."""
    meta["commands"][-1]["files"] = sorted(p.name for p in run_dir.iterdir() if p.is_file() and p.name != RUN_JSON)
    (run_dir / RUN_JSON).write_text(json.dumps(meta, indent=1, default=str) + "\n")


def pack(run_dir: Path, tar_path: Path) -> Path:
    """The run directory as one uncompressed tar (its members under ``<run>/``), written whole or not at all."""
    tmp = tar_path.with_name(tar_path.name + ".partial")
    with tarfile.open(tmp, "w") as tar:
        for p in sorted(run_dir.iterdir()):
            if p.is_file():
                tar.add(p, arcname=f"{run_dir.name}/{p.name}")
    tmp.replace(tar_path)
    return tar_path


def unpack(tar_path: Path, root: Path) -> Path:
    """A session's tar into ``root/<run>/``: plain files one level down only, none over an existing file but
    ``run.json``, whose commands are merged (the second part of a run)."""
    with tarfile.open(tar_path) as tar:
        members = tar.getmembers()
        runs = {m.name.split("/")[0] for m in members}
        bad = [m.name for m in members if not m.isfile() or m.name.count("/") != 1 or ".." in m.name
               or m.name.startswith("/")]
        if len(runs) != 1 or bad:
            raise SystemExit(f"{tar_path}: not a session's results (one <run>/ directory of plain files): "
                             f"{sorted(runs)[:3]} {bad[:3]}")
        run = runs.pop()
        dest = root / run
        dest.mkdir(parents=True, exist_ok=True)
        clash = [m.name for m in members if (root / m.name).exists() and not m.name.endswith("/" + RUN_JSON)]
        if clash:
            raise SystemExit(f"{tar_path}: {', '.join(clash[:5])} already under {root}: move them away first (results "
                             "land as measured, never over another run's)")
        old = json.loads((dest / RUN_JSON).read_text()) if (dest / RUN_JSON).is_file() else None
        for m in members:
            data = tar.extractfile(m).read()
            (root / m.name).write_bytes(data)
    if old is not None:  # merge: the earlier part's commands first
        new = json.loads((dest / RUN_JSON).read_text())
        new["commands"] = old["commands"] + [c for c in new["commands"] if c not in old["commands"]]
        (dest / RUN_JSON).write_text(json.dumps(new, indent=1, default=str) + "\n")
    return dest


def runs(root: Path | None = None) -> list[dict[str, Any]]:
    """Every run under ``root`` (default: the results), oldest first: its ``run.json`` with ``dir`` added."""
    root = root or common.RESULTS
    out = []
    for meta in sorted(root.glob(f"*/{RUN_JSON}")):
        res = json.loads(meta.read_text())
        if not res.get("dry"):
            out.append({**res, "dir": meta.parent})
    return sorted(out, key=lambda r: (r.get("date", ""), r["dir"].name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.results", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("unpack", help="a session's tar into benchmarks/results/<run>/")
    u.add_argument("tar", type=Path)
    sub.add_parser("list", help="the runs under benchmarks/results/ and their files")
    a = p.parse_args(argv)
    if a.cmd == "unpack":
        if not a.tar.is_file():
            raise SystemExit(f"{a.tar}: no such file (the .tar a session left in $OUT)")
        dest = unpack(a.tar, common.RESULTS)
        print(f"unpacked into {common.shown(dest)}; now: python -m benchmarks.report")
        return 0
    for r in runs():
        files = sorted({f for c in r["commands"] for f in c["files"]})
        print(f"{common.shown(r['dir'])}: {r['device'].get('name')}, {r['date']}, git {r['git']}; {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
