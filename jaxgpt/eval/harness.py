"""jaxgpt as an EleutherAI lm-evaluation-harness model: ``--model jaxgpt``.

    pip install -e ".[eval]"
    python -m jaxgpt.eval.harness --model jaxgpt --model_args pretrained=runs/gpt2-124m,batch_size=16 \
        --tasks hellaswag,lambada_openai

``python -m jaxgpt.eval.harness`` (installed as ``jaxgpt-lm-eval``) is lm-eval's own command line (every option
of ``lm_eval``) with this module imported first: lm-eval 0.4 discovers models through its registry only, with no
plugin entry points, so the registration below has to run before lm-eval looks the name up. ``batch_size=`` and
``max_batch_size=`` in ``--model_args`` are moved to lm-eval's own ``--batch_size`` / ``--max_batch_size`` (lm-eval
passes those to every model as keyword arguments, so the same name in ``--model_args`` as well would be given
twice); giving both with different values is an error. From Python, ``import jaxgpt.eval.harness`` before
``lm_eval.simple_evaluate(model="jaxgpt", ...)``, or pass ``JaxGPTLM(...)`` itself as the model. Importing this
module keeps lm-eval's built-in models (``hf``, ...) available: they are registered first.

``model_args``: ``pretrained`` (a training run directory, a Hugging Face GPT-2 directory or name, or
``random:PRESET``), ``batch_size`` (rows per forward pass; ``auto`` means 8, or ``max_batch_size`` if smaller),
``precision`` (fp32, bf16, auto; default fp32) or, as lm-eval's ``hf`` model spells it, ``dtype`` (float32 or
bfloat16; anything else is refused), ``step`` (with a run directory), ``max_gen_toks`` (default 256), ``seed``
(sampling with ``do_sample``). ``device`` is accepted and ignored: JAX runs on its default device.

The three request types follow lm-eval's own ``hf`` model (``HFLM``) token for token, so the two agree to float
rounding on the same weights (parity_tests/test_lm_eval_parity.py):

* ``loglikelihood``: lm-eval's context/continuation split (``TemplateLM._encode_pair``); the input is the last
  ``block_size + 1`` tokens minus one; the continuation's summed log-probability and whether every one of its
  tokens is the greedy choice.
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows (``utils.get_rolling_token_windows``, prefix
  ``<|endoftext|>``), summed.
* ``generate_until``: batched as ``HFLM`` batches (lm-eval's ``Collator``: grouped by generation arguments, longest
  context first, ``batch_size`` at a time), each context cut from the left to ``block_size - max_gen_toks``; greedy
  (or sampled, with ``do_sample``) with jaxgpt's KV cache, each row at its own positions; the batch ends where
  ``HFLM``'s ends (every row has produced ``<|endoftext|>``, or one stop sequence has appeared in every row, by
  lm-eval's ``MultiTokenEOSCriteria`` look-back test, or ``max_gen_toks``), then each row is cut at
  ``<|endoftext|>`` and at the first stop sequence.

Shapes, so that a run compiles a handful of times: log-likelihood batches are padded to multiples of
:data:`PAD_TO` tokens; generation pads the batch to ``batch_size`` rows and the contexts to a power of two of at
least :data:`GEN_MIN_WIDTH` tokens (at most ``block_size - max_gen_toks``), and decodes :data:`GEN_CHECK_EVERY`
tokens per call, checking the stopping rule on the host between calls, so it stops within that many tokens of
where ``HFLM`` stops: a prefill and a decoder compiled once per width (and per ``max_gen_toks``; greedy and
sampling are separate variants). ``JaxGPTLM.traces`` counts the traces (compilations) of each jitted function,
``JaxGPTLM.gen_steps`` the tokens each batch of the last ``generate_until`` decoded.
"""

from __future__ import annotations

import collections
import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    import lm_eval.models  # noqa: F401  (the built-in models first: see the registration at the end)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("jaxgpt.eval.harness needs lm-evaluation-harness: pip install -e '.[eval]'") from e

