"""Expected data-parallel throughput on N GPUs from a measured one-GPU step and a stated all-reduce cost model
(docs/scaling.md, "What 8 GPUs should give").

    python -m benchmarks.gpu.scaling --from benchmarks/results/h100-2026-11-26/train_step-gpu-h100.json    # the measured b=32 row
    python -m benchmarks.gpu.scaling --micro-step-ms 80 --batch 32                        # any figure by hand

The model, for gpt2 124M under jaxgpt's default mesh (``data=N``, params replicated):

* each GPU runs ``k = global_tokens / (N * batch * seq)`` micro-steps per optimizer step, each as long as the
  measured one-GPU step at that micro-batch (which includes one optimizer update: a slight overestimate for k > 1);
* then one all-reduce of the fp32 gradients, ``S = 4 bytes x params``, which jaxgpt issues once per optimizer
  step after the accumulation loop, so nothing overlaps it: ``t_ar = 2 (N - 1) / N x S / busbw + 2 (N - 1) x
  alpha`` (a ring; ``busbw`` as nccl-tests reports it, whose definition makes this exact; ``alpha`` the per-hop
  latency).
* tokens/s per GPU = ``k x batch x seq / (k x t_micro + t_ar)``.

Defaults: busbw 360 GB/s (a conservative all-reduce bus bandwidth for 8 H100 SXM over NVLink 4 / NVSwitch, whose
per-GPU link rate is 450 GB/s each way), alpha 10 us. Both are assumptions, printed with the result; pass your
own (``--busbw-gbs``, ``--alpha-us``) after running nccl-tests' ``all_reduce_perf`` on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Projection:
    gpus: int
    micro_steps: int
    tokens_per_step: int
    micro_step_s: float
    allreduce_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    tokens_per_s: float
    efficiency: float  # per-GPU tokens/s over the one-GPU figure
    grad_bytes: int


def grad_bytes(preset: str = "gpt2", padded_vocab_size: int | None = 50304) -> int:
    """Bytes of one fp32 gradient of every parameter (what the data-parallel all-reduce moves)."""
    from jaxgpt.config import GPTConfig
    from jaxgpt.flops import n_params

    cfg = GPTConfig.preset(preset, padded_vocab_size=padded_vocab_size)
    return 4 * n_params(cfg)["total"]


def project(*, micro_step_s: float, batch: int, seq: int = 1024, gpus: int = 8, global_tokens: int = 524288,
            grad_bytes: int, busbw: float = 360e9, alpha_s: float = 10e-6) -> Projection:
    per_gpu_micro = batch * seq
    if global_tokens % (gpus * per_gpu_micro):
        raise ValueError(f"global batch {global_tokens} is not a multiple of {gpus} GPUs x {batch} x {seq}")
    k = global_tokens // (gpus * per_gpu_micro)
    t_ar = 0.0 if gpus == 1 else 2 * (gpus - 1) / gpus * grad_bytes / busbw + 2 * (gpus - 1) * alpha_s
    step = k * micro_step_s + t_ar
    per_gpu = k * per_gpu_micro / step
    return Projection(gpus, k, global_tokens, micro_step_s, t_ar, step, per_gpu, per_gpu * gpus,
                      per_gpu / (per_gpu_micro / micro_step_s), grad_bytes)


def measured_micro_step(path: Path, batch: int) -> float:
    """The median step time (s) of the jax_bf16 gpt2 row at ``batch`` in a ``train_step-gpu-*.json``."""
    res = json.loads(Path(path).read_text())
    for r in res.get("rows", []):
        if r.get("shape") == "gpt2" and r.get("variant") == "jax_bf16" and r.get("batch") == batch and "error" not in r:
            return r["step_ms"]["median"] / 1e3
    raise SystemExit(f"{path}: no jax_bf16 gpt2 row at micro-batch {batch} that ran")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="src", type=Path, help="a train_step-gpu-*.json written on one GPU")
    src.add_argument("--micro-step-ms", type=float, help="a one-GPU step time at --batch, by hand")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--global-tokens", type=int, default=524288)
    p.add_argument("--busbw-gbs", type=float, default=360.0)
    p.add_argument("--alpha-us", type=float, default=10.0)
    a = p.parse_args(argv)
    t = measured_micro_step(a.src, a.batch) if a.src else a.micro_step_ms / 1e3
    g = grad_bytes()
    one = project(micro_step_s=t, batch=a.batch, gpus=1, global_tokens=a.global_tokens, grad_bytes=g)
    many = project(micro_step_s=t, batch=a.batch, gpus=a.gpus, global_tokens=a.global_tokens, grad_bytes=g,
                   busbw=a.busbw_gbs * 1e9, alpha_s=a.alpha_us * 1e-6)
    print(f"one GPU: micro-batch {a.batch} x 1024 in {t * 1e3:.1f} ms = {one.tokens_per_s:,.0f} tok/s "
          f"({'from ' + str(a.src) if a.src else 'given'})")
    print(f"all-reduce of {g / 1e6:,.0f} MB of fp32 gradients over {a.gpus} GPUs at busbw {a.busbw_gbs:g} GB/s, "
          f"alpha {a.alpha_us:g} us: {many.allreduce_s * 1e3:.2f} ms per optimizer step")
    print(f"{a.gpus} GPUs: {many.micro_steps} micro-steps per {a.global_tokens:,}-token step, "
          f"{many.step_s * 1e3:.1f} ms/step, {many.tokens_per_s_per_gpu:,.0f} tok/s per GPU, "
          f"{many.tokens_per_s:,.0f} tok/s in all ({many.efficiency:.1%} of linear)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
