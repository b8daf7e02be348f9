"""How far the compiled-kernel roofline (jaxgpt.compile's prediction) sits from a measured step, on this CPU.

The GPU prediction of ``python -m jaxgpt.compile`` cannot be checked here against a GPU run; the same roll-up of an
XLA:CPU program can be checked against the same program's measured time. The peaks are this machine's, measured in
the same run: the GEMM probe of ``jaxgpt.account.measure_cpu_peak`` (fp32 and bf16), and a numpy copy for memory
bandwidth. The ratio measured / predicted says how much a roofline lower bound underestimates a real step here
(a GPU's ratio is its own: wider kernels, no cache blocking, launch gaps instead of thread-pool gaps).

    python -m benchmarks.roofline_cpu [--config configs/shakespeare-cpu.yaml] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large copy (read + write), best of ``repeats``."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/shakespeare-cpu.yaml")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxgpt import account
    from jaxgpt import step as step_lib
    from jaxgpt.compile import hlo, predict
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.flops import count_flops
    from jaxgpt.model import GPT
    from jaxgpt.optim import make_optimizer
    from jaxgpt.train.config import TrainConfig
    from benchmarks.common import cpu_info

    load_start = list(os.getloadavg())
    cfg = TrainConfig.load(args.config)
    policy = resolve_policy(cfg, "cpu")
    model = GPT(cfg.model, policy=policy, rngs=nnx.Rngs(params=0))
    opt = make_optimizer(cfg.optim)
    graphdef, state = step_lib.init_train_state(model, opt)
    micro = cfg.micro_steps(1)
    step_fn = step_lib.make_train_step(graphdef, opt, micro_steps=micro, dropout=cfg.model.dropout > 0)
    x = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (micro, cfg.batch_size, cfg.seq_len)),
                    jnp.int32)
    key = jax.random.key(0)
    compiled = step_fn.jitted.lower(state, x, x, key).compile()
    times = []
    for _ in range(args.steps + 1):
        t = time.perf_counter()
        state, metrics = compiled(state, x, x, key)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    measured = float(np.median(times[1:]))

    gemm = account.measure_cpu_peak()
    bandwidth = measure_bandwidth()
    peaks = predict.Peaks("cpu", {"f32": gemm.get("fp32"), "bf16": gemm.get("bf16")}, vector=gemm.get("fp32"),
                          bandwidth=bandwidth)
    kernels, unknown = hlo.kernels(compiled.as_text())
    fc = count_flops(cfg.model, cfg.seq_len, batch_size=cfg.batch_size, grad_accum=micro)
    pred = predict.predict(kernels, peaks, model_flops=fc.training_per_step, tokens=micro * cfg.batch_size * cfg.seq_len)
    cpu = cpu_info()
    print(f"CPU: {cpu.get('model_name')} family {cpu.get('family')} model {cpu.get('model')}, avx512_bf16 "
          f"{cpu.get('flags', {}).get('avx512_bf16')} ({cpu.get('cores', '?')} cores); {args.config}: {policy.compute_dtype}, "
          f"micro-batch {cfg.batch_size} x {cfg.seq_len}, {micro} micro-step(s)")
    print(f"peaks measured here: GEMM fp32 {gemm.get('fp32') / 1e9:,.0f} / bf16 {gemm.get('bf16') / 1e9:,.0f} "
          f"GFLOP/s, copy bandwidth {bandwidth / 1e9:,.1f} GB/s")
    print(pred.table(peak=gemm.get(policy.compute_dtype.replace("float32", "fp32").replace("bfloat16", "bf16")),
                     peak_name="this CPU's GEMM probe"))
    load_end = list(os.getloadavg())
    print(f"measured step {measured * 1e3:,.1f} ms (median of {args.steps}); predicted lower bound "
          f"{pred.time_s * 1e3:,.1f} ms: measured / predicted = {measured / pred.time_s:.2f}x "
          f"(load average {load_start[0]:.2f} -> {load_end[0]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu, config=args.config, measured_s=measured, times=times, loadavg_start=load_start,
                           loadavg_end=load_end, compute=policy.compute_dtype, bandwidth=bandwidth,
                           gemm_peak=dict(fp32=gemm.get("fp32"), bf16=gemm.get("bf16")),
                           prediction=pred.to_dict(), unknown_loops=unknown), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
