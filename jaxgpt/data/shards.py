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
# present while prepare() moves new shards into a directory; with no manifest beside it, the directory holds a
# half-replaced set of shards (the process was killed mid-commit) that nothing may read
COMMIT_MARKER = ".jaxgpt-committing"
SCAN_MAX_TOKENS = 1 << 25  # a shard whose header records no max_token is read whole up to this size (64 MB)


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
    tokens = to_uint16(tokens)
    data = tokens.astype("<u2").tobytes()
    bin_path = Path(out_dir) / shard_filename(name, split, index)
    header = {
        "format": SHARD_FORMAT, "version": FORMAT_VERSION, "name": name, "split": split, "index": index,
        "num_tokens": len(data) // 2, "dtype": "uint16", "byte_order": "little",
        "tokenizer": tokenizer.ENCODING_NAME, "vocab_size": tokenizer.VOCAB_SIZE, "eot_token": tokenizer.EOT_TOKEN,
        "max_token": int(np.max(tokens)) if len(data) else -1, "sha256": sha256_bytes(data), **meta,
    }
    atomic_write_bytes(bin_path, data)
    atomic_write_json(bin_path.with_suffix(".json"), header)
    return header


class ShardWriter:
    """Accumulates token arrays of one split and writes them out in shards of ``shard_size`` tokens."""

    def __init__(self, out_dir: Path, name: str, split: str, shard_size: int, meta: dict[str, Any],
                 before_first_write: Any = None):
        self.out_dir, self.name, self.split, self.shard_size, self.meta = out_dir, name, split, shard_size, meta
        self.before_first_write = before_first_write  # called once, before this writer's first file
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

    @property
    def num_tokens(self) -> int:
        """Tokens added so far (written and pending)."""
        return sum(h["num_tokens"] for h in self.headers) + self.num_pending

    def _flush(self, n: int) -> None:
        if self.before_first_write is not None:
            self.before_first_write()
            self.before_first_write = None
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
        if manifest is None and (data / COMMIT_MARKER).exists():
            raise DataError(f"{data}: a preparation was interrupted while it moved new shards in (no manifest.json, "
                            f"and {COMMIT_MARKER} is still there), so its shards may be mixed; prepare it again with "
                            f"`python -m jaxgpt.data ... --out {data}`")
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


def tokenizer_record() -> dict[str, Any]:
    """What a manifest records of the tokenizer its shards were made with (GPT-2's BPE; a character vocabulary
    records :meth:`jaxgpt.chars.CharTokenizer.record`)."""
    return {"name": tokenizer.ENCODING_NAME, "vocab_size": tokenizer.VOCAB_SIZE,
            "merges_sha256": tokenizer.VOCAB_BPE_SHA256, "eot_token": tokenizer.EOT_TOKEN}


def manifest_tokenizer(data: str | Path) -> dict[str, Any] | None:
    """The tokenizer record of a shard directory's manifest (None: no manifest or an older one, i.e. GPT-2)."""
    data = Path(data)
    rec = (_read_json(data / MANIFEST_NAME) or {}).get("tokenizer") if data.is_dir() else None
    return rec if isinstance(rec, dict) else None


def check_tokenizer_matches(data: str | Path, model_tokenizer: dict[str, Any] | None, whose: str) -> None:
    """One line refusing shards made with another tokenizer than the model's (``whose``: "the checkpoint in
    runs/x", "the model"): character ids fed to a GPT-2 model or BPE ids to a character model mean other text."""
    rec = manifest_tokenizer(data)
    if not tokenizer.same(rec, model_tokenizer):
        want = "char" if (model_tokenizer or {}).get("name") == "char" else "gpt2"
        how = ("the same characters" if want == "char" and (rec or {}).get("name") == "char"
               else tokenizer.describe(model_tokenizer))
        raise DataError(f"{data} holds {tokenizer.describe(rec)} but {whose} was trained on "
                        f"{tokenizer.describe(model_tokenizer)}: its ids would mean other text; use shards made with "
                        f"{how} (`python -m jaxgpt.data ... --tokenizer {want} --out DIR`)")


def vocab_fix(data: str | Path, vocab_size: int, top: int) -> str:
    """What to do about shards holding id ``top`` (>= ``vocab_size``): the model's vocabulary may be the one too
    small, or the shards may come from another tokenizer."""
    from jaxgpt import tokenizer as tok

    return (f"either train a model whose vocab_size exceeds every id in the shards (>= {top + 1:,}), or "
            f"re-tokenize the corpus into shards made with the model's own tokenizer (every id < {vocab_size:,}; "
            f"`python -m jaxgpt.data ... --out {data} --force` makes GPT-2 ones, for a model with vocab_size >= "
            f"{tok.VOCAB_SIZE:,})")


