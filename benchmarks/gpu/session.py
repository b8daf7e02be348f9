"""The GPU runbook: every measurement issue 15 asks for, in parts that each end well inside a 10-minute command
and write at most 8 files under ``$OUT`` (the device tool's limits; any GPU box works the same way).

    python -m benchmarks.gpu.session table     # gpt2 124M: jaxgpt vs torch.compile vs eager, b=16..128  (~8 min)
    python -m benchmarks.gpu.session ab        # gpt2-medium rows, then jaxgpt's one-knob A/B at b=32    (~8 min)
    python -m benchmarks.gpu.session profile   # the traced step at b=32 and its summary, e2e training   (~6 min)
    python -m benchmarks.gpu.session parity    # pytest parity_tests on the GPU (the CUDA-only tests)     (~5 min)
    python -m benchmarks.gpu.session char      # nanoGPT's GPU recipe, configs/shakespeare-char.yaml       (~2 min)
    python -m benchmarks.gpu.session compare   # the default, the fast set, torch.compile: b64, b16, profiles, recipe
                                               # (<= 540 s; benchmarks.gpu.compare)
    python -m benchmarks.gpu.session kernels   # the Pallas kernels compiled on the GPU against XLA's path (<= 300 s)
    python -m benchmarks.gpu.session compare --plan   # print the plan with each step's budget; exit 1 if over
    python -m benchmarks.gpu.session PART --dry   # the same part on the CPU at tiny shapes (tests, rehearsal)

Results go to ``$OUT`` when it is set (the device tool), else to ``benchmarks/results``; each part prints its
tables last. ``compare`` and ``kernels`` leave one tar of their run directory and a summary JSON there
(``python -m benchmarks.gpu.results unpack FILE.tar`` puts it under ``benchmarks/results/<device>-<date>/``);
docs/gpu.md says how a maintainer with a GPU runs them and brings the files back. The device image has no network and lacks a few of our packages: before a session, run
``python -m benchmarks.gpu.carry`` here (it packs their wheels into ``.whl/`` and the end-to-end run's text into
``.gpu_carry/``), then give each device call ``carry: [".whl", ".gpu_carry"]`` and a command that starts with
:data:`benchmarks.gpu.carry.DEVICE_PREFIX`, e.g.::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; \
        python3 -m benchmarks.gpu.session table

The end-to-end run's text is ``--text PATH`` (default ``../shared/data/tinyshakespeare.txt``, else
``.gpu_carry/tinyshakespeare.txt``). After a session, copy the JSON/markdown from the device's files back to
``benchmarks/results/`` and run ``python -m benchmarks.report``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common

PARTS = ("table", "ab", "profile", "parity", "char")
TEXTS = (common.ROOT.parent / "shared" / "data" / "tinyshakespeare.txt",
         common.ROOT / ".gpu_carry" / "tinyshakespeare.txt")


def commands(part: str, *, dry: bool, out: Path, text: Path | None, batch: int = 32) -> list[list[str]]:
    """The commands of one part, in order (argv lists, run from the repository root)."""
    py = [sys.executable, "-m"]
    d = ["--dry"] if dry else []
    b = 2 if dry else batch
    if part == "table":
        batches = "2,4" if dry else "16,32,64,128"
        return [[*py, "benchmarks.gpu.bench", *d, "--batches", batches, "--eager-batches",
                 batches.split(",")[0], "--medium-batch", "0", "--budget-s", "470"]]
    if part == "ab":
        return [[*py, "benchmarks.gpu.bench", *d, "--batches", "", "--eager-batches", "",
                 "--medium-batch", str(2 if dry else 16), "--out", "train_step-gpu-medium" + ("-dry" if dry else "")],
                [*py, "benchmarks.gpu.bench", "ab", *d, "--batch", str(b), "--steps", "10" if dry else "20"]]
    if part == "profile":
        if text is None:
            raise SystemExit("the profile part's end-to-end run needs a text file: --text PATH")
        # the run and its shards stay in the scratch dir (their files would overrun $OUT's 8); the metrics travel
        run, shards = common.TMP / f"e2e-run-{int(time.time())}", common.TMP / "e2e-shards"
        # e2e: gpt2-124m's recipe with 4 micro-batches of b per step (gradient accumulation), a few hundred steps
        steps, seq = ("12", "64") if dry else ("300", "1024")
        model = ["--model_preset=tiny"] if dry else []
        return [[*py, "benchmarks.gpu.profile", *d, "--batch", str(b), "--steps", "5"],
                [*py, "jaxgpt.data", "--input", str(text), "--out", str(shards), "--quiet"],
                [*py, "benchmarks.gpu.bench", *d, "--batches", str(b), "--eager-batches", "",
                 "--variants", "jax_bf16", "--medium-batch", "0", "--micro-steps", "4", "--out",
                 "train_step-gpu-e2e-harness"],
                [*py, "jaxgpt.train", "--config", str(common.ROOT / "configs" / "gpt2-124m.yaml"), *model,
                 f"--data_dir={shards}", f"--out_dir={run}", f"--batch_size={b}", f"--seq_len={seq}",
                 f"--total_batch_tokens={4 * b * int(seq)}", f"--max_steps={steps}", "--log_interval=10" if not dry
                 else "--log_interval=2", "--eval_interval=0", "--sample_interval=0", "--checkpoint_interval=0",
                 "--hellaswag_interval=0", "--precision=bf16", "--progress=false"],
                [*py, "benchmarks.gpu.e2e_check", str(run), str(out / "train_step-gpu-e2e-harness.json"),
                 "--batch", str(b), "--out", str(out / "e2e-check.json")] + (["--tolerance", "10"] if dry else []),
                ["cp", str(run / "metrics.jsonl"), str(out / "e2e-metrics.jsonl")]]
    if part == "char":
        # nanoGPT's first run on a GPU (config/train_shakespeare_char.py: best val loss 1.4697, ~3 A100 minutes):
        # the characters of the same text, 5,000 iterations; summary.json has the best val loss and the wall time
        if text is None:
            raise SystemExit("the char part needs the text of tiny Shakespeare: --text PATH")
        run, shards = common.TMP / f"char-run-{int(time.time())}", common.TMP / "char-shards"
        tiny = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--batch_size=4", "--seq_len=32",
                "--max_steps=20", "--eval_interval=10", "--eval_steps=2", "--checkpoint_interval=10",
                "--sample_len=16", "--precision=fp32"] if dry else []
        return [[*py, "jaxgpt.data", "--input", str(text), "--name", "shakespeare", "--tokenizer", "char",
                 "--out", str(shards), "--quiet"],
                [*py, "jaxgpt.train", "--config", str(common.ROOT / "configs" / "shakespeare-char.yaml"), *tiny,
                 f"--data_dir={shards}", f"--out_dir={run}", "--progress=false", "--tensorboard=false"],
                ["cp", str(run / "summary.json"), str(out / "shakespeare-char-summary.json")],
                ["cp", str(run / "metrics.jsonl"), str(out / "shakespeare-char-metrics.jsonl")],
                ["cp", str(run / "samples.txt"), str(out / "shakespeare-char-samples.txt")]]
    if part == "parity":
        return [[*py, "pytest", "-q", "-p", "no:cacheprovider", str(common.ROOT / "parity_tests"),
                 "--junitxml", str(out / "parity-junit.xml")]]
    raise SystemExit(f"unknown part {part!r}; valid: {PARTS}")


# ---- compare and kernels: budgeted parts (benchmarks.gpu.compare, benchmarks.gpu.kernel_check) ---------------
COMPARE, KERNELS = "compare", "kernels"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=(*PARTS, COMPARE, KERNELS))
    p.add_argument("--dry", action="store_true", help="on the CPU at tiny shapes")
    p.add_argument("--plan", action="store_true", help="compare / kernels: print the plan with each step's budget "
                   "and whether it fits; run nothing (exit 1 if it does not fit)")
    p.add_argument("--text", type=Path, help="the end-to-end run's training text (profile part)")
    p.add_argument("--batch", type=int, default=32, help="micro-batch of the A/B, profile and end-to-end run")
    a = p.parse_args(argv)
    text = a.text or next((t for t in TEXTS if t.exists()), None)
    command = "python -m benchmarks.gpu.session " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.plan:
        if a.part not in (COMPARE, KERNELS):
            p.error("--plan goes with compare or kernels")
        from benchmarks.gpu import budget, compare, kernel_check

        if a.part == COMPARE:
            steps, total = compare.plan(dry=a.dry, text=text or Path("TEXT"), work=common.TMP / "plan"), compare.BUDGET_S
        else:
            steps, total = kernel_check.plan(dry=a.dry, run_dir=common.TMP / "plan"), kernel_check.BUDGET_S
        print("\n".join(budget.plan_lines(steps, total)))
        return 0 if budget.planned_s(steps) <= total else 1
    out = Path(os.environ.get("OUT") or os.environ.get("JAXGPT_BENCH_RESULTS") or common.RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JAXGPT_BENCH_RESULTS": str(out), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(common.ROOT)]))}
    if a.dry:
        env["JAX_PLATFORMS"] = "cpu"
    if a.part == COMPARE:
        from benchmarks.gpu import compare

        return compare.run(dry=a.dry, out=out, text=text, command=command)
    if a.part == KERNELS:
        from benchmarks.gpu import kernel_check

        return kernel_check.run(dry=a.dry, out=out, command=command)
    failed = 0
    for cmd in commands(a.part, dry=a.dry, out=out, text=text, batch=a.batch):
        shown = " ".join(c if c else "''" for c in (["python", *cmd[1:]] if cmd[0] == sys.executable else cmd))
        print(f"\n$ {shown}", flush=True)
        t0 = time.time()
        rc = subprocess.run(cmd, cwd=common.ROOT, env=env, check=False).returncode
        print(f"[exit {rc} after {time.time() - t0:.0f} s]", flush=True)
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
