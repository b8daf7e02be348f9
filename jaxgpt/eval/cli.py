"""``python -m jaxgpt.eval``: HellaSwag (build-nanogpt's scoring) or the loss on prepared shards.

    python -m jaxgpt.eval --task hellaswag --init-from gpt2 [--data hellaswag_val.jsonl] [--limit 500] [--out r.jsonl]
    python -m jaxgpt.eval --task val-loss --init-from runs/shakespeare-cpu --data data_cache/shakespeare

Prints a summary line and the summary as one line of JSON (also written to ``--json FILE``). Everything that can
be checked without the model is checked before it is loaded: the options, the data (HellaSwag items are read, or
downloaded, and parsed; the shard directory and its split are found) and the output files (their directories are
made; an output that cannot be written is an error then, not after the scoring).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from jaxgpt.eval.common import EvalError, load_model
from jaxgpt.kernels.fp8 import DEFAULT_GEMMS as DEFAULT_FP8_GEMMS
from jaxgpt.kernels.fp8 import GEMM_SETS
from jaxgpt.generate import int_at_least
from jaxgpt.localpath import missing_directory
from jaxgpt.precision import PRECISIONS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxgpt.eval", description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True, choices=["hellaswag", "val-loss"])
    p.add_argument("--init-from", required=True,
                   help="a training run directory, a Hugging Face GPT-2 directory or name (gpt2, ...), or "
                        "random:PRESET")
    p.add_argument("--step", type=int_at_least(0), default=None, help="with a run directory: this checkpoint step")
    p.add_argument("--data", default=None,
                   help="hellaswag: the official jsonl (default: the cached val split, downloaded where a network "
                        "is reachable); val-loss: a prepared shard directory (required)")
    p.add_argument("--split", default="val", choices=["train", "val"], help="val-loss: the split (default val)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32")
    p.add_argument("--fp8-gemms", choices=[g for g in GEMM_SETS if g != "none"], default=None,
                   help="with --precision fp8: which forward GEMMs take e4m3 operands, as the run's fp8_gemms "
                        f"(default: {DEFAULT_FP8_GEMMS})")
    p.add_argument("--logits-dtype", choices=["float32", "bfloat16"], default=None,
                   help="the dtype the lm_head writes its logits in, as the run's logits_dtype (default: the "
                        "precision's own: fp32; bf16 under bf16-autocast)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8,
                   help="items (hellaswag) or sequences (val-loss) per batch")
    p.add_argument("--seq-len", type=int_at_least(1), default=None,
                   help="val-loss: tokens per sequence (default: block size)")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="only the first N items / batches")
    p.add_argument("--out", default=None, help="hellaswag: write each item's result here (jsonl)")
    p.add_argument("--json", default=None, help="also write the summary JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def check_output(path: str, flag: str) -> Path:
    """``path`` as an output file: its directory made (with parents) and writable, and not a directory itself."""
    out = Path(path)
    if out.is_dir():
        raise EvalError(f"{flag} {path}: is a directory; give a file name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EvalError(f"{flag} {path}: cannot create its directory ({e})") from None
    if not os.access(out.parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise EvalError(f"{flag} {path}: not writable")
    return out


def prepare(args: argparse.Namespace) -> dict:
    """What the run needs before the model: the outputs checked, and the data (items, or the shards' split)."""
    missing = None if args.init_from.startswith("random:") else missing_directory(args.init_from)
    if missing:  # a path (runs/typo), not a hub name: said before the data is read or the hub is asked
        raise EvalError(f"--init-from {args.init_from}: {missing}; give a training run directory, a Hugging Face "
                        "GPT-2 directory or name (gpt2, ...), or random:PRESET")
    outputs = {flag: check_output(path, flag) for flag, path in (("--out", args.out), ("--json", args.json)) if path}
    if len(outputs) == 2 and outputs["--out"].resolve() == outputs["--json"].resolve():
        raise EvalError(f"--out and --json are the same file ({args.out}): give two")
    if args.task == "hellaswag":
        from jaxgpt.eval import hellaswag

        if args.seq_len is not None:
            raise EvalError("--seq-len applies to --task val-loss only")
        path = hellaswag.find_or_download(args.data)
        return {"outputs": outputs, "data": path, "items": hellaswag.load(path, limit=args.limit)}
    if args.out:
        raise EvalError("--out (per-item results) applies to --task hellaswag only; use --json for the summary")
    if args.data is None:
        raise EvalError("--task val-loss needs --data DIR, a directory of prepared shards "
                        "(python -m jaxgpt.data ... --out DIR)")
    if not Path(args.data).exists() and not any(c in args.data for c in "*?["):  # (a glob of .bin files is fine)
        raise EvalError(f"--data {args.data}: does not exist; --task val-loss needs a directory of prepared shards")
    from jaxgpt.data import find_shards

    find_shards(args.data, args.split)  # a DataError naming what is missing
    return {"outputs": outputs, "data": args.data}


def run(args: argparse.Namespace, prepared: dict | None = None) -> dict:
    prepared = prepare(args) if prepared is None else prepared
    model = load_model(args.init_from, precision=args.precision, fp8_gemms=args.fp8_gemms,
                       logits_dtype=args.logits_dtype, step=args.step)
    if args.task == "hellaswag":
        from jaxgpt.eval import hellaswag

        scorer = hellaswag.Scorer(model, batch_size=args.batch_size)
        scorer.check_memory(prepared["items"])  # on a GPU: the widest batch against the memory pool
        t0 = time.perf_counter()
        results = scorer.score(prepared["items"], progress=not args.no_progress)
        summary = hellaswag.summarize(results, seconds=time.perf_counter() - t0)
        if "--out" in prepared["outputs"]:
            _write_whole(prepared["outputs"]["--out"], "".join(json.dumps(r) + "\n" for r in results))
        summary.update(task="hellaswag", data=str(prepared["data"]))
    else:
        from jaxgpt.eval import val_loss

        from jaxgpt.generate import load_tokenizer

        summary = val_loss.evaluate(model, prepared["data"], split=args.split, batch_size=args.batch_size,
                                    seq_len=args.seq_len, limit=args.limit, progress=not args.no_progress,
                                    tokenizer=load_tokenizer(args.init_from, step=args.step).record())
        summary.update(task="val-loss", data=str(prepared["data"]))
    summary.update(init_from=args.init_from, precision=args.precision)
    if args.fp8_gemms is not None:
        summary.update(fp8_gemms=args.fp8_gemms)
    if args.logits_dtype is not None:
        summary.update(logits_dtype=args.logits_dtype)
    return summary


def headline(s: dict) -> str:
    if s["task"] == "hellaswag":
        return (f"hellaswag: acc_norm {s['acc_norm']:.4f}, acc {s['acc']:.4f} on {s['n']} items ({s['init_from']}; "
                f"{s['items_per_s']:.1f} items/s" + (f"; {s['truncated']} truncated" if s["truncated"] else "") + ")")
    return (f"{s['split']} loss {s['loss']:.4f} nats, perplexity {s['perplexity']:.2f}, {s['bits_per_byte']:.4f} bits "
            f"per byte over {s['tokens']:,} tokens ({s['init_from']})")


def _write_whole(path, text: str) -> None:
    """Write ``text`` beside ``path`` and rename it into place: an interrupted or failed write leaves no half file."""
    from jaxgpt.data.common import atomic_write_bytes

    atomic_write_bytes(path, text.encode())


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        prepared = prepare(args)
        summary = run(args, prepared)
        print(headline(summary))
        print(json.dumps(summary))
        if "--json" in prepared["outputs"]:
            _write_whole(prepared["outputs"]["--json"], json.dumps(summary, indent=2) + "\n")
    except (EvalError, ValueError, OSError, ImportError) as e:  # GenerateError, DataError, unwritable files, ...
        print(f"error: {e}", file=sys.stderr)  # (and DeviceMemoryError: a batch too large for the GPU)
        return 2
    except RuntimeError as e:  # XLA's RESOURCE_EXHAUSTED while running (another process on the GPU, fragmentation)
        from jaxgpt.memory_fit import report_out_of_memory

        return report_out_of_memory(e, smaller="--batch-size")
    return 0