from jaxgpt.eval.common import EvalError, jit_model_program, load_model

PAD_TO = 64  # log-likelihood batches: padded lengths are multiples of this
GEN_MIN_WIDTH = 16  # generation: contexts padded to a power of two >= this
GEN_CHECK_EVERY = 8  # generation: new tokens per compiled call, between host checks of the stopping rule
AUTO_BATCH_SIZE = 8
DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}  # dtype= -> precision
KNOWN_ARGS = ("pretrained", "batch_size", "max_batch_size", "precision", "dtype", "step", "max_gen_toks", "seed",
              "device", "trust_remote_code")


def gen_width(n: int, limit: int) -> int:
    """The padded context width of a generation batch whose longest context has ``n`` tokens."""
    return min(limit, max(GEN_MIN_WIDTH, 1 << max(0, n - 1).bit_length()))


def _precision(precision: str | None, dtype: str | None) -> str:
    if dtype is not None:
        mapped = DTYPES.get(str(dtype).lower().removeprefix("torch."))
        if mapped is None:
            raise EvalError(f"--model_args dtype={dtype}: the jaxgpt model computes in float32 or bfloat16 "
                            f"(dtype=float32|bfloat16, or precision=fp32|bf16|auto)")
        if precision is not None and DTYPES.get(str(precision).lower(), str(precision)) != mapped:
            raise EvalError(f"--model_args dtype={dtype} and precision={precision} disagree: give one of them")
        return mapped
    return "fp32" if precision is None else str(precision)


def _int_arg(name: str, value: Any, minimum: int) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise EvalError(f"--model_args {name}={value}: expected an integer") from None
    if v < minimum:
        raise EvalError(f"--model_args {name}={value}: must be >= {minimum}")
    return v


def _merge_lm_eval_config(arg_dict: dict[str, Any], additional: dict[str, Any] | None) -> dict[str, Any]:
    """``model_args`` and lm-eval's own per-model settings (``batch_size``, ``max_batch_size``, ``device``) as
    one set of keyword arguments: a batch size in both is taken once if the values agree, else refused (lm-eval
    always passes one, 1 by default); ``device`` (lm-eval's default: cuda:0) gives way to ``model_args``."""
    merged = dict(arg_dict)
    for k, v in (additional or {}).items():
        if v is None or (k == "device" and k in merged):
            continue
        if k in merged and str(merged[k]) != str(v):
            raise EvalError(f"{k} is given twice, {merged[k]} in --model_args and {v} as lm-eval's --{k}: "
                            f"give it once (python -m jaxgpt.eval.harness moves {k}= out of --model_args)")
        merged[k] = v
    return merged


