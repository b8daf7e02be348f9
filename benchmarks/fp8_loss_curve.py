"""fp8 against bf16 on nanoGPT's CPU char recipe: the same model, init and data order, two precisions.

    python -m benchmarks.fp8_loss_curve                 # the committed run: 2,000 steps, 5 runs, ~30 min here
    python -m benchmarks.fp8_loss_curve --render RESULT.json   # only rewrite the .md and .png from a finished run

Every run is ``python -m jaxgpt.train --config configs/shakespeare-char-cpu.yaml`` (4 layers, 4 heads, 128 wide,
64-character context, 12 rows per step, AdamW as nanoGPT's CPU line) with ``--precision`` bf16 or fp8 and
``--fp8_gemms`` naming the e4m3 GEMMs (``all``: the attention projections, the MLP and the tied lm_head; ``lm_head``:
the lm_head alone). A run's ``seed`` draws both its initial weights and its batches, so bf16 and fp8 at one seed
start from the same weights and see the same batches in the same order: their curves differ by the precision only.

The yardstick is bf16 against itself: bf16 also runs at further seeds, and the spread of its final val loss over
its seeds (max - min) is how far two equally good bf16 runs land apart. The bound: fp8's final val loss is within
that spread of bf16's at the same seed (``|fp8 - bf16| <= max - min of bf16 over its seeds``). With 3 seeds the
range is a small-sample estimate (the range of 3 draws is ~1.7 sigma of one run on average); it is the measured
one, not tuned. Also reported: the largest |fp8 - bf16| at any evaluation, and at how many evaluations the gap lies
within that evaluation's bf16 seed range.

Evaluations: the recipe's own (the first 20 sequential val batches, 15,360 characters, the same every time), every
``--eval-interval`` steps. Train losses: the mean of each window of ``--train-window`` steps (from metrics.jsonl,
every step logged). Writes ``benchmarks/results/fp8-loss-curve.{json,md,png}`` (JAXGPT_BENCH_RESULTS or ``--out``
redirects them) and keeps the runs under ``--runs-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import common

CONFIG = common.ROOT / "configs" / "shakespeare-char-cpu.yaml"
NAME = "fp8-loss-curve"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--train-window", type=int, default=25, help="steps per point of the train-loss curve")
    p.add_argument("--seeds", default="1337,1338,1339",
                   help="bf16 runs at each; fp8 at the first (>= 2 seeds: the bound is bf16's seed-to-seed range)")
    p.add_argument("--fp8-gemms", default="all,lm_head", help="one fp8 run per TrainConfig.fp8_gemms value")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="more jaxgpt.train overrides for every run (e.g. model.n_layer=1 for a quick check)")
    p.add_argument("--git-rev", default=None,
                   help="the commit the code was exported from, when run from an export (default: git rev-parse)")
    p.add_argument("--in-process", action="store_true",
                   help="call jaxgpt.train.main in this process instead of a subprocess per run (tests)")
    p.add_argument("--runs-dir", type=Path, default=common.ROOT / "runs" / NAME)
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results (JAXGPT_BENCH_RESULTS)")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="only rewrite the .md and .png in --out from a finished run's JSON")
    args = p.parse_args(argv)
    if len(args.seeds.split(",")) < 2 and args.render is None:
        p.error("--seeds needs at least two seeds: the bound is bf16's seed-to-seed range")
    return args


# ---- the runs ---------------------------------------------------------------------------------------------
def plan(seeds: list[int], fp8_gemms: list[str]) -> list[dict[str, Any]]:
    """The runs, in order: bf16 and each fp8 setting at the first seed, then bf16 at the other seeds."""
    first = [{"name": f"bf16 seed {seeds[0]}", "precision": "bf16", "fp8_gemms": None, "seed": seeds[0]}]
    first += [{"name": f"fp8 {g} seed {seeds[0]}", "precision": "fp8", "fp8_gemms": g, "seed": seeds[0]}
              for g in fp8_gemms]
    return first + [{"name": f"bf16 seed {s}", "precision": "bf16", "fp8_gemms": None, "seed": s} for s in seeds[1:]]


def train_cmd(run: dict[str, Any], args: argparse.Namespace, out_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "jaxgpt.train", "--config", str(args.config), f"--precision={run['precision']}",
           f"--seed={run['seed']}", f"--max_steps={args.steps}", f"--optim.decay_steps={args.steps}",
           f"--eval_interval={args.eval_interval}", "--log_interval=1", "--checkpoint_interval=0",
           "--keep_best_checkpoint=false", "--sample_interval=-1", "--progress=false", "--tensorboard=false",
           "--plot=false", f"--out_dir={out_dir}", "--resume=never"]
    if run["fp8_gemms"]:
        cmd.append(f"--fp8_gemms={run['fp8_gemms']}")
    return cmd + [f"--{kv}" for kv in args.set]


def curves(run_dir: Path, window: int) -> tuple[list[list[float]], list[list[float]]]:
    """(val curve [[step, loss], ...], train curve [[last step of the window, mean loss], ...]) of a run."""
    from jaxgpt.train.metrics import read_metrics

    rows = read_metrics(run_dir)
    val = [[r["step"], r["val_loss"]] for r in rows if r["type"] == "eval"]
    train = [(r["step"], r["loss"]) for r in rows if r["type"] == "train"]
    pts = [[train[i + window - 1][0], statistics.fmean(v for _, v in train[i:i + window])]
           for i in range(0, len(train) - window + 1, window)]
    return val, pts


def run_one(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out_dir = args.runs_dir / run["name"].replace(" ", "-")
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "PYTHONUNBUFFERED": "1"}
    load, done = [common.loadavg()], threading.Event()

    def watch() -> None:
        while not done.wait(30):
            load.append(common.loadavg())

    threading.Thread(target=watch, daemon=True).start()
    cmd = train_cmd(run, args, out_dir)
    t0 = time.perf_counter()
    if args.in_process:
        from jaxgpt.train import main as train_main

        rc, err = train_main(cmd[3:]), "(its output above)"
    else:
        proc = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True)
        rc, err = proc.returncode, proc.stderr[-3000:]
    wall = time.perf_counter() - t0
    done.set()
    load.append(common.loadavg())
    if rc != 0:
        raise SystemExit(f"error: run {run['name']!r} exited {rc}:\n{err}")
    val, train = curves(out_dir, args.train_window)
    summary = json.loads((out_dir / "summary.json").read_text())
    one = [x[0] for x in load]
    return {**run, "val": val, "train": train, "final_val": val[-1][1], "wall_s": wall,
            "tokens_per_s": summary.get("tokens_per_s"), "loadavg_1min_mean": statistics.fmean(one),
            "run_dir": common.shown(out_dir)}


# ---- the bound --------------------------------------------------------------------------------------------
def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison of every fp8 run with bf16 at its seed, against bf16's seed-to-seed range (see the module
    docstring). ``runs``: run records with ``precision``, ``fp8_gemms``, ``seed`` and ``val`` ([[step, loss], ...])."""
    bf16 = {r["seed"]: r for r in runs if r["precision"] == "bf16"}
    if len(bf16) < 2:
        raise ValueError("the bound needs bf16 runs at >= 2 seeds (their val-loss range is the yardstick)")
    finals = [r["val"][-1][1] for r in bf16.values()]
    spread = max(finals) - min(finals)
    steps = [s for s, _ in next(iter(bf16.values()))["val"]]
    if any([s for s, _ in r["val"]] != steps for r in runs):
        raise ValueError("the runs were not evaluated at the same steps")
    range_at = [max(r["val"][i][1] for r in bf16.values()) - min(r["val"][i][1] for r in bf16.values())
                for i in range(len(steps))]
    out: dict[str, Any] = {"bf16_seeds": sorted(bf16), "bf16_final_val": {str(s): r["val"][-1][1]
                                                                           for s, r in sorted(bf16.items())},
                           "bf16_seed_range": spread, "bf16_seed_range_at": range_at, "steps": steps, "fp8": {}}
    for r in runs:
        if r["precision"] != "fp8":
            continue
        ref = bf16.get(r["seed"])
        if ref is None:
            raise ValueError(f"fp8 run at seed {r['seed']} has no bf16 run at that seed")
        gaps = [a[1] - b[1] for a, b in zip(r["val"], ref["val"])]
        worst = max(range(1, len(gaps)), key=lambda i: abs(gaps[i])) if len(gaps) > 1 else 0
        out["fp8"][r["fp8_gemms"]] = {
            "seed": r["seed"], "final_val": r["val"][-1][1], "bf16_final_val": ref["val"][-1][1],
            "final_gap": gaps[-1], "gaps": gaps, "max_abs_gap": abs(gaps[worst]), "max_abs_gap_step": steps[worst],
            "evals_within_range": sum(abs(g) <= w for g, w in zip(gaps[1:], range_at[1:])),
            "evals": len(gaps) - 1, "bound": spread, "holds": abs(gaps[-1]) <= spread,
        }
    return out


