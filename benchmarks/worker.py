"""One measurement in its own process: ``python -m benchmarks.worker '<json spec>'``, result written as JSON to
``spec["out"]``. Launched by the orchestrators (train_step, generate, data_loader, gemm); not meant to be run by
hand. Only the framework a variant needs is imported, so peak RSS is that variant's own. The GPU harness's train
steps run in ``python -m benchmarks.gpu.worker``, which builds on this module (this one knows nothing of it)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

import numpy as np

TRAIN_VARIANTS = {
    # name: (framework, precision, compiled)
    "jax_fp32": ("jax", "fp32", True),
    "jax_bf16": ("jax", "bf16", True),
    "torch_eager_fp32": ("torch_ref", "fp32", False),
    "torch_eager_bf16": ("torch_ref", "bf16", False),
    "torch_compile_fp32": ("torch_ref", "fp32", True),
    "torch_compile_bf16": ("torch_ref", "bf16", True),
    "hf_eager_bf16": ("hf", "bf16", False),
}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def gpt_config(spec: dict[str, Any]):
    from jaxgpt.config import GPTConfig

    return GPTConfig.preset(spec["config"], **spec.get("overrides", {}))


def make_batch(cfg, micro_steps: int, batch: int, seq: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The one batch every variant trains on: uniform random token ids, y = x shifted by one."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, size=(micro_steps, batch, seq + 1), dtype=np.int32)
    return tokens[..., :-1].copy(), tokens[..., 1:].copy()


def load_init(path: str | None) -> dict[str, np.ndarray] | None:
    if not path:
        return None
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


# ---- train step -------------------------------------------------------------------------------------------------
def run_train(spec: dict[str, Any]) -> dict[str, Any]:
    framework, precision, compiled = TRAIN_VARIANTS[spec["variant"]]
    cfg = gpt_config(spec)
    M, B, T = spec.get("micro_steps", 1), spec["batch"], spec["seq"]
    x, y = make_batch(cfg, M, B, T)
    init = load_init(spec.get("init"))
    runner = {"jax": _jax_train, "torch_ref": _torch_train, "hf": _torch_train}[framework]
    step, info = runner(spec, cfg, precision, compiled, x, y, init)

    load_start = list(os.getloadavg())
    t0 = time.perf_counter()
    first_loss = step()
    cold = time.perf_counter() - t0
    for _ in range(spec.get("warmup", 2)):
        step()
    times, losses = [], []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    return {
        **info, "variant": spec["variant"], "framework": framework, "precision": precision,
        "tokens_per_step": M * B * T, "cold_first_step_s": cold, "step_times_s": times,
        "loss_first": first_loss, "loss_last": losses[-1], "peak_rss_mib": peak_rss_mib(),
        "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()),
    }


def _jax_train(spec, cfg, precision, compiled, x, y, init):

    from benchmarks import impl
    from jaxgpt.precision import Policy

    policy = Policy.named(precision)
    step_metrics, _, sources = impl.jax_fixed_batch_step(cfg, policy, init, x, y)

    def step() -> float:
        return float(step_metrics()["loss"])

    return step, {**sources, "policy": str(policy)}


def _torch_train(spec, cfg, precision, compiled, x, y, init):
    import contextlib

    import torch
    import torch.nn.functional as F

    from benchmarks import impl

    torch.manual_seed(0)
    framework = TRAIN_VARIANTS[spec["variant"]][0]
    if framework == "torch_ref":
        from torch_ref.model import GPT

        model = GPT(cfg, seed=0)
        if init is not None:
            model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        hf = GPT2Config(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, n_positions=cfg.block_size,
                        vocab_size=cfg.vocab_rows, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        layer_norm_epsilon=cfg.layer_norm_epsilon)
        hf._attn_implementation = "sdpa"
        model = GPT2LMHeadModel(hf)
    model.train()
    hyper, hyper_src = impl.optim_hyper()
    opt, clip, opt_src = impl.torch_optimizer(model, hyper)
    fwd = torch.compile(model) if compiled else model
    xs, ys = torch.from_numpy(x).long(), torch.from_numpy(y).long()
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    M = xs.shape[0]
    lr_at = impl.torch_lr_schedule()
    counter = {"step": 0}

    def loss_of(xb, yb):
        if framework == "torch_ref":
            return fwd(xb, yb)[1]
        logits = fwd(input_ids=xb).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), yb.reshape(-1))

    def step() -> float:
        lr = lr_at(counter["step"])
        for group in opt.param_groups:
            group["lr"] = lr
        counter["step"] += 1
        total = 0.0
        for m in range(M):
            with autocast():
                loss = loss_of(xs[m], ys[m]) / M
            loss.backward()
            total += loss.detach()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    return step, {"train_step": f"benchmarks.worker ({framework} loop)", "optimizer": opt_src,
                  "hyper_source": hyper_src, "torch_threads": torch.get_num_threads(),
                  "torch_compile": bool(compiled), "optimizer_class": type(opt).__name__}


# ---- GEMM probe -----------------------------------------------------------------------------------------------------
# square, wide, and the small config's lm_head (2,048 tokens x 256 -> the padded 50,304-way vocabulary)
GEMM_SIZES = [(2048, 2048, 2048), (4096, 1024, 4096), (2048, 256, 50304)]
GEMM_SANITY_SIZE = (512, 512, 512)  # measured first, for every dtype: the rate larger sizes are projected from


def run_gemm(spec: dict[str, Any]) -> dict[str, Any]:
    """Best achieved GFLOP/s of large matmuls, fp32 and bf16 operands (fp32 accumulation), in one framework.

    Every dtype starts with a 512^3 matmul (a quarter GFLOP); a larger size whose timed repetitions would take
    more than ``spec["budget_s"]`` (default 30 s) at the rate of the last size measured is skipped and listed under
    ``<dtype>_skipped_sizes``. So the probe ends in seconds even where a dtype is emulated (torch's bf16 GEMM on a
    CPU without avx512_bf16/AMX runs at about 1 GFLOP/s: 2048^3 x 10 would take 3 minutes), and its rate is still
    measured, at 512^3."""
    sizes = [GEMM_SANITY_SIZE] + [s for s in map(tuple, spec.get("sizes", GEMM_SIZES)) if s != GEMM_SANITY_SIZE]
    reps = spec.get("reps", 8)
    budget = spec.get("budget_s", 30.0)
    fw = spec["framework"]
    out: dict[str, Any] = {"framework": fw, "sizes": sizes, "loadavg_start": list(os.getloadavg())}
    if fw == "jax" and spec.get("use_library", True):
        lib = _library_peak()
        if lib is not None:
            out["library"] = lib
    for dtype in ("fp32", "bf16"):
        best, skipped = {}, []
        rate = None  # GFLOP/s of the last size measured: what the next one's time is projected from
        for (m, k, n) in sizes:
            gflop = 2 * m * k * n / 1e9
            if rate is not None and gflop / rate * (reps + 2) > budget:
                skipped.append(f"{m}x{k}x{n}")
                continue
            fn = _jax_gemm(m, k, n, dtype) if fw == "jax" else _torch_gemm(m, k, n, dtype)
            t0 = time.perf_counter()
            fn()
            first = time.perf_counter() - t0
            n_reps = reps if first * (reps + 1) <= budget else 2  # the first call may include compilation
            fn()
            ts = []
            for _ in range(n_reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            best[f"{m}x{k}x{n}"] = rate = gflop / min(ts)
        out[f"{dtype}_gflops"] = max(best.values())
        out[f"{dtype}_by_size"] = best
        if skipped:
            out[f"{dtype}_skipped_sizes"] = skipped
    out["peak_rss_mib"] = peak_rss_mib()
    out["loadavg_end"] = list(os.getloadavg())
    return out


def _library_peak():
    try:
        from jaxgpt import account
    except ImportError:
        return None
    fn = getattr(account, "measure_cpu_peak", None)
    if fn is None:
        return None
    res = fn()
    if hasattr(res, "__dataclass_fields__"):
        import dataclasses

        res = dataclasses.asdict(res)
    return res if isinstance(res, dict) else {"value": repr(res)}


def _jax_gemm(m, k, n, dtype):
    import jax
    import jax.numpy as jnp

    dt = jnp.float32 if dtype == "fp32" else jnp.bfloat16
    a = jax.random.normal(jax.random.key(0), (m, k), dt)
    b = jax.random.normal(jax.random.key(1), (k, n), dt)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return lambda: f(a, b).block_until_ready()


def _torch_gemm(m, k, n, dtype):
    import torch

    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    a, b = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
    out = torch.empty(m, n, dtype=dt)
    # torch has no bf16 x bf16 -> fp32 matmul on CPU; its bf16 GEMM accumulates in fp32 and rounds the output.
    return lambda: torch.mm(a, b, out=out)


# ---- generation -----------------------------------------------------------------------------------------------------
def run_generate(spec: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import gen_impl

    cfg = gpt_config(spec)
    n, new, plen = spec["num_prompts"], spec["max_new_tokens"], spec["prompt_len"]
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, size=(n, plen), dtype=np.int32)
    gen, info = gen_impl.make(spec["variant"], cfg, spec.get("init"))
    load_start = list(os.getloadavg())
    t0 = time.perf_counter()
    out = gen(prompts, new)
    cold = time.perf_counter() - t0
    times = [] if spec.get("repeats", 2) else [cold]  # repeats 0: the one (eager, compile-free) run is the sample
    for _ in range(spec.get("repeats", 2)):
        t0 = time.perf_counter()
        out = gen(prompts, new)
        times.append(time.perf_counter() - t0)
    out = np.asarray(out)
    if out.shape != (n, plen + new):
        raise RuntimeError(f"{spec['variant']} returned shape {out.shape}, expected {(n, plen + new)}")
    return {**info, "variant": spec["variant"], "num_prompts": n, "max_new_tokens": new, "prompt_len": plen,
            "cold_s": cold, "times_s": times, "new_tokens": n * new, "peak_rss_mib": peak_rss_mib(),
            "loadavg_start": load_start, "loadavg_end": list(os.getloadavg())}


# ---- data loader ----------------------------------------------------------------------------------------------------
def run_data(spec: dict[str, Any]) -> dict[str, Any]:
    from jaxgpt.data import DataLoader

    loader = DataLoader(spec["data"], "train", spec["batch"], spec["seq"], mode=spec.get("mode", "sequential"))
    for _ in range(5):
        loader.next_batch()
    n = spec.get("batches", 2000)
    t0 = time.perf_counter()
    for _ in range(n):
        bx, by = loader.next_batch()
    dt = time.perf_counter() - t0
    return {"mode": spec.get("mode", "sequential"), "batch": spec["batch"], "seq": spec["seq"], "batches": n,
            "seconds": dt, "tokens_per_s": n * spec["batch"] * spec["seq"] / dt, "peak_rss_mib": peak_rss_mib(),
            "dtype": str(bx.dtype)}


# ---- shared initial weights ---------------------------------------------------------------------------------------
def run_init(spec: dict[str, Any]) -> dict[str, Any]:
    """torch_ref's seeded init as a torch_ref-named .npz, loaded by the jaxgpt and torch_ref variants alike."""
    from torch_ref.model import GPT

    model = GPT(gpt_config(spec), seed=0)
    np.savez(spec["path"], **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    return {"path": spec["path"]}


TASKS = {"init": run_init, "train": run_train, "gemm": run_gemm, "generate": run_generate, "data": run_data}


def main(tasks: dict[str, Any] = TASKS) -> None:
    """Run the task ``sys.argv[1]``'s JSON spec names (one of ``tasks``) and write its result to ``spec["out"]``."""
    spec = json.loads(sys.argv[1])
    result = tasks[spec["task"]](spec)
    result["pid"] = os.getpid()
    with open(spec["out"], "w") as f:
        json.dump(result, f, default=str)


if __name__ == "__main__":
    main()
