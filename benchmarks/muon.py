"""Muon against AdamW, side by side in one run: the same model, data, token budget and data order per seed.

    python -m benchmarks.muon            # the committed run (pins itself to core 1: --core)

Corpus: tiny Shakespeare, **character-level** (nanoGPT's shakespeare_char: 65 symbols, 1.0M training characters,
the last 10% held out for validation). A larger corpus is not reachable offline here (only package registries: the
``datasets`` hub is not, and Debian's KJV text ships in the ``bible`` program's compressed format), and the GPT-2
tokenised tiny Shakespeare (338k tokens) would be repeated many times by the budget below; characters make the
training split 1.0M tokens, and every run's budget (``--steps x batch x seq``) is kept <= one pass over it, so
no run sees a training window twice in expectation and none is memorising. Each step draws ``batch`` random windows
(seeded by the run's seed: AdamW and Muon runs of one seed see the same windows).

Protocol: (1) AdamW lr sweep at seed 0; (2) Muon ``muon_lr`` sweep at seed 0 with the AdamW part at AdamW's best
lr; (3) the two winners at seeds 1 and 2 too. Each run: warmup then cosine to 10% (both parts, one schedule),
GPT-2's betas (0.9, 0.95), weight decay 0.1 on AdamW's matrices, Muon's defaults otherwise (momentum 0.95,
Nesterov, 5 bf16 Newton-Schulz steps). Reported: the tuned AdamW's final val loss (mean over seeds) as the target;
tokens each Muon seed needs to reach it (linear interpolation between evaluations) over AdamW's tokens; final val
loss at equal tokens; the median step time of each, from alternating AdamW, Muon and Muon-with-fp32-Newton-Schulz
steps in one loop (the CPU is shared: alternating cancels its drift), beside each run's own median; the optimizer
update alone (the jitted ``optimizer.update`` + ``apply_updates`` on fixed gradients), timed the same way; and
Newton-Schulz's share of the step's FLOPs (``jaxgpt.flops``), which is what the overhead is made of. Writes
``benchmarks/results/muon.json``, ``.md`` and ``muon.png`` (val-loss curves).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--adamw-lrs", default="3e-3,6e-3,1.2e-2")
    p.add_argument("--muon-lrs", default="0.01,0.02,0.04,0.08")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--eval-windows", type=int, default=128)
    p.add_argument("--timing-pairs", type=int, default=40,
                   help="interleaved rounds of timed steps (AdamW, Muon, Muon with fp32 Newton-Schulz)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--core", type=int, default=1, help="pin this process to one CPU core (-1: no pinning)")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results (JAXGPT_BENCH_RESULTS)")
    p.add_argument("--render", type=Path, default=None, metavar="MUON_JSON",
                   help="only rewrite muon.md and muon.png in --out from a finished run's muon.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.out is None:
        from benchmarks.common import RESULTS

        args.out = RESULTS
    if args.render is not None:
        res = json.loads(args.render.read_text())
        write_outputs(res, args.out)
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.core >= 0:  # before jax starts: its thread pools follow the affinity
        os.sched_setaffinity(0, {args.core})
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from benchmarks.common import cpu_info, git_rev, versions
    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT
    from jaxgpt.optim import OptimConfig, make_optimizer
    from jaxgpt.precision import Policy
    from jaxgpt.step import data_mesh, init_train_state, make_eval_step, make_train_step

    if not args.corpus.is_file():
        sys.exit(f"error: corpus {args.corpus} not found (tiny Shakespeare: shared/data/tinyshakespeare.txt)")
    from jaxgpt.chars import CharTokenizer

    text = args.corpus.read_text()
    chars = CharTokenizer.from_text(text).chars  # jaxgpt's character tokenizer (nanoGPT's shakespeare_char)
    ids = np.array(CharTokenizer(chars).encode(text), np.int32)
    split = int(0.9 * len(ids))  # nanoGPT's split, as `python -m jaxgpt.data --tokenizer char` writes it
    train, val = ids[:split], ids[split:]
    budget = args.steps * args.batch * args.seq
    if budget > len(train):
        sys.exit(f"error: budget {budget:,} tokens > the training split ({len(train):,}): runs would repeat data")
    vrng = np.random.default_rng(12345)
    vstarts = vrng.integers(0, len(val) - args.seq - 1, args.eval_windows)
    vx = np.stack([val[s:s + args.seq] for s in vstarts])
    vy = np.stack([val[s + 1:s + args.seq + 1] for s in vstarts])

    gcfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.seq,
                     vocab_size=len(chars))
    policy = Policy.named(args.precision)
    mesh = data_mesh(jax.devices()[:1])
    tokens_per_step = args.batch * args.seq

    def windows(seed):
        rng = np.random.default_rng(1000 + seed)
        for _ in range(args.steps):
            s = rng.integers(0, len(train) - args.seq - 1, args.batch)
            x = np.stack([train[i:i + args.seq] for i in s])[None]
            y = np.stack([train[i + 1:i + args.seq + 1] for i in s])[None]
            yield x, y

    def optim(name, lr, muon_lr=None):
        base = dict(lr=lr, warmup_steps=args.warmup, decay_steps=args.steps, min_lr_ratio=0.1, weight_decay=0.1,
                    grad_clip=1.0, beta1=0.9, beta2=0.95)
        if name == "muon":
            return OptimConfig(name="muon", muon_lr=muon_lr, **base)
        return OptimConfig(name="adamw", **base)

    def run(cfg: OptimConfig, seed: int) -> dict:
        model = GPT(gcfg, policy=policy, rngs=nnx.Rngs(seed))
        opt = make_optimizer(cfg)
        graphdef, state = init_train_state(model, opt, mesh=mesh)
        step = make_train_step(graphdef, opt, micro_steps=1, mesh=mesh)
        evaluate = make_eval_step(graphdef, mesh=mesh)
        curve, times, losses = [], [], []
        curve.append((0, float(evaluate(state.params, vx, vy))))
        key = jax.random.key(seed)
        for i, (x, y) in enumerate(windows(seed), start=1):
            t0 = time.perf_counter()
            state, m = step(state, x, y, key)
            loss = float(m["loss"])  # waits for the step
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            if i % args.eval_every == 0 or i == args.steps:
                curve.append((i * tokens_per_step, float(evaluate(state.params, vx, vy))))
        return dict(curve=curve, step_s=statistics.median(times[5:]), train_loss=losses,
                    final=curve[-1][1])

    def label(cfg):
        return f"muon muon_lr={cfg.muon_lr} lr={cfg.lr}" if cfg.name == "muon" else f"adamw lr={cfg.lr}"

    results: dict[str, dict] = {}
    t_start = time.perf_counter()
    git = git_rev()  # at the start: the code this run imported (the tree may change while it runs)

    def do(cfg, seed):
        t0 = time.perf_counter()
        r = run(cfg, seed)
        r.update(name=cfg.name, lr=cfg.lr, muon_lr=cfg.muon_lr if cfg.name == "muon" else None, seed=seed)
        results[f"{label(cfg)} seed={seed}"] = r
        print(f"{label(cfg)} seed={seed}: final val {r['final']:.4f}, step {1e3 * r['step_s']:.1f} ms, "
              f"run {time.perf_counter() - t0:.0f} s (total {time.perf_counter() - t_start:.0f} s)", flush=True)
        return r

    seeds = [int(s) for s in args.seeds.split(",")]
    adamw = {lr: do(optim("adamw", lr), seeds[0]) for lr in map(float, args.adamw_lrs.split(","))}
    best_lr = min(adamw, key=lambda lr: adamw[lr]["final"])
    muon = {mlr: do(optim("muon", best_lr, mlr), seeds[0]) for mlr in map(float, args.muon_lrs.split(","))}
    best_mlr = min(muon, key=lambda m: muon[m]["final"])
    a_runs, m_runs = [adamw[best_lr]], [muon[best_mlr]]
    for s in seeds[1:]:  # interleaved: the step times of both see the same machine state
        a_runs.append(do(optim("adamw", best_lr), s))
        m_runs.append(do(optim("muon", best_lr, best_mlr), s))

    # Step time, interleaved: one AdamW step, one Muon step, ... from the tuned configs (the runs' own medians
    # above are from different minutes of a shared machine; alternating cancels its drift)
    def timed_steps(cfg):
        model = GPT(gcfg, policy=policy, rngs=nnx.Rngs(0))
        opt = make_optimizer(cfg)
        graphdef, state = init_train_state(model, opt, mesh=mesh)
        return [make_train_step(graphdef, opt, micro_steps=1, mesh=mesh), state]

    tuned = {"adamw": optim("adamw", best_lr), "muon": optim("muon", best_lr, best_mlr)}
    tuned["muon_ns_fp32"] = tuned["muon"].replace(muon_ns_dtype="float32")
    pair = {name: timed_steps(cfg) for name, cfg in tuned.items()}
    alt = {name: [] for name in pair}
    key = jax.random.key(0)
    for i, (x, y) in enumerate(windows(0)):
        if i >= args.timing_pairs + 4:
            break
        for name, ps in pair.items():
            t0 = time.perf_counter()
            ps[1], m = ps[0](ps[1], x, y, key)
            float(m["loss"])
            if i >= 4:  # after compilation and warm-up
                alt[name].append(time.perf_counter() - t0)
    update_s = time_updates(tuned, gcfg, policy, args.timing_pairs)
    target = statistics.mean(r["final"] for r in a_runs)
    budget_tokens = args.steps * tokens_per_step

    def tokens_to(curve, level):
        for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
            if l1 <= level:
                return t0 + (t1 - t0) * (l0 - level) / (l0 - l1) if l0 > level else t0
        return None

    reach = [tokens_to(r["curve"], target) for r in m_runs]
    ratios = [t / budget_tokens if t is not None else None for t in reach]
    a_step, m_step = statistics.median(alt["adamw"]), statistics.median(alt["muon"])
    from jaxgpt.flops import count_flops, newton_schulz_flops

    ns = newton_schulz_flops(gcfg)
    model_flops = count_flops(gcfg, args.seq, batch_size=args.batch).training_per_step
    summary = dict(
        target_val_loss=target, adamw_best_lr=best_lr, muon_best_lr=best_mlr,
        adamw_final=[r["final"] for r in a_runs], muon_final=[r["final"] for r in m_runs],
        muon_tokens_to_target=reach, muon_token_ratio=ratios,
        muon_token_ratio_mean=statistics.mean(ratios) if all(x is not None for x in ratios) else None,
        runs_step_ms={"adamw": [1e3 * r["step_s"] for r in a_runs], "muon": [1e3 * r["step_s"] for r in m_runs]},
        adamw_step_ms=1e3 * a_step, muon_step_ms=1e3 * m_step, step_overhead=m_step / a_step - 1.0,
        muon_ns_fp32_step_ms=1e3 * statistics.median(alt["muon_ns_fp32"]),
        update_ms={name: 1e3 * t for name, t in update_s.items()},
        ns_matmul_flops=ns["matmul"], model_flops_per_step=model_flops,
        budget_tokens=budget_tokens, train_tokens=len(train), val_tokens=len(val), vocab=len(chars),
        target_met=bool(all(x is not None and x <= 0.75 for x in ratios) and m_step / a_step - 1.0 <= 0.10),
    )
    res = dict(summary=summary, runs=results, args={k: str(v) for k, v in vars(args).items()}, cpu=cpu_info(),
               versions=versions(), git=git, model=dict(n_layer=gcfg.n_layer, n_head=gcfg.n_head,
                                                             n_embd=gcfg.n_embd, seq=args.seq),
               seconds=time.perf_counter() - t_start)
    res["command"] = "python -m benchmarks.muon " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "muon.json").write_text(json.dumps(res, indent=1) + "\n")
    write_outputs(res, args.out)
    return 0


def time_updates(cfgs: dict, gcfg, policy, rounds: int) -> dict[str, float]:
    """Median seconds of each optimizer's update alone (``update`` + ``apply_updates``, jitted, on fixed
    gradients of the model's shapes), the optimizers interleaved round by round."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxgpt.model import GPT
    from jaxgpt.optim import make_optimizer

    params = nnx.state(GPT(gcfg, policy=policy, rngs=nnx.Rngs(0)), nnx.Param)
    grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
    fns = {}
    for name, cfg in cfgs.items():
        opt = make_optimizer(cfg)

        @jax.jit
        def update(p, s, g, opt=opt):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        fns[name] = [update, params, opt.init(params)]
    times = {name: [] for name in fns}
    for i in range(rounds + 3):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f[1], f[2] = f[0](f[1], f[2], grads)
            jax.block_until_ready(f[1])
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def overhead_note(s: dict) -> str:
    """Why the step-time overhead is what it is, from the run's own measurements."""
    if "update_ms" not in s:
        return ""
    u = s["update_ms"]
    share = s["ns_matmul_flops"] / s["model_flops_per_step"]
    return (f"Where the overhead comes from (measured in the same run, interleaved): the optimizer update alone takes "
            f"{u['adamw']:.1f} ms with AdamW and {u['muon']:.1f} ms with Muon ({u['muon'] - u['adamw']:+.1f} ms, "
            f"{u['muon_ns_fp32']:.1f} ms with fp32 Newton-Schulz), against a step-time difference of "
            f"{s['muon_step_ms'] - s['adamw_step_ms']:+.1f} ms; Newton-Schulz is {s['ns_matmul_flops'] / 1e9:.2f} "
            f"GFLOP of matmuls per step (`jaxgpt.flops.newton_schulz_flops`) against "
            f"{s['model_flops_per_step'] / 1e9:.2f} GFLOP of model FLOPs ({share:.0%} more work). It runs once per "
            "optimizer step whatever the batch, so its share falls with the tokens per step and the model: for GPT-2 "
            "124M on a 0.5M-token step it is 0.4% of the FLOPs (1.6 TFLOP). Muon with fp32 Newton-Schulz: "
            f"{s['muon_ns_fp32_step_ms']:.1f} ms per step.")


