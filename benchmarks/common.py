"""Shared plumbing for the benchmarks: the environment every variant runs under, machine/version facts,
launching one measurement in its own subprocess, and statistics.

Every measured variant runs in a fresh ``python -m benchmarks.worker`` process so that its peak RSS is its own
and no allocator or thread-pool state leaks from one variant to the next. All workers of one invocation get the
same environment (:func:`worker_env`), whichever framework they use. Every module of ``benchmarks/`` (and of
``benchmarks/gpu/``) may import this one; it imports none of them.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# JAXGPT_BENCH_RESULTS redirects the results (tests and dry runs use it so they don't overwrite committed ones)
RESULTS = Path(os.environ.get("JAXGPT_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
TMP = ROOT / "benchmarks" / "results" / "tmp"  # git-ignored scratch: init weights, shards, inductor cache

# The glibc malloc settings measured in /work/shared/notes/cpu-performance.md: one arena, no mmap for large
# blocks and never trimming, so XLA's large per-step buffers are reused instead of faulted in every step.
TUNED_GLIBC = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
ALLOCATORS = {"default": None, "tuned": TUNED_GLIBC}

# Variables that change what is measured; recorded with every result.
RECORDED_ENV = ("GLIBC_TUNABLES", "XLA_FLAGS", "JAX_PLATFORMS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                "TORCHINDUCTOR_CACHE_DIR", "TF_CPP_MIN_LOG_LEVEL", "LD_PRELOAD", "MALLOC_ARENA_MAX")


def worker_env(allocator: str, *, inductor_cache: Path | None = None) -> dict[str, str]:
    """The environment of every worker of one invocation: this process's environment with GLIBC_TUNABLES set
    (``tuned``) or removed (``default``), JAX pinned to the CPU, and a per-invocation inductor cache."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator = {allocator!r}: allowed values are {sorted(ALLOCATORS)}")
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if ALLOCATORS[allocator]:
        env["GLIBC_TUNABLES"] = ALLOCATORS[allocator]
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if inductor_cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def recorded_env(env: dict[str, str]) -> dict[str, str | None]:
    return {k: env.get(k) for k in RECORDED_ENV}


def shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (results may go elsewhere: JAXGPT_BENCH_RESULTS)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def save_result(name: str, res: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write one benchmark's result as ``<name>.json`` and its table as ``<name>.md`` under :data:`RESULTS`."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    j, m = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    j.write_text(json.dumps(res, indent=1, default=str))
    m.write_text(markdown + "\n")
    return j, m


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_worker(spec: dict[str, Any], env: dict[str, str], *, timeout: float = 1800,
               module: str = "benchmarks.worker") -> dict[str, Any]:
    """Run one measurement (``spec``) in a fresh ``python -m <module>`` subprocess (the CPU worker, or the GPU
    harness's ``benchmarks.gpu.worker``); its JSON result, or ``{"error": ...}``."""
    TMP.mkdir(parents=True, exist_ok=True)
    out = TMP / f"worker-{os.getpid()}-{time.time_ns()}.json"
    spec = {**spec, "out": str(out)}
    cmd = [sys.executable, "-m", module, json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "spec": spec}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout or "")[-3000:]
        return {"error": f"worker exited {proc.returncode}: {tail}", "spec": spec, "process_s": wall}
    result = json.loads(out.read_text())
    out.unlink(missing_ok=True)
    result["process_s"] = round(wall, 2)
    return result


def ensure_init(preset: str, overrides: dict | None = None) -> Path:
    """torch_ref's seeded initial weights for ``preset`` (with config ``overrides``), written once to the scratch
    dir (every orchestrator's variants, CPU and GPU, start from them)."""
    tag = "".join(f"-{k}={v}" for k, v in sorted((overrides or {}).items()))
    path = TMP / f"init-{preset}{tag}.npz"
    if not path.exists():
        TMP.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.stem + ".partial.npz")
        res = run_worker({"task": "init", "config": preset, "overrides": overrides or {}, "path": str(tmp)},
                         worker_env("default"))
        if "error" in res:
            raise RuntimeError(f"could not make initial weights: {res['error']}")
        tmp.replace(path)
    return path


# ---- precisions a framework cannot run here -----------------------------------------------------------------
# A (framework, dtype) whose GEMM probe reaches less than this fraction of the same framework's fp32 rate is not run:
# torch's bf16 GEMM on a CPU without avx512_bf16 or AMX (e.g. AMD Zen 3) runs at about 1 GFLOP/s against 140 in
# fp32, so one bf16 train step of the small config would take minutes, and of gpt2 124M, a quarter of an hour.
UNUSABLE_FRACTION = 0.05
QUICK_PROBE = {"task": "gemm", "sizes": [], "reps": 3, "use_library": False, "budget_s": 10}  # 512^3 only


