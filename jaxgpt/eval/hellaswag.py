"""HellaSwag, scored as build-nanogpt scores it.

Each item is a context and four endings, one of them right (``label``). Every ending is appended to the context
(``ctx`` tokens, then the tokens of ``" " + ending``) and the model's loss of the ending's tokens is summed and
averaged. The prediction is the ending with the lowest summed loss (``acc``) and with the lowest *average* loss
(``acc_norm``, length-normalised: the number build-nanogpt reports, 29.55% for OpenAI's gpt2 124M). Items come
from the official ``rowanz/hellaswag`` jsonl files (fields ``ctx``, ``endings``, ``label``, ``ind``, ...); Hugging
Face's ``Rowan/hellaswag`` rows, whose labels are strings (``"1"``), are read as well.

Scoring is batched and jitted, and the four endings share their context: ``batch_size`` items at a time, the
contexts run once (padded to a multiple of :data:`CTX_BUCKET` tokens) filling a KV cache, then each item's four
endings (padded to a multiple of :data:`END_BUCKET`) run against a copy of its context's cache from the
context's true length on (the padding past it is overwritten by the endings' own keys, or masked as the future),
and the lm_head runs only where an ending token is predicted. That is about half the work of scoring four full
rows, and the same numbers (parity_tests/test_eval_parity.py: torch_ref and transformers score full rows). The
scorer compiles once per (context, ending) bucket pair, a handful of times in all. An item longer than the block
size loses the start of its context (it is counted in ``truncated``).
"""

from __future__ import annotations

import dataclasses
import functools
import http.client
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Int32

from jaxgpt.eval.common import EvalError, jit_model_program

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
CTX_BUCKET, END_BUCKET = 32, 16  # padded context / ending lengths are multiples of these
N_ENDINGS = 4


@dataclasses.dataclass(frozen=True)
class Item:
    ctx: str
    endings: tuple[str, ...]
    label: int
    ind: int | None = None
    origin: str | None = None  # "file:line" it was read from

    def name(self) -> str:
        """How messages name the item: its ``ind``, and where it was read from."""
        if self.ind is None:
            return f"HellaSwag item at {self.origin}" if self.origin else "HellaSwag item"
        return f"HellaSwag item {self.ind}" + (f" ({self.origin})" if self.origin else "")


def parse(lines: Iterable[str], *, source: str = "<items>", limit: int | None = None) -> list[Item]:
    """HellaSwag items from jsonl lines (blank lines skipped); a malformed line is an :class:`EvalError` naming
    the line and the field."""
    items: list[Item] = []
    for n, line in enumerate(lines, start=1):
        if limit is not None and len(items) >= limit:
            break
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{source}:{n}: not JSON ({e.msg}); expected one HellaSwag item per line") from None
        ctx, endings, label = d.get("ctx") if isinstance(d, dict) else None, None, None
        if isinstance(d, dict):
            endings, label = d.get("endings"), d.get("label")
        if not isinstance(ctx, str) or not ctx:
            raise EvalError(f"{source}:{n}: 'ctx' must be a non-empty string (is this a HellaSwag jsonl file?)")
        if not (isinstance(endings, list) and len(endings) == N_ENDINGS and all(isinstance(e, str) for e in endings)):
            raise EvalError(f"{source}:{n}: 'endings' must be a list of {N_ENDINGS} strings")
        if isinstance(label, str) and label.strip().isdigit():  # Hugging Face's Rowan/hellaswag: "0".."3"
            label = int(label)
        if label is None or label == "":
            raise EvalError(f"{source}:{n}: 'label' is missing or empty (the test split has no labels: use the val "
                            "split)")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < N_ENDINGS:
            raise EvalError(f"{source}:{n}: 'label' must be an integer in [0, {N_ENDINGS}) (or its string, as "
                            f"Hugging Face's Rowan/hellaswag stores it), got {label!r}")
        items.append(Item(ctx, tuple(endings), label, d.get("ind"), f"{source}:{n}"))
    return items


