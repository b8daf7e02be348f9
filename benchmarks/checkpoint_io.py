"""What checkpoint digests cost: ``python -m benchmarks.checkpoint_io [--preset gpt2] [--repeats 3]``.

Saves and restores a checkpoint of a model's fp32 params and AdamW state (gpt2 124M: 124M params, 1.49 GB in
all) through :class:`jaxgpt.checkpoint.Checkpoints`, and times, in the same process and alternating:

* a save (``save`` + ``wait``: the digests, the device-to-host copy, orbax's writes and commit);
* a verified restore (orbax's reads + the digests + the comparison);
* :func:`jaxgpt.checkpoint.tree_digests` of fresh copies of the same trees alone (not yet read from the host, as
  a training step's outputs are): what the digests add to each.

Prints a table and writes ``benchmarks/results/checkpoint_io.{json,md}``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common


def measure(preset: str, repeats: int) -> dict[str, Any]:
    import jax
    from flax import nnx

    from jaxgpt.checkpoint import Checkpoints, tree_digests
    from jaxgpt.config import GPTConfig, to_dict
    from jaxgpt.model import GPT
    from jaxgpt.optim import OptimConfig, make_optimizer

    cfg = GPTConfig.preset(preset)
    params = nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    opt_state = make_optimizer(OptimConfig()).init(params)
    trees = (params, opt_state)
    jax.block_until_ready(trees)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(trees))
    tree_digests(params), tree_digests(opt_state)  # compile once
    rows: dict[str, list[float]] = {"save": [], "restore (verified)": [], "digests": []}
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-io-", dir=common.TMP if common.TMP.exists() else None))
    try:
        for i in range(repeats):
            run = tmp / f"run{i}"
            with Checkpoints(run, keep=1) as c:
                t0 = time.perf_counter()
                c.save(1, params=params, opt_state=opt_state, config={"model": to_dict(cfg), "optim": {"name": "adamw"}})
                c.wait()
                rows["save"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                r = c.restore(1, params=params, opt_state=opt_state)
                jax.block_until_ready((r.params, r.opt_state))
                rows["restore (verified)"].append(time.perf_counter() - t0)
            fresh = jax.block_until_ready(jax.tree.map(lambda a: a + 0, trees))  # not yet on the host, as in training
            t0 = time.perf_counter()
            tree_digests(fresh[0]), tree_digests(fresh[1])
            rows["digests"].append(time.perf_counter() - t0)
            del fresh
            shutil.rmtree(run)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: common.summarize(v)["median"] for k, v in rows.items()}
    return {"preset": preset, "bytes": nbytes, "repeats": repeats, "seconds": rows, "median_s": med,
            "digest_share_of_save": med["digests"] / med["save"],
            "digest_share_of_restore": med["digests"] / med["restore (verified)"],
            "digest_gb_per_s": nbytes / med["digests"] / 1e9,
            "cpu": common.cpu_info(), "versions": common.versions(), "command": common.command_line()}


def markdown(res: dict[str, Any]) -> str:
    m = res["median_s"]
    cpu = res["cpu"].get("model_name") or "?"
    return "\n".join([
        f"**checkpoint digests**: {res['preset']} params + AdamW state ({res['bytes'] / 1e9:.2f} GB), median of "
        f"{res['repeats']}, on {cpu} (`{res['command']}`)",
        "",
        "| | seconds | digests' share |",
        "|---|---:|---:|",
        f"| save (digests + host copy + orbax write + commit) | {m['save']:.2f} | {res['digest_share_of_save']:.1%} |",
        f"| restore, verified (orbax read + digests) | {m['restore (verified)']:.2f} | "
        f"{res['digest_share_of_restore']:.1%} |",
        f"| the digests alone ({res['digest_gb_per_s']:.1f} GB/s) | {m['digests']:.2f} | |",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_io", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    res = measure(args.preset, args.repeats)
    md = markdown(res)
    common.save_result("checkpoint_io", res, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
