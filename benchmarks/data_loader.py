"""Data loader throughput: ``jaxgpt.data.DataLoader`` batches per second on memory-mapped uint16 shards.

    python -m benchmarks.data_loader

The shards are synthetic (uniform random GPT-2 ids, written with ``jaxgpt.data.write_shard``: 2 shards of 4M
tokens, 16 MB) so the benchmark needs no corpus; the loader reads them exactly as it reads a prepared corpus.
Each (mode, shape) runs in its own subprocess after 5 untimed batches; tokens/s = batches x batch x seq / s.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from benchmarks import common

CASES = [("sequential", 8, 256), ("random", 8, 256), ("sequential", 1, 1024), ("random", 4, 256)]
SHARD_TOKENS = 4_000_000


def ensure_shards() -> str:
    out = common.TMP / "data-shards"
    if not (out / "bench_train_000001.json").exists():
        from jaxgpt.data import write_shard

        out.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        for i in range(2):
            write_shard(out, "bench", "train", i, rng.integers(0, 50257, SHARD_TOKENS, dtype=np.uint16),
                        {"source": "benchmarks synthetic uniform ids"})
    return str(out)


def run(*, batches: int, allocator: str, log=print) -> dict[str, Any]:
    data = ensure_shards()
    env = common.worker_env(allocator)
    rows = []
    for mode, b, t in CASES:
        res = common.run_worker({"task": "data", "data": data, "mode": mode, "batch": b, "seq": t,
                                 "batches": batches}, env)
        rows.append(res)
        if "error" in res:
            log(f"  {mode} {b}x{t}: ERROR {res['error'][-500:]}")
        else:
            log(f"  {mode:10s} {b}x{t}: {res['tokens_per_s'] / 1e6:8.1f} M tok/s")
    return {"benchmark": "data_loader", "rows": rows, "batches": batches, "allocator": allocator,
            "machine": common.cpu_info(), "versions": common.versions(), "env": common.recorded_env(env),
            "git": common.git_rev(), "loadavg": common.loadavg(), "command": common.command_line(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def markdown(res: dict[str, Any]) -> str:
    lines = [f"**data loader**: `jaxgpt.data.DataLoader`, synthetic uint16 shards (2 x {SHARD_TOKENS:,} tokens), "
             f"{res['batches']} timed `next_batch()` calls per case; load avg {res['loadavg'][0]:.2f}; "
             f"{res['started']}, git {res['git']}.", "",
             "| mode | batch x seq | tokens/s | batches/s |", "|---|---|---:|---:|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| error | {r['error'][-150:].replace(chr(10), ' ').replace('|', '/')} | | |")
        else:
            lines.append(f"| {r['mode']} | {r['batch']} x {r['seq']} | {r['tokens_per_s'] / 1e6:,.1f} M "
                         f"| {r['batches'] / r['seconds']:,.0f} |")
    return "\n".join(lines)


def save(res: dict[str, Any], name: str = "data_loader") -> None:
    common.save_result(name, res, markdown(res))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--allocator", default="tuned", choices=sorted(common.ALLOCATORS))
    p.add_argument("--out", default="data_loader")
    a = p.parse_args(argv)
    res = run(batches=a.batches, allocator=a.allocator, log=lambda s: print(s, flush=True))
    save(res, a.out)
    print(markdown(res))
    return 0 if all("error" not in r for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
