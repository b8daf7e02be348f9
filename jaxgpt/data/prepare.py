"""Corpus -> train/val shards: tokenize (optionally in a process pool), split by documents or by tokens, write
the shards into a staging directory and, once both splits are complete, move them into place and write the
manifest; reuse shards whose manifest matches the input and settings. :func:`ensure_prepared` is the entry for
callers that share a data directory (training): it waits for another process preparing it."""

from __future__ import annotations

import contextlib
import glob
import math
import multiprocessing
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from jaxtyping import UInt16
from tqdm import tqdm

from jaxgpt import diskspace, tokenizer
from jaxgpt.data.common import DataError, _log, _read_json, atomic_write_json
from jaxgpt.data.corpus import Corpus
from jaxgpt.data.shards import (COMMIT_MARKER, FORMAT_VERSION, MANIFEST_FORMAT, MANIFEST_NAME, SPLITS, ShardWriter,
                                encode_document, shard_filename, tokenizer_record)
from jaxgpt.chars import NAME as CHAR_TOKENIZER, CharTokenizer, CharTokenizerError
from jaxgpt.rundir import LOCK_NAME
from jaxgpt.data.sources import LOCAL_SOURCES, resolve_source


DEFAULT_SHARD_SIZE = 100_000_000  # tokens (200 MB) per shard, as build-nanogpt's fineweb.py
DEFAULT_VAL_FRACTION = 0.1


def _tokenized(corpus: Corpus, num_proc: int, progress: bool, chars: CharTokenizer | None = None
               ) -> Iterator[UInt16[np.ndarray, " n"]]:
    """Each document's tokens, in order; with ``num_proc > 1`` encoded by a spawn-started process pool. With
    ``chars``: each document's character ids, no separator (nanoGPT's shakespeare_char)."""
    bar = tqdm(total=corpus.num_documents, unit="doc", desc=f"tokenizing {corpus.name}", disable=not progress)
    try:
        if chars is not None:
            for text in corpus.documents():
                bar.update(1)
                yield np.asarray(chars.encode(text), dtype=np.uint16)
            return
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


TOKENIZERS = (tokenizer.ENCODING_NAME, CHAR_TOKENIZER)  # "gpt2", "char"


def _settings(val_fraction: float, shard_size: int, tokenizer_name: str = tokenizer.ENCODING_NAME) -> dict[str, Any]:
    return {"val_fraction": val_fraction, "shard_size": shard_size, "tokenizer": tokenizer_name,
            "version": FORMAT_VERSION}


def _check_settings(val_fraction: float, shard_size: int, num_proc: int, tokenizer_name: str = "gpt2") -> None:
    if tokenizer_name not in TOKENIZERS:
        raise DataError(f"tokenizer = {tokenizer_name!r}: allowed values are {list(TOKENIZERS)} (GPT-2's BPE, or "
                        "nanoGPT's characters)")
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


def _source_changed(out_dir: Path, source: Any, cache_dir: str | Path | None, verbose: bool) -> bool:
    """Whether ``out_dir``'s shards are jaxgpt's own build of the named ``source`` from another text than the local
    copy found now (``$JAXGPT_SHAKESPEARE`` supplied after the Open Shakespeare fallback was used): to be rebuilt.
    False for shards without a manifest (made by hand or by another tool), for a manifest of another source or
    route (``python -m jaxgpt.data --input my.txt`` made it: the user's), and when no local copy is there (the
    network is not asked)."""
    if not isinstance(source, str) or source not in LOCAL_SOURCES:
        return False
    manifest = _read_json(out_dir / MANIFEST_NAME)
    local, routes = LOCAL_SOURCES[source]
    if (manifest is None or manifest.get("format") != MANIFEST_FORMAT or manifest.get("name") != source
            or manifest.get("route") not in routes):
        return False
    corpus = local(cache_dir)
    if corpus is None or corpus.sha256 == manifest.get("source_sha256"):
        return False
    if verbose:
        _log(f"{out_dir}: its shards were built from {manifest.get('source')} (sha256 "
             f"{str(manifest.get('source_sha256'))[:12]}…), but {source} is now {corpus.source} (sha256 "
             f"{corpus.sha256[:12]}…): rebuilding them")
    return True


