"""How fast can an fp32 GEMM run on this CPU at all? ``python -m benchmarks.gemm_ceiling``

The train-step tables quote jaxgpt's FLOP/s against a GEMM *probe* (the libraries' own best rate). This benchmark
asks whether those libraries leave anything on the table: it compiles ``benchmarks/kernels/fma_ceiling.c`` (gcc,
AVX2 + FMA, OpenMP) and measures, in one run, on 1 thread and on all cores:

* ``fma``: the FMA units' peak (12 independent register-only FMA chains with distinct values; no loads);
* ``kernel``: the 6x16 AVX2 microkernel that BLIS/OpenBLAS-style GEMMs are built from, on packed panels that stay
  in L1/L2: a GEMM's inner loop with no memory traffic, packing or edges. A library GEMM cannot beat it by much;
* the libraries: jax (XLA:CPU, YNNPACK) and torch fp32 2048^3 matmuls (``benchmarks.worker``'s GEMM probe).

Each figure is the best of ``--repeats`` runs. The kernel's result is checked against numpy (exact: the inputs are
small dyadic numbers). Where there is no C compiler, or the CPU is not x86-64 with AVX2 and FMA, the benchmark
says so and records a skip. Results: ``benchmarks/results/gemm_ceiling.{json,md}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

SOURCE = common.ROOT / "benchmarks" / "kernels" / "fma_ceiling.c"
KC, MR, NR, PANELS = 256, 6, 16, 16  # must match fma_ceiling.c


def unsupported() -> str | None:
    """Why the C kernels cannot run here, or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are x86-64 AVX2 code; this machine is {platform.machine()}"
    flags = common.cpu_info().get("flags")
    if flags is None:
        return "cannot read the CPU flags from /proc/cpuinfo"
    missing = [f for f in ("avx2", "fma") if not flags[f]]
    if missing:
        return f"this CPU lacks {' and '.join(missing)}"
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")):
        return "no C compiler (gcc or $CC) to build benchmarks/kernels/fma_ceiling.c"
    return None


CFLAGS = ["-O2", "-mavx2", "-mfma", "-fopenmp"]


def compiler() -> str:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or "cc"


def build() -> Path:
    """Compile the kernels once per (source, compiler, flags) into the git-ignored scratch folder."""
    cc = compiler()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *CFLAGS]).encode()).hexdigest()[:12]
    exe = common.TMP / f"fma_ceiling-{digest}"
    if not exe.exists():
        common.TMP.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")
        try:
            proc = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
        except OSError as e:
            raise RuntimeError(f"cannot run the C compiler {cc!r}: {e}") from e
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{cc} {' '.join(CFLAGS)} could not build {SOURCE.name}: {proc.stderr[-2000:]}")
        tmp.replace(exe)
    return exe


def fma_instructions() -> int:
    """FMA instructions in the compiled assembly: 12 in the microkernel's loop and 12 in the peak loop, unless the
    compiler merged chains (it does, if they start from the same value: the peak would then be overstated 12x per
    instruction counted)."""
    proc = subprocess.run([compiler(), *CFLAGS, "-S", str(SOURCE), "-o", "-"], capture_output=True, text=True,
                          check=True)
    return sum(line.strip().startswith("vfmadd") for line in proc.stdout.splitlines())


