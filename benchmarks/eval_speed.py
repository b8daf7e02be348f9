"""HellaSwag scoring speed: ``python -m benchmarks.eval_speed [--preset gpt2] [--items 64] [--repeats 3]``.

Items per second of HellaSwag-format items (a context of ~20-60 tokens and four endings of ~5-35 tokens, made up
here from a fixed word list: the lengths are realistic, the text is not the dataset) on a random-init model of
``--preset``'s shape, in fp32, each variant in a fresh process, measured side by side in one run:

* ``jaxgpt``: :class:`jaxgpt.eval.hellaswag.Scorer` (8 items per jitted call: each context once, its four endings
  against its KV cache, the lm_head only where an ending token is predicted);
* ``torch_ref``: :func:`torch_ref.eval.ending_losses` one item (4 rows) at a time, as build-nanogpt evaluates;
* ``torch_ref-batched``: the same function on 8 items (32 rows) per call, padded to the batch's longest row.

The first pass over the items (compilation, warm-up) is not timed; the figure is the median of ``--repeats``
timed passes. Prints a table and writes ``benchmarks/results/eval_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks import common

WORDS = ("the a man woman dog child chef car house water street park ball road light door table window garden "
         "city river music book game kitchen friend teacher morning evening walks runs opens closes takes puts "
         "looks turns picks holds starts stops laughs waits carefully slowly quickly again then into onto over "
         "under with without before after because while small large old new red blue green quiet loud").split()
VARIANTS = ("jaxgpt", "torch_ref", "torch_ref-batched")
BATCH_ITEMS = 8


def make_items(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    text = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    return [{"ind": i, "ctx": text(rng.randint(15, 50)).capitalize() + ".",
             "endings": [text(rng.randint(4, 30)) + "." for _ in range(4)], "label": rng.randrange(4)}
            for i in range(n)]


def run_variant(variant: str, preset: str, n_items: int, repeats: int) -> dict[str, Any]:
    import jax
    import numpy as np
    import torch

    from jaxgpt.config import GPTConfig
    from jaxgpt.eval import hellaswag
    from jaxgpt.tokenizer import encode

    items = hellaswag.parse([json.dumps(d) for d in make_items(n_items)])
    cfg = GPTConfig.preset(preset)
    torch.set_num_threads(torch.get_num_threads())
    if variant == "jaxgpt":
        from flax import nnx

        from jaxgpt.model import GPT
        from jaxgpt.precision import Policy

        scorer = hellaswag.Scorer(GPT(cfg, policy=Policy.fp32(), rngs=nnx.Rngs(0)), batch_size=BATCH_ITEMS)
        one_pass = lambda: scorer.score(items)  # noqa: E731
    else:
        from torch_ref.eval import ending_losses
        from torch_ref.model import GPT as TorchGPT

        model = TorchGPT(cfg).eval()
        per_call = 1 if variant == "torch_ref" else BATCH_ITEMS

        def one_pass():
            for s in range(0, len(items), per_call):
                batch = items[s : s + per_call]
                rendered = [hellaswag.render(it, encode, cfg.block_size) for it in batch]
                rows = [r for rs, _, _ in rendered for r in rs]
                ctx = [c for _, c, _ in rendered for _ in range(4)]
                tokens, mask = hellaswag.pad(rows, ctx, max(map(len, rows)), len(rows))
                ending_losses(model, torch.from_numpy(tokens).long(), torch.from_numpy(mask))

    t0 = time.perf_counter()
    one_pass()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    del jax, np
    return {"variant": variant, "items": len(items), "first_pass_s": first, "times_s": times,
            "items_per_s": len(items) / med}


def measure(preset: str, n_items: int, repeats: int) -> dict[str, Any]:
    env = common.worker_env("tuned")
    rows = []
    for v in VARIANTS:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.eval_speed", "--worker", v, "--preset", preset,
                               "--items", str(n_items), "--repeats", str(repeats)], env=env, cwd=common.ROOT,
                              capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"variant {v} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    by = {r["variant"]: r for r in rows}
    fastest_torch = max(("torch_ref", "torch_ref-batched"), key=lambda v: by[v]["items_per_s"])
    return {"preset": preset, "rows": rows, "fastest_torch": fastest_torch,
            "ratio": by["jaxgpt"]["items_per_s"] / by[fastest_torch]["items_per_s"],
            "cpu": common.cpu_info(), "versions": common.versions(), "command": common.command_line(),
            "loadavg": common.loadavg()}


def markdown(res: dict[str, Any]) -> str:
    lines = [f"**HellaSwag scoring**: {res['preset']} shapes, random weights, fp32, {res['rows'][0]['items']} items, "
             f"on {res['cpu'].get('model_name') or '?'} ({res['cpu'].get('cores')} cores; `{res['command']}`)", "",
             "| variant | items/s | first pass (s) |", "|---|---:|---:|"]
    lines += [f"| {r['variant']} | {r['items_per_s']:.2f} | {r['first_pass_s']:.1f} |" for r in res["rows"]]
    lines += ["", f"jaxgpt / fastest torch_ref ({res['fastest_torch']}): **{res['ratio']:.2f}x** (target >= 1.2x)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eval_speed", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--items", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(run_variant(args.worker, args.preset, args.items, args.repeats)))
        return 0
    res = measure(args.preset, args.items, args.repeats)
    md = markdown(res)
    common.save_result("eval_speed", res, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
