"""Any source spec -> a :class:`Corpus`: a named source, ``"hf:NAME_OR_FILES"``, or text file paths/globs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxgpt.data.common import DataError
from jaxgpt.data.corpus import Corpus, _safe_name, text_files_corpus
from jaxgpt.data.hf import HF_PREFIX, hf_corpus
from jaxgpt.data.shakespeare import ROUTES as SHAKESPEARE_ROUTES, shakespeare_corpus, shakespeare_local_corpus


NAMED_SOURCES: dict[str, Callable[..., Corpus]] = {"shakespeare": shakespeare_corpus}
# a named source's local copy (no network) and the routes its corpora record: how prepare tells that shards built from
# it came from another text than the one found now (e.g. the Open Shakespeare fallback, then $JAXGPT_SHAKESPEARE)
LOCAL_SOURCES: dict[str, tuple[Callable[..., Corpus | None], tuple[str, ...]]] = {
    "shakespeare": (shakespeare_local_corpus, SHAKESPEARE_ROUTES)}


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
