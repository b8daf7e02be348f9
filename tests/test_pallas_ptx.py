"""The fast set's Pallas GEMMs compiled for the H100 issue Hopper's warpgroup MMA (``wgmma.mma_async``), read from
the PTX of a compile-only build (no GPU): a change that loses it (a tile too small for a warpgroup, a layout
Triton cannot feed to wgmma) fails here, on the CPU, before a lent GPU's minutes are spent finding it slower.

gpt2 124M's widths (768, 3072, the 50,304-row lm_head: every Pallas GEMM at its default tiles) with one layer and one
row of 1024 tokens, under the fast set (benchmarks.gpu.fastset), compiled by ``python -m jaxgpt.compile`` with
``XLA_FLAGS=--xla_dump_to``: XLA writes the optimized HLO and one PTX file per kernel, a Pallas kernel's under its
``pallas_call`` name (Triton may add ``__1``, ``__2``). Skipped, with the reason, without JAX's CUDA plugin
(tests/test_compile.py's ``needs_plugin``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.test_compile import ROOT, needs_plugin

ENTRY = re.compile(r"^(?:\.visible\s+)?\.entry\s+([\w$]+)", re.M)


def _dump(tmp: Path) -> Path:
    from benchmarks.gpu import fastset

    dump = tmp / "dump"
    sets = [*fastset.compile_sets(), "model.n_layer=1", "batch_size=1", "total_batch_tokens=1024"]
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "jaxgpt.compile", "--config", "configs/gpt2-124m.yaml", "--target",
                        "h100", "--no-search", *(a for s in sets for a in ("--set", s))],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return dump


@needs_plugin
def test_every_pallas_gemm_of_the_fast_set_issues_wgmma_on_the_h100(tmp_path):
    from benchmarks.gpu import hlo_trace

    dump = _dump(tmp_path)
    (hlo_file,) = dump.glob("*gpu_after_optimizations.txt")
    mod = hlo_trace.parse(hlo_file.read_text())
    gemms = sorted({i.pallas for i in mod.instrs.values() if i.pallas.startswith(("gemm_", "gemm2_"))})
    assert len(gemms) >= 4, gemms  # the MLP's two, the lm_head's, q, k, v's forward and their input gradient's
    ptx = {}
    for f in dump.glob("*.ptx"):
        text = f.read_text()
        for entry in ENTRY.findall(text):
            ptx[hlo_trace.kernel_name(entry)] = ptx.get(hlo_trace.kernel_name(entry), "") + text
    missing = [g for g in gemms if g not in ptx]
    assert not missing, f"no PTX for {missing} among {sorted(ptx)[:20]}"
    without = [g for g in gemms if "wgmma.mma_async" not in ptx[g]]
    assert not without, f"Pallas GEMMs without Hopper's wgmma: {without}"
    # and the check can tell: the Pallas kernels without a GEMM (LayerNorm's) issue none
    others = [n for n in {i.pallas for i in mod.instrs.values() if i.pallas} if n not in gemms and n in ptx]
    assert others and all("wgmma" not in ptx[n] for n in others), others
