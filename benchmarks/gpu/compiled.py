"""BENCHMARKS.md's "GPU, compiled (not run)" section: jaxgpt's train step compiled for an H100 on this CPU-only
machine (``python -m jaxgpt.compile``), its memory per micro-batch, and the roofline prediction before and after
each traffic change, beside published GPU anchors. Nothing here ran on a GPU.

    python -m benchmarks.gpu.compiled record --label "what changed"   # compile the tree as it is, add an A/B row
    python -m benchmarks.gpu.compiled markdown                        # write results/gpu-compiled.md

An A/B row is gpt2 124M (configs/gpt2-124m.yaml) at micro-batch 16 x 1024 with 32 micro-steps (524,288 tokens) on
one H100 SXM target; rows are recorded one change at a time, each against the row before it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import common

AB = common.RESULTS / "gpu-compiled-ab.json"
MD = common.RESULTS / "gpu-compiled.md"
SEARCHES = ("compile-gpt2-124m-h100.json", "compile-gpt2-124m-h200.json", "compile-gpt2-124m-a100.json")
GiB = 2**30


def row_from_hlo(label: str, hlo_text: str, memory: dict, compile_s: float, *, short: str = "", micro_batch: int = 16,
                 micro_steps: int = 32) -> dict:
    """One A/B row from a compiled step's optimized HLO text (gpt2 124M, padded vocabulary, T=1024, H100 SXM)."""
    from jaxgpt.compile import hlo, predict, targets
    from jaxgpt.config import PRESETS, GPTConfig
    from jaxgpt.flops import count_flops

    target = targets.get_target("h100")
    cfg = GPTConfig.from_dict({**PRESETS["gpt2"], "padded_vocab_size": 50304})
    kernels, _ = hlo.kernels(hlo_text)
    fc = count_flops(cfg, 1024, batch_size=micro_batch, grad_accum=micro_steps)
    p = predict.predict(kernels, predict.gpu_peaks(target), model_flops=fc.training_per_step,
                        tokens=micro_batch * micro_steps * 1024)
    return dict(label=label, short=short or label[:40], memory_total=memory["total"], compile_s=compile_s,
                compute_s=sum(r.compute_s for r in p.rows), memory_s=sum(r.memory_s for r in p.rows),
                model_flops=fc.training_per_step,
                fusions=hlo_text.count(" fusion("), bytes_per_micro_step=p.bytes / micro_steps,
                time_s=p.time_s, mfu=p.mfu(target.peak_bf16),
                by_scope={r.category: dict(bytes=r.bytes / micro_steps, time_s=r.time_s) for r in p.rows})


def record(label: str, short: str = "") -> dict:
    from jaxgpt.compile.program import compile_train_step
    from jaxgpt.compile.targets import get_target, topology_devices
    from jaxgpt.train.config import TrainConfig

    cfg = TrainConfig.load(common.ROOT / "configs" / "gpt2-124m.yaml")
    cs = compile_train_step(cfg, topology_devices(get_target("h100"), 1), micro_batch=16)
    row = row_from_hlo(label, cs.hlo_text(), cs.memory(), cs.compile_s, short=short)
    row.update(commit=common.git_rev(), dirty=common.dirty_files(), recorded=time.strftime("%Y-%m-%d %H:%M"))
    rows = json.loads(AB.read_text()) if AB.exists() else []
    AB.write_text(json.dumps(rows + [row], indent=1))
    return row


