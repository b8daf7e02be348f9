"""The GPU mode of the train-step benchmark: jaxgpt against torch_ref on one GPU, in one run.

    python -m benchmarks.gpu.bench                                    # the full table (about 8 minutes on an H100)
    python -m benchmarks.gpu.bench --dry                              # the same code path on the CPU, tiny shapes
    python -m benchmarks.gpu.bench ab --batch 32                      # jaxgpt A/B: one knob at a time

``python -m benchmarks.train_step --device gpu [...]`` is the same command as ``python -m benchmarks.gpu.bench
[...]`` (the train-step benchmark's GPU mode hands its arguments over).

Variants (each in a fresh ``benchmarks.gpu.worker`` process, same seeded init, same batch, same AdamW
hyperparameters and schedule):

* ``jax_bf16``: jaxgpt's default on a GPU (``precision: auto`` = bf16 compute, fp32 params and optimizer state,
  cuDNN flash attention, the fused chunked lm_head + cross-entropy, donated state);
* ``torch_compile_bf16``: torch_ref under ``torch.compile`` + ``torch.autocast(bfloat16)``, SDPA (flash) attention,
  ``AdamW(fused=True)``, TF32 allowed for what stays fp32 (nanoGPT / build-nanogpt's fastest recipe);
* ``torch_eager_bf16``: the same without ``torch.compile``.

gpt2 124M at T=1024 runs at every micro-batch of ``--batches`` (16, 32, 64, 128) until a variant stops fitting
(out of memory: "does not fit", and no larger batch is tried for it); eager at ``--eager-batches``; gpt2-medium
at ``--medium-batch``. MFU is the training FLOP count of :mod:`jaxgpt.flops` (matmuls, attention counted over the
full T x T, the nanoGPT/PaLM convention; the causal-halved figure is in the JSON) over the step time and the
device's dense bf16 peak from :data:`jaxgpt.account.DEVICES`, keyed on the device's name (``jax_fp8``: against
the blended peak of its e4m3 GEMMs at the fp8 peak and the rest at the bf16 one, :func:`jaxgpt.devices.mixed_peak`).
Results:
``train_step-gpu-<device>.{json,md}`` under ``benchmarks/results`` (``JAXGPT_BENCH_RESULTS`` redirects them),
rewritten after every variant so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks import common

WORKER = "benchmarks.gpu.worker"  # the module each variant runs in (common.run_worker's ``module``)

VARIANTS = ["jax_bf16", "torch_compile_bf16"]  # grown over --batches
# also accepted by --variants: the opt-in programs of issues 32 and 33 (benchmarks.gpu.worker.GPU_VARIANTS), e.g.
#   python -m benchmarks.gpu.bench --batches 64,16 --eager-batches "" --medium-batch 0 \
#       --variants jax_bf16,jax_bf16_autocast,jax_autocast_fused_ln,jax_fp8,jax_bf16_gelu_gemm,jax_bf16_qkv_pallas,jax_bf16_lm_head_pallas,jax_bf16_gelu_recompute,jax_bf16_ln_pallas,jax_bf16_fast,jax_bf16_fast_h32,torch_compile_bf16
OPT_IN_VARIANTS = ["jax_bf16_autocast", "jax_autocast_fused_ln", "jax_fp8", "jax_bf16_gelu_gemm",
                   "jax_bf16_qkv_pallas", "jax_bf16_lm_head_pallas", "jax_bf16_gelu_recompute", "jax_bf16_ln_pallas",
                   "jax_bf16_fast", "jax_bf16_fast_h32"]
EAGER = "torch_eager_bf16"
SHAPES = {"gpt2": ("gpt2", 1024), "gpt2-medium": ("gpt2-medium", 1024)}
DRY_SHAPES = {"gpt2": ("tiny", 64), "gpt2-medium": ("mini", 64)}  # --dry: the plumbing, on the CPU
# jaxgpt A/B knobs: name -> (Policy overrides, XLA_FLAGS to add, other spec fields)
KNOBS: dict[str, tuple[dict, str, dict]] = {
    "default": ({}, "", {}),
    "loss fetched every step": ({}, "", {"sync_every_step": True}),
    "attention=xla": ({"kernels": {"attention": "xla"}}, "", {}),
    "fast_kernels=False (plain matmuls, unfused CE)": ({"fast_kernels": False}, "", {}),
    # the default fused loss's chunk on GPUs is 2^28 fp32 logits (fused_loss.CE_CHUNK_ELEMENTS_GPU, chosen from the
    # compiled H100 program's traffic; lm_head: pallas has its own, CE_CHUNK_ELEMENTS_LSE, which these leave alone):
    # measure the 4x smaller and the 4x larger one against it
    "CE chunk 1/4 (2^26 fp32 logits)": ({}, "", {"ce_chunk_elements": 1 << 26}),
    "CE chunk 4x (2^30 fp32 logits)": ({}, "", {"ce_chunk_elements": 1 << 30}),
    "latency-hiding scheduler": ({}, "--xla_gpu_enable_latency_hiding_scheduler=true", {}),
    "no Triton GEMM fusion": ({}, "--xla_gpu_enable_triton_gemm=false", {}),
    "no command buffers": ({}, "--xla_gpu_enable_command_buffer=", {}),
}
PAD = {"padded_vocab_size": 50304}  # build-nanogpt's and configs/gpt2-124m.yaml's padded vocabulary
TARGET_MFU, TARGET_VS_TORCH, TARGET_COLD_S, TARGET_FIT_BATCH = 0.50, 1.10, 60.0, 32


def gpu_env(dry: bool) -> dict[str, str]:
    """The workers' environment: JAX on the GPU (``--dry``: pinned to the CPU), and allowed 94% of its memory
    (XLA preallocates 75% by default, which would make jaxgpt's "largest micro-batch" smaller than torch's)."""
    env = common.worker_env("default")
    if dry:
        env["JAX_PLATFORMS"] = "cpu"
    elif env.get("JAX_PLATFORMS") == "cpu":
        env.pop("JAX_PLATFORMS")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    return env


def gpu_info() -> dict[str, Any]:
    """nvidia-smi's name, driver and memory of GPU 0 (empty where there is none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    parts = [p.strip() for p in out.splitlines()[0].split(",")] if out.strip() else []
    return dict(zip(["name", "driver", "memory", "max_sm_clock"], parts))


