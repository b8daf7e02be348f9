"""One train-step measurement on a GPU (or, ``spec["device"] == "cpu"``, the same code path on the CPU: the dry
mode the default test suite runs): ``python -m benchmarks.gpu.worker '<json spec>'``, launched by
:mod:`benchmarks.gpu.bench` through ``common.run_worker(..., module=bench.WORKER)``. Results as
:func:`benchmarks.worker.run_train`'s, plus peak device memory and the device's name. It builds on the CPU worker
(its variants, batch, initial weights and result file), which does not know it.

Timing is device-synchronised and pipelined the way a training loop runs: after the cold first step (trace +
compile + one step) and ``warmup`` steps, ``windows`` windows of ``window`` steps each are timed from a
synchronised start to a synchronised end (JAX: ``block_until_ready`` on the new state; torch:
``torch.cuda.synchronize()``), and each window's time per step is one sample. Neither framework reads the loss
on the host inside a window (jaxgpt's training loop fetches metrics every ``log_interval`` steps; a per-step
``loss.item()`` would serialise host and device in both). ``host_call_s`` holds each timed step call's host time
(per window): JAX's call returns once the step is dispatched, so a window's first call is time the device sits idle
(it has finished the previous window), and a call slower than the device's step makes the window host-bound.

A micro-batch that does not fit in device memory returns ``{"does_not_fit": True, "error": ...}`` instead of
raising: the orchestrator reports it as "does not fit" and stops growing that variant's batch. What is measured is
never lost to what is only derived: the step's prediction (``predicted_step_s``) is computed after the timing, and
an error there is recorded as ``predicted_error`` beside the measured row. A jaxgpt row also records the tile
configuration of every Pallas kernel its step was built with (``pallas_kernels``, :mod:`benchmarks.gpu.pallas_tiles`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from benchmarks import worker
from benchmarks.gpu import fastset, pallas_tiles
from benchmarks.worker import peak_rss_mib

OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OutOfMemory", "Failed to allocate")


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a device out-of-memory error (XLA's RESOURCE_EXHAUSTED or torch's OutOfMemoryError)."""
    return type(exc).__name__ == "OutOfMemoryError" or any(m in str(exc) for m in OOM_MARKERS)


# the opt-in programs of issues 32 and 33, measured beside jax_bf16 by `benchmarks.gpu.bench --variants ...`:
# (framework, precision, compiled), and the Policy fields a variant sets beyond its precision's
GPU_VARIANTS = {**worker.TRAIN_VARIANTS,
                "jax_bf16_autocast": ("jax", "bf16-autocast", True),
                "jax_autocast_fused_ln": ("jax", "bf16-autocast", True),
                "jax_fp8": ("jax", "fp8", True),
                "jax_bf16_ln_pallas": ("jax", "bf16", True),
                "jax_bf16_gelu_gemm": ("jax", "bf16", True),
                "jax_bf16_qkv_pallas": ("jax", "bf16", True),
                "jax_bf16_lm_head_pallas": ("jax", "bf16", True),
                "jax_bf16_gelu_recompute": ("jax", "bf16", True),
                "jax_bf16_fast": ("jax", "bf16", True),
                "jax_bf16_fast_h32": ("jax", "bf16", True)}
