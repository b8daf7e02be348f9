"""The library's entry points: :func:`generate` (token ids in and out), :func:`generate_samples` and
:func:`generate_text` (text through the model's tokenizer), with their arguments checked before anything compiles."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jaxgpt.config import GPTConfig
from jaxgpt.generate.decode import run_decoder
from jaxgpt.generate.errors import GenerateError
from jaxgpt.model import GPT, TokenError, check_tokens

__all__ = ["generate", "generate_samples", "generate_text"]


def _check_int(name: str, value, *, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise GenerateError(f"{name} = {value!r}: expected an integer" + (" or None" if allow_none else ""))
    if value < minimum:
        raise GenerateError(f"{name} = {value!r}: must be >= {minimum}")


def _prompt_array(prompt_ids, config: GPTConfig) -> np.ndarray:
    """The prompt as an int (batch, T) array with every id checked against the vocabulary."""
    try:
        ids = np.asarray(prompt_ids)
    except (ValueError, TypeError) as e:
        raise GenerateError(f"prompt_ids must be a sequence of token ids: {e}") from e
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise GenerateError(f"prompt_ids must have shape (seq,) or (batch, seq), got {ids.shape}")
    if ids.size == 0:
        raise GenerateError(f"prompt_ids is empty (shape {ids.shape}); give at least one token, e.g. "
                            "the end-of-text token 50256 to sample unconditionally")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TokenError(f"prompt_ids must hold integer token ids, got dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        raise TokenError(f"prompt_ids holds token ids outside [0, {config.vocab_size}): e.g. "
                         f"{bad[:5].tolist()}; ids must come from the model's tokenizer")
    return ids.astype(np.int32)


def generate(
    model: GPT,
    prompt_ids,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    num_samples: int = 1,
    use_cache: bool = True,
) -> np.ndarray:
    """Sample ``max_new_tokens`` tokens after ``prompt_ids``.

    ``prompt_ids``: token ids, shape (seq,) or (batch, seq). Each prompt row is repeated ``num_samples``
    times (prompt-major), and every row is sampled independently. A prompt longer than ``block_size``
    keeps only its last ``block_size`` tokens as context (nanoGPT), but is returned whole.
    ``temperature``: 0 = greedy; ``top_k``: None or 0 = no top-k filtering.

    Returns an int32 array (batch * num_samples, seq + max_new_tokens): the prompt, then the new tokens.
    """
    config: GPTConfig = model.config
    _check_int("max_new_tokens", max_new_tokens, minimum=0)
    _check_int("num_samples", num_samples, minimum=1)
    _check_int("top_k", top_k, minimum=0, allow_none=True)
    _check_int("seed", seed, minimum=0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating, np.integer)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise GenerateError(f"temperature = {temperature!r}: must be a finite number >= 0 (0 = greedy)")
    if seed >= 2**32:
        raise GenerateError(f"seed = {seed}: must be < 2**32")
    prompt = np.repeat(_prompt_array(prompt_ids, config), num_samples, axis=0)
    ctx = prompt[:, -config.block_size:]
    check_tokens(ctx, config, name="prompt_ids")
    if max_new_tokens == 0:
        return prompt

    if not top_k or top_k >= config.vocab_size:
        top_k = None  # no filtering (and one compiled function for all of these)
    out = run_decoder(model, ctx, n_new=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                      use_cache=use_cache, num_samples=num_samples)
    new = np.asarray(out)[:, ctx.shape[1]:]
    return np.concatenate([prompt, new], axis=1)


def generate_text(
    model: GPT,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    num_samples: int = 1,
    use_cache: bool = True,
    allow_special: bool = False,
    tokenizer=None,
) -> list[str]:
    """``num_samples`` texts: ``prompt`` followed by its sampled continuation, through GPT-2's tokenizer.

    The prompt is encoded literally: a ``"<|endoftext|>"`` typed in it is seven ordinary tokens, unless
    ``allow_special`` makes each one the end-of-text token (50256), as between documents in training. An empty
    prompt samples unconditionally: the context starts with the end-of-text token, which is not returned.
    """
    return [text for text, _ in generate_samples(model, prompt, max_new_tokens=max_new_tokens,
                                                 temperature=temperature, top_k=top_k, seed=seed,
                                                 num_samples=num_samples, use_cache=use_cache,
                                                 allow_special=allow_special, tokenizer=tokenizer)]


def generate_samples(
    model: GPT,
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    num_samples: int = 1,
    use_cache: bool = True,
    allow_special: bool = False,
    tokenizer=None,
) -> list[tuple[str, list[int]]]:
    """Like :func:`generate_text`, with each sample's token ids (prompt + continuation); ``prompt`` may also be
    token ids (checked against the vocabulary), taken as they are. ``tokenizer``: the model's (a
    :class:`jaxgpt.chars.CharTokenizer` for a character model, see :func:`load_tokenizer`; None: GPT-2's BPE).
    A character vocabulary has no end-of-text token: an empty prompt then starts from id 0 (``"\n"`` in tiny
    Shakespeare's), which is not returned."""
    from jaxgpt import tokenizer as tokenizers

    tok = tokenizer if tokenizer is not None else tokenizers.GPT2BPE()
    if isinstance(prompt, str):
        if allow_special and tok.eot_token is None:
            raise GenerateError(f"allow_special: the {tok.vocab_size}-character vocabulary has no end-of-text token")
        try:
            ids = tok.encode(prompt, allow_eot=allow_special)
        except ValueError as e:  # a character outside the model's vocabulary
            raise GenerateError(f"prompt: {e}") from None
    elif isinstance(prompt, Sequence) and all(isinstance(i, (int, np.integer)) for i in prompt):
        ids = [int(i) for i in prompt]
    else:
        raise GenerateError(f"prompt = {prompt!r}: expected a string or a list of token ids")
    skip = 0
    if not ids:
        ids, skip = [tok.eot_token or 0], 1
    out = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                   seed=seed, num_samples=num_samples, use_cache=use_cache)
    return [(tok.decode(row[skip:].tolist()), row[skip:].tolist()) for row in out]