def peak_of(device_kind: str | None) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s, its source) for a device name; (None, why) where the table has none."""
    from jaxgpt import account

    key = account._device_from_kind(device_kind or "")
    if key is None or key == "cpu":
        return None, f"no peak for {device_kind!r} in jaxgpt.account.DEVICES (MFU not computed)"
    spec = account.DEVICES[key]
    return spec.peak["bf16"], f"{spec.description}, dense bf16 {spec.peak['bf16'] / 1e12:,.1f} TFLOP/s ({spec.source})"


def flops(preset: str, batch: int, seq: int, micro_steps: int = 1) -> tuple[int, int]:
    """(training FLOPs per step with full T x T attention, with causal-halved attention) from jaxgpt.flops."""
    from jaxgpt.config import GPTConfig
    from jaxgpt.flops import count_flops

    cfg = GPTConfig.preset(preset, padded_vocab_size=50304)
    return (count_flops(cfg, seq, batch_size=batch, grad_accum=micro_steps).training_per_step,
            count_flops(cfg, seq, batch_size=batch, grad_accum=micro_steps, causal_halving=True).training_per_step)


def e4m3_flops(variant: str, preset: str, batch: int, seq: int, micro_steps: int = 1) -> int:
    """Training FLOPs per step a variant runs in e4m3 GEMMs: the forward GEMMs jaxgpt.kernels.fp8 selects under a ``precision:
    fp8`` variant (benchmarks.gpu.worker.GPU_VARIANTS; fp8_gemms all, its default), 0 for every other variant."""
    from benchmarks.gpu.worker import GPU_VARIANTS
    from jaxgpt.config import GPTConfig
    from jaxgpt.flops import count_flops

    if GPU_VARIANTS.get(variant, ("", ""))[1] != "fp8":
        return 0
    cfg = GPTConfig.preset(preset, padded_vocab_size=50304)
    return count_flops(cfg, seq, batch_size=batch, grad_accum=micro_steps).training_per_step_by_dtype("all")["e4m3"]


def plan(batches: list[int], eager_batches: list[int], medium_batch: int | None,
         variants: list[str] = VARIANTS) -> list[tuple[str, str, int]]:
    """(shape, variant, micro-batch) in run order: jaxgpt and torch.compile side by side at each batch."""
    out = []
    for b in batches:
        out += [("gpt2", v, b) for v in variants]
        out += [("gpt2", EAGER, b)] if b in eager_batches else []
    if medium_batch:
        out += [("gpt2-medium", v, medium_batch) for v in variants]
    return out


def row_of(res: dict[str, Any], shape: str, preset: str, seq: int, batch: int, variant: str) -> dict[str, Any]:
    base = {"shape": shape, "preset": preset, "seq": seq, "batch": batch, "variant": variant}
    if "error" in res:
        return {**base, "error": res["error"], "does_not_fit": bool(res.get("does_not_fit")),
                "skipped": bool(res.get("skipped")), **({"not_measured": res["not_measured"]}
                                                         if res.get("not_measured") else {})}
    st = common.summarize(res["step_times_s"])
    full, causal = flops(preset, batch, seq, res.get("micro_steps", 1))
    peak, peak_src = peak_of(res.get("device_kind"))
    tok = res["tokens_per_step"]
    mfu = mfu_causal = None
    if peak:
        mfu, mfu_causal = full / st["median"] / peak, causal / st["median"] / peak
        e4m3 = e4m3_flops(variant, preset, batch, seq, res.get("micro_steps", 1))
        if e4m3:  # precision fp8: each class of GEMMs against its own dense peak (jaxgpt.devices.mixed_peak)
            from jaxgpt import devices

            key = devices.device_from_kind(res["device_kind"])
            mixed = devices.mixed_peak(key, e4m3, full - e4m3)
            mfu, peak = mixed.mfu(st["median"]), mixed.peak
            mfu_causal = devices.mixed_peak(key, e4m3, causal - e4m3).mfu(st["median"])
            peak_src += f"; fp8 variant: blended with the fp8 peak, {e4m3 / full:.1%} of the FLOPs in e4m3"
    return {**base, "micro_steps": res.get("micro_steps", 1), "tokens_per_s": tok / st["median"], "step_ms": {k: v * 1e3 if k != "n" else v for k, v in st.items()},
            "mfu": mfu, "mfu_causal_halved": mfu_causal,
            "flops_per_step": full, "flops_per_step_causal_halved": causal, "peak_flops": peak, "peak_source": peak_src,
            "peak_device_gib": res["peak_device_mib"] / 1024 if res.get("peak_device_mib") else None,
            "cold_first_step_s": res["cold_first_step_s"], "loss_first": res["loss_first"], "loss_last": res["loss_last"],
            "predicted_step_ms": res["predicted_step_s"] * 1e3 if res.get("predicted_step_s") else None,
            **({"predicted_error": res["predicted_error"]} if res.get("predicted_error") else {}),
            "pallas_kernels": res.get("pallas_kernels") or [],
            "host_call_ms": host_calls(res.get("host_call_s")),
            "device_kind": res.get("device_kind"), "details": {k: res.get(k) for k in (
                "train_step", "optimizer", "optimizer_class", "policy", "attention", "sdpa_backends_enabled",
                "timing", "xla_flags", "process_s")}}


def run(*, dry: bool, batches: list[int], eager_batches: list[int], medium_batch: int | None, steps: int,
        budget_s: float, variants: list[str] = VARIANTS, name: str | None = None, micro_steps: int = 1,
        row_budget_s: dict[tuple[str, int], float] | None = None, log=print) -> dict[str, Any]:
    """Every row of :func:`plan`, each in a fresh worker, results saved after each. ``budget_s``: no row starts
    after it; ``row_budget_s`` ({(variant, batch): seconds}, a row's expected process time): a row whose budget
    exceeds what is left is recorded as "not measured: budget" (and the next row tried), and a worker is given at
    most what is left."""
    shapes = DRY_SHAPES if dry else SHAPES
    env = gpu_env(dry)
    started = time.time()
    res: dict[str, Any] = {
        "benchmark": "train_step-gpu", "dry": dry, "gpu": gpu_info(), "machine": common.cpu_info(),
        "versions": common.versions(), "env": {**common.recorded_env(env),
                                               "XLA_PYTHON_CLIENT_MEM_FRACTION": env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")},
        "git": os.environ.get("JAXGPT_GIT_REV") or common.git_rev(), "command": common.command_line(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": steps, "name": name, "micro_steps": micro_steps,
        "rows": []}
    too_big: set[tuple[str, str]] = set()
    window = 5
    for i, (shape, variant, batch) in enumerate(plan(batches, eager_batches, medium_batch, variants)):
        preset, seq = shapes[shape]
        if (shape, variant) in too_big:
            row = {"error": "not run: a smaller micro-batch did not fit", "skipped": True, "variant": variant}
        elif time.time() - started > budget_s:
            row = {"error": f"not run: the {budget_s:.0f} s time budget was spent", "skipped": True, "variant": variant,
                   "not_measured": "budget"}
        elif (need := (row_budget_s or {}).get((variant, batch))) is not None \
                and budget_s - (time.time() - started) < need:
            row = {"error": f"not measured: budget ({budget_s - (time.time() - started):.0f} s of {budget_s:.0f} s "
                            f"left, the row's budget is {need:.0f} s)", "skipped": True, "variant": variant,
                   "not_measured": "budget"}
        else:
            spec = {"task": "train", "device": "cpu" if dry else "gpu", "variant": variant, "config": preset,
                    "overrides": PAD, "seq": seq, "batch": batch, "micro_steps": micro_steps, "warmup": 3,
                    "window": window, "windows": max(1, steps // window),
                    "init": str(common.ensure_init(preset, PAD))}
            # a fresh inductor cache per worker: torch.compile's cold step is as cold as jaxgpt's (no reuse of
            # kernels an earlier variant compiled)
            wenv = {**env, "TORCHINDUCTOR_CACHE_DIR": str(common.TMP / f"inductor-gpu-{int(started)}-{i}")}
            left = budget_s - (time.time() - started)
            row = common.run_worker(spec, wenv, timeout=max(1.0, min(600.0, left)) if row_budget_s else 600,
                                    module=WORKER)
        r = row_of(row, shape, preset, seq, batch, variant)
        if r.get("does_not_fit"):
            too_big.add((shape, variant))
        res["rows"].append(r)
        log(line_of(r))
        res["duration_s"] = time.time() - started
        res["targets"] = targets(res["rows"])
        save(res)
    return res


def host_calls(windows: list[list[float]] | None) -> dict[str, float] | None:
    """The host time of the timed step calls (worker.py's ``host_call_s``, per window), in ms: ``median`` of every
    call, ``first``: the median of each window's first call, during which the device idles."""
    if not windows or not all(windows):
        return None
    return {"median": statistics.median([t for w in windows for t in w]) * 1e3,
            "first": statistics.median([w[0] for w in windows]) * 1e3, "window": len(windows[0])}


def host_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What the host costs each measured row: the paragraph under the table (none if no row recorded it)."""
    shown = [r for r in rows if "error" not in r and r.get("host_call_ms")]
    if not shown:
        return []
    def part(r):
        h = r["host_call_ms"]
        share = f" (~{h['first'] / h['window']:.1f} ms per step)" if r["variant"].startswith("jax") else ""
        return f"{r['variant']} b{r['batch']} {h['median']:.1f} / {h['first']:.1f} ms{share}"

    return ["", "Host time of one step call (median of all timed calls / of each window's first call): "
            + "; ".join(part(r) for r in shown) + ". A jaxgpt call returns once its one program is dispatched, so the "
            "device idles through a window's first call: about first / window of each step's time is the host's (in "
            "parentheses); a median call as long as the step would make the steps host-bound. A torch call launches "
            "its kernels one by one while the GPU runs the first ones, so its times bound the host's share only from "
            "above."]


def line_of(r: dict[str, Any]) -> str:
    head = f"  {r['shape']:11s} {r['variant']:20s} b={r['batch']:<4d}"
    if "error" in r:
        return f"{head} {r['error'][-400:]}"
    mfu = f"{100 * r['mfu']:5.1f}% MFU" if r["mfu"] else "  - MFU"
    mem = f"{r['peak_device_gib']:6.1f} GiB" if r["peak_device_gib"] else "     - GiB"
    return (f"{head} {r['tokens_per_s']:10,.0f} tok/s  {r['step_ms']['median']:8.1f} ms  {mfu}  {mem}  "
            f"cold {r['cold_first_step_s']:6.1f} s  loss {r['loss_first']:.3f}->{r['loss_last']:.3f}")


def _ok(rows, shape, variant):
    return {r["batch"]: r for r in rows if r["shape"] == shape and r["variant"] == variant and "error" not in r}


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets on gpt2 124M at T=1024, at jaxgpt's best micro-batch (highest tokens/s that fits)."""
    jax_rows, torch_rows = _ok(rows, "gpt2", "jax_bf16"), _ok(rows, "gpt2", "torch_compile_bf16")
    if not jax_rows:
        return [{"target": "jaxgpt gpt2 124M runs", "met": False, "measured": None,
             "also": "no jax_bf16 row ran"}]
    best = max(jax_rows.values(), key=lambda r: r["tokens_per_s"])
    b = best["batch"]
    out = [{"target": f"jaxgpt MFU >= {TARGET_MFU:.0%} (full T x T attention count)", "batch": b,
            "measured": best["mfu"], "met": best["mfu"] is not None and best["mfu"] >= TARGET_MFU,
            "also": f"causal-halved count: {best['mfu_causal_halved']:.1%}" if best["mfu_causal_halved"] else None}]
    t = torch_rows.get(b)
    ratio = best["tokens_per_s"] / t["tokens_per_s"] if t else None
    out.append({"target": f"jaxgpt >= {TARGET_VS_TORCH}x torch_ref torch.compile bf16 at the same micro-batch",
                "batch": b, "measured": ratio, "met": ratio is not None and ratio >= TARGET_VS_TORCH,
                "also": (f"torch.compile's best: {max(r['tokens_per_s'] for r in torch_rows.values()):,.0f} tok/s at "
                         f"b={max(torch_rows.values(), key=lambda r: r['tokens_per_s'])['batch']}") if torch_rows else
                "torch.compile did not run"})
    out.append({"target": f"cold first step (trace + compile + 1 step) <= {TARGET_COLD_S:.0f} s", "batch": b,
                "measured": best["cold_first_step_s"], "met": best["cold_first_step_s"] <= TARGET_COLD_S})
    fit = jax_rows.get(TARGET_FIT_BATCH)
    out.append({"target": f"micro-batch {TARGET_FIT_BATCH} x 1024 fits", "batch": TARGET_FIT_BATCH,
                "measured": fit["peak_device_gib"] if fit else None, "met": fit is not None,
                "also": None if fit else next((r.get("error") for r in rows if r["shape"] == "gpt2" and
                                               r["variant"] == "jax_bf16" and r["batch"] == TARGET_FIT_BATCH), "not run")})
    return out


def markdown(res: dict[str, Any]) -> str:
    g, v = res["gpu"], res["versions"]
    ok = [r for r in res["rows"] if "error" not in r]
    src = next((r["peak_source"] for r in ok), "-")
    lines = [
        f"**{g.get('name', 'no GPU (dry run on the CPU)')}** (driver {g.get('driver', '-')}, {g.get('memory', '-')}); "
        f"host {res['machine'].get('model_name')} x {res['machine'].get('cores')}; jax {v.get('jax')}, flax "
        f"{v.get('flax')}, optax {v.get('optax')}, torch {v.get('torch')}, python {v.get('python')}; git {res['git']}; "
        f"{res['started']}; `{res['command']}`; XLA_FLAGS={res['env'].get('XLA_FLAGS') or '(none)'}, "
        f"XLA_PYTHON_CLIENT_MEM_FRACTION={res['env'].get('XLA_PYTHON_CLIENT_MEM_FRACTION')}.", "",
        f"MFU: jaxgpt.flops training FLOPs (matmuls; attention over the full T x T, as nanoGPT and PaLM count it) "
        f"/ step time / peak; peak: {src}. Step time: median of {res['steps'] // 5} windows of 5 steps, "
        "device-synchronised at each window's ends, after a cold step and 3 warm-up steps.", "",
        "Predicted: the roofline lower bound of the same compiled step (`python -m jaxgpt.compile`'s prediction, "
        "from the program this GPU ran, autotuned); measured / predicted says how far the GPU sits from it.", "",
        "| model | variant | micro-batch | tok/s | step ms | predicted ms | measured / predicted | MFU | "
        "MFU (causal-halved count) | peak memory GiB | cold 1st step s | loss 1st -> last |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        name = f"**{r['variant']}**" if r["variant"] == "jax_bf16" else r["variant"]
        if "error" in r:
            what = "does not fit (out of memory)" if r.get("does_not_fit") else _last_line(r["error"])[:200]
            lines.append(f"| {r['shape']} | {name} | {r['batch']} | {what.replace('|', '/')} |||||||||")
            continue
        pct = (lambda x: f"{100 * x:.1f}%" if x is not None else "-")
        pred = r.get("predicted_step_ms")
        vs_pred = f"{r['step_ms']['median'] / pred:.2f}x" if pred else "-"
        lines.append(f"| {r['shape']} | {name} | {r['batch']} | {r['tokens_per_s']:,.0f} | {r['step_ms']['median']:,.1f} "
                     f"| {common.fmt(pred, 1) if pred else '-'} | {vs_pred} | {pct(r['mfu'])} | {pct(r['mfu_causal_halved'])} | "
                     f"{common.fmt(r['peak_device_gib'], 1)} | {r['cold_first_step_s']:.1f} | "
                     f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    lines += host_lines(res["rows"])
    lines += ["", "Targets (gpt2 124M, T=1024, jaxgpt's best micro-batch):", "",
              "| target | micro-batch | measured | met |", "|---|---:|---:|---|"]
    for t in res.get("targets", []):
        m = t["measured"]
        shown = "-" if m is None else (f"{100 * m:.1f}%" if "MFU" in t["target"] else
                                       f"{m:.2f}x" if "torch" in t["target"] else
                                       f"{m:.1f} s" if "cold" in t["target"] else f"{m:.1f} GiB")
        lines.append(f"| {t['target']} | {t.get('batch', '-')} | {shown} | {'yes' if t['met'] else 'NO'}"
                     f"{'; ' + t['also'] if t.get('also') else ''} |")
    return "\n".join(lines)


def _last_line(text: str) -> str:
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    return lines[-1] if lines else text


def result_name(res: dict[str, Any]) -> str:
    if res.get("name"):
        return res["name"]
    if res["dry"]:
        return "train_step-gpu-dry"
    name = (res["gpu"].get("name") or "gpu").lower()
    return "train_step-gpu-" + ("h200" if "h200" in name else "h100" if "h100" in name else "a100" if "a100" in name
                                else "other")


def save(res: dict[str, Any]):
    return common.save_result(result_name(res), res, markdown(res))


# ---- A/B of one knob at a time on jaxgpt's step ---------------------------------------------------------------
def ab(*, dry: bool, batch: int, knobs: list[str], steps: int, log=print) -> dict[str, Any]:
    preset, seq = (DRY_SHAPES if dry else SHAPES)["gpt2"]
    started = time.time()
    out: dict[str, Any] = {"benchmark": "gpu-ab", "dry": dry, "gpu": gpu_info(), "versions": common.versions(),
                           "git": os.environ.get("JAXGPT_GIT_REV") or common.git_rev(), "batch": batch,
                           "preset": preset, "seq": seq, "command": common.command_line(), "rows": []}
    for name in knobs:
        policy, flags, extra = KNOBS[name]
        env = gpu_env(dry)
        if flags:
            env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), flags]))
        spec = {"task": "train", "device": "cpu" if dry else "gpu", "variant": "jax_bf16", "config": preset,
                "overrides": PAD, "seq": seq, "batch": batch, "warmup": 3, "window": 5,
                "windows": max(1, steps // 5), "init": str(common.ensure_init(preset, PAD)), "policy": policy,
                **extra}
        r = row_of(common.run_worker(spec, env, timeout=600, module=WORKER), "gpt2", preset, seq, batch, "jax_bf16")
        r["knob"], r["xla_flags_added"] = name, flags
        out["rows"].append(r)
        log(f"  {name:48s}" + line_of(r)[40:])
    base = next((r for r in out["rows"] if r["knob"] == "default" and "error" not in r), None)
    for r in out["rows"]:
        if base and "error" not in r:
            r["vs_default"] = r["tokens_per_s"] / base["tokens_per_s"]
    out["duration_s"] = time.time() - started
    md = ["| knob | XLA_FLAGS added | tok/s | step ms | vs default | cold 1st step s | peak GiB |",
          "|---|---|---:|---:|---:|---:|---:|"]
    for r in out["rows"]:
        if "error" in r:
            md.append(f"| {r['knob']} | `{r['xla_flags_added']}` | {_last_line(r['error'])[:200].replace('|', '/')} |||||")
        else:
            md.append(f"| {r['knob']} | `{r['xla_flags_added']}` | {r['tokens_per_s']:,.0f} | {r['step_ms']['median']:.1f} "
                      f"| {r.get('vs_default', 0):.3f}x | {r['cold_first_step_s']:.1f} | {common.fmt(r['peak_device_gib'], 1)} |")
    head = (f"jaxgpt gpt2 124M train step, T={seq}, micro-batch {batch}, one knob changed at a time from the default "
            f"(fresh process each); {out['gpu'].get('name', 'CPU dry run')}; jax {out['versions'].get('jax')}; "
            f"git {out['git']}.")
    common.save_result("gpu-ab-dry" if dry else "gpu-ab", out, head + "\n\n" + "\n".join(md))
    print(head + "\n\n" + "\n".join(md))
    return out


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ab"]:
        p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.bench ab")
        p.add_argument("--batch", type=int, default=32)
        p.add_argument("--knobs", default="all", help=f"all, or a comma list of {list(KNOBS)}")
        p.add_argument("--steps", type=int, default=20)
        p.add_argument("--dry", action="store_true")
        a = p.parse_args(argv[1:])
        knobs = list(KNOBS) if a.knobs == "all" else [k.strip() for k in a.knobs.split(";")]
        bad = [k for k in knobs if k not in KNOBS]
        if bad:
            raise SystemExit(f"unknown knob(s) {bad}; valid (separate with ';'): {list(KNOBS)}")
        res = ab(dry=a.dry, batch=a.batch, knobs=knobs, steps=a.steps)
        return 1 if any(common.failed(r) for r in res["rows"] if r["knob"] == "default") else 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="gpu", choices=["gpu"], help="(python -m benchmarks.train_step --device gpu)")
    p.add_argument("--dry", action="store_true", help="the GPU code path on the CPU at tiny shapes (tests)")
    p.add_argument("--batches", default="16,32,64,128", help="gpt2 124M micro-batches, grown until one does not fit")
    p.add_argument("--eager-batches", default="16")
    p.add_argument("--medium-batch", type=int, default=16, help="gpt2-medium's micro-batch (0: skip)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (windows of 5)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no variant after this many seconds")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"grown over --batches; a comma list of {VARIANTS + OPT_IN_VARIANTS}")
    p.add_argument("--out", help="results file stem (default train_step-gpu-<h100|h200|a100|other>, or -dry)")
    p.add_argument("--micro-steps", type=int, default=1, help="micro-batches per optimizer step (accumulated)")
    p.add_argument("--row-budget-s", default="", help="VARIANT@BATCH=SECONDS,...: a row is not started with less than "
                   "its budget left of --budget-s (recorded as 'not measured: budget'); benchmarks.gpu.compare's plan")
    a = p.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if any(v not in VARIANTS + OPT_IN_VARIANTS for v in variants):
        raise SystemExit(f"--variants {a.variants!r}: allowed are {VARIANTS + OPT_IN_VARIANTS}")
    rows = {}
    for item in filter(None, (x.strip() for x in a.row_budget_s.split(","))):
        try:
            key, sec = item.split("=")
            v, b = key.split("@")
            rows[(v, int(b))] = float(sec)
        except ValueError:
            raise SystemExit(f"--row-budget-s {item!r}: expected VARIANT@BATCH=SECONDS") from None
    res = run(dry=a.dry, batches=_ints(a.batches), eager_batches=_ints(a.eager_batches),
              medium_batch=a.medium_batch or None, steps=a.steps, budget_s=a.budget_s, variants=variants,
              name=a.out, micro_steps=a.micro_steps, row_budget_s=rows or None, log=lambda s: print(s, flush=True))
    j, m = save(res)
    print(markdown(res))
    print(f"\nwrote {common.shown(j)} and {common.shown(m)}")
    return 1 if any(common.failed(r) for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