VARIANT_POLICY = {"jax_autocast_fused_ln": {"kernels": {"layer_norm": "fused"}},
                  "jax_bf16_ln_pallas": {"kernels": {"layer_norm": "pallas"}},
                  "jax_bf16_gelu_gemm": {"kernels": {"mlp": "pallas-gemm"}},  # GELU in the two Pallas GEMMs' epilogues
                  "jax_bf16_qkv_pallas": {"kernels": {"qkv": "pallas"}},  # q, k, v's bias + bf16 in their Pallas GEMMs
                  # the loss's row max and sum of exp in the bf16 logits GEMM's epilogue
                  "jax_bf16_lm_head_pallas": {"kernels": {"loss": "pallas"}, "logits_dtype": "bfloat16"},
                  "jax_bf16_gelu_recompute": {"kernels": {"mlp": "pallas-recompute"}},  # pallas-gemm, h recomputed
                  # kernels: pallas (the Pallas LayerNorm, GELU, q, k, v and the loss's logits in Pallas GEMMs), bf16
                  # logits (as torch.compile's autocast writes them) and h kept in bf16 for GELU's backward (as
                  # torch.compile's autocast keeps it): the program predicted fastest (BENCHMARKS.md; docs/kernels.md);
                  # jax_bf16_fast_h32: the same kernels with the default's numerics but for the bf16 logits
                  fastset.VARIANT: fastset.policy_fields(),  # {"kernels": "pallas", "gelu_h_dtype": ..., ...}
                  "jax_bf16_fast_h32": {"kernels": "pallas", "logits_dtype": "bfloat16"}}


