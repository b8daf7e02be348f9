"""Batches from prepared shards: :class:`DataLoader` (sequential or random windows, several processes, an exact
resumable position) and :func:`unigram_loss` (the context-free baseline of a split)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from jaxtyping import Int32

from jaxgpt.data.common import DataError
from jaxgpt.data.shards import _describe, find_shards, vocab_fix


class DataLoader:
    """(x, y) int32 batches of shape (batch_size, seq_len) from memory-mapped uint16 shards; y = x shifted by one.

    ``mode="sequential"``: each shard is cut into consecutive windows of batch_size*seq_len (+1) tokens;
    process p of P takes windows p, p+P, p+2P, ... (disjoint across processes, the same count for each);
    the shard order is a seeded permutation, reshuffled every epoch; the stream wraps around forever.
    ``mode="random"``: each row starts at a uniformly random token position (all shards pooled), drawn
    from a generator seeded by (seed, process_index, batch number).

    ``state_dict()`` is a small JSON-serialisable position; ``load_state_dict`` on a loader built with the
    same arguments continues the stream bit-identically.

    ``vocab_size``: when set (the constructor, or the attribute later), every batch is checked before it is
    returned (one ``max`` over its rows) and an id ``>= vocab_size`` raises the :class:`DataError` of
    :meth:`token_error`, naming the shard, the token offset and the id.
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
        vocab_size: int | None = None,
    ):
        for field_name, v, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("seed", seed, 0),
                                   ("process_count", process_count, 1), ("process_index", process_index, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise DataError(f"DataLoader.{field_name} = {v!r}: must be an integer >= {low}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer))
                                       or vocab_size < 1):
            raise DataError(f"DataLoader.vocab_size = {vocab_size!r}: must be a positive integer or None")
        if process_index >= process_count:
            raise DataError(f"DataLoader.process_index = {process_index}: must be < process_count ({process_count})")
        if mode not in ("sequential", "random"):
            raise DataError(f"DataLoader.mode = {mode!r}: allowed values are ['sequential', 'random']")
        self.data, self.split, self.mode, self.seed = str(data), split, mode, int(seed)
        self.batch_size, self.seq_len = int(batch_size), int(seq_len)
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.shards = find_shards(data, split)
        self.num_tokens = sum(s.num_tokens for s in self.shards)
        self._memmaps: dict[int, np.memmap] = {}
        self._windows = [(s.num_tokens - 1) // self.tokens_per_batch // self.process_count for s in self.shards]
        self._random_starts = np.array([max(s.num_tokens - self.seq_len, 0) for s in self.shards], dtype=np.int64)
        self._check_enough_tokens()
        self._last_rows: list[tuple[int, int]] = []  # (shard, token offset) of each row of the last batch
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
        rows = self._next_rows()
        x, y = rows[:, :-1], rows[:, 1:]
        if self.vocab_size is not None and rows.size and int(rows.max()) >= self.vocab_size:  # uint16: never < 0
            bad = self.token_error(x, y, self.vocab_size)
            if bad is not None:
                raise bad
        return x, y

    def skip(self, batches: int) -> None:
        """Advance past ``batches`` batches exactly as ``next_batch`` would, without checking their ids (skipping
        is how a run steps over bad data)."""
        for _ in range(batches):
            self._next_rows()

    def _next_rows(self) -> Int32[np.ndarray, "batch seq+1"]:
        rows = self._random_rows() if self.mode == "random" else self._sequential_rows()
        self.step += 1
        return rows

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        while True:
            yield self.next_batch()

    def _sequential_rows(self) -> Int32[np.ndarray, "batch seq+1"]:
        shard = self._order[self.shard_pos]
        start = (self.window * self.process_count + self.process_index) * self.tokens_per_batch
        flat = np.asarray(self._tokens(shard)[start : start + self.tokens_per_batch + 1], dtype=np.int32)
        self._last_rows = [(shard, start + r * self.seq_len) for r in range(self.batch_size)]
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
        self._last_rows = [(int(s), int(o)) for s, o in zip(shard_ids, offsets)]
        return np.stack([np.asarray(self._tokens(int(s))[o : o + self.seq_len + 1], dtype=np.int32)
                         for s, o in zip(shard_ids, offsets)])

    def locate(self, row: int, col: int) -> tuple[Path, int]:
        """Where token ``x[row, col]`` of the last batch came from: the shard file and the token offset in it
        (``y[row, col]`` is the next token, at offset + 1)."""
        shard, offset = self._last_rows[row]
        return self.shards[shard].path, offset + col

    def token_error(self, x: np.ndarray, y: np.ndarray, vocab_size: int) -> DataError | None:
        """For the last batch ``x, y`` (as returned, or reshaped with the rows in order): a DataError naming the
        shard, the offset and the first id ``>= vocab_size`` (or negative), or None when every id is valid."""
        for name, a, shift in (("x", x, 0), ("y", y, 1)):
            rows = np.asarray(a).reshape(-1, self.seq_len)
            bad = np.argwhere((rows < 0) | (rows >= vocab_size))
            if len(bad):
                r, c = (int(v) for v in bad[0])
                path, offset = self.locate(r, c)
                top = int(rows.max())
                return DataError(
                    f"{path}: token id {int(rows[r, c]):,} at token offset {offset + shift:,} is outside the model's "
                    f"vocabulary [0, {vocab_size:,}) (found in batch {self.step} of the {self.split} split, {name}); "
                    + vocab_fix(self.data, vocab_size, top))
        return None

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
