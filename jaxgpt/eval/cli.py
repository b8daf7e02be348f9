"""``python -m jaxgpt.eval``: HellaSwag (build-nanogpt's scoring) or the loss on prepared shards.

    python -m jaxgpt.eval --task hellaswag --init-from gpt2 [--data hellaswag_val.jsonl] [--limit 500] [--out r.jsonl]
    python -m jaxgpt.eval --task val-loss --init-from runs/shakespeare-cpu --data data_cache/shakespeare

Prints a summary line and the summary as one line of JSON (also written to ``--json FILE``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from jaxgpt.eval.common import EvalError, load_model


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxgpt.eval", description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True, choices=["hellaswag", "val-loss"])
    p.add_argument("--init-from", required=True,
                   help="a training run directory, a Hugging Face GPT-2 directory or name (gpt2, ...), or "
                        "random:PRESET")
    p.add_argument("--step", type=int, default=None, help="with a run directory: this checkpoint step")
    p.add_argument("--data", default=None,
                   help="hellaswag: the official jsonl (default: the cached val split, downloaded where a network "
                        "is reachable); val-loss: a prepared shard directory (required)")
    p.add_argument("--split", default="val", help="val-loss: the split (train or val; default val)")
    p.add_argument("--precision", choices=["fp32", "bf16", "auto"], default="fp32")
    p.add_argument("--batch-size", type=int, default=8, help="items (hellaswag) or sequences (val-loss) per batch")
    p.add_argument("--seq-len", type=int, default=None, help="val-loss: tokens per sequence (default: block size)")
    p.add_argument("--limit", type=int, default=None, help="only the first N items / batches")
    p.add_argument("--out", default=None, help="hellaswag: write each item's result here (jsonl)")
    p.add_argument("--json", default=None, help="also write the summary JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args: argparse.Namespace) -> dict:
    model = load_model(args.init_from, precision=args.precision, step=args.step)
    if args.task == "hellaswag":
        from jaxgpt.eval import hellaswag

        path = hellaswag.find_or_download(args.data)
        items = hellaswag.load(path, limit=args.limit)
        scorer = hellaswag.Scorer(model, batch_size=args.batch_size)
        t0 = time.perf_counter()
        results = scorer.score(items, progress=not args.no_progress)
        summary = hellaswag.summarize(results, seconds=time.perf_counter() - t0)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))
        summary.update(task="hellaswag", data=str(path))
    else:
        from jaxgpt.eval import val_loss

        if args.data is None:
            raise EvalError("--task val-loss needs --data DIR, a directory of prepared shards "
                            "(python -m jaxgpt.data ... --out DIR)")
        summary = val_loss.evaluate(model, args.data, split=args.split, batch_size=args.batch_size,
                                    seq_len=args.seq_len, limit=args.limit, progress=not args.no_progress)
        summary.update(task="val-loss", data=str(args.data))
    summary.update(init_from=args.init_from, precision=args.precision)
    return summary


def headline(s: dict) -> str:
    if s["task"] == "hellaswag":
        return (f"hellaswag: acc_norm {s['acc_norm']:.4f}, acc {s['acc']:.4f} on {s['n']} items ({s['init_from']}; "
                f"{s['items_per_s']:.1f} items/s" + (f"; {s['truncated']} truncated" if s["truncated"] else "") + ")")
    return (f"{s['split']} loss {s['loss']:.4f} nats, perplexity {s['perplexity']:.2f}, {s['bits_per_byte']:.4f} bits "
            f"per byte over {s['tokens']:,} tokens ({s['init_from']})")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        summary = run(args)
    except (EvalError, ValueError, OSError) as e:  # GenerateError, DataError, missing files, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(headline(summary))
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0
