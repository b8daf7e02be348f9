"""jaxgpt as an EleutherAI lm-evaluation-harness model: ``--model jaxgpt``.

    pip install -e ".[eval]"
    python -m jaxgpt.eval.harness --model jaxgpt --model_args pretrained=runs/gpt2-124m,batch_size=16 \
        --tasks hellaswag,lambada_openai

``python -m jaxgpt.eval.harness`` is lm-eval's own command line (every option of ``lm_eval``) with this module
imported first: lm-eval 0.4 discovers models through its registry only, with no plugin entry points, so the
registration below has to run before lm-eval looks the name up. From Python, ``import jaxgpt.eval.harness``
before ``lm_eval.simple_evaluate(model="jaxgpt", ...)``, or pass ``JaxGPTLM(...)`` itself as the model.

``model_args``: ``pretrained`` (a training run directory, a Hugging Face GPT-2 directory or name, or
``random:PRESET``), ``batch_size`` (rows per forward pass; ``auto`` means 8), ``precision`` (fp32, bf16, auto),
``step`` (with a run directory), ``max_gen_toks`` (default 256).

The three request types follow lm-eval's own ``hf`` model (``HFLM``) token for token, so the two agree to
float rounding on the same weights (parity_tests/test_eval_parity.py):

* ``loglikelihood``: lm-eval's context/continuation split (``TemplateLM._encode_pair``); the input is the last
  ``block_size + 1`` tokens minus one; the continuation's summed log-probability and whether every one of its
  tokens is the greedy choice.
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows (``utils.get_rolling_token_windows``, prefix
  ``<|endoftext|>``), summed.
* ``generate_until``: greedy (or sampled, with ``do_sample``) with jaxgpt's KV cache, the context cut from the
  left to ``block_size - max_gen_toks``, stopped at ``<|endoftext|>``, cut at the first stop sequence.

Requests are batched and sorted by length (longest first), padded to multiples of 64 tokens so that a run
compiles a handful of shapes.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import Any

import numpy as np

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("jaxgpt.eval.harness needs lm-evaluation-harness: pip install -e '.[eval]'") from e

from jaxgpt.eval.common import EvalError, load_model

PAD_TO = 64


@register_model("jaxgpt")
class JaxGPTLM(TemplateLM):
    def __init__(self, pretrained: str = "gpt2", batch_size: int | str = 8, precision: str = "fp32",
                 step: int | str | None = None, max_gen_toks: int | str = 256, seed: int | str = 0, **kwargs: Any):
        super().__init__()
        import jax
        from flax import nnx

        unknown = sorted(k for k in kwargs if k not in ("device", "dtype", "trust_remote_code"))
        if unknown:
            raise EvalError(f"--model_args: unknown argument(s) {unknown} for the jaxgpt model; known: pretrained, "
                            "batch_size, precision, step, max_gen_toks, seed")
        self.model = load_model(str(pretrained), precision=str(precision),
                                step=None if step in (None, "") else int(step))
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_length = self.model.config.block_size
        self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)
        graphdef, self.state = nnx.split(self.model)

        def scores(state, tokens):
            return nnx.merge(graphdef, state).token_losses(tokens[:, :-1], tokens[:, 1:])

        self._scores = jax.jit(scores)

    # ---- tokenizer -------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        from jaxgpt.tokenizer import EOT_TOKEN

        return EOT_TOKEN

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """GPT-2 tokens; a ``<|endoftext|>`` in the text is the special token, as Hugging Face's tokenizer reads it."""
        from jaxgpt import tokenizer

        return tokenizer.encode(string, allow_eot=True)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
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
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
        from tqdm.auto import tqdm

        from jaxgpt.generate import generate

        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[tuple, list[int]] = defaultdict(list)
        prepared = []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            n_new = int(kw.pop("max_gen_toks"))
            if n_new >= self.max_length:
                raise EvalError(f"max_gen_toks = {n_new}: must be < the model's block_size ({self.max_length})")
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            ids = self.tok_encode(context)[-(self.max_length - n_new):] or [self.prefix_token_id]
            prepared.append((ids, until))
            groups[(len(ids), n_new, temperature)].append(i)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for (length, n_new, temperature), members in sorted(groups.items(), key=lambda g: -g[0][0]):
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                rows = generate(self.model, np.array([prepared[i][0] for i in chunk]), max_new_tokens=n_new,
                                temperature=temperature, top_k=None, seed=self.seed)
                for i, row in zip(chunk, rows):
                    new = row[length:].tolist()
                    if self.eot_token_id in new:  # Hugging Face's generate stops at <|endoftext|>
                        new = new[: new.index(self.eot_token_id)]
                    out[i] = postprocess_generated_text(generation=self.tok_decode(new), stop=prepared[i][1],
                                                        think_end_token=None)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line, with ``--model jaxgpt`` registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