def load(path: str | Path, *, limit: int | None = None) -> list[Item]:
    path = check_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            items = parse(f, source=str(path), limit=limit)
    except UnicodeDecodeError as e:
        raise EvalError(f"HellaSwag file {str(path)!r} is not UTF-8 text ({e}); expected the official jsonl") from None
    except OSError as e:
        raise EvalError(f"HellaSwag file {str(path)!r} cannot be read: {e}") from None
    if not items:
        raise EvalError(f"{path}: no HellaSwag items")
    return items


def check_file(path: str | Path) -> Path:
    """``path``, if it is a file; else an :class:`EvalError` saying what it is instead."""
    path = Path(path)
    if path.is_dir():
        raise EvalError(f"HellaSwag file {str(path)!r} is a directory; pass the jsonl file itself "
                        f"(e.g. {path / 'hellaswag_val.jsonl'})")
    if not path.is_file():
        raise EvalError(f"HellaSwag file {str(path)!r} does not exist; download {URL.format(split='val')}")
    return path


def find_or_download(data: str | Path | None, *, split: str = "val", cache_dir: Path | None = None,
                     fetch: Callable[[str, float], bytes] | None = None) -> Path:
    """``data`` itself; else the cached ``hellaswag_<split>.jsonl``; else download it into the cache where a
    network is reachable. Offline with no file: an :class:`EvalError` naming the fix."""
    from jaxgpt import data as data_lib

    if data is not None:
        return Path(data)
    cache = Path(cache_dir) if cache_dir is not None else data_lib.default_cache_dir()
    path = cache / f"hellaswag_{split}.jsonl"
    if path.is_file():
        return path
    url = URL.format(split=split)
    fix = f"download it elsewhere and pass --data PATH/hellaswag_{split}.jsonl (or put it at {path})"
    try:
        body = (fetch or data_lib.fetch_url)(url, 30.0)
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError, timeouts, IncompleteRead, ...
        raise EvalError(f"no HellaSwag file given and {url} could not be downloaded ({str(e) or type(e).__name__}); "
                        f"{fix}") from None
    try:  # all of it, before it is cached: a truncated download or a page that is not the dataset is refused
        items = parse(body.decode("utf-8").splitlines(), source=url)
    except UnicodeDecodeError:
        raise EvalError(f"{url}: the download is not UTF-8 text, so not the HellaSwag jsonl; {fix}") from None
    except EvalError as e:
        raise EvalError(f"{e} (the download is incomplete or not the dataset; nothing was cached); {fix}") from None
    if not items:
        raise EvalError(f"{url}: the download holds no HellaSwag items; {fix}")
    try:
        data_lib.atomic_write_bytes(path, body)
    except OSError as e:
        raise EvalError(f"cannot write the downloaded HellaSwag file to {path} ({e}); set JAXGPT_CACHE_DIR, or "
                        f"save it elsewhere and pass --data") from None
    return path


def render(item: Item, encode: Callable[[str], list[int]], block_size: int) -> tuple[list[list[int]], int, bool]:
    """The four rows (context + ending tokens), the context length, and whether the context was cut from the left
    to fit ``block_size``; build-nanogpt's ``render_example``."""
    ctx = encode(item.ctx)
    ends = [encode(" " + e) for e in item.endings]
    longest = len(ctx) + max(len(e) for e in ends)
    cut = max(0, longest - block_size)
    if cut >= len(ctx):
        raise EvalError(f"{item.name()}: an ending alone is longer than the block size {block_size}")
    ctx = ctx[cut:]
    return [ctx + e for e in ends], len(ctx), cut > 0


def pad(rows: Sequence[list[int]], ctx_lens: Sequence[int], length: int, n_rows: int
        ) -> tuple[Int32[np.ndarray, "rows length"], Int32[np.ndarray, "rows length"]]:
    """Token rows padded to ``length`` x ``n_rows`` (zeros), and a mask of 1 on each row's ending tokens."""
    tokens = np.zeros((n_rows, length), np.int32)
    mask = np.zeros((n_rows, length), np.int32)
    for r, (row, c) in enumerate(zip(rows, ctx_lens)):
        tokens[r, : len(row)] = row
        mask[r, c : len(row)] = 1
    return tokens, mask