def _target_text(row: dict, rows: list[dict]) -> str:
    """The 60% MFU target against what the prediction says binds, and what the not-kept experiments measured."""
    from jaxgpt.compile import targets

    peak = targets.get_target("h100").peak_bf16
    need = row["model_flops"] / (0.6 * peak)
    ce = row["by_scope"].get("lm_head + cross-entropy", {}).get("bytes", 0.0)
    text = (f"Target, predicted MFU >= 60%: not met ({row['mfu']:.1%}). Of the predicted {row['time_s'] * 1e3:,.0f} ms, "
            f"{row['compute_s'] * 1e3:,.0f} ms are compute-bound kernels (the GEMMs, cuDNN attention, the lm_head) "
            f"and {row['memory_s'] * 1e3:,.0f} ms memory-bound passes; 60% needs {need * 1e3:,.0f} ms, so those passes "
            f"would have to shrink by {(row['time_s'] - need) * 1e3:,.0f} ms "
            f"({(row['time_s'] - need) / row['memory_s']:.0%} of them). They are what jaxgpt's precision policy asks "
            "for: every GEMM returns fp32, and LayerNorm, GELU, the residual stream, the softmax of the loss and "
            "their backward passes read and write fp32 activations (the parity tests define these numerics); XLA "
            "fuses each of them into its own kernel, not into the GEMMs' prologues or epilogues.")
    bf16 = [r for r in rows if r.get("short") == "bf16 GEMM outputs"]
    if bf16:
        b = bf16[-1]
        text += (f" Relaxing the policy where it is cheapest to relax does not get there: bf16 GEMM outputs (torch "
                 f"autocast's numerics, tried and not kept) predict {b['mfu']:.1%} ({b['bytes_per_micro_step'] / 1e9:.1f} "
                 "GB per micro-step).")
    text += (f" The largest single item is the loss: {ce / 1e9:.1f} GB per b16 micro-step, the fp32 logits written "
             "by the lm_head GEMM and read back by the max/sum pass and the softmax-gradient pass of each chunk "
             "(XLA fuses neither into the GEMM). What is left needs fused kernels (a linear-cross-entropy kernel that "
             "never writes the logits, LayerNorm and GELU in the GEMMs' prologues and epilogues: Pallas/Triton "
             "work) or bf16 activations throughout (a numerics change to be weighed against the parity bounds).")
    return text