def first_bad_id(shard: Shard, vocab_size: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
    """(token offset, id) of the first id ``>= vocab_size`` in ``shard``, read from disk; None when all are valid."""
    tokens = np.memmap(shard.path, dtype="<u2", mode="r") if shard.num_tokens else np.zeros(0, np.uint16)
    for i in range(0, len(tokens), chunk):
        part = np.asarray(tokens[i : i + chunk])
        if int(part.max()) >= vocab_size:
            j = int(np.flatnonzero(part >= vocab_size)[0])
            return i + j, int(part[j])
    return None


def check_shards_for_model(data: str | Path, vocab_size: int, splits: Sequence[str] = SPLITS, *,
                           scan_max_tokens: int | None = None, model_tokenizer: dict[str, Any] | None = None,
                           whose: str = "the model") -> None:
    """Refuse shards a model with ``vocab_size`` ids cannot train on, before the first step: a manifest naming
    another tokenizer (name or merges) or a larger vocabulary, or a shard holding an id ``>= vocab_size``.

    A shard's id range comes from its header's ``max_token``; a shard without it (made before it was recorded,
    or by another tool) is read whole when it has at most ``scan_max_tokens`` tokens (a val split, usually:
    tens of milliseconds), and otherwise left to the batch-by-batch check (:class:`DataLoader` with
    ``vocab_size``). Errors name the shard, and for a read shard the token offset and the id.
    ``scan_max_tokens``: default :data:`SCAN_MAX_TOKENS`; 0 reads none. ``model_tokenizer``: the record of the
    model's tokenizer (None: GPT-2's); shards of another (characters for a BPE model, or the reverse) are refused
    in one line naming ``whose`` tokenizer it is."""
    scan_max_tokens = SCAN_MAX_TOKENS if scan_max_tokens is None else scan_max_tokens
    data = Path(data)
    manifest = _read_json(data / MANIFEST_NAME) if data.is_dir() else None
    rec = (manifest or {}).get("tokenizer")
    ours = tokenizer_record()
    if isinstance(rec, dict) and (rec.get("name") == "char" or (model_tokenizer or {}).get("name") == "char"):
        check_tokenizer_matches(data, model_tokenizer, whose)
        ours = rec  # (the same characters: checked above)
    elif model_tokenizer is not None and model_tokenizer.get("name") == "char":
        check_tokenizer_matches(data, model_tokenizer, whose)  # no manifest record: GPT-2's shards
    if isinstance(rec, dict):
        if rec.get("name") != ours["name"] or rec.get("merges_sha256") != ours.get("merges_sha256"):
            raise DataError(f"{data}: the shards were made with tokenizer {rec.get('name')!r} (merges sha256 "
                            f"{str(rec.get('merges_sha256'))[:12]}...), but jaxgpt tokenizes with {ours['name']!r} "
                            f"(merges sha256 {ours['merges_sha256'][:12]}...): its ids mean other text to this "
                            f"model; re-tokenize the corpus with jaxgpt's tokenizer: `python -m jaxgpt.data ... "
                            f"--out {data} --force`")
        if int(rec.get("vocab_size", 0)) > vocab_size:
            raise DataError(f"{data}: the shards' tokenizer has {rec['vocab_size']:,} ids but the model's vocab_size is "
                            f"{vocab_size:,}: ids >= {vocab_size:,} would index past its embedding; "
                            + vocab_fix(data, vocab_size, int(rec["vocab_size"]) - 1))
    reference, whose = ((rec, f"the manifest ({data / MANIFEST_NAME})") if isinstance(rec, dict)
                        else (ours, "jaxgpt's tokenizer (the model's)"))
    for split in splits:
        for shard in find_shards(data, split):
            _check_shard_tokenizer(shard, reference, whose, data)
            top = shard.header.get("max_token")
            if isinstance(top, int) and not isinstance(top, bool):
                if top >= vocab_size:
                    raise DataError(f"{shard.path}: holds token id {top:,} >= the model's vocab_size {vocab_size:,} "
                                    f"(its header records it); " + vocab_fix(data, vocab_size, top))
            elif shard.num_tokens <= scan_max_tokens:
                bad = first_bad_id(shard, vocab_size)
                if bad is not None:
                    raise DataError(f"{shard.path}: token id {bad[1]:,} at token offset {bad[0]:,} is outside the "
                                    f"model's vocabulary [0, {vocab_size:,}) (the {split} split; its header records "
                                    f"no max_token, so the shard was read); " + vocab_fix(data, vocab_size, bad[1]))


def shard_tokenizer_record(header: dict[str, Any]) -> dict[str, Any]:
    """What a shard's header records of its tokenizer (the keys a manifest's record shares with it)."""
    return {"name": header.get("tokenizer"), "vocab_size": header.get("vocab_size"),
            "eot_token": header.get("eot_token")}


def _check_shard_tokenizer(shard: Shard, reference: dict[str, Any], whose: str, data: Path) -> None:
    """Refuse a shard whose header names another tokenizer than ``reference`` (a shard copied in from a corpus
    tokenized otherwise). A header without a tokenizer record (another tool's) is left to the id checks."""
    if shard.header.get("tokenizer") is None:
        return
    mine = shard_tokenizer_record(shard.header)
    differ = [k for k in ("name", "vocab_size", "eot_token") if reference.get(k) is not None and mine[k] != reference[k]]
    if differ:
        show = lambda r: ", ".join(f"{k} {r.get(k)!r}" for k in ("name", "vocab_size", "eot_token"))  # noqa: E731
        raise DataError(f"{shard.path}: its header records tokenizer ({show(mine)}) but {whose} records "
                        f"({show(reference)}): the shard was made with another tokenizer (copied in from another "
                        f"corpus?), so its ids mean other text. Remove it, or re-tokenize the corpus: `python -m "
                        f"jaxgpt.data ... --out {data} --force`")