def bucket(n: int, step: int, limit: int) -> int:
    return min(limit, step * math.ceil(n / step))


def pack(rendered: Sequence[tuple[list[list[int]], int, bool]], n_items: int, block_size: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Contexts ``(items, Lc)``, their lengths, endings ``(items, 4, Le)`` and their lengths, zero-padded to the
    buckets (and to ``n_items`` items: padding items have one-token contexts and empty endings)."""
    ctxs = [rows[0][:c] for rows, c, _ in rendered]
    ends = [[r[c:] for r in rows] for rows, c, _ in rendered]
    lc = bucket(max(map(len, ctxs)), CTX_BUCKET, block_size)
    le = bucket(max(len(e) for es in ends for e in es), END_BUCKET, block_size)
    ctx = np.zeros((n_items, lc), np.int32)
    ctx_len = np.ones((n_items,), np.int32)
    end = np.zeros((n_items, N_ENDINGS, le), np.int32)
    end_len = np.zeros((n_items, N_ENDINGS), np.int32)
    for i, (c, es) in enumerate(zip(ctxs, ends)):
        ctx[i, : len(c)], ctx_len[i] = c, len(c)
        for k, e in enumerate(es):
            end[i, k, : len(e)], end_len[i, k] = e, len(e)
    return ctx, ctx_len, end, end_len


class Scorer:
    """Scores items with a jaxgpt model; build it once and call :meth:`score` or :meth:`evaluate` as often as
    needed (compiled functions are reused as long as the model's structure and the buckets are the same)."""

    def __init__(self, model: Any, *, batch_size: int = 8):
        from flax import nnx

        if batch_size < 1:
            raise EvalError(f"batch_size = {batch_size}: must be >= 1")
        self.batch_size, self.config = batch_size, model.config
        self.graphdef, self.state = nnx.split(model)
        self._fn = jit_model_program(self.graphdef, functools.partial(_ending_losses, self.graphdef))

    def check_memory(self, items: Sequence[Item]) -> None:
        """On a GPU: the scoring program at the widest of ``items``' padded shapes against JAX's memory pool; one
        that does not fit raises :class:`~jaxgpt.memory_fit.DeviceMemoryError` naming the largest batch size that
        does (:mod:`jaxgpt.memory_fit`). On the CPU: nothing."""
        import jax

        from jaxgpt import memory_fit, tokenizer

        pool = memory_fit.device_pool(jax.local_devices()[:1])
        if pool is None or not items:
            return
        rendered = [render(it, tokenizer.encode, self.config.block_size) for it in items]
        lc = bucket(max(c for _, c, _ in rendered), CTX_BUCKET, self.config.block_size)
        le = bucket(max(len(r) - c for rows, c, _ in rendered for r in rows), END_BUCKET, self.config.block_size)

        def measure(n: int) -> int:
            i32 = np.int32
            shapes = ((n, lc), (n,), (n, N_ENDINGS, le), (n, N_ENDINGS))
            args = [jax.ShapeDtypeStruct(s, i32) for s in shapes]
            return memory_fit.program_bytes(self._fn.lower(self.state, *args).compile())

        memory_fit.check_batch(f"HellaSwag scoring at --batch-size {self.batch_size}", measure(self.batch_size),
                               pool, self.batch_size, measure, option="--batch-size")

    def score(self, items: Sequence[Item], *, state: Any = None, progress: bool = False) -> list[dict[str, Any]]:
        """Per item: the four endings' summed and mean losses, the predictions and whether they are right."""
        from tqdm.auto import tqdm

        from jaxgpt import tokenizer

        state = self.state if state is None else state
        out: list[dict[str, Any]] = []
        bar = tqdm(total=len(items), unit="item", desc="hellaswag", disable=not progress)
        for start in range(0, len(items), self.batch_size):
            batch = items[start : start + self.batch_size]
            rendered = [render(it, tokenizer.encode, self.config.block_size) for it in batch]
            sums, counts = (np.asarray(a) for a in self._fn(state, *pack(rendered, self.batch_size,
                                                                           self.config.block_size)))
            for i, (item, (_, _, truncated)) in enumerate(zip(batch, rendered)):
                s, n = sums[i].astype(float), counts[i].astype(float)
                mean = s / n
                pred, pred_norm = int(np.argmin(s)), int(np.argmin(mean))
                out.append({"ind": item.ind, "label": item.label, "pred": pred, "pred_norm": pred_norm,
                            "correct": pred == item.label, "correct_norm": pred_norm == item.label,
                            "sum_losses": s.tolist(), "mean_losses": mean.tolist(),
                            "n_tokens": [int(x) for x in n], "truncated": truncated})
            bar.update(len(batch))
        bar.close()
        return out

    def evaluate(self, items: Sequence[Item], *, params: Any = None, progress: bool = False) -> dict[str, Any]:
        """``acc``, ``acc_norm``, ``n`` and the time taken; ``params`` (an ``nnx.Param`` state of the same model,
        e.g. a training run's current params) replaces the model's own."""
        state = None if params is None else _with_params(self.graphdef, self.state, params)
        t0 = time.perf_counter()
        results = self.score(items, state=state, progress=progress)
        return summarize(results, seconds=time.perf_counter() - t0)


def _ending_losses(graphdef, state, ctx, ctx_len, end, end_len):
    """Summed loss and token count of each item's four endings, ``(items, 4)`` each (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxgpt.kernels import loss as fused_loss
    from jaxgpt.model import KVCache

    model = nnx.merge(graphdef, state)
    n, le = end.shape[0], end.shape[2]
    cache = model.init_cache(n, ctx.shape[1] + le)
    h_ctx, cache = model.hidden(ctx, cache=cache, pos=0)
    last = jnp.take_along_axis(h_ctx, (ctx_len - 1)[:, None, None], axis=1)  # predicts each ending's first token

    def endings(k, v, tokens, pos):  # one item: its context's cache, four rows from its true length on
        copies = KVCache(*(jnp.broadcast_to(a[:, None], (a.shape[0], N_ENDINGS, *a.shape[1:])) for a in (k, v)))
        return model.hidden(tokens, cache=copies, pos=pos)[0]

    h_end = jax.vmap(endings)(cache.k.swapaxes(0, 1), cache.v.swapaxes(0, 1), end, ctx_len)  # (n, 4, le, C)
    h = jnp.concatenate([jnp.broadcast_to(last[:, None], (n, N_ENDINGS, 1, last.shape[-1])), h_end[:, :, :-1]], 2)
    losses, _ = fused_loss.token_cross_entropy(h.reshape(n * N_ENDINGS, le, -1), model.wte.embedding[...],
                                        end.reshape(n * N_ENDINGS, le), vocab_size=model.config.vocab_size,
                                        dtype=model.policy.dtype, precision=model.policy.lax_precision)
    valid = jnp.arange(le) < end_len[..., None]  # (n, 4, le)
    losses = jnp.where(valid, losses.reshape(n, N_ENDINGS, le), 0.0)  # padding may be NaN past the block size
    return losses.sum(axis=-1), valid.sum(axis=-1)


def _with_params(graphdef: Any, state: Any, params: Any) -> Any:
    """The model's state with its ``nnx.Param`` leaves replaced by ``params``; ``state`` itself is left as it is
    (merged without ``copy``, the model's Variables would be ``state``'s own, and the update would write into it)."""
    from flax import nnx

    model = nnx.merge(graphdef, state, copy=True)
    nnx.update(model, params)
    return nnx.state(model)


def summarize(results: Sequence[dict[str, Any]], *, seconds: float | None = None) -> dict[str, Any]:
    n = len(results)
    out = {"n": n, "acc": sum(r["correct"] for r in results) / n if n else float("nan"),
           "acc_norm": sum(r["correct_norm"] for r in results) / n if n else float("nan"),
           "truncated": sum(r["truncated"] for r in results)}
    if seconds is not None:
        out.update(seconds=seconds, items_per_s=n / seconds if seconds > 0 else None)
    return out
