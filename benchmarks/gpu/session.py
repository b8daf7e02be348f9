"""The GPU runbook: every measurement issue 15 asks for, in parts that each end well inside a 10-minute command
and write at most 8 files under ``$OUT`` (the device tool's limits; any GPU box works the same way).

    python -m benchmarks.gpu.session table     # gpt2 124M: jaxgpt vs torch.compile vs eager, b=16..128  (~8 min)
    python -m benchmarks.gpu.session ab        # gpt2-medium rows, then jaxgpt's one-knob A/B at b=32    (~8 min)
    python -m benchmarks.gpu.session profile   # the traced step at b=32 and its summary, e2e training   (~6 min)
    python -m benchmarks.gpu.session parity    # pytest parity_tests on the GPU (the CUDA-only tests)     (~5 min)
    python -m benchmarks.gpu.session char      # nanoGPT's GPU recipe, configs/shakespeare-char.yaml       (~2 min)
    python -m benchmarks.gpu.session compare   # issue 32: b64/b16 vs torch.compile, both profiles, recipe (~7 min)
    python -m benchmarks.gpu.session PART --dry   # the same part on the CPU at tiny shapes (tests, rehearsal)

Results go to ``$OUT`` when it is set (the device tool), else to ``benchmarks/results``; each part prints its
tables last. The device image has no network and lacks a few of our packages: before a session, run
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
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
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


# ---- compare: everything issue 32 changes, measured in one budgeted command ----------------------------------
COMPARE = "compare"
FASTEST = "jax_bf16_fast"  # benchmarks.gpu.worker's variant: issue 32's Pallas kernels, bf16 logits and h
COMPARE_BUDGET_S = 560.0  # the device tool's command limit is 600 s; the rest is Python's start and the copy back
SLACK_S = 2.0  # set aside per later step beyond its need: a killed step's exit, a process start
COMPARE_FILES = 8  # bench 2 (json, md), jaxgpt's profile 4 (json, md, hlo, trace), torch's profile 1, this part's 1
_TRIPLE = ("import pathlib, sys; t = pathlib.Path(sys.argv[1]).read_text(); d = pathlib.Path(sys.argv[2]); "
           "d.mkdir(parents=True, exist_ok=True); [(d / f'ts-{i}.txt').write_text(t) for i in range(3)]")


@dataclass(frozen=True)
class Step:
    """One command of a budgeted part: it gets at most ``cap_s`` seconds and is not started with less than
    ``need_s`` left."""

    name: str
    argv: list[str]
    cap_s: float
    need_s: float


def compare_steps(*, dry: bool, text: Path | None, stamp: str = "") -> list[Step]:
    """The compare part in priority order (seconds are an H100's: the table ran in 191 s, jaxgpt's b64 compile in
    15 s, torch.compile's cold b64 step in 37 s, the recipe's 10 steps in 64 s, on 2026-11-26; the table's
    fastest-set rows (b64 and b16), not yet run, are budgeted at about a jaxgpt row's 25-30 s each, hence its 210 s
    bench budget and 300 s cap). ``--dry``: the same on the CPU at tiny shapes, torch eager instead of torch.compile
    (inductor's C++ compile takes minutes)."""
    if text is None:
        raise SystemExit("the compare part's recipe run needs a text file: --text PATH")
    py = [sys.executable, "-m"]
    d = ["--dry"] if dry else []
    # --dry: one tiny batch, jaxgpt and torch eager (its default suite's test must stay short)
    b64, batches = (2, "2") if dry else (64, "64,16")
    # beside the default and torch.compile: the bf16 program with the Pallas LayerNorm and GEMM kernels (layer_norm:
    # pallas, gelu: pallas-gemm) and bf16 logits, the opt-in set issue 32 predicts fastest, so one lent GPU measures
    # it in the same command
    torch_rows = (["--variants", f"jax_bf16,{FASTEST}", "--eager-batches", "2"] if dry else
                  ["--variants", f"jax_bf16,torch_compile_bf16,{FASTEST}", "--eager-batches", ""])
    # the recipe: tiny Shakespeare x 3 (912,668 train tokens: more than one 524,288-token step), as on 2026-11-26
    texts, shards = common.TMP / f"compare-text{stamp}", common.TMP / f"compare-shards{stamp}"
    run = common.TMP / f"compare-run{stamp}"
    recipe = (["--model_preset=tiny", "--batch_size=2", "--seq_len=64", "--total_batch_tokens=256", "--max_steps=2",
               "--sample_interval=0", "--checkpoint_interval=1"] if dry else
              ["--max_steps=10", "--sample_interval=10", "--checkpoint_interval=5"])
    return [
        Step("table", [*py, "benchmarks.gpu.bench", *d, "--batches", batches, *torch_rows,
                       "--medium-batch", "0", "--budget-s", "210", "--steps", "5" if dry else "20"],
             cap_s=300, need_s=150),
        Step("jaxgpt profile", [*py, "benchmarks.gpu.profile", *d, "--batch", str(b64),
                                "--steps", "2" if dry else "4"], cap_s=120, need_s=60),
        Step("torch profile", [*py, "benchmarks.gpu.torch_profile", *d, "--batch", str(b64),
                               "--steps", "2" if dry else "3"], cap_s=120, need_s=60),
        Step("recipe text", [sys.executable, "-c", _TRIPLE, str(text), str(texts)], cap_s=15, need_s=5),
        Step("recipe shards", [*py, "jaxgpt.data", "--input", *(str(texts / f"ts-{i}.txt") for i in range(3)),
                               "--out", str(shards), "--quiet"], cap_s=60, need_s=20),
        Step("recipe", [*py, "jaxgpt.train", "--config", str(common.ROOT / "configs" / "gpt2-124m.yaml"), *recipe,
                        f"--data_dir={shards}", f"--out_dir={run}", "--eval_interval=0", "--hellaswag_interval=0",
                        "--progress=false", "--log_interval=1"], cap_s=150, need_s=80),
    ]


def run_budgeted(steps: list[Step], *, budget_s: float, env: dict[str, str], log=print,
                 after=lambda record: None) -> list[dict]:
    """Run ``steps`` in order within ``budget_s`` seconds. Each gets its cap, cut to what is left once the later
    steps' needs (and :data:`SLACK_S` each) are set aside, but never below its own need (earlier steps come
    first), and is killed at that timeout; a step with less than its need left is skipped. One record per step
    (status ok / failed / timed out / skipped, seconds, the timeout it had); ``after`` sees each as it is made."""
    started, records = time.monotonic(), []
    for i, step in enumerate(steps):
        left = budget_s - (time.monotonic() - started)
        reserve = sum(s.need_s + SLACK_S for s in steps[i + 1:])
        timeout = min(step.cap_s, max(step.need_s, left - reserve), left)
        rec = {"step": step.name, "command": _shown(step.argv), "cap_s": step.cap_s, "need_s": step.need_s,
               "left_s": round(left, 1), "timeout_s": round(timeout, 1)}
        if left < step.need_s:
            rec.update(status="skipped", seconds=0.0, why=f"{left:.0f} s of the {budget_s:.0f} s budget left; "
                       f"it needs {step.need_s:.0f}")
        else:
            log(f"\n$ {rec['command']}   [{step.name}: up to {timeout:.0f} s]")
            t0 = time.monotonic()
            try:
                rc = subprocess.run(step.argv, cwd=common.ROOT, env=env, check=False, timeout=timeout).returncode
                rec.update(status="ok" if rc == 0 else "failed", rc=rc)
            except subprocess.TimeoutExpired:
                rec.update(status="timed out", rc=None)
            rec["seconds"] = round(time.monotonic() - t0, 1)
            log(f"[{step.name}: {rec['status']} after {rec['seconds']:.0f} s]")
        records.append(rec)
        after(rec)
    return records


def _shown(argv: list[str]) -> str:
    return " ".join(c if c else "''" for c in (["python", *argv[1:]] if argv[0] == sys.executable else argv))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()] if path.is_file() else []