def _remove_stale_shards(out_dir: Path, name: str, keep: set[str]) -> None:
    for split in SPLITS:
        for path in out_dir.glob(f"{glob.escape(name)}_{split}_[0-9]*.bin"):
            if path.name not in keep:
                path.unlink(missing_ok=True)
                path.with_suffix(".json").unlink(missing_ok=True)


DEFAULT_WAIT_S = 3600.0  # how long ensure_prepared waits for another process preparing the same directory
STAGING_PREFIX = ".jaxgpt-staging."  # <out>/.jaxgpt-staging.<pid>.<random>/: the new shards until they are complete


def is_prepared(data_dir: str | Path) -> bool:
    """Whether ``data_dir`` holds shards to use as they are: a manifest, or shards without one (made by hand, by
    another tool or by an older jaxgpt), unless they are the remains of an interrupted commit."""
    d = Path(data_dir)
    if not d.is_dir():
        return False
    if (d / MANIFEST_NAME).exists():
        return True
    return not (d / COMMIT_MARKER).exists() and any(d.glob("*_train_[0-9]*.bin"))


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
    option: str = "--out",
    wait_s: float | None = 0,
    use_existing: bool = False,
    tokenizer: str = "gpt2",
) -> Path:
    """Tokenize ``source`` into train/val shards in ``out_dir`` and return ``out_dir``.

    ``source``: a named source (``"shakespeare"``), ``"hf:NAME_OR_LOCAL_FILES"`` or text file paths/globs.
    Idempotent: when ``out_dir/manifest.json`` records the same input sha256 and settings and every shard
    header agrees, nothing is rewritten (``force=True`` rewrites anyway).

    All or nothing: the new shards are written into a staging directory inside ``out_dir`` and moved into place
    (the manifest last) only once both splits are complete and non-empty; any failure before that leaves an
    existing ``out_dir`` exactly as it was and removes one this call created.

    The directory is locked while it is written (see :mod:`jaxgpt.rundir`). ``wait_s=0`` refuses at once when
    another process holds the lock; otherwise wait up to ``wait_s`` seconds for it (``None``: no limit), then
    check again. ``use_existing=True``: shards already in ``out_dir`` (:func:`is_prepared`: a manifest of any
    source, or shards without one) are used as they are, also when another process finished them while this
    one waited. ``option`` names the caller's setting for ``out_dir`` in error messages (``"--out"``,
    ``"data_dir"``). ``tokenizer``: ``"gpt2"`` (BPE, an ``<|endoftext|>`` before every document) or ``"char"``
    (nanoGPT's shakespeare_char: the sorted set of the corpus's characters, no separator; the vocabulary is
    recorded in the manifest and the shard headers).
    """
    _check_settings(val_fraction, shard_size, num_proc, tokenizer)
    out = Path(out_dir)
    if use_existing and is_prepared(out) and not _source_changed(out, source, cache_dir, verbose):
        return out
    corpus = resolve_source(source, name=name, text_column=text_column, hf_split=hf_split, hf_config=hf_config,
                            cache_dir=cache_dir, verbose=verbose)
    if corpus.num_documents == 0:
        raise DataError(f"{corpus.source} has no documents; nothing to tokenize")
    settings = _settings(val_fraction, shard_size, tokenizer)
    with _writing(out, option, wait_s, verbose):
        if use_existing and is_prepared(out) and not _source_changed(out, source, cache_dir, False):
            if verbose:
                _log(f"{out}: prepared by the process this one waited for; using its shards")
            return out
        existing = None if force else _manifest_matches(out, corpus, settings)
        if existing is not None:
            if verbose:
                _log(f"{out}: shards up to date (source sha256 {corpus.sha256[:12]}…, built from "
                     f"{existing['source']})")
            return out
        manifest = _build_shards(corpus, out, settings, num_proc, verbose, option)
    if verbose:
        counts = ", ".join(f"{s} {manifest['splits'][s]['num_tokens']:,} tokens in "
                           f"{len(manifest['splits'][s]['shards'])} shard(s)" for s in SPLITS)
        _log(f"{out}: {corpus.name} from {corpus.source}: {counts}")
    return out