def measure(exe: Path, mode: str, threads: int, mfma: float) -> dict[str, Any]:
    """One run of the C program: ``mfma`` million FMA instructions per thread."""
    proc = subprocess.run([str(exe), mode, str(threads), str(mfma)], capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_PROC_BIND": "false"})
    return json.loads(proc.stdout)


def expected_checksum() -> float:
    """Thread 0's C after one repetition of every panel, computed by numpy from the C program's inputs."""
    import numpy as np

    a = ((np.arange(MR * KC) % 7 - 2) * 0.25).reshape(KC, MR)
    b = ((np.arange(KC * NR * PANELS) % 5 - 1) * 0.5).reshape(PANELS, KC, NR)
    return float(sum((a.T @ b[p]).sum() for p in range(PANELS)))


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may run on (cgroups, taskset)
    except AttributeError:
        return os.cpu_count() or 1


def run(*, repeats: int = 5, mfma: float = 4000.0, libraries: bool = True, log=print) -> dict[str, Any]:
    n = cores()
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "git": common.git_rev(),
                           "cpu": common.cpu_info(), "cores": n, "loadavg_start": common.loadavg(),
                           "command": common.command_line()}
    why = unsupported()
    if why is None:
        try:
            exe = build()
        except RuntimeError as e:
            why = str(e)
    if why:
        res["skipped"] = why
        log(f"gemm_ceiling not run: {why}")
        return res
    want = expected_checksum()
    for mode in ("fma", "kernel"):
        for threads in sorted({1, n}):
            runs = [measure(exe, mode, threads, mfma) for _ in range(repeats)]
            if {r["threads"] for r in runs} != {threads}:
                raise RuntimeError(f"asked OpenMP for {threads} thread(s), got {sorted({r['threads'] for r in runs})}"
                                   " (OMP_DYNAMIC / OMP_THREAD_LIMIT?)")
            if mode == "kernel":
                got = {r["checksum"] for r in runs}
                if got != {want}:
                    raise RuntimeError(f"the 6x16 kernel computed checksum {sorted(got)}, numpy says {want}: "
                                       f"the kernel is wrong, so its rate means nothing")
            best = max(r["gflops"] for r in runs)
            res[f"{mode}_gflops_{threads}t"] = best
            log(f"{mode:6s} {threads} thread(s): best {best:.1f} GFLOP/s of {repeats}")
    res["kernel_checksum"] = want
    if libraries:
        env = common.worker_env("tuned")
        res["libraries"] = {}
        for fw in ("jax", "torch"):
            spec = {"task": "gemm", "framework": fw, "sizes": [[2048, 2048, 2048]], "reps": repeats,
                    "use_library": False}
            r = common.run_worker(spec, env)
            big = (r.get("fp32_by_size") or {}).get("2048x2048x2048")
            res["libraries"][fw] = {"error": r.get("error", "no 2048^3 measurement")[-300:]} if big is None else {
                "fp32_gflops": big, "fp32_by_size": r["fp32_by_size"]}
            log(f"{fw} fp32 GEMM 2048^3: {res['libraries'][fw].get('fp32_gflops', res['libraries'][fw].get('error'))}")
    res["loadavg_end"] = common.loadavg()
    return res


def markdown(res: dict[str, Any]) -> str:
    head = (f"**GEMM ceiling**: `benchmarks/kernels/fma_ceiling.c` (gcc -O2 -mavx2 -mfma -fopenmp) and the libraries' "
            f"fp32 2048^3 matmul, best of several runs each; load avg {res['loadavg_start'][0]:.2f}; "
            f"{res['started']}, git {res['git']}.")
    if "skipped" in res:
        return head + f"\n\nNot run: {res['skipped']}."
    cores = res["cores"]
    fma, kern = res[f"fma_gflops_{cores}t"], res[f"kernel_gflops_{cores}t"]
    rows = [("FMA units, register-only (12 independent chains, no loads)", res["fma_gflops_1t"], fma),
            ("6x16 AVX2 GEMM microkernel, L1/L2-resident packed panels", res["kernel_gflops_1t"], kern)]
    lines = [head, "", f"| what | 1 thread GFLOP/s | {cores} threads GFLOP/s | of the FMA peak | of the microkernel |",
             "|---|---:|---:|---:|---:|"]
    for name, one, alln in rows:
        lines.append(f"| {name} | {one:,.0f} | {alln:,.0f} | {alln / fma:.0%} | "
                     f"{'' if alln == fma else f'{alln / kern:.0%}'} |")
    for fw, lib in res.get("libraries", {}).items():
        label = {"jax": "jax fp32 matmul 2048^3 (XLA:CPU, YNNPACK)", "torch": "torch fp32 matmul 2048^3"}[fw]
        if "error" in lib:
            lines.append(f"| {label} | | failed: {lib['error'][-100:].replace('|', '/')} | | |")
        else:
            g = lib["fp32_gflops"]
            lines.append(f"| {label} | | {g:,.0f} | {g / fma:.0%} | {g / kern:.0%} |")
    return "\n".join(lines)


def save(res: dict[str, Any], name: str = "gemm_ceiling") -> None:
    common.save_result(name, res, markdown(res))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mfma", type=float, default=4000.0, help="million FMA instructions per thread and run")
    p.add_argument("--no-libraries", action="store_true", help="only the C kernels")
    p.add_argument("--out", default="gemm_ceiling")
    a = p.parse_args(argv)
    res = run(repeats=a.repeats, mfma=a.mfma, libraries=not a.no_libraries, log=lambda s: print(s, flush=True))
    save(res, a.out)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
