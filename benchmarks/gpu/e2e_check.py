"""Does ``python -m jaxgpt.train`` run as fast as the benchmark says? Compare a run's ``metrics.jsonl`` with a
harness row at the same micro-batch.

    python -m benchmarks.gpu.e2e_check RUN_DIR HARNESS_JSON [--batch 32] [--tolerance 0.05]

The run's figure is the median over its train records after the first ``--skip`` (the cold compile and the
first log intervals); the harness's is the ``jax_bf16`` row of ``train_step-gpu-*.json`` (or of ``gpu-ab.json``'s
default knob) at ``--batch``. Exit 0 when tokens/s and MFU agree within ``--tolerance`` (relative), 1 otherwise.
Gradient accumulation runs ``micro_steps`` micro-batches per optimizer step, so the run's tokens/s per micro-batch
is the comparable figure: both count every token the step trained on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def run_figures(run_dir: Path, skip: int = 2) -> dict[str, float | None]:
    from jaxgpt.train import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("type") == "train"]
    if len(rows) <= skip:
        raise SystemExit(f"{run_dir}: {len(rows)} train records in metrics.jsonl; need more than --skip {skip}")
    rows = rows[skip:]
    mfus = [r["mfu"] for r in rows if r.get("mfu") is not None]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "mfu": statistics.median(mfus) if mfus else None, "records": len(rows),
            "steps": [rows[0]["step"], rows[-1]["step"]]}


def harness_figures(path: Path, batch: int, micro_steps: int = 4) -> dict[str, Any]:
    res = json.loads(Path(path).read_text())
    rows = [r for r in res.get("rows", []) if r.get("batch") == batch and "error" not in r
            and r.get("micro_steps", 1) == micro_steps
            and r.get("variant") == "jax_bf16" and r.get("shape", "gpt2") == "gpt2" and r.get("knob", "default") == "default"]
    if not rows:
        raise SystemExit(f"{path}: no jax_bf16 gpt2 row at micro-batch {batch} x {micro_steps} micro-steps that ran")
    return {"tokens_per_s": rows[0]["tokens_per_s"], "mfu": rows[0]["mfu"]}


def compare(run: dict[str, Any], harness: dict[str, Any], tolerance: float) -> dict[str, Any]:
    out: dict[str, Any] = {"run": run, "harness": harness, "tolerance": tolerance}
    for k in ("tokens_per_s", "mfu"):
        if run.get(k) is None or harness.get(k) is None:  # MFU: no peak for this device in one of them
            out[f"{k}_ratio"], out[f"{k}_ok"] = None, k == "mfu"
            continue
        ratio = run[k] / harness[k]
        out[f"{k}_ratio"], out[f"{k}_ok"] = ratio, abs(ratio - 1) <= tolerance
    out["ok"] = bool(out["tokens_per_s_ok"] and out["mfu_ok"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("harness_json", type=Path)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro-steps", type=int, default=4, help="the harness row's micro-steps (the run's accumulation)")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--skip", type=int, default=2, help="train records to leave out at the start")
    p.add_argument("--out", type=Path, help="write the comparison as JSON here")
    a = p.parse_args(argv)
    res = compare(run_figures(a.run_dir, a.skip), harness_figures(a.harness_json, a.batch, a.micro_steps), a.tolerance)
    def fmt(x, pct=False):
        return "-" if x is None else (f"{100 * x:.1f}%" if pct else f"{x:,.0f}")
    print(f"train run  {fmt(res['run']['tokens_per_s'])} tok/s, MFU {fmt(res['run']['mfu'], True)} "
          f"(median of {res['run']['records']} records, steps {res['run']['steps'][0]}-{res['run']['steps'][1]})")
    print(f"harness    {fmt(res['harness']['tokens_per_s'])} tok/s, MFU {fmt(res['harness']['mfu'], True)} "
          f"(jax_bf16, micro-batch {a.batch} x {a.micro_steps} micro-steps)")
    r = res["tokens_per_s_ratio"]
    print(f"{'OK' if res['ok'] else 'DIFFERENT'}: run / harness tokens/s = {r:.3f} (tolerance {a.tolerance:.0%})"
          if r is not None else "DIFFERENT: no tokens/s to compare")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