def ensure_prepared(
    source: str | Path | Sequence[str | Path],
    data_dir: str | Path,
    *,
    option: str = "data_dir",
    wait_s: float | None = DEFAULT_WAIT_S,
    verbose: bool = True,
    **prepare_kwargs: Any,
) -> Path:
    """``data_dir`` ready to train on, for callers such as training that share a data directory: shards already
    there are used as they are (:func:`is_prepared`); otherwise ``source`` is prepared into it. When another
    process holds the directory's lock (it is preparing it), wait up to ``wait_s`` seconds for it (saying so),
    then use what it made. Errors are :class:`DataError` naming ``option``."""
    return prepare(source, data_dir, option=option, wait_s=wait_s, verbose=verbose, use_existing=True,
                   **prepare_kwargs)


class EmptySplit(DataError):
    """The corpus has no text, or a split would hold no tokens; raised before any shard reaches the directory."""


@contextlib.contextmanager
def _writing(out: Path, option: str, wait_s: float | None, verbose: bool) -> Iterator[None]:
    """Create ``out`` (errors naming the problem and ``option``) and hold its lock while the block writes. If the
    block fails, a directory this created is removed again, and so is a lock file this created."""
    from jaxgpt import rundir

    what = "shard directory"

    def waiting(holder: dict[str, Any]) -> None:
        if verbose:
            limit = "no time limit" if wait_s is None else f"up to {wait_s:g} s"
            _log(f"{out}: the {what} is locked by {rundir.describe_holder(holder)}; waiting for it to finish "
                 f"({limit})")

    created = not out.exists()
    try:
        rundir.make_dir(out, what=what, option=option)
        had_lock_file = (out / LOCK_NAME).exists()
        lock = rundir.DirLock(out, what=what, option=option).acquire(wait_s=wait_s, on_wait=waiting)
    except rundir.DirError as e:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise DataError(str(e)) from None
    ok = False
    try:
        for leftover in out.glob(glob.escape(STAGING_PREFIX) + "*"):  # of a killed preparation: ours to remove
            shutil.rmtree(leftover, ignore_errors=True)
        if (out / MANIFEST_NAME).exists():  # a commit killed before it began or after its manifest: consistent
            (out / COMMIT_MARKER).unlink(missing_ok=True)
        yield
        ok = True
    finally:
        if not ok:
            if created or not had_lock_file:
                lock.remove_file()
            if created:
                with contextlib.suppress(OSError):
                    out.rmdir()
        lock.release()


def _check_not_empty(corpus: Corpus, writers: dict[str, ShardWriter], val_fraction: float, out: Path,
                     option: str, separated: bool = True) -> None:
    counts = {s: w.num_tokens for s, w in writers.items()}
    separators = corpus.num_documents if separated else 0  # GPT-2: every document adds one <|endoftext|>
    text = sum(counts.values()) - separators
    nothing = f"nothing was written to {out}"
    settings = ("" if option == "--out" else
                f" (prepare {out} with other settings first: `python -m jaxgpt.data ... --out {out} --val-fraction F`)")
    if text <= 0:
        raise EmptySplit(f"{corpus.source}: no text to train on ({corpus.num_documents} document(s), all empty); "
                         f"{nothing}. Pass a corpus with text")
    if counts["train"] < 2:
        raise EmptySplit(f"{corpus.source}: the train split would hold {counts['train']} token(s) (val_fraction "
                         f"{val_fraction} of {sum(counts.values())} tokens goes to val); {nothing}. Use a "
                         f"smaller --val-fraction or more text{settings}")
    if val_fraction > 0 and counts["val"] < 2:
        raise EmptySplit(f"{corpus.source}: the val split would hold {counts['val']} token(s) at val_fraction "
                         f"{val_fraction}; {nothing}. Use more text, a larger --val-fraction, or "
                         f"--val-fraction 0 for no val split{settings}")