class JaxGPTLM(TemplateLM):
    def __init__(self, pretrained: str = "gpt2", batch_size: int | str = AUTO_BATCH_SIZE,
                 max_batch_size: int | str | None = None, precision: str | None = None, dtype: str | None = None,
                 step: int | str | None = None, max_gen_toks: int | str = 256, seed: int | str = 0,
                 **kwargs: Any):
        super().__init__()
        from flax import nnx

        unknown = sorted(k for k in kwargs if k not in KNOWN_ARGS)
        if unknown:
            raise EvalError(f"--model_args: unknown argument(s) {unknown} for the jaxgpt model; known: "
                            f"{', '.join(KNOWN_ARGS[:-2])}")
        cap = None if max_batch_size in (None, "") else _int_arg("max_batch_size", max_batch_size, 1)
        if str(batch_size).startswith("auto"):
            self.batch_size = AUTO_BATCH_SIZE if cap is None else min(AUTO_BATCH_SIZE, cap)
        else:
            self.batch_size = _int_arg("batch_size", batch_size, 1)
        self.max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 1)
        self.seed = _int_arg("seed", seed, 0)
        step = None if step in (None, "") else _int_arg("step", step, 0)
        self.model = load_model(str(pretrained), precision=_precision(precision, dtype), step=step)
        self.max_length = self.model.config.block_size
        self.traces: collections.Counter = collections.Counter()  # jitted function -> times traced
        self.gen_steps: list[tuple[int, int]] = []  # the last generate_until's batches: (tokens decoded, max_gen_toks)
        graphdef, self.state = nnx.split(self.model)
        self._scores, self._prefill, self._decode = programs(graphdef, self.traces)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None):
        return cls(**_merge_lm_eval_config(arg_dict, additional_config))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None):
        from lm_eval import utils

        return cls(**_merge_lm_eval_config(utils.simple_parse_args_string(arg_string), additional_config))

    # ---- tokenizer -------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        from jaxgpt.tokenizer import EOT_TOKEN

        return EOT_TOKEN

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """GPT-2 tokens; a ``<|endoftext|>`` in the text is the special token, as Hugging Face's tokenizer reads it."""
        from jaxgpt import tokenizer

        return tokenizer.encode(string, allow_eot=True)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        from jaxgpt import tokenizer

        if skip_special_tokens:
            tokens = [t for t in tokens if t != tokenizer.EOT_TOKEN]
        return tokenizer.decode(tokens)

    # ---- scoring ---------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        from tqdm.auto import tqdm

        rows = []
        for i, (_, context_enc, continuation_enc) in enumerate(requests):
            if not continuation_enc:
                raise EvalError("an lm-eval request with an empty continuation: nothing to score")
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
            rows.append((i, whole, min(len(continuation_enc), len(whole) - 1)))
        order = sorted(rows, key=lambda r: -len(r[1]))  # longest first: similar lengths share a padded batch
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        bs = override_bs or self.batch_size
        for start in tqdm(range(0, len(order), bs), desc="loglikelihood", disable=disable_tqdm):
            batch = order[start : start + bs]
            length = min(self.max_length + 1, PAD_TO * math.ceil(max(len(w) for _, w, _ in batch) / PAD_TO))
            tokens = np.zeros((bs, length), np.int32)
            for r, (_, whole, _) in enumerate(batch):
                tokens[r, : len(whole)] = whole
            losses, greedy = (np.asarray(a) for a in self._scores(self.state, tokens))
            for r, (i, whole, n_cont) in enumerate(batch):
                span = slice(len(whole) - 1 - n_cont, len(whole) - 1)  # positions predicting the continuation
                results[i] = (-float(losses[r, span].astype(np.float64).sum()), bool(greedy[r, span].all()))
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *w))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores):
            totals[i] += logprob
        return totals

    # ---- generation ------------------------------------------------------------------------------------------
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import (
            Collator,
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )
        from tqdm.auto import tqdm

        def longest_first(req: tuple[str, dict]) -> tuple[int, str]:  # HFLM's order, so HFLM's batches
            return -len(self.tok_encode(req[0])), req[0]

        batches = Collator([req.args for req in requests], sort_fn=longest_first, group_by="gen_kwargs",
                           group_fn=lambda req: req[1])
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        self.gen_steps = []
        out: list[str] = []
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for chunk in batches.get_batched(n=self.batch_size):
            contexts, all_gen_kwargs = zip(*chunk)
            kw = normalize_gen_kwargs(dict(all_gen_kwargs[0]), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            n_new = int(kw.pop("max_gen_toks"))
            if n_new >= self.max_length:
                raise EvalError(f"max_gen_toks = {n_new}: must be < the model's block_size ({self.max_length})")
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            prompts = [self.tok_encode(c)[-(self.max_length - n_new):] or [self.prefix_token_id] for c in contexts]
            for context, gen_kwargs, new in zip(contexts, all_gen_kwargs,
                                                self._generate_batch(prompts, n_new, temperature, until)):
                text = postprocess_generated_text(generation=self.tok_decode(new), stop=until, think_end_token=None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            bar.update(len(chunk))
        bar.close()
        return batches.get_original(out)

    def _generate_batch(self, prompts: Sequence[list[int]], n_new: int, temperature: float,
                        until: Sequence[str]) -> list[list[int]]:
        """Each prompt's new tokens, up to where ``HFLM``'s batch would have ended and its first
        ``<|endoftext|>`` (excluded)."""
        import jax
        import jax.numpy as jnp

        from jaxgpt import tokenizer

        rows, bs = len(prompts), max(self.batch_size, len(prompts))
        width = gen_width(max(map(len, prompts)), self.max_length - n_new)
        tokens = np.zeros((bs, width), np.int32)
        lengths = np.ones((bs,), np.int32)  # padding rows: one token
        for r, p in enumerate(prompts):
            tokens[r, : len(p)], lengths[r] = p, len(p)
        cache, logits = self._prefill(self.state, tokens, lengths, cache_len=width + n_new)
        pos, key = jnp.asarray(lengths), jax.random.key(self.seed)
        rule = StopRule(until, rows, encode=self.tok_encode, decode=tokenizer.decode, eot=self.eot_token_id)
        new = np.zeros((rows, 0), np.int64)
        stop = None
        while stop is None and new.shape[1] < n_new:
            steps = min(GEN_CHECK_EVERY, n_new - new.shape[1])
            chunk, cache, logits, pos = self._decode(self.state, cache, logits, pos, key, jnp.float32(temperature),
                                                     jnp.int32(new.shape[1]), jnp.int32(steps),
                                                     greedy=temperature == 0.0)
            new = np.concatenate([new, np.asarray(chunk)[:rows, :steps]], axis=1)
            stop = rule.update(new)
        ends = new.shape[1] if stop is None else stop
        self.gen_steps.append((new.shape[1], n_new))
        out = []
        for row in new[:, :ends].tolist():
            out.append(row[: row.index(self.eot_token_id)] if self.eot_token_id in row else row)
        return out


class StopRule:
    """Where ``HFLM``'s ``model.generate`` ends a batch: after the first step at which every row has produced
    ``eot``, or at which one stop sequence has been seen in every row. lm-eval's ``MultiTokenEOSCriteria`` looks
    for a stop sequence ``s`` in the decoded last ``len(encode(s)) + 2`` new tokens after each step (a row, once
    seen, stays seen), and a row that has produced ``eot`` is padded with ``eot`` (GPT-2's pad token in lm-eval)."""

    def __init__(self, until: Sequence[str], rows: int, *, encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], eot: int):
        self.looks = [(s, len(encode(s)) + 2) for s in until]
        self.decode, self.eot = decode, eot
        self.seen = np.zeros((len(self.looks), rows), bool)
        self.eot_seen = np.zeros((rows,), bool)
        self.steps = 0  # steps checked so far

    def update(self, new: np.ndarray) -> int | None:
        """``new``: every row's new tokens so far, ``(rows, n)``. The step at which the batch ends, if it ends
        within these ``n`` tokens, else None."""
        new = np.asarray(new)
        padded = np.where(np.cumsum(new == self.eot, axis=1) > 0, self.eot, new)  # eot, then eot as padding
        for t in range(self.steps + 1, new.shape[1] + 1):
            self.steps = t
            self.eot_seen |= padded[:, t - 1] == self.eot
            for j, (s, look) in enumerate(self.looks):
                for r in np.flatnonzero(~self.seen[j]):
                    self.seen[j, r] = s in self.decode(padded[r, max(0, t - look) : t].tolist())
            if self.eot_seen.all() or self.seen.all(axis=1).any():
                return t
        return None


# ---- the compiled functions ------------------------------------------------------------------------------------
def programs(graphdef: Any, traces: collections.Counter) -> tuple[Callable, Callable, Callable]:
    """The jitted scoring, prefill and decode functions of ``graphdef``'s model, with its platform's compiler options
    (:func:`jaxgpt.eval.common.jit_model_program`: cuBLASLt fp8 GEMMs for an fp8 model on a GPU)."""
    return (jit_model_program(graphdef, functools.partial(_token_scores, graphdef, traces)),
            jit_model_program(graphdef, functools.partial(_prefill, graphdef, traces), static_argnames="cache_len"),
            jit_model_program(graphdef, functools.partial(_decode, graphdef, traces), static_argnames="greedy"))


def _token_scores(graphdef, traces, state, tokens):
    from flax import nnx

    traces["loglikelihood"] += 1  # runs only while tracing
    return nnx.merge(graphdef, state).token_losses(tokens[:, :-1], tokens[:, 1:])


def _prefill(graphdef, traces, state, tokens, lengths, *, cache_len: int):
    """Every row's context (right-padded to one width) into a KV cache of ``cache_len`` positions, and the
    logits after each row's last real token. Past a row's length the cache holds padding, which that row's own
    decoding overwrites before any query may see it (causal masking)."""
    import jax.numpy as jnp
    from flax import nnx

    traces["prefill"] += 1
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden(tokens, cache=model.init_cache(tokens.shape[0], cache_len), pos=0)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)
    return cache, model.logits(last)[:, 0]