def run_train(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``train`` task: the spec's variant on the same fixed batch and initial weights as the CPU worker's."""
    cfg = worker.gpt_config(spec)
    x, y = worker.make_batch(cfg, spec.get("micro_steps", 1), spec["batch"], spec["seq"])
    spec = {**spec, "policy": {**VARIANT_POLICY.get(spec["variant"], {}), **spec.get("policy", {})}}
    return run_train_gpu(spec, cfg, GPU_VARIANTS[spec["variant"]], x, y, worker.load_init(spec.get("init")))


def run_train_gpu(spec: dict[str, Any], cfg, variant: tuple[str, str, bool], x, y, init) -> dict[str, Any]:
    framework, precision, compiled = variant
    runner = _jax if framework == "jax" else _torch
    load_start = list(os.getloadavg())
    tiles = pallas_tiles.recording() if framework == "jax" else contextlib.nullcontext([])
    try:
        with tiles as kernels:  # the step is traced (its Pallas kernels built) in its first call
            fns = runner(spec, cfg, precision, compiled, x, y, init)
            t0 = time.perf_counter()
            first = fns["step"]()
            fns["sync"]()
        cold = time.perf_counter() - t0
        loss_first = fns["value"](first)
        for _ in range(spec.get("warmup", 3)):
            fns["step"]()
        fns["sync"]()
        times, host = [], []
        window = spec.get("window", 5)
        for _ in range(spec.get("windows", 4)):
            t0 = time.perf_counter()
            calls = []
            for _ in range(window):
                t_call = time.perf_counter()
                last = fns["step"]()
                calls.append(time.perf_counter() - t_call)
                if spec.get("sync_every_step"):  # the A/B of a training loop that reads the loss every step
                    fns["value"](last)
            fns["sync"]()
            times.append((time.perf_counter() - t0) / window)
            host.append(calls)
        loss_last = fns["value"](last)
    except Exception as e:  # classified: re-raised unless it is an out-of-memory error
        if not is_oom(e):
            raise
        first_line = next((s for s in str(e).splitlines() if s.strip()), type(e).__name__)
        return {"does_not_fit": True, "error": f"does not fit: {first_line[:300]}", "variant": spec["variant"],
                "framework": framework, "precision": precision, "peak_rss_mib": peak_rss_mib()}
    predicted, predicted_error = None, None
    if "predicted_s" in fns:  # derived, after the measurement: an error here must not lose the measured row
        try:
            predicted = fns["predicted_s"]()
        except Exception as e:  # noqa: BLE001 - recorded in one line beside the row
            predicted_error = f"{type(e).__name__}: {next(iter(str(e).splitlines()), '')[:300]}"
    return {
        **fns["info"], "variant": spec["variant"], "framework": framework, "precision": precision,
        "micro_steps": x.shape[0],
        "tokens_per_step": x.shape[0] * x.shape[1] * x.shape[2], "cold_first_step_s": cold, "step_times_s": times,
        "host_call_s": host,
        "timing": f"{spec.get('windows', 4)} windows x {window} steps, synchronised at each window's ends",
        "loss_first": loss_first, "loss_last": loss_last, "peak_device_mib": fns["peak_mib"](),
        "peak_rss_mib": peak_rss_mib(), "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()),
        "predicted_step_s": predicted, **({"predicted_error": predicted_error} if predicted_error else {}),
        "pallas_kernels": kernels,
    }


def _jax(spec, cfg, precision, compiled, x, y, init) -> dict[str, Callable | dict]:
    import jax

    from benchmarks import impl
    from jaxgpt.precision import Policy

    device = jax.devices()[0]
    if spec.get("ce_chunk_elements"):  # the A/B of the fused loss's chunk size (read when the step is traced)
        from jaxgpt.kernels import loss as fused_loss

        fused_loss.CE_CHUNK_ELEMENTS_GPU = int(spec["ce_chunk_elements"])  # what the GPU program's chunks read
    policy = Policy.named(precision, **spec.get("policy", {}))
    step, holder, sources = impl.jax_fixed_batch_step(cfg, policy, init, x, y)

    def peak_mib():
        stats = device.memory_stats() or {}
        return stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None

    info = {**sources, "policy": str(policy),
            "attention": policy.attention_impl(), "device_kind": device.device_kind, "platform": device.platform,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    def predicted_s():
        """The same step's roofline lower bound from its compiled kernels (jaxgpt.compile), None off the table."""
        from jaxgpt import account
        from jaxgpt.compile import hlo, predict, targets

        target = targets.TARGETS.get(account.resolve_device(device)) if device.platform == "gpu" else None
        if target is None or "compiled_text" not in holder:
            return None
        kernels, _ = hlo.kernels(holder["compiled_text"]())
        return predict.predict(kernels, predict.gpu_peaks(target), model_flops=0.0, tokens=1).time_s

    return {"step": step, "sync": lambda: jax.block_until_ready(holder["state"]),
            "value": lambda m: float(m["loss"]), "peak_mib": peak_mib, "info": info, "predicted_s": predicted_s}


def _torch(spec, cfg, precision, compiled, x, y, init) -> dict[str, Callable | dict]:
    import torch

    from benchmarks import impl
    from torch_ref.model import GPT

    dev = "cuda" if spec.get("device", "gpu") == "gpu" else "cpu"
    if dev == "cuda":
        # nanoGPT / build-nanogpt: TF32 for whatever stays fp32 (the bf16 autocast covers the matmuls)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = GPT(cfg, seed=0)
    if init is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    model.to(dev).train()
    hyper, hyper_src = impl.optim_hyper()
    opt, clip, opt_src = impl.torch_optimizer(model, hyper)  # AdamW(fused=True): the fused CUDA kernel on a GPU
    fwd = torch.compile(model) if compiled else model
    xs = torch.from_numpy(x).long().to(dev)
    ys = torch.from_numpy(y).long().to(dev)
    autocast = (lambda: torch.autocast(dev, dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    lr_at = impl.torch_lr_schedule()
    counter = {"step": 0}
    M = xs.shape[0]

    def step():
        for group in opt.param_groups:
            group["lr"] = lr_at(counter["step"])
        counter["step"] += 1
        total = torch.zeros((), device=dev)
        for m in range(M):
            with autocast():
                loss = fwd(xs[m], ys[m])[1] / M
            loss.backward()
            total += loss.detach()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def peak_mib():
        return torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else None

    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    sdpa = {"flash": torch.backends.cuda.flash_sdp_enabled(), "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled()} if dev == "cuda" else {}
    info = {"train_step": "benchmarks.gpu.worker (torch_ref loop)", "optimizer": opt_src, "hyper_source": hyper_src,
            "optimizer_class": f"{type(opt).__name__}(fused={opt.defaults.get('fused')})",
            "torch_compile": bool(compiled), "device_kind": name, "platform": dev, "sdpa_backends_enabled": sdpa}
    return {"step": step, "sync": sync, "value": lambda t: float(t), "peak_mib": peak_mib, "info": info}


TASKS = {"train": run_train}

if __name__ == "__main__":
    worker.main(TASKS)