def framework_of(variant: str) -> str:
    """The library whose kernels a benchmark variant runs on: ``jax`` or ``torch`` (torch_ref and transformers)."""
    return "jax" if variant.startswith("jax_") else "torch"


def precision_of(variant: str) -> str:
    return "bf16" if "bf16" in variant else "fp32"


def unusable_precisions(gemm: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """``{(framework, dtype): why}`` for every framework/dtype the GEMM probes in ``gemm`` found unusable (below
    :data:`UNUSABLE_FRACTION` of that framework's fp32 rate); each ``why`` gives the rates."""
    out = {}
    for fw in ("jax", "torch"):
        runs = [g for g in gemm if g.get("framework") == fw and "error" not in g]
        if not runs:
            continue
        fp32 = max(g["fp32_gflops"] for g in runs)
        bf16 = max(g["bf16_gflops"] for g in runs)
        if bf16 < UNUSABLE_FRACTION * fp32:
            out[(fw, "bf16")] = (f"{fw}'s bf16 GEMM runs at {bf16:.1f} GFLOP/s on this CPU against {fp32:.0f} in "
                                 f"fp32 ({100 * bf16 / fp32:.1f}%: no native bf16 dot here)")
    return out


def probe_precisions(env: dict[str, str], frameworks: set[str], log=print) -> list[dict[str, Any]]:
    """Quick GEMM probes (512^3, a few seconds each) of ``frameworks``, for :func:`unusable_precisions` when the
    full probe is not run."""
    out = []
    for fw in sorted(frameworks):
        res = run_worker({**QUICK_PROBE, "framework": fw}, env, timeout=300)
        if "error" in res:
            log(f"  quick gemm probe {fw}: ERROR {res['error'][-300:]}")
        out.append(res)
    return out


def unusable_variants(variants: list[str], env: dict[str, str], gemm: list[dict[str, Any]] | None = None,
                      log=print) -> dict[str, str]:
    """``{variant: why}`` for the variants whose framework/precision this machine cannot run in reasonable time
    (:func:`unusable_precisions`), judged from the GEMM probes in ``gemm`` where a framework has an error-free one,
    else from a quick probe (:func:`probe_precisions`) of each framework a bf16 variant needs."""
    frameworks = {framework_of(v) for v in variants if precision_of(v) == "bf16"}
    probed = [g for g in gemm or [] if "error" not in g]
    missing = frameworks - {g.get("framework") for g in probed}
    unusable = unusable_precisions(probed + (probe_precisions(env, missing, log=log) if missing else []))
    skip = {v: unusable[key] for v in variants if (key := (framework_of(v), precision_of(v))) in unusable}
    for v, why in skip.items():
        log(f"  {v}: not run: {why}")
    return skip


def skipped_row(why: str) -> dict[str, Any]:
    """A result row for a variant that was not run because its precision is unusable here (see
    :func:`unusable_precisions`): it counts as unavailable wherever a failed row does, but is no failure."""
    return {"error": f"not run: {why}", "skipped": True}


def failed(row: dict[str, Any]) -> bool:
    """A row that errored (a skipped row is not a failure)."""
    return "error" in row and not row.get("skipped")


# ---- statistics ----------------------------------------------------------------------------------------------
def summarize(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


# ---- machine and versions ------------------------------------------------------------------------------------
def cpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cores": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    first = text.split("\n\n")[0]
    fields = dict(re.findall(r"^([^\t:]+?)\s*:\s*(.*)$", first, flags=re.M))
    flags = set(fields.get("flags", "").split())
    info.update({
        "model_name": fields.get("model name"),
        "vendor": fields.get("vendor_id"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "hypervisor": "hypervisor" in flags,
        "flags": {f: f in flags for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
                                          "amx_bf16", "amx_tile", "amx_int8")},
    })
    try:
        mem_kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        info["mem_gib"] = round(mem_kb / 2**20, 1)
    except (OSError, AttributeError):
        pass
    return info


def versions() -> dict[str, str]:
    """Package versions, read from metadata (no import of jax or torch in the orchestrating process)."""
    from importlib import metadata

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        out["glibc"] = platform.libc_ver()[1]
    except Exception:  # pragma: no cover
        pass
    return out


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def dirty_files() -> list[str]:
    """Library files that differ from HEAD (or are untracked) while measuring: results then describe the working
    tree, not the commit."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "jaxgpt", "torch_ref"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10).stdout
        return [line[3:] for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


def command_line() -> str:
    """The command this process runs as ``python -m benchmarks.<module> <args>`` (``benchmarks.gpu.bench`` for
    a module of a subpackage)."""
    args = " ".join(sys.argv[1:])
    path = Path(sys.argv[0]).resolve().with_suffix("")
    try:
        mod = ".".join(path.relative_to(ROOT / "benchmarks").parts)
    except ValueError:
        mod = path.name
    return f"python -m benchmarks.{mod} {args}".strip()


def fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}"
