"""Everything, then BENCHMARKS.md: ``python -m benchmarks.run_all``.

1. waits (up to ``--wait-max`` s) for the 1-minute load average to drop below ``--wait-load``;
2. train step, all variants, tuned allocator: small (``--rounds`` x ``--steps``), gpt2 T=1024 batch 1 and gpt2 T=256
   batch 4 (``--gpt2-rounds`` x ``--gpt2-steps``, >= 10 pooled steady steps);
3. small again with the glibc default allocator (the allocator comparison);
4. generation (gpt2 124M, 1 and 8 prompts, 128 new tokens) and the data loader;
5. the GEMM ceiling (``benchmarks.gemm_ceiling``: a C AVX2 microkernel against the libraries' matmuls);
6. a profile of jaxgpt's default small step (``benchmarks.profile_step``: where the time goes);
7. HellaSwag scoring speed (``benchmarks.eval_speed``) and the cost of checkpoint digests (``benchmarks.checkpoint_io``);
8. ``benchmarks.report`` writes BENCHMARKS.md.

``--only small,gpt2,gpt2-t256,alloc,generate,data,profile,ceiling,eval,checkpoint`` runs a subset (the report uses the latest of each).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks import checkpoint_io, common, data_loader, eval_speed, gemm_ceiling, generate, report, train_step

PARTS = ["small", "gpt2", "gpt2-t256", "alloc", "generate", "data", "profile", "ceiling", "eval", "checkpoint"]


def wait_quiet(threshold: float, max_s: float) -> None:
    t0 = time.time()
    while True:
        load = common.loadavg()[0]
        if load < threshold:
            print(f"load average {load:.2f} < {threshold}: starting", flush=True)
            return
        if time.time() - t0 > max_s:
            print(f"load average still {load:.2f} after {max_s:.0f} s: starting anyway (recorded)", flush=True)
            return
        print(f"load average {load:.2f} >= {threshold}: waiting", flush=True)
        time.sleep(30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--gpt2-rounds", type=int, default=2)
    p.add_argument("--gpt2-steps", type=int, default=5)
    p.add_argument("--alloc-rounds", type=int, default=1)
    p.add_argument("--alloc-steps", type=int, default=10)
    p.add_argument("--gen-rounds", type=int, default=1)
    p.add_argument("--wait-load", type=float, default=1.5)
    p.add_argument("--wait-max", type=float, default=1200)
    p.add_argument("--only", default=",".join(PARTS))
    p.add_argument("--dry-run", action="store_true",
                   help="plumbing check: the tiny preset everywhere, 1 round x 2 steps, no waiting; set "
                        "JAXGPT_BENCH_RESULTS to a scratch dir so the committed results stay")
    a = p.parse_args(argv)
    parts = [x.strip() for x in a.only.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        raise SystemExit(f"unknown part(s) {bad}; valid: {PARTS}")
    log = lambda s: print(s, flush=True)  # noqa: E731
    dry = a.dry_run
    if dry:
        a.rounds = a.gpt2_rounds = a.alloc_rounds = a.gen_rounds = 1
        a.steps = a.gpt2_steps = a.alloc_steps = 2
    else:
        wait_quiet(a.wait_load, a.wait_max)
    ok = True
    variants = train_step.ALL_VARIANTS
    for shape in ("small", "gpt2", "gpt2-t256"):
        if shape in parts:
            rounds, steps = (a.rounds, a.steps) if shape == "small" else (a.gpt2_rounds, a.gpt2_steps)
            log(f"== train_step {shape}, tuned allocator, load {common.loadavg()}")
            res = train_step.run("tiny" if dry else shape, variants, rounds=rounds, steps=steps, warmup=2,
                                 allocator="tuned", log=log)
            res["shape"] = shape
            res["command"] = (f"python -m benchmarks.train_step --config {shape} --variants all --rounds {rounds} "
                              f"--steps {steps} --allocator tuned")
            train_step.save(res)
            log(train_step.markdown(res))
            ok &= not any(common.failed(r) for r in res["variants"].values())
    if "alloc" in parts:
        log(f"== train_step small, default allocator, load {common.loadavg()}")
        res = train_step.run("tiny" if dry else "small", variants, rounds=a.alloc_rounds, steps=a.alloc_steps,
                             warmup=2, allocator="default", log=log)
        res["shape"] = "small"
        res["command"] = (f"python -m benchmarks.train_step --config small --variants all --rounds {a.alloc_rounds} "
                          f"--steps {a.alloc_steps} --allocator default")
        train_step.save(res)
        log(train_step.markdown(res))
    if "generate" in parts:
        log(f"== generate, load {common.loadavg()}")
        res = generate.run(preset="tiny" if dry else "gpt2", prompt_counts=[1, 8], variants=generate.GEN_VARIANTS,
                           new=8 if dry else 128,
                           prompt_len=16, rounds=a.gen_rounds, repeats=2, allocator="tuned", log=log)
        res["command"] = f"python -m benchmarks.generate --rounds {a.gen_rounds}"
        generate.save(res)
        log(generate.markdown(res))
    if "data" in parts:
        log(f"== data loader, load {common.loadavg()}")
        res = data_loader.run(batches=50 if dry else 2000, allocator="tuned", log=log)
        res["command"] = "python -m benchmarks.data_loader"
        data_loader.save(res)
        log(data_loader.markdown(res))
    if "ceiling" in parts:
        log(f"== GEMM ceiling (C microkernel vs the libraries), load {common.loadavg()}")
        try:
            res = gemm_ceiling.run(repeats=1 if dry else 5, mfma=20 if dry else 4000, log=log)
        except RuntimeError as e:  # a wrong kernel or a thread count OpenMP did not give: no figures, but go on
            log(f"gemm_ceiling failed: {e}")
            ok = False
        else:
            res["command"] = "python -m benchmarks.gemm_ceiling"
            gemm_ceiling.save(res)
            log(gemm_ceiling.markdown(res))
            ok &= not any("error" in lib for lib in res.get("libraries", {}).values())
    if "eval" in parts:
        log(f"== HellaSwag scoring speed, load {common.loadavg()}")
        res = eval_speed.measure("tiny" if dry else "gpt2", 8 if dry else 64, 1 if dry else 3)
        common.save_result("eval_speed", res, eval_speed.markdown(res))
        log(eval_speed.markdown(res))
    if "checkpoint" in parts:
        log(f"== checkpoint digests, load {common.loadavg()}")
        res = checkpoint_io.measure("tiny" if dry else "gpt2", 1 if dry else 3)
        common.save_result("checkpoint_io", res, checkpoint_io.markdown(res))
        log(checkpoint_io.markdown(res))
    if "profile" in parts and not dry:
        log(f"== profile of the default small step, load {common.loadavg()}")
        proc = subprocess.run([sys.executable, "-m", "benchmarks.profile_step", "--config", "small"], cwd=common.ROOT,
                              env=common.worker_env("tuned"), capture_output=True, text=True)
        if proc.returncode != 0:
            log(f"profile failed ({proc.returncode}): {proc.stderr[-2000:]}")
            ok = False
    log(f"wrote {report.write()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
