"""Corpus -> train/val shards: tokenize (optionally in a process pool), split by documents or by tokens, write
the shards and then the manifest; reuse shards whose manifest matches the input and settings."""

from __future__ import annotations

import contextlib
import glob
import math
import multiprocessing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from jaxtyping import UInt16
from tqdm import tqdm

from jaxgpt import tokenizer
from jaxgpt.data.common import DataError, _log, _read_json, atomic_write_json
from jaxgpt.data.corpus import Corpus
from jaxgpt.data.shards import (FORMAT_VERSION, MANIFEST_FORMAT, MANIFEST_NAME, SPLITS, ShardWriter, encode_document,
                                shard_filename, tokenizer_record)
from jaxgpt.rundir import LOCK_NAME
from jaxgpt.data.sources import resolve_source


DEFAULT_SHARD_SIZE = 100_000_000  # tokens (200 MB) per shard, as build-nanogpt's fineweb.py
DEFAULT_VAL_FRACTION = 0.1


def _tokenized(corpus: Corpus, num_proc: int, progress: bool) -> Iterator[UInt16[np.ndarray, " n"]]:
    """Each document's tokens, in order; with ``num_proc > 1`` encoded by a spawn-started process pool."""
    bar = tqdm(total=corpus.num_documents, unit="doc", desc=f"tokenizing {corpus.name}", disable=not progress)
    try:
        if num_proc <= 1:
            for arr in map(encode_document, corpus.documents()):
                bar.update(1)
                yield arr
            return
        # spawn, not fork: the caller (a trainer) may have started JAX's threads
        with multiprocessing.get_context("spawn").Pool(num_proc) as pool:
            for arr in pool.imap(encode_document, corpus.documents(), chunksize=16):
                bar.update(1)
                yield arr
    finally:
        bar.close()


def split_mode(num_documents: int, val_fraction: float) -> Literal["documents", "tokens"]:
    """"documents" (whole documents go to val) when there are at least 1/val_fraction of them, else "tokens"."""
    return "tokens" if 0 < num_documents * val_fraction < 1 else "documents"


def is_val_document(index: int, val_fraction: float) -> bool:
    """Evenly spaced val documents: document ``index`` is val iff floor((i+1) f) > floor(i f)."""
    return math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)


def _write_splits(corpus: Corpus, writers: dict[str, ShardWriter], val_fraction: float, docs: Iterator[np.ndarray]) -> None:
    if split_mode(corpus.num_documents, val_fraction) == "documents":
        for i, tokens in enumerate(docs):
            writers["val" if is_val_document(i, val_fraction) else "train"].add(tokens)
        return
    stream = np.concatenate(list(docs))  # fewer than 1/val_fraction documents: small enough to hold
    cut = math.floor(len(stream) * (1 - val_fraction))
    writers["train"].add(stream[:cut])
    writers["val"].add(stream[cut:])


def _settings(val_fraction: float, shard_size: int) -> dict[str, Any]:
    return {"val_fraction": val_fraction, "shard_size": shard_size, "tokenizer": tokenizer.ENCODING_NAME,
            "version": FORMAT_VERSION}