def markdown() -> str:
    import jax
    import jaxlib

    from jaxgpt.compile.predict import CATEGORIES

    out = ["Compiled on a CPU-only machine for NVIDIA GPUs this project has never run on (compile-only CUDA topology, "
           f"jax/jaxlib {jax.__version__}/{jaxlib.__version__} with jax-cuda12-plugin at the same version, XLA's "
           "device specs as targets; no GEMM autotuning). Memory is XLA's `memory_analysis()` of the compiled step; "
           "times are **predictions**: each kernel's roofline max(FLOPs / dense peak, bytes / HBM bandwidth), summed "
           "over the optimized HLO's kernels times their launches, a lower bound on the step time, not a measurement. "
           "MFU: jaxgpt.flops' model FLOPs over that time and the dense bf16 peak (989 TFLOP/s on H100/H200).", ""]
    searches = [json.loads((common.RESULTS / n).read_text()) for n in SEARCHES if (common.RESULTS / n).exists()]
    if searches:
        out += ["### Memory per device by micro-batch (gpt2 124M, T=1024, bf16, AdamW; `python -m jaxgpt.compile "
                "--config configs/gpt2-124m.yaml --target TARGET`)", "",
                "| target | " + " | ".join(f"b{b}" for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)) + " | largest that fits "
                "(75% pool, 10% of it free) | predicted at the config's b |", "|---|" + "---|" * 11]
        for s in searches:
            tried = {int(k): v for k, v in s.get("search", {}).get("tried", {}).items()}
            tried[s["micro_batch"]] = s["memory"]["total"]
            cells = " | ".join(f"{tried[b] / GiB:.1f} GiB" if b in tried else "" for b in (1, 2, 4, 8, 16, 32, 64, 128,
                                                                                            256))
            out.append(f"| {s['target']} | {cells} | b{s.get('search', {}).get('best')} | b{s['micro_batch']}: "
                       f"{s['prediction']['time_s'] * 1e3:,.0f} ms per {s['tokens_per_step']:,} tokens, "
                       f"MFU {s['predicted_mfu']:.1%} |")
        out.append("")
    multi = common.RESULTS / "compile-gpt2-124m-8xh100.json"
    if multi.exists():
        m = json.loads(multi.read_text())
        coll = "; ".join(f"{op}: {n} per optimizer step" + (" (outside the accumulation loop)" if d == "0" else
                                                          f" (inside loop depth {d})")
                         for op, by in m["structure"]["collectives"].items() for d, n in by.items())
        out += [f"8 x H100 SXM, data parallel, b{m['micro_batch']} per GPU x {m['micro_steps']} micro-steps "
                f"({m['tokens_per_step']:,} tokens): {m['memory']['total'] / GiB:.2f} GiB per GPU, predicted "
                f"{m['prediction']['time_s'] * 1e3:,.1f} ms per step (MFU {m['predicted_mfu']:.1%}; collectives at HBM "
                f"bandwidth, a lower bound); {coll}.", ""]
    rows = json.loads(AB.read_text()) if AB.exists() else []
    if rows:
        out += ["### The traffic changes, one at a time (gpt2 124M, b16 x 32 micro-steps, one H100 SXM)", "",
                "| change | memory | GB moved per b16 micro-step | predicted step | predicted MFU | fusions | compile |",
                "|---|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {'' if r.get('kept', True) else '(not kept) '}{r['label']} | {r['memory_total'] / GiB:.2f} GiB | {r['bytes_per_micro_step'] / 1e9:.1f} | "
                       f"{r['time_s'] * 1e3:,.0f} ms | {r['mfu']:.1%} | {r['fusions']:,} | {r['compile_s']:.0f} s |")
        kept = [r for r in rows if r.get("kept", True)]
        first, base, last = kept[0], kept[1] if len(kept) > 1 else kept[0], kept[-1]
        out += ["", f"Bytes moved per b16 micro-step: {first['bytes_per_micro_step'] / 1e9:.1f} GB on main as it was "
                f"-> {last['bytes_per_micro_step'] / 1e9:.1f} GB "
                f"({1 - last['bytes_per_micro_step'] / first['bytes_per_micro_step']:.0%} less); against the program "
                f"with the right kernels only ({base['bytes_per_micro_step'] / 1e9:.1f} GB), "
                f"{1 - last['bytes_per_micro_step'] / base['bytes_per_micro_step']:.0%} less.", "",
                _target_text(last, rows), "",
                "### Where the predicted time goes, before and after (per b16 micro-step)", "",
                f"| scope | {base['short']}: GB | ms | {last['short']}: GB | ms |", "|---|---|---|---|---|"]
        for cat in CATEGORIES:
            b, a = base["by_scope"].get(cat), last["by_scope"].get(cat)
            if b or a:
                f = lambda x, k, s: f"{x[k] * s:,.2f}" if x else "-"  # noqa: E731
                out.append(f"| {cat} | {f(b, 'bytes', 1e-9)} | {f(b, 'time_s', 1e3 / 32)} | {f(a, 'bytes', 1e-9)} | "
                           f"{f(a, 'time_s', 1e3 / 32)} |")
        out.append("")
    cpu = common.RESULTS / "roofline_cpu.json"
    if cpu.exists():
        c = json.loads(cpu.read_text())
        ratio = c["measured_s"] / c["prediction"]["time_s"]
        out += [f"How far a roofline sits from reality where a measurement exists (`python -m benchmarks.roofline_cpu`): "
                f"the same roll-up of the XLA:CPU train step of `{c['config']}` ({c['compute']}) on this project's "
                f"{c['cpu'].get('model_name')} (family {c['cpu'].get('family')} model {c['cpu'].get('model')}, "
                f"{c['cpu'].get('cores')} cores; peaks measured in the same run: GEMM "
                f"{c['gemm_peak']['fp32'] / 1e9:,.0f} fp32 / {c['gemm_peak']['bf16'] / 1e9:,.0f} bf16 GFLOP/s, copy "
                f"{c['bandwidth'] / 1e9:,.1f} GB/s) predicts {c['prediction']['time_s'] * 1e3:,.0f} ms; the step measured "
                f"{c['measured_s'] * 1e3:,.0f} ms, {ratio:.2f}x the bound (load average {c['loadavg_start'][0]:.1f}). "
                "A GPU's ratio is its own; `benchmarks.gpu.bench` reports it beside each measured step when a GPU is lent.",
                ""]
    out += ["Published anchors (measured on GPUs by others; not comparable to a lower bound): llm.c GPT-2 124M on 8x "
            "H100 ~467k tokens/s per GPU (~40% MFU by jaxgpt.flops' count); nanoGPT 124M on A100 ~37% MFU; the JAX "
            "port of jax-ml/jax#24411 on an A100 at 0.87-0.94x PyTorch's tokens/s. A measured GPU step, when a GPU is "
            "lent, goes in the section above and is compared with this prediction there "
            "(`python -m benchmarks.gpu.session`).", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--label", required=True)
    r.add_argument("--short", default="", help="the label in the before/after table's header")
    sub.add_parser("markdown")
    args = p.parse_args(argv)
    if args.cmd == "record":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        print(json.dumps(record(args.label, args.short), indent=1))
    MD.write_text(markdown())
    print(f"wrote {MD}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported: the CUDA plugin stays loaded
    sys.exit(main())
