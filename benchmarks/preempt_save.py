"""How long a SIGTERM costs: a real ``python -m jaxgpt.train`` per model (tiny, small, gpt2 124M), SIGTERM once
it has trained a step, then the time from the signal to the process's exit, and the save's own time as the
trainer reports it ("saved checkpoint step N in X s": the checks, the save and its commit).

The batch is one row of 64 tokens (the state saved is the full model and AdamW state whatever the batch; the
check before the save is one forward pass over the next batch, so on a GPU with a real batch it takes
milliseconds, on this CPU it is a small part). ``eval_interval: 0`` so the check compiles the eval step at the
signal: the worst case (a run that already evaluated has it compiled). Must fit a 30 s grace period.

    python -m benchmarks.preempt_save [--models tiny small gpt2] [--eval-compiled] [--out-dir /tmp/preempt-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(model: str, out_dir: Path, *, eval_compiled: bool = False) -> dict:
    run = out_dir / model
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "jaxgpt.train", "--config", str(REPO / "configs/tiny-test.yaml"),
           f"--model_preset={model}", "--batch_size=1", "--seq_len=64", "--total_batch_tokens=null",
           "--max_steps=100000", f"--eval_interval={100000 - 1 if eval_compiled else 0}", "--checkpoint_interval=0", "--sample_interval=-1",
           "--optim.decay_steps=100000", f"--data_dir={REPO / 'data_cache' / 'shakespeare'}", f"--out_dir={run}",
           "--progress=false", "--plot=false"]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count('"type": "train"') >= 2:
            break
        time.sleep(0.05)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    exit_s = time.perf_counter() - t0
    m = re.search(r"saved checkpoint step (\d+) in ([\d.]+) s", out)
    ckpt = run / "checkpoints" / (m.group(1) if m else "?")
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.is_dir() else None
    return {"model": model, "eval_step_compiled_before": eval_compiled, "exit_code": proc.returncode, "signal_to_exit_s": round(exit_s, 2),
            "save_s": float(m.group(2)) if m else None, "checkpoint_bytes": size,
            "tail": None if m else out[-1500:]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["tiny", "small", "gpt2"])
    p.add_argument("--out-dir", default="/tmp/jaxgpt-preempt-bench")
    p.add_argument("--eval-compiled", action="store_true",
                   help="evaluate at step 0 (eval_interval > 0), so the check at the signal finds its step compiled")
    args = p.parse_args()
    for model in args.models:
        r = one(model, Path(args.out_dir), eval_compiled=args.eval_compiled)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