def _check_settings(val_fraction: float, shard_size: int, num_proc: int) -> None:
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction = {val_fraction!r}: must be a number in [0, 1)")
    for field_name, v in (("shard_size", shard_size), ("num_proc", num_proc)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DataError(f"{field_name} = {v!r}: must be a positive integer")


def _manifest_matches(out_dir: Path, corpus: Corpus, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The existing manifest if it and every shard it lists belong to this exact input and settings."""
    manifest = _read_json(out_dir / MANIFEST_NAME)
    if manifest is None or manifest.get("format") != MANIFEST_FORMAT:
        return None
    if (manifest.get("name"), manifest.get("source_sha256"), manifest.get("settings")) != (corpus.name, corpus.sha256, settings):
        return None
    for split in SPLITS:
        for entry in manifest.get("splits", {}).get(split, {}).get("shards", []):
            bin_path = out_dir / entry["file"]
            header = _read_json(bin_path.with_suffix(".json"))
            if header is None or header.get("source_sha256") != corpus.sha256 or not bin_path.is_file():
                return None
            if bin_path.stat().st_size != 2 * header.get("num_tokens", -1):
                return None
    return manifest


def _remove_stale_shards(out_dir: Path, name: str, keep: set[str]) -> None:
    for split in SPLITS:
        for path in out_dir.glob(f"{glob.escape(name)}_{split}_[0-9]*.bin"):
            if path.name not in keep:
                path.unlink(missing_ok=True)
                path.with_suffix(".json").unlink(missing_ok=True)


def prepare(
    source: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shard_size: int = DEFAULT_SHARD_SIZE,
    num_proc: int = 1,
    name: str | None = None,
    text_column: str = "text",
    hf_split: str = "train",
    hf_config: str | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
    verbose: bool = True,
) -> Path:
    """Tokenize ``source`` into train/val shards in ``out_dir`` and return ``out_dir``.

    ``source``: a named source (``"shakespeare"``), ``"hf:NAME_OR_LOCAL_FILES"`` or text file paths/globs.
    Idempotent: when ``out_dir/manifest.json`` records the same input sha256 and settings and every shard
    header agrees, nothing is rewritten (``force=True`` rewrites anyway).
    """
    _check_settings(val_fraction, shard_size, num_proc)
    corpus = resolve_source(source, name=name, text_column=text_column, hf_split=hf_split, hf_config=hf_config,
                            cache_dir=cache_dir, verbose=verbose)
    if corpus.num_documents == 0:
        raise DataError(f"{corpus.source} has no documents; nothing to tokenize")
    out = Path(out_dir)
    settings = _settings(val_fraction, shard_size)
    with _writing(out) as created:
        existing = None if force else _manifest_matches(out, corpus, settings)
        if existing is not None:
            if verbose:
                _log(f"{out}: shards up to date (source sha256 {corpus.sha256[:12]}…, built from "
                     f"{existing['source']})")
            return out
        try:
            manifest = _build_shards(corpus, out, settings, num_proc, verbose)
        except EmptySplit:
            if created:  # leave nothing behind: not even the new, empty directory
                (out / LOCK_NAME).unlink(missing_ok=True)
                out.rmdir()
            raise
    if verbose:
        counts = ", ".join(f"{s} {manifest['splits'][s]['num_tokens']:,} tokens in "
                           f"{len(manifest['splits'][s]['shards'])} shard(s)" for s in SPLITS)
        _log(f"{out}: {corpus.name} from {corpus.source}: {counts}")
    return out


class EmptySplit(DataError):
    """The corpus has no text, or a split would hold no tokens; raised before any shard is written."""


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[bool]:
    """Create ``out`` (errors naming the problem) and hold its lock while the block writes; whether it was new."""
    from jaxgpt import rundir

    created = not out.exists()
    try:
        with rundir.locked_dir(out, what="shard directory", option="--out"):
            yield created
    except rundir.DirError as e:
        raise DataError(str(e)) from None


def _check_not_empty(corpus: Corpus, writers: dict[str, ShardWriter], val_fraction: float) -> None:
    counts = {s: w.num_tokens for s, w in writers.items()}
    text = sum(counts.values()) - corpus.num_documents  # every document adds one <|endoftext|>
    if text <= 0:
        raise EmptySplit(f"{corpus.source}: no text to train on ({corpus.num_documents} document(s), all empty); "
                         "nothing was written. Pass a corpus with text")
    if counts["train"] < 2:
        raise EmptySplit(f"{corpus.source}: the train split would hold {counts['train']} token(s) (val_fraction "
                         f"{val_fraction} of {sum(counts.values())} tokens goes to val); nothing was written. Use a "
                         "smaller --val-fraction or more text")
    if val_fraction > 0 and counts["val"] < 2:
        raise EmptySplit(f"{corpus.source}: the val split would hold {counts['val']} token(s) at val_fraction "
                         f"{val_fraction}; nothing was written. Use more text, a larger --val-fraction, or "
                         "--val-fraction 0 for no val split")


def _build_shards(corpus: Corpus, out: Path, settings: dict[str, Any], num_proc: int, verbose: bool) -> dict[str, Any]:
    def drop_manifest() -> None:  # the shards are about to change
        (out / MANIFEST_NAME).unlink(missing_ok=True)

    meta = {"source": corpus.source, "route": corpus.route, "source_sha256": corpus.sha256}
    writers = {s: ShardWriter(out, corpus.name, s, settings["shard_size"], meta, before_first_write=drop_manifest)
               for s in SPLITS}
    _write_splits(corpus, writers, settings["val_fraction"], _tokenized(corpus, num_proc, verbose))
    _check_not_empty(corpus, writers, settings["val_fraction"])
    drop_manifest()
    headers = {s: w.close() for s, w in writers.items()}
    _remove_stale_shards(out, corpus.name, {shard_filename(corpus.name, h["split"], h["index"])
                                            for hs in headers.values() for h in hs})
    manifest = {
        "format": MANIFEST_FORMAT, "version": FORMAT_VERSION, "name": corpus.name, "source": corpus.source,
        "route": corpus.route, "source_sha256": corpus.sha256, "num_documents": corpus.num_documents,
        "split_mode": split_mode(corpus.num_documents, settings["val_fraction"]), "settings": settings,
        "tokenizer": tokenizer_record(),
        "splits": {s: {"num_tokens": sum(h["num_tokens"] for h in hs),
                       "shards": [{"file": shard_filename(corpus.name, s, h["index"]), "num_tokens": h["num_tokens"]}
                                  for h in hs]}
                   for s, hs in headers.items()},
    }
    atomic_write_json(out / MANIFEST_NAME, manifest)
    return manifest
