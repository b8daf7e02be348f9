"""A Hugging Face ``datasets`` dataset as a :class:`Corpus`: a hub name, or local jsonl/json/parquet/csv/txt
files (each row one document)."""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxgpt.data.common import DataError, sha256_bytes
from jaxgpt.data.corpus import Corpus, _files_fingerprint, _safe_name, expand_paths

HF_PREFIX = "hf:"
_HF_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}


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
