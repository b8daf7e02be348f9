"""Record healthy runs' per-step losses and gradient norms into tests/data/healthy_runs.json, the evidence that
jaxgpt.train.guard's default factors never fire on them (tests/test_guard.py).

    python tests/data/record_healthy_runs.py NAME=RUN_DIR [NAME=RUN_DIR ...]
    python tests/data/record_healthy_runs.py --add NAME=RUN_DIR ...   # keep the recorded runs of other names

For each run: every train record's loss and grad norm, and the largest ratio of a step's value to the median
of the preceding ``spike_window`` values (the guard's rule), with the step where it occurred.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path

from jaxgpt.train import TrainConfig, read_metrics

OUT = Path(__file__).resolve().parent / "healthy_runs.json"


def max_ratio(values: list[float], window: int) -> tuple[float, int]:
    best, at = 0.0, 0
    for i in range(1, len(values)):
        ratio = values[i] / statistics.median(values[max(0, i - window):i])
        if ratio > best:
            best, at = ratio, i + 1
    return best, at


def record(name: str, run_dir: Path, window: int) -> dict:
    train = [r for r in read_metrics(run_dir) if r["type"] == "train"]
    steps = [r["step"] for r in train]
    if steps != list(range(1, len(steps) + 1)):
        raise SystemExit(f"{run_dir}: log every step (log_interval: 1) from step 1; got steps {steps[:5]}...")
    loss, norm = [r["loss"] for r in train], [r["grad_norm"] for r in train]
    (lr_, l_at), (gr, g_at) = max_ratio(loss, window), max_ratio(norm, window)
    return {"name": name, "steps": len(train), "max_loss_ratio": round(lr_, 4),
            "max_loss_ratio_step": l_at, "max_grad_norm_ratio": round(gr, 4), "max_grad_norm_ratio_step": g_at,
            "loss": loss, "grad_norm": norm}


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main(argv: list[str]) -> None:
    add = argv[:1] == ["--add"]
    window = TrainConfig.load(overrides={}).spike_window
    runs = [record(name, Path(d), window) for name, _, d in (a.partition("=") for a in argv[add:])]
    source = f"tests/data/record_healthy_runs.py, spike_window {window}, on {_cpu_model()} ({platform.machine()})"
    if add and OUT.exists():
        old = json.loads(OUT.read_text())
        new_names = {r["name"] for r in runs}
        runs = [r for r in old["runs"] if r["name"] not in new_names] + runs
        source = f"{old['source']}; {', '.join(sorted(new_names))} added by the same script on {_cpu_model()}"
    OUT.write_text(json.dumps({"source": source, "runs": runs}) + "\n")
    for r in runs:
        print(f"{r['name']}: {r['steps']} steps, max loss ratio {r['max_loss_ratio']} (step "
              f"{r['max_loss_ratio_step']}), max grad-norm ratio {r['max_grad_norm_ratio']} (step "
              f"{r['max_grad_norm_ratio_step']})")


if __name__ == "__main__":
    main(sys.argv[1:])
