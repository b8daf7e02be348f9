"""``python -m jaxgpt.data``: prepare shards from the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from jaxgpt.data.common import DataError, _log, _read_json
from jaxgpt.data.loader import unigram_loss
from jaxgpt.data.prepare import DEFAULT_SHARD_SIZE, DEFAULT_VAL_FRACTION, prepare
from jaxgpt.data.shards import MANIFEST_NAME, SPLITS
from jaxgpt.data.hf import HF_PREFIX
from jaxgpt.data.sources import NAMED_SOURCES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxgpt.data",
        description="Tokenize a corpus with GPT-2 BPE (or characters) into uint16 train/val shards (see the "
                    "jaxgpt.data docstring).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--source", choices=sorted(NAMED_SOURCES), help="a named corpus")
    src.add_argument("--input", nargs="+", metavar="PATH_OR_GLOB", help="local UTF-8 text files (one document each)")
    src.add_argument("--hf-dataset", metavar="NAME_OR_LOCAL_FILES",
                     help="a Hugging Face dataset name, or local .jsonl/.json/.parquet/.csv/.txt files or a glob")
    p.add_argument("--out", required=True, help="output directory, e.g. data_cache/shakespeare")
    p.add_argument("--name", help="shard file prefix (default: the source's name)")
    p.add_argument("--text-column", default="text", help="text column of --hf-dataset (default: text)")
    p.add_argument("--hf-split", default="train", help="split of a hub --hf-dataset (default: train)")
    p.add_argument("--hf-config", help="configuration of a hub --hf-dataset")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, help="in [0, 1) (default: 0.1)")
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="tokens per shard (default: 1e8)")
    p.add_argument("--tokenizer", choices=["gpt2", "char"], default="gpt2",
                   help="gpt2: GPT-2's BPE (default); char: nanoGPT's shakespeare_char, the sorted set of the text's "
                        "characters (65 for tiny Shakespeare), recorded in the manifest")
    p.add_argument("--num-proc", type=int, default=1, help="tokenizer processes (default: 1)")
    p.add_argument("--cache-dir", help="download cache (default: $JAXGPT_CACHE_DIR or ~/.cache/jaxgpt)")
    p.add_argument("--force", action="store_true", help="rewrite shards even if up to date")
    p.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    source: Any = args.source or (HF_PREFIX + args.hf_dataset if args.hf_dataset else args.input)
    try:
        out = prepare(source, args.out, val_fraction=args.val_fraction, shard_size=args.shard_size,
                      num_proc=args.num_proc, name=args.name, text_column=args.text_column, hf_split=args.hf_split,
                      hf_config=args.hf_config, cache_dir=args.cache_dir, force=args.force, verbose=not args.quiet,
                      tokenizer=args.tokenizer)
        if not args.quiet:
            for split in SPLITS:
                if _read_json(out / MANIFEST_NAME)["splits"][split]["shards"]:
                    _log(f"unigram baseline ({split}): {unigram_loss(out, split):.4f} nats")
    except DataError as e:
        print(f"jaxgpt.data: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a write outside the shard directory (the download cache, ...)
        from jaxgpt import diskspace

        why = diskspace.write_failure(e)
        if why is None:
            raise
        print(f"jaxgpt.data: error: writing {e.filename or args.out} failed: {why[1]}; "
              f"{diskspace.human(diskspace.free_bytes(e.filename or args.out))} free there. Free space, then run "
              "the same command again (nothing half-written is taken for prepared)", file=sys.stderr)
        return 2
    return 0
