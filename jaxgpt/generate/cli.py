"""``python -m jaxgpt.generate``: the command's arguments, its ``main`` (samples printed, then their speed on
stderr) and its one-line errors (exit 2)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence

from jaxgpt.config import PRESETS
from jaxgpt.kernels.fp8 import DEFAULT_GEMMS as DEFAULT_FP8_GEMMS
from jaxgpt.kernels.fp8 import GEMM_SETS
from jaxgpt.generate.api import generate_samples
from jaxgpt.generate.errors import GenerateError
from jaxgpt.generate.load import load_model, load_tokenizer
from jaxgpt.precision import PRECISIONS, Policy

__all__ = ["SAMPLE_TEMPERATURE", "SAMPLE_TOP_K", "build_parser", "int_at_least", "main"]

# The sampling defaults: a training run's own (TrainConfig.sample_temperature / sample_top_k), which are nanoGPT's
# sample.py's, so `generate --init-from RUN` samples as the run's samples.txt did (tests/test_generate.py checks
# that they agree)
SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 200


def int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum`` (also the eval command's)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be >= {minimum}")
        return v
    return parse


def _temperature(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{s} must be a finite number >= 0 (0 = greedy)")
    return v


def _token_ids(s: str) -> list[int]:
    parts = [p for p in s.replace(",", " ").split() if p]
    if not parts:
        raise argparse.ArgumentTypeError("no token ids given (e.g. --prompt-ids 15496,11,995)")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: token ids are integers, comma- or space-separated") from None
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{s!r}: token ids are >= 0")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxgpt.generate",
        description="Sample text from a GPT-2 model (KV-cached, jit-compiled).",
    )
    p.add_argument("--init-from", default="gpt2",
                   help="a Hugging Face model name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a Hugging Face "
                        "GPT-2 directory, a jaxgpt training run directory, or random:PRESET for a random "
                        f"model (presets: {', '.join(sorted(PRESETS))}) (default: gpt2)")
    p.add_argument("--step", type=int_at_least(0), default=None,
                   help="with a training run directory: the checkpoint step, an error if it is damaged "
                   "(default: the newest intact step)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="",
                        help="the text to continue (default: empty = unconditional). Taken literally: a typed "
                             "<|endoftext|> is seven ordinary tokens unless --allow-special")
    prompt.add_argument("--prompt-ids", type=_token_ids, default=None, metavar="IDS",
                        help="the prompt as GPT-2 token ids, comma- or space-separated (e.g. '15496,11,995')")
    p.add_argument("--allow-special", action="store_true",
                   help="<|endoftext|> in --prompt is the special end-of-text token 50256 (the document separator "
                        "the model was trained with), not seven ordinary tokens")
    p.add_argument("--print-ids", action="store_true",
                   help="after each sample's text, print its token ids (prompt + new tokens) as one JSON line: "
                        '{"sample": i, "ids": [...]}')
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=100)
    p.add_argument("--temperature", type=_temperature, default=SAMPLE_TEMPERATURE,
                   help=f"0 = greedy (default: {SAMPLE_TEMPERATURE}, as a training run's own samples and nanoGPT's "
                        "sample.py; Hugging Face's pipeline samples at 1.0)")
    p.add_argument("--top-k", type=int_at_least(0), default=SAMPLE_TOP_K,
                   help=f"0 = no top-k filtering (default: {SAMPLE_TOP_K}, as a training run's own samples and "
                        "nanoGPT's sample.py; Hugging Face's pipeline keeps 50)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--num-samples", type=int_at_least(1), default=1)
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="matmul operand dtype; bf16-autocast: torch.autocast's bf16 (default: fp32)")
    p.add_argument("--fp8-gemms", choices=[g for g in GEMM_SETS if g != "none"], default=None,
                   help="with --precision fp8: which forward GEMMs take e4m3 operands, as the run's fp8_gemms "
                        f"(default: {DEFAULT_FP8_GEMMS})")
    p.add_argument("--logits-dtype", choices=["float32", "bfloat16"], default=None,
                   help="the dtype the lm_head writes its logits in, as the run's logits_dtype (default: the "
                        "precision's own: fp32; bf16 under bf16-autocast)")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole context for every token (slow; the reference path)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.seed >= 2**32:
            raise GenerateError(f"--seed {args.seed}: must be < 2**32")
        policy = Policy.named(args.precision, fp8_gemms=args.fp8_gemms, logits_dtype=args.logits_dtype)
        model = load_model(args.init_from, policy=policy, step=args.step)
        tok = load_tokenizer(args.init_from, step=args.step)
        t0 = time.perf_counter()
        if args.allow_special and args.prompt_ids is not None:
            raise GenerateError("--allow-special applies to --prompt text; --prompt-ids are taken as they are")
        samples = generate_samples(model, args.prompt if args.prompt_ids is None else args.prompt_ids,
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   top_k=args.top_k or None, seed=args.seed, num_samples=args.num_samples,
                                   use_cache=not args.no_cache, allow_special=args.allow_special, tokenizer=tok)
        dt = time.perf_counter() - t0
    except (ValueError, OSError, ImportError) as e:  # GenerateError, ConfigError, TokenError, DeviceMemoryError, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # XLA's RESOURCE_EXHAUSTED while running (another process on the GPU, fragmentation)
        from jaxgpt.memory_fit import report_out_of_memory

        return report_out_of_memory(e, smaller="--num-samples")
    for i, (text, ids) in enumerate(samples):
        if i:
            print("-" * 40)
        print(text)
        if args.print_ids:
            print(json.dumps({"sample": i, "ids": ids}))
    n = args.max_new_tokens * args.num_samples
    sampling = "greedy" if args.temperature == 0 else (f"temperature {args.temperature:g}, "
                                                         + (f"top-k {args.top_k}" if args.top_k else "no top-k"))
    print(f"[{n} tokens in {dt:.2f} s including compilation: {n / max(dt, 1e-9):.1f} tokens/s; {sampling}"
          + ("" if (args.temperature, args.top_k) != (SAMPLE_TEMPERATURE, SAMPLE_TOP_K) else
             " (the defaults, a training run's own: --temperature, --top-k to change)") + "]", file=sys.stderr)
    return 0

