"""nanoGPT's first run, reproduced: character-level tiny Shakespeare in jaxgpt and torch_ref from the same start.

    python -m benchmarks.shakespeare_char run      # both runs of configs/shakespeare-char-cpu.yaml, one after the other
    python -m benchmarks.shakespeare_char report   # the JSON, the PNG and the BENCHMARKS.md table from the two runs

``run`` trains ``python -m jaxgpt.train --config configs/shakespeare-char-cpu.yaml`` (out_dir
runs/shakespeare-char-cpu) and then ``python -m torch_ref.train`` on the same config (runs/shakespeare-char-cpu-torch:
the same initial weights, batches, schedule and evaluations), timing each and sampling /proc/loadavg every 30 s;
each run directory gets ``wall.json`` (wall seconds, load averages, the CPU). ``report`` reads the two runs'
metrics, evaluates jaxgpt's final checkpoint on the whole val split (the runs' evaluations use its first 20 batches,
as nanoGPT's use 20 random ones), and writes ``benchmarks/results/shakespeare-char-cpu.{json,png}``. ``--config``
names another recipe (configs/shakespeare-char.yaml on a GPU: ``--nanogpt 1.4697``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import common

CPU_CONFIG = common.ROOT / "configs" / "shakespeare-char-cpu.yaml"
NANOGPT = {"shakespeare-char-cpu": 1.88, "shakespeare-char": 1.4697}  # its README's losses
NANOGPT_MINUTES = {"shakespeare-char-cpu": 3.0, "shakespeare-char": 3.0}  # "about 3 minutes" (laptop CPU / A100)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return f"{fields.get('Model name', '?').strip()} ({fields.get('CPU(s)', '?').strip()} cores; family " \
               f"{fields.get('CPU family', '?').strip()} model {fields.get('Model', '?').strip()})"
    except OSError:
        return platform.processor() or "?"


def loadavg() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


def timed(cmd: list[str], run_dir: Path, env: dict[str, str]) -> dict:
    """Run ``cmd``, sampling the load average every 30 s; write and return ``run_dir/wall.json``."""
    samples, done = [loadavg()], threading.Event()

    def watch() -> None:
        while not done.wait(30):
            samples.append(loadavg())

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.time()
    rc = subprocess.run(cmd, cwd=common.ROOT, env=env, check=False).returncode
    wall = time.time() - t0
    done.set()
    samples.append(loadavg())
    one = [s[0] for s in samples]
    rec = {"command": " ".join(cmd[1:]), "exit": rc, "wall_s": wall, "cpu": cpu_name(),
           "loadavg_1min_mean": sum(one) / len(one), "loadavg_1min_min": min(one), "loadavg_1min_max": max(one),
           "env": {k: env[k] for k in ("OMP_NUM_THREADS", "JAX_PLATFORMS") if k in env}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "wall.json").write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def run(config: Path) -> None:
    name = config.stem
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "PYTHONUNBUFFERED": "1"}
    jax_dir, torch_dir = common.ROOT / "runs" / name, common.ROOT / "runs" / f"{name}-torch"
    for d, cmd in ((jax_dir, [sys.executable, "-m", "jaxgpt.train", "--config", str(config), "--progress=false",
                              f"--out_dir={jax_dir}", "--resume=never"]),
                   (torch_dir, [sys.executable, "-m", "torch_ref.train", "--config", str(config),
                                f"--out_dir={torch_dir}"])):
        rec = timed(cmd, d, env)
        print(f"{rec['command']}: exit {rec['exit']}, {rec['wall_s']:.0f} s wall, load average "
              f"{rec['loadavg_1min_mean']:.1f} on {rec['cpu']}", flush=True)


def curve(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["val_loss"]) for r in rows if r.get("type") == "eval"]


def samples(run_dir: Path) -> list[str]:
    text = (run_dir / "samples.txt").read_text()
    return [s.split("---\n", 1)[1].strip("\n") for s in text.split("--- sample ")[1:]]


def full_val_loss(run_dir: Path, data_dir: str) -> float:
    """jaxgpt's final checkpoint on the whole val split (sequential windows of the recipe's shape)."""
    from jaxgpt.eval import val_loss
    from jaxgpt.generate import load_model, load_tokenizer
    from jaxgpt.precision import Policy

    model = load_model(str(run_dir), policy=Policy.named("fp32"))
    r = val_loss.evaluate(model, data_dir, batch_size=12, seq_len=model.config.block_size,
                          tokenizer=load_tokenizer(str(run_dir)).record())
    return r["loss"]


def eval_noise(run_dir: Path, data_dir: str, batches: int, draws: int = 30) -> dict:
    """nanoGPT's estimate of the val loss: the mean of ``batches`` random val batches; its spread over ``draws``
    draws for jaxgpt's final checkpoint (what one evaluation of nanoGPT's may land on)."""
    import statistics

    import jax
    from flax import nnx

    from jaxgpt.data import DataLoader
    from jaxgpt.generate import load_model
    from jaxgpt.precision import Policy

    model = load_model(str(run_dir), policy=Policy.named("fp32"))
    graphdef, state = nnx.split(model)
    loss = jax.jit(lambda state, x, y: nnx.merge(graphdef, state).token_losses(x, y)[0].mean())
    means = []
    for seed in range(draws):
        loader = DataLoader(data_dir, "val", 12, model.config.block_size, mode="random", seed=1000 + seed)
        means.append(sum(float(loss(state, *loader.next_batch())) for _ in range(batches)) / batches)
    return {"batches": batches, "draws": draws, "mean": statistics.mean(means), "std": statistics.stdev(means),
            "min": min(means), "max": max(means)}


def report(config: Path, nanogpt: float) -> dict:
    from jaxgpt.train import TrainConfig

    name, cfg = config.stem, TrainConfig.load(config)
    dirs = {"jaxgpt": common.ROOT / "runs" / name, "torch_ref": common.ROOT / "runs" / f"{name}-torch"}
    res = {"config": str(config.relative_to(common.ROOT)), "nanogpt_val_loss": nanogpt,
           "nanogpt_minutes": NANOGPT_MINUTES.get(name), "runs": {}}
    for who, d in dirs.items():
        c = curve(d)
        best = min(c, key=lambda sv: sv[1])
        wall = json.loads((d / "wall.json").read_text()) if (d / "wall.json").exists() else {}
        res["runs"][who] = {"run_dir": str(d.relative_to(common.ROOT)), "val_curve": c, "best_val_loss": best[1],
                            "best_val_step": best[0], "final_val_loss": c[-1][1], "wall": wall,
                            "samples": samples(d)}
    res["runs"]["jaxgpt"]["final_val_loss_whole_split"] = full_val_loss(dirs["jaxgpt"], cfg.resolved_data_dir())
    res["nanogpt_style_eval"] = eval_noise(dirs["jaxgpt"], cfg.resolved_data_dir(), cfg.eval_steps)
    if (d := common.ROOT / "runs" / f"{name}-retime").exists():  # `run` again later, on a quieter machine
        res["rerun"] = rerun_record(d)
    a, b = (dict(res["runs"][w]["val_curve"]) for w in ("jaxgpt", "torch_ref"))
    res["max_val_diff"] = max(abs(a[s] - b[s]) for s in a if s in b)
    out = common.RESULTS / f"{name}.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, common.RESULTS / f"{name}.png", name)
    (common.RESULTS / f"{name}.md").write_text(section(res, name) + "\n")
    print(markdown(res))
    return res


def rerun_record(d: Path) -> dict:
    c = curve(d)
    return {"run_dir": str(d.relative_to(common.ROOT)), "best_val_loss": min(v for _, v in c),
            "final_val_loss": c[-1][1],
            "wall": json.loads((d / "wall.json").read_text()), "samples_identical": samples(d) == samples(
                common.ROOT / "runs" / d.name.removesuffix("-retime"))}


def plot(res: dict, path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for who, style in (("jaxgpt", dict(lw=2.5, color="C0")), ("torch_ref", dict(lw=1.2, ls="--", color="C3",
                                                                                  marker="o", ms=3))):
        steps, losses = zip(*res["runs"][who]["val_curve"])
        ax.plot(steps, losses, label=f"{who} (best {res['runs'][who]['best_val_loss']:.4f})", **style)
    ax.axhline(res["nanogpt_val_loss"], color="gray", lw=1, ls=":", label=f"nanoGPT's {res['nanogpt_val_loss']}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("val loss (nats/char)")
    ax.set_ylim(1.5, 2.6 if name.endswith("cpu") else 2.2)
    ax.set_title(f"{name}: same init and batches, jaxgpt vs torch_ref")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def markdown(res: dict) -> str:
    rows = ["| run | best val loss (step) | final val loss | vs nanoGPT's | wall time | load average (1 min) |",
            "|---|---|---|---|---|---|"]
    for who, r in res["runs"].items():
        w = r["wall"]
        rows.append(f"| {who} | {r['best_val_loss']:.4f} ({r['best_val_step']}) | {r['final_val_loss']:.4f} | "
                    f"{r['best_val_loss'] - res['nanogpt_val_loss']:+.4f} | "
                    + (f"{w['wall_s'] / 60:.1f} min | {w['loadavg_1min_mean']:.1f} (min {w['loadavg_1min_min']:.1f},"
                       f" max {w['loadavg_1min_max']:.1f}) |" if w else "? | ? |"))
    if res.get("rerun"):
        r, w = res["rerun"], res["rerun"]["wall"]
        rows.append(f"| jaxgpt, run again later | {r['best_val_loss']:.4f} (2000) | {r['final_val_loss']:.4f} | "
                    f"{r['best_val_loss'] - res['nanogpt_val_loss']:+.4f} | {w['wall_s'] / 60:.1f} min | "
                    f"{w['loadavg_1min_mean']:.1f} (min {w['loadavg_1min_min']:.1f}, "
                    f"max {w['loadavg_1min_max']:.1f}) |")
    rows.append(f"| nanoGPT (its README) | {res['nanogpt_val_loss']} | | | about {res['nanogpt_minutes']:g} min | |")
    return "\n".join(rows)


def section(res: dict, name: str) -> str:
    """BENCHMARKS.md's section (benchmarks/report.py includes this file as it is)."""
    j, t, noise = res["runs"]["jaxgpt"], res["runs"]["torch_ref"], res["nanogpt_style_eval"]
    w = j["wall"]
    first = lambda r: r["samples"][0][:400].rstrip()  # noqa: E731
    return "\n".join([
        f"`{res['config']}` (nanoGPT's CPU line, every value's source named in the file) run to the end by "
        "`python -m jaxgpt.train` and by `python -m torch_ref.train` on the same shards, from the same initial "
        "weights (jaxgpt's init of seed 1337, copied), on the same batches (jaxgpt's loader, same seed), with the same "
        "schedule and evaluations (the first 20 sequential val batches at every 250th step), fp32 in both. "
        f"CPU: {w.get('cpu', '?')}, 2 cores shared with four other engineers' test runs: the wall times were "
        "**measured under load** (load average in the table; an idle machine would be several times faster: a "
        "prediction, not measured). torch_ref ran with one thread (`OMP_NUM_THREADS=1`; two threads were 4x slower "
        "per step under this load), its first 16 minutes beside the jaxgpt run.", "",
        markdown(res), "",
        f"![val loss of jaxgpt and torch_ref](benchmarks/results/{name}.png)", "",
        f"The two curves agree to {res['max_val_diff']:.1e} at every evaluation (the same recipe, step by step: "
        "`parity_tests/test_train_parity.py::test_char_model_nanogpt_recipe_20_steps` checks its first 20 steps to "
        "1e-5 in the loss). Both land "
        f"{j['best_val_loss'] - res['nanogpt_val_loss']:+.3f} from nanoGPT's 1.88, inside the issue's bound of 1.95 "
        "(`tests/test_chars.py::test_cpu_recipe_reaches_nanogpts_loss`, slow). Why not 1.88 exactly:", "",
        f"- **Which val batches.** jaxgpt evaluates the same first 20 batches (the first 15,360 of the 111,540 val "
        f"characters) every time; on the whole val split jaxgpt's final model scores "
        f"{j['final_val_loss_whole_split']:.4f}. nanoGPT draws 20 random batches per evaluation: for jaxgpt's final "
        f"model, {noise['draws']} such draws give {noise['mean']:.4f} +- {noise['std']:.4f} (min {noise['min']:.4f}, "
        f"max {noise['max']:.4f}), so nanoGPT's single 1.88 carries a few hundredths of sampling noise (a best "
        "over its 9 evaluations also favours low draws).",
        "- **One run each.** 1.88 is one run of nanoGPT's (seed 1337 in torch's generator); ours is one run from "
        "another draw of the same initial distributions (normal 0.02, residual projections 0.02/sqrt(2 n_layer)). "
        "The run-to-run spread over seeds was not measured here.",
        "- **Small recipe differences.** nanoGPT takes 2,001 updates (iterations 0-2000) to our 2,000; its warmup is "
        "lr (it+1)/(warmup+1) where ours (build-nanogpt's) is lr (step+1)/warmup (1% apart, first 100 steps only); "
        "its GELU is exact (`nn.GELU()`) where GPT-2's and ours is the tanh approximation. Their effects were not "
        "measured separately.", "",
        f"Samples at step {j['val_curve'][-1][0]} (prompt \"\\n\", temperature 0.8, top-k 200, as nanoGPT's "
        "sample.py):", "",
        "jaxgpt:", "", "```", first(j), "```", "", "torch_ref:", "", "```", first(t), "```", "",
        "**The GPU recipe** (`configs/shakespeare-char.yaml`, nanoGPT's 1.4697 in about 3 A100 minutes) is the "
        "`char` part of the device session script (`python -m benchmarks.gpu.session char`: the best val loss and "
        "the wall time in its summary.json): **not yet measured** (no GPU has been lent to this work).", "",
        "**`make train`'s default is now this recipe** (`python -m jaxgpt.train` without `--config`): run again "
        "when the load had fallen" + (f" (load average {res['rerun']['wall']['loadavg_1min_mean']:.1f}), it took "
        f"{res['rerun']['wall']['wall_s'] / 60:.1f} min and repeated the first run bit for bit (the same val losses"
        + (" and samples" if res["rerun"]["samples_identical"] else "") + ")" if res.get("rerun") else "")
        + ": nanoGPT's number within the issue's 1.95 in a few minutes, less than the BPE run that was the default "
        "(`configs/shakespeare-cpu.yaml`: 10 min 44 s on an idle AVX2 EPYC, val loss 5.04, which nothing "
        "published compares with).", "",
        "Command: `python -m benchmarks.shakespeare_char run` (both runs; here the first two were started by hand with "
        "the same commands and timed from outside, the re-run by its `timed`), then `python -m "
        "benchmarks.shakespeare_char report`.",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["run", "report"])
    p.add_argument("--config", type=Path, default=CPU_CONFIG)
    p.add_argument("--nanogpt", type=float, default=None, help="nanoGPT's published val loss (default: by config)")
    a = p.parse_args(argv)
    if a.what == "run":
        run(a.config.resolve())
    else:
        report(a.config.resolve(), a.nanogpt or NANOGPT[a.config.stem])
    return 0


if __name__ == "__main__":
    sys.exit(main())