def _build_shards(corpus: Corpus, out: Path, settings: dict[str, Any], num_proc: int, verbose: bool,
                  option: str) -> dict[str, Any]:
    """Write the shards into a staging directory inside ``out``, then :func:`_commit` them."""
    staging = out / f"{STAGING_PREFIX}{os.getpid()}.{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    writers: dict[str, ShardWriter] = {}
    committing = False
    try:
        meta = {"source": corpus.source, "route": corpus.route, "source_sha256": corpus.sha256}
        chars, record = None, tokenizer_record()
        if settings["tokenizer"] == CHAR_TOKENIZER:  # nanoGPT: the vocabulary of the whole text, both splits
            chars = _char_vocabulary(corpus)
            record = chars.record()
            meta = {**meta, "tokenizer": CHAR_TOKENIZER, "vocab_size": chars.vocab_size, "eot_token": None}
        writers = {s: ShardWriter(staging, corpus.name, s, settings["shard_size"], meta) for s in SPLITS}
        _write_splits(corpus, writers, settings["val_fraction"], _tokenized(corpus, num_proc, verbose, chars))
        _check_not_empty(corpus, writers, settings["val_fraction"], out, option, separated=chars is None)
        headers = {s: w.close() for s, w in writers.items()}
        manifest = {
            "format": MANIFEST_FORMAT, "version": FORMAT_VERSION, "name": corpus.name, "source": corpus.source,
            "route": corpus.route, "source_sha256": corpus.sha256, "num_documents": corpus.num_documents,
            "split_mode": split_mode(corpus.num_documents, settings["val_fraction"]), "settings": settings,
            "tokenizer": record,
            "splits": {s: {"num_tokens": sum(h["num_tokens"] for h in hs),
                           "shards": [{"file": shard_filename(corpus.name, s, h["index"]),
                                       "num_tokens": h["num_tokens"]} for h in hs]}
                       for s, hs in headers.items()},
        }
        committing = True
        _commit(staging, out, corpus.name, manifest)
    except OSError as e:
        why = diskspace.write_failure(e)
        if why is None:
            raise
        tokens = sum(w.num_tokens for w in writers.values())
        kept = ("the commit was cut short: the directory has no manifest now, so nothing reads it as prepared "
                "until it is prepared again" if committing else
                f"nothing was moved into {out} (the staging directory is removed; shards already there are "
                "untouched)")
        raise DataWriteFailed(f"{out}: writing the shards failed at {e.filename or out}: {why[1]}; "
                              f"{tokens:,} tokens ({diskspace.human(2 * tokens)} at 2 bytes per token) were "
                              f"tokenized by then and the shards need at least that much; "
                              f"{diskspace.human(diskspace.free_bytes(out))} free on that file system now; "
                              f"{kept}. Free space or choose another --out, then run the same command again") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _char_vocabulary(corpus: Corpus) -> CharTokenizer:
    try:
        return CharTokenizer.from_text(corpus.documents())
    except CharTokenizerError as e:
        raise EmptySplit(f"{corpus.source}: {e}; nothing was written. Pass a corpus with text") from None


class DataWriteFailed(DataError, diskspace.WriteFailed):
    """Preparing shards ran out of space (or hit another write error); nothing half-written is taken for
    prepared."""


def _commit(staging: Path, out: Path, name: str, manifest: dict[str, Any]) -> None:
    """Move the staged shards into ``out``, replacing the old ones, and write the manifest last.

    Renames within one directory: milliseconds. While they run, ``COMMIT_MARKER`` is in ``out`` and the old
    manifest is gone, so a process killed half-way leaves a directory that readers refuse and the next
    ``prepare`` rebuilds (never a mix of old and new shards taken for a prepared set)."""
    atomic_write_json(out / COMMIT_MARKER, {"pid": os.getpid(), "staging": staging.name})
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    keep = set()
    for split in SPLITS:
        for entry in manifest["splits"][split]["shards"]:
            bin_name = entry["file"]
            json_name = Path(bin_name).with_suffix(".json").name
            os.replace(staging / json_name, out / json_name)
            os.replace(staging / bin_name, out / bin_name)
            keep.add(bin_name)
    _remove_stale_shards(out, name, keep)
    _fsync_dir(out)
    atomic_write_json(out / MANIFEST_NAME, manifest)
    _fsync_dir(out)
    (out / COMMIT_MARKER).unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
