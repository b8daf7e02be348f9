"""The shard format: uint16 token files with JSON sidecar headers and a directory manifest; writing one shard,
and finding and checking the shards of a split (see :mod:`jaxgpt.data` for the layout)."""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import UInt16

from jaxgpt import tokenizer
from jaxgpt.data.common import DataError, _read_json, atomic_write_bytes, atomic_write_json, sha256_bytes


SPLITS = ("train", "val")
SHARD_FORMAT = "jaxgpt-shard"
MANIFEST_FORMAT = "jaxgpt-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


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
