"""The character-level tokenizer of nanoGPT's ``data/shakespeare_char/prepare.py``: the vocabulary is the sorted
set of the text's characters (65 for tiny Shakespeare, ``"\\n !$&',-.3:;?ABC...xyz"``), a character's id is its
index there, and there is no end-of-text token.

    >>> tok = CharTokenizer.from_text("hello world")
    >>> tok.encode("hello"), tok.decode([3, 2, 4, 4, 5])
    ([3, 2, 4, 4, 5], 'hello')

The vocabulary travels as :meth:`CharTokenizer.record` (``name`` "char", ``vocab_size``, ``chars`` itself and its
``chars_sha256``): in the shards' manifest (:mod:`jaxgpt.data`), in every checkpoint of a run trained on them
(``meta.extra.tokenizer``) and in exports, so sampling, evaluation and export decode with the very characters
the model was trained on (:func:`jaxgpt.tokenizer.from_record`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

NAME = "char"


class CharTokenizerError(ValueError):
    """Text with a character outside the vocabulary, an id outside it, or a malformed record."""


@dataclass(frozen=True)
class CharTokenizer:
    chars: str  # the vocabulary: distinct characters, sorted; id i is chars[i]

    name = NAME
    eot_token = None  # nanoGPT's character vocabulary has no document separator

    def __post_init__(self) -> None:
        if not isinstance(self.chars, str) or not self.chars:
            raise CharTokenizerError(f"chars = {self.chars!r}: must be a non-empty string")
        if list(self.chars) != sorted(set(self.chars)):
            raise CharTokenizerError("chars must be distinct characters in sorted order (nanoGPT's sorted(set(text)))")
        object.__setattr__(self, "_ids", {c: i for i, c in enumerate(self.chars)})

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> "CharTokenizer":
        """The vocabulary of ``text`` (or of several texts together): ``sorted(set(...))``."""
        seen: set[str] = set()
        for part in [text] if isinstance(text, str) else text:
            seen.update(part)
        if not seen:
            raise CharTokenizerError("no characters: the text is empty")
        return cls("".join(sorted(seen)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str, *, allow_eot: bool = False) -> list[int]:
        """The id of every character (``allow_eot`` has nothing to enable here: there is no separator)."""
        ids = self._ids
        try:
            return [ids[c] for c in text]
        except KeyError as e:
            raise CharTokenizerError(f"character {e.args[0]!r} is not in the {self.vocab_size}-character vocabulary "
                                     f"the model was trained on ({self.chars!r}); use only those characters") from None

    def decode(self, ids: Iterable[int]) -> str:
        chars, out = self.chars, []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(chars):
                raise CharTokenizerError(f"token id {i} is outside the {len(chars)}-character vocabulary")
            out.append(chars[i])
        return "".join(out)

    def record(self) -> dict[str, Any]:
        """What a manifest, a checkpoint and an export record of this tokenizer."""
        return {"name": NAME, "vocab_size": self.vocab_size, "chars": self.chars,
                "chars_sha256": hashlib.sha256(self.chars.encode("utf-8")).hexdigest(), "eot_token": None}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "CharTokenizer":
        chars = record.get("chars") if isinstance(record, dict) else None
        if not isinstance(chars, str):
            raise CharTokenizerError(f"a character tokenizer record must hold its 'chars' (got {record!r})")
        tok = cls(chars)
        if record.get("vocab_size") not in (None, tok.vocab_size):
            raise CharTokenizerError(f"the record says vocab_size {record['vocab_size']} but holds {tok.vocab_size} "
                                     "characters")
        return tok
