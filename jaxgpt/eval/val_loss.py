"""The loss of a model on prepared shards: mean next-token loss (nats), perplexity and bits per byte.

One pass over the split in sequential windows of ``batch_size x seq_len`` tokens (``jaxgpt.data.DataLoader``;
the tail that does not fill a window is left out). Bits per byte divide the summed loss, in bits, by the UTF-8
bytes of the predicted tokens' text: each token's byte length comes from the tokenizer's own bytes for it, and
the ``<|endoftext|>`` separators count 0 bytes (they are not text), so the figure compares across tokenizers.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.eval.common import EvalError, jit_model_program


@functools.lru_cache(maxsize=1)
def byte_lengths() -> np.ndarray:
    """UTF-8 bytes of each GPT-2 token's text (``<|endoftext|>``: 0)."""
    from jaxgpt import tokenizer

    enc = tokenizer.get_encoding()
    lens = np.array([len(enc.decode_single_token_bytes(i)) for i in range(tokenizer.EOT_TOKEN)] + [0], np.int64)
    assert len(lens) == tokenizer.VOCAB_SIZE
    return lens


def char_byte_lengths(record: dict[str, Any]) -> np.ndarray:
    """UTF-8 bytes of each character of a character vocabulary (:mod:`jaxgpt.chars`)."""
    return np.array([len(c.encode("utf-8")) for c in record["chars"]], np.int64)


def evaluate(model: Any, data: str | Path, *, split: str = "val", batch_size: int = 8, seq_len: int | None = None,
             limit: int | None = None, progress: bool = False, tokenizer: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """``loss``, ``perplexity``, ``bits_per_byte``, ``tokens``, ``bytes``, ``batches`` of ``model`` on ``data``.
    ``tokenizer``: the record of the model's tokenizer (None: GPT-2's); shards of another are refused."""
    from flax import nnx
    from tqdm.auto import tqdm

    from jaxgpt.data import DataError, DataLoader, check_tokenizer_matches

    try:
        check_tokenizer_matches(data, tokenizer, "the model")  # characters vs BPE: one line
    except DataError as e:
        raise EvalError(str(e)) from None
    seq_len = seq_len or model.config.block_size
    if seq_len > model.config.block_size:
        raise EvalError(f"seq_len = {seq_len}: must be <= the model's block_size ({model.config.block_size})")
    loader = DataLoader(data, split, batch_size, seq_len, mode="sequential", vocab_size=model.config.vocab_size)
    n = loader.batches_per_epoch if limit is None else min(limit, loader.batches_per_epoch)
    graphdef, state = nnx.split(model)
    loss_sum = loss_sum_program(graphdef)
    _check_memory(loss_sum, state, batch_size, seq_len)
    lens = char_byte_lengths(tokenizer) if (tokenizer or {}).get("name") == "char" else byte_lengths()
    total, tokens, nbytes = 0.0, 0, 0
    t0 = time.perf_counter()
    for _ in tqdm(range(n), unit="batch", desc=f"{split} loss", disable=not progress):
        try:
            x, y = loader.next_batch()  # every id checked against the model's vocabulary
        except DataError as e:  # names the shard, the token offset and the id
            raise EvalError(str(e)) from None
        total += float(loss_sum(state, x, y))
        tokens += y.size
        nbytes += int(lens[np.minimum(y, len(lens) - 1)].sum())
    loss = total / tokens
    return {"split": split, "loss": loss, "perplexity": math.exp(loss), "bits_per_byte": total / math.log(2) / nbytes,
            "tokens": tokens, "bytes": nbytes, "batches": n, "batch_size": batch_size, "seq_len": seq_len,
            "seconds": time.perf_counter() - t0}


def loss_sum_program(graphdef: Any) -> Any:
    """``loss_sum(state, x, y)``: the summed next-token losses of ``graphdef``'s model, jitted with its platform's
    compiler options (:func:`jaxgpt.eval.common.jit_model_program`)."""
    from flax import nnx

    def loss_sum(state, x, y):
        losses, _ = nnx.merge(graphdef, state).token_losses(x, y)
        return losses.sum()

    return jit_model_program(graphdef, loss_sum)


def _check_memory(loss_sum: Any, state: Any, batch_size: int, seq_len: int) -> None:
    """On a GPU: the loss program against JAX's memory pool (:mod:`jaxgpt.memory_fit`); on the CPU: nothing."""
    import jax

    from jaxgpt import memory_fit

    pool = memory_fit.device_pool(jax.local_devices()[:1])
    if pool is None:
        return

    def measure(n: int) -> int:
        tokens = jax.ShapeDtypeStruct((n, seq_len), np.int32)
        return memory_fit.program_bytes(loss_sum.lower(state, tokens, tokens).compile())

    memory_fit.check_batch(f"the loss at --batch-size {batch_size} x {seq_len} tokens", measure(batch_size), pool,
                           batch_size, measure, option="--batch-size")