def write_outputs(res: dict, out: Path) -> None:
    s = res["summary"]
    runs = list(res["runs"].values())
    pick = lambda name, lr: [r for r in runs if r["name"] == name and (r["muon_lr"] if name == "muon" else r["lr"]) == lr  # noqa: E731
                             and (name == "adamw" or r["lr"] == s["adamw_best_lr"])]
    a_runs, m_runs = pick("adamw", s["adamw_best_lr"]), pick("muon", s["muon_best_lr"])
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(res)
    (out / "muon.md").write_text(md)
    plot(res, a_runs, m_runs, out / "muon.png", s["target_val_loss"])
    print(md)


def markdown(res: dict) -> str:
    s = res["summary"]
    flags = res["cpu"].get("flags", {})
    cpu = (res["cpu"].get("model_name") or "CPU") + " (" + ", ".join(
        f"{f} {'yes' if flags.get(f) else 'no'}" for f in ("avx512f", "avx512_bf16", "amx_bf16")) + ")"
    f = lambda xs: ", ".join(f"{x:.4f}" for x in xs)  # noqa: E731
    f0 = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
    r = lambda xs: ", ".join("not reached" if x is None else f"{x:.2f}x" for x in xs)  # noqa: E731
    lines = [
        f"Muon vs AdamW, {res['model']}, char-level tiny Shakespeare (vocab {s['vocab']}, "
        f"{s['train_tokens']:,} train / {s['val_tokens']:,} val tokens), {s['budget_tokens']:,} tokens per run, "
        f"CPU: {cpu}, one core; {res['seconds'] / 60:.0f} min in all.",
        "",
        "| | AdamW (tuned) | Muon (tuned) |",
        "|---|---|---|",
        f"| lr | {s['adamw_best_lr']} | muon_lr {s['muon_best_lr']} (AdamW part lr {s['adamw_best_lr']}) |",
        f"| final val loss, seeds 0-2 | {f(s['adamw_final'])} | {f(s['muon_final'])} |",
        f"| mean final val loss | {sum(s['adamw_final']) / len(s['adamw_final']):.4f} | "
        f"{sum(s['muon_final']) / len(s['muon_final']):.4f} |",
        f"| tokens to AdamW's mean final val loss ({s['target_val_loss']:.4f}) / AdamW's tokens | 1.00x | "
        f"{r(s['muon_token_ratio'])} |",
        f"| median step time (interleaved steps) | {s['adamw_step_ms']:.1f} ms | {s['muon_step_ms']:.1f} ms "
        f"({100 * s['step_overhead']:+.1f}%) |",
        f"| median step time in each run | {f0(s['runs_step_ms']['adamw'])} ms | {f0(s['runs_step_ms']['muon'])} ms |",
        "",
        "Targets: tokens <= 0.75x AdamW's: " + ("met" if s["muon_token_ratio_mean"] is not None and all(
            x is not None and x <= 0.75 for x in s["muon_token_ratio"]) else "not met")
        + f"; step-time overhead <= 10%: {'met' if s['step_overhead'] <= 0.10 else 'not met'} "
        f"({100 * s['step_overhead']:+.1f}%).",
        "",
        "Sweeps (seed 0, final val loss): " + "; ".join(
            f"{k.removesuffix(' seed=0')}: {v['final']:.4f}" for k, v in res["runs"].items() if v["seed"] == 0),
        "",
        "![val loss of AdamW and Muon, 3 seeds each](benchmarks/results/muon.png)",
        "",
        f"Command: `{res.get('command', 'python -m benchmarks.muon')}` (git {res.get('git', '?')}).",
        "",
        "Corpus: tiny Shakespeare at the character level, because nothing larger is reachable offline here (the module "
        "docstring of benchmarks/muon.py); each run's tokens are less than one pass over the training split.",
    ]
    note = overhead_note(s)
    if note:
        lines += ["", note]
    if res.get("note"):
        lines += ["", res["note"]]
    return "\n".join(lines) + "\n"


def plot(res, a_runs, m_runs, path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for runs, color, name in ((a_runs, "tab:blue", "AdamW"), (m_runs, "tab:red", "Muon")):
        for i, r in enumerate(runs):
            t, l = zip(*r["curve"][1:])
            ax.plot([x / 1e6 for x in t], l, color=color, alpha=0.8, label=f"{name} (lr {r['muon_lr'] or r['lr']})"
                    if i == 0 else None)
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"AdamW final (mean) {target:.3f}")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("val loss (nats/char)")
    ax.set_title(f"Muon vs AdamW, 3 seeds each ({res['cpu'].get('model_name') or 'CPU'})", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