def compare(*, dry: bool, out: Path, text: Path | None, env: dict[str, str], budget_s: float = COMPARE_BUDGET_S,
            steps: list[Step] | None = None, log=print) -> int:
    """Run the compare part; ``session-compare[-dry].json`` under ``out`` holds each step's record (rewritten
    after every step), the recipe's metrics and summary, and the result files' names. 0 when every step ran ok."""
    stamp = f"-{int(time.time())}"
    steps = steps if steps is not None else compare_steps(dry=dry, text=text, stamp=stamp)
    path = out / f"session-compare{'-dry' if dry else ''}.json"
    res = {"part": COMPARE, "dry": dry, "budget_s": budget_s, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "git": os.environ.get("JAXGPT_GIT_REV") or common.git_rev(), "steps": []}

    def save(rec=None):
        if rec is not None:
            res["steps"].append(rec)
        run = next((Path(a.split("=", 1)[1]) for s in steps for a in s.argv if a.startswith("--out_dir=")), None)
        if run is not None:
            res["recipe"] = {"run_dir": common.shown(run), "metrics": _jsonl(run / "metrics.jsonl"),
                             "summary": json.loads((run / "summary.json").read_text())
                             if (run / "summary.json").is_file() else None}
        res["files"] = sorted(p.name for p in out.iterdir() if p.is_file() and p != path) + [path.name]
        path.write_text(json.dumps(res, indent=1, default=str))

    save()
    run_budgeted(steps, budget_s=budget_s, env=env, log=log, after=save)
    log("\n| step | status | seconds | timeout s |\n|---|---|---:|---:|")
    for r in res["steps"]:
        log(f"| {r['step']} | {r['status']}{' (rc ' + str(r['rc']) + ')' if r.get('rc') else ''} | "
            f"{r['seconds']:.0f} | {r['timeout_s']:.0f} |")
    used = sum(r["seconds"] for r in res["steps"])
    log(f"{used:.0f} s of the {budget_s:.0f} s budget; {len(res['files'])} files in {out}: {', '.join(res['files'])}")
    if len(res["files"]) > COMPARE_FILES:
        log(f"WARNING: {len(res['files'])} files in {out}, more than the {COMPARE_FILES} the device tool brings back")
    return 0 if all(r["status"] == "ok" for r in res["steps"]) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=(*PARTS, COMPARE))
    p.add_argument("--dry", action="store_true", help="on the CPU at tiny shapes")
    p.add_argument("--text", type=Path, help="the end-to-end run's training text (profile part)")
    p.add_argument("--batch", type=int, default=32, help="micro-batch of the A/B, profile and end-to-end run")
    a = p.parse_args(argv)
    out = Path(os.environ.get("OUT") or os.environ.get("JAXGPT_BENCH_RESULTS") or common.RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    text = a.text or next((t for t in TEXTS if t.exists()), None)
    env = {**os.environ, "JAXGPT_BENCH_RESULTS": str(out), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(common.ROOT)]))}
    if a.dry:
        env["JAX_PLATFORMS"] = "cpu"
    if a.part == COMPARE:
        return compare(dry=a.dry, out=out, text=text, env=env)
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