def _decode(graphdef, traces, state, cache, logits, pos, key, temperature, start, steps, *, greedy: bool):
    """Up to :data:`GEN_CHECK_EVERY` new tokens (``steps`` of them; the rest of the returned row is 0), each row
    at its own positions ``pos``, ``pos + 1``, ... (jaxgpt.generate.sampling; ``temperature`` 0: greedy)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxgpt.generate.decode import _matmul_weights_in_compute_dtype
    from jaxgpt.generate.sampling import argmax, sample_logits
    from jaxgpt.model import KVCache

    traces["decode"] += 1
    model = nnx.merge(graphdef, _matmul_weights_in_compute_dtype(graphdef, state))
    head = model.policy.cast(model.wte.embedding[...])

    def row(k, v, tok, p):  # one row: its cache (layer, heads, seq, dim), its token and position
        h, c = model.hidden(tok[None, None], cache=KVCache(k[:, None], v[:, None]), pos=p)
        return h[0], c.k[:, 0], c.v[:, 0]

    def step(i, carry):
        out, cache, logits, pos = carry
        tok = argmax(logits) if greedy else sample_logits(logits, jax.random.fold_in(key, start + i), temperature,
                                                           top_k=None)
        h, k, v = jax.vmap(row, in_axes=(1, 1, 0, 0), out_axes=(0, 1, 1))(cache.k, cache.v, tok, pos)
        out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, i))
        return out, KVCache(k, v), model.logits(h, head=head)[:, 0], pos + 1

    out = jnp.zeros((logits.shape[0], GEN_CHECK_EVERY), jnp.int32)
    return jax.lax.fori_loop(0, steps, step, (out, cache, logits, pos))


# ---- registration and the command line ----------------------------------------------------------------------
def _move_batch_size(args: Any) -> str | None:
    """lm-eval's parsed ``run`` arguments with ``batch_size``/``max_batch_size`` moved from ``--model_args`` to
    lm-eval's own options; an error message if both give one, differently."""
    model_args = getattr(args, "model_args", None)
    if not isinstance(model_args, dict):
        return None
    for name in ("batch_size", "max_batch_size"):
        if name not in model_args:
            continue
        value = model_args.pop(name)
        given = getattr(args, name, None)
        if given is not None and str(given) != str(value):
            return (f"{name} is given twice, {value} in --model_args and {given} as --{name}: give it once")
        setattr(args, name, str(value) if name == "batch_size" else _int_arg(name, value, 1))
    return None


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line, with ``--model jaxgpt`` registered (from this package's module, once)."""
    import importlib

    importlib.import_module("jaxgpt.eval.harness")  # under ``python -m`` this file is __main__, which does not register

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError:  # pragma: no cover - another lm-eval 0.4 command line
        from lm_eval.__main__ import cli_evaluate

        cli_evaluate()
        return 0
    setup_logging()
    cli = HarnessCLI()
    args = cli.parse_args()
    try:
        problem = _move_batch_size(args) if getattr(args, "command", None) == "run" else None
    except EvalError as e:
        problem = str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cli.execute(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
else:  # a model registered before lm_eval.models's own would hide them (get_model loads those into an empty registry)
    register_model("jaxgpt")(JaxGPTLM)