# ---- outputs ----------------------------------------------------------------------------------------------
def markdown(res: dict[str, Any]) -> str:
    v, a = res["verdict"], res["args"]
    cpu = res["cpu"].get("model_name") or "CPU"
    flags = res["cpu"].get("flags", {})
    cpu += " (" + ", ".join(f"{f} {'yes' if flags.get(f) else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16",
                                                                               "amx_bf16")) + ")"
    lines = [
        f"`{res['command']}` (git {res['git']}"
        + (", run from `git archive` of that commit (plus this script): the shared tree's uncommitted edits could not reach the runs"
           if a.get("git_rev") else "") + f"): `{Path(a['config']).name}` "
        + (f"with {', '.join(a['set'])}" if a.get("set") else "(nanoGPT's CPU char recipe: 4 layers, 4 heads, 128 "
           "wide, 64 characters x 12 rows per step)")
        + f" for {a['steps']:,} steps at each precision, from the "
        "same initial weights and the same batches per seed; val loss on the first `eval_steps` sequential val "
        "batches (20 in the recipe: 15,360 characters, the same every time) every "
        f"{a['eval_interval']} steps. CPU: {cpu}, {res['cpu'].get('cores')} cores shared with other jobs; "
        f"{res['seconds'] / 60:.0f} min in all. Measured, on the CPU (fp8 numerics, not fp8 speed: e4m3 GEMMs are "
        "emulated here; tokens/s and wall time follow the shared machine's load, which changed between the runs).",
        "",
        "| run | final val loss | fp8 - bf16 (same seed) | max abs gap (step) | evals within bf16's seed range | "
        "bound holds | tokens/s | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        f = v["fp8"].get(r["fp8_gemms"]) if r["precision"] == "fp8" else None
        gap = (f"{f['final_gap']:+.4f} | {f['max_abs_gap']:.4f} ({f['max_abs_gap_step']}) | "
               f"{f['evals_within_range']} of {f['evals']} | {'yes' if f['holds'] else 'NO'}") if f else "| | |"
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "?"
        lines.append(f"| {r['name']} | {r['final_val']:.4f} | {gap} | {tps} | {r['wall_s'] / 60:.1f} min "
                     f"(load {r['loadavg_1min_mean']:.1f}) |")
    finals = ", ".join(f"{x:.4f}" for x in v["bf16_final_val"].values())
    lines += [
        "",
        f"The bound: |fp8 - bf16| in final val loss <= bf16's own seed-to-seed range, {v['bf16_seed_range']:.4f} "
        f"(final val loss {finals} at seeds {', '.join(map(str, v['bf16_seeds']))}): "
        + "; ".join(f"fp8_gemms={g}: {'holds' if f['holds'] else 'does NOT hold'} ({abs(f['final_gap']):.4f} "
                    f"{'<=' if f['holds'] else '>'} {f['bound']:.4f})" for g, f in v["fp8"].items()) + ".",
        "",
        f"![val loss, fp8 against bf16](benchmarks/results/{NAME}.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gx) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"bf16": "tab:blue", "all": "tab:red", "lm_head": "tab:orange", "mlp": "tab:green",
              "mlp+lm_head": "tab:purple"}
    first = res["verdict"]["bf16_seeds"][0]
    for r in res["runs"]:
        key = "bf16" if r["precision"] == "bf16" else r["fp8_gemms"]
        main = r["seed"] == first or r["precision"] == "fp8"
        style = dict(color=colors.get(key, "black"), alpha=1.0 if main else 0.45, lw=1.4 if main else 0.9,
                     ls="-" if main else "--")
        s, l = zip(*r["val"][1:])
        ax.plot(s, l, marker="o", ms=2.5, label=r["name"], **style)
        ts, tl = zip(*r["train"])
        ax.plot(ts, tl, lw=0.6, color=style["color"], alpha=0.35 * style["alpha"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/char); faint: train, window means")
    ax.set_ylim(top=max(l for r in res["runs"] for _, l in r["val"][1:]) + 0.05)  # step 0 (ln 65) off the top
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    v = res["verdict"]
    steps = v["steps"][1:]
    gx.fill_between(steps, [-w for w in v["bf16_seed_range_at"][1:]], v["bf16_seed_range_at"][1:], color="tab:blue",
                    alpha=0.15, label="+- bf16's seed range")
    for g, f in v["fp8"].items():
        gx.plot(steps, f["gaps"][1:], marker="o", ms=2.5, color=colors.get(g, "black"), label=f"fp8 {g} - bf16")
    gx.axhline(0, color="gray", lw=0.8)
    gx.set_xlabel("step")
    gx.set_ylabel("val loss difference")
    gx.legend(fontsize=7)
    gx.grid(alpha=0.3)
    fig.suptitle(f"fp8 against bf16, char tiny Shakespeare ({res['cpu'].get('model_name') or 'CPU'})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(res: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(res)
    (out / f"{NAME}.md").write_text(md)
    plot(res, out / f"{NAME}.png")
    print(md)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out or common.RESULTS
    if args.render is not None:
        write_outputs(json.loads(args.render.read_text()), out)
        return 0
    git = args.git_rev or common.git_rev()  # at the start: the code the runs import
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.perf_counter()
    runs = []
    for run in plan(seeds, [g for g in args.fp8_gemms.split(",") if g]):
        r = run_one(run, args)
        runs.append(r)
        print(f"{r['name']}: final val {r['final_val']:.4f}, {r['wall_s']:.0f} s (total "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
    res = {"verdict": verdict(runs), "runs": runs, "cpu": common.cpu_info(), "versions": common.versions(),
           "git": git, "seconds": time.perf_counter() - t0,
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "command": "python -m benchmarks.fp8_loss_curve " + " ".join(argv if argv is not None else sys.argv[1:])}
    res["command"] = res["command"].rstrip()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(res, indent=1) + "\n")
    write_outputs(res, out)
    return 0 if all(f["holds"] for f in res["verdict"]["fp8"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
