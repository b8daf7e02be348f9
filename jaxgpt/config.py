"""Typed, frozen model configuration and the presets that match Hugging Face's GPT-2 family.

Every config in jaxgpt is a frozen dataclass built through :func:`from_dict`, which rejects unknown keys,
wrong types and out-of-range values with an error naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


def _check_type(cls_name: str, name: str, value: Any, tp: Any) -> Any:
    """Check (and lightly coerce: int -> float, list -> tuple) one field value against its annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(cls_name, name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # `X | None`: X's own message (allowed values, expected kind), null named too
            raise ConfigError(errors[0] + (" (or null)" if type(None) in args else ""))
        raise ConfigError(f"{cls_name}.{name} = {value!r}: expected {_type_name(tp)}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{cls_name}.{name} = {value!r}: allowed values are {list(allowed)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{cls_name}.{name} = {value!r}: expected a list")
        (elt, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(_check_type(cls_name, name, v, elt) for v in value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{cls_name}.{name} = {value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{cls_name}.{name} = {value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "6e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{cls_name}.{name} = {value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{cls_name}.{name} = {value!r}: expected a string")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return from_dict(tp, value)
        raise ConfigError(f"{cls_name}.{name} = {value!r}: expected a mapping of {tp.__name__} fields")
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build the frozen dataclass ``cls`` from a plain mapping, validating every key and value."""
    if not isinstance(data, dict):
        raise ConfigError(f"{cls.__name__}: expected a mapping of fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{cls.__name__}: unknown key(s) {unknown}; valid keys are {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {k: _check_type(cls.__name__, k, v, hints[k]) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain (YAML/JSON-serialisable) dict of a config dataclass."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def _require(cls_name: str, name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{cls_name}.{name} = {value!r}: {allowed}")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2 model. Field names follow nanoGPT; ``hf_config`` maps them to Hugging Face's."""

    block_size: int = 1024  # max sequence length (HF n_positions)
    vocab_size: int = 50257  # real vocabulary; ids must lie in [0, vocab_size)
    padded_vocab_size: int | None = None  # embedding rows (e.g. 50304 = 64 * 786); None = vocab_size
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0  # one rate for embeddings, attention probabilities and residual branches
    bias: bool = True  # biases in Linear and LayerNorm (GPT-2: True)
    layer_norm_epsilon: float = 1e-5  # GPT-2's eps (Flax's default is 1e-6)

    def __post_init__(self) -> None:
        name = type(self).__name__
        # Types first (direct construction skips from_dict's checks), so range checks never hit a TypeError.
        for field in ("dropout", "layer_norm_epsilon"):
            v = getattr(self, field)
            _require(name, field, v, isinstance(v, (int, float)) and not isinstance(v, bool), "must be a number")
        _require(name, "bias", self.bias, isinstance(self.bias, bool), "must be true or false")
        for field in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, field)
            _require(name, field, v, isinstance(v, int) and not isinstance(v, bool) and v > 0,
                     "must be a positive integer")
        if self.padded_vocab_size is not None:
            _require(name, "padded_vocab_size", self.padded_vocab_size,
                     isinstance(self.padded_vocab_size, int) and self.padded_vocab_size >= self.vocab_size,
                     f"must be null or an integer >= vocab_size ({self.vocab_size})")
        _require(name, "n_embd", self.n_embd, self.n_embd % self.n_head == 0,
                 f"must be divisible by n_head ({self.n_head}); e.g. n_embd = {self.n_head * max(1, self.n_embd // self.n_head)}")
        _require(name, "dropout", self.dropout, 0.0 <= self.dropout < 1.0, "must be in [0, 1)")
        _require(name, "layer_norm_epsilon", self.layer_norm_epsilon, self.layer_norm_epsilon > 0,
                 "must be > 0")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def vocab_rows(self) -> int:
        """Rows of the token embedding (and columns of the tied lm_head): the padded vocabulary size."""
        return self.padded_vocab_size or self.vocab_size

    def replace(self, **changes: Any) -> "GPTConfig":
        return from_dict(GPTConfig, {**to_dict(self), **changes})

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPTConfig":
        return from_dict(cls, data)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; valid presets are {sorted(PRESETS)}")
        return from_dict(cls, {**PRESETS[name], **overrides})

    @classmethod
    def from_yaml(cls, path: str | Path) -> "GPTConfig":
        data = load_yaml(path)
        if "model" in data and isinstance(data["model"], dict):
            data = data["model"]
        return from_dict(cls, data)

    # ---- Hugging Face ---------------------------------------------------------------------------
    def hf_config(self) -> dict[str, Any]:
        """The fields of a ``transformers.GPT2Config`` describing this model."""
        if not self.bias:
            raise ConfigError("GPTConfig.bias = False: Hugging Face GPT-2 always has biases; "
                              "export needs bias=True")
        return dict(
            model_type="gpt2", architectures=["GPT2LMHeadModel"],
            vocab_size=self.vocab_size, n_positions=self.block_size, n_embd=self.n_embd,
            n_layer=self.n_layer, n_head=self.n_head, n_inner=None,
            activation_function="gelu_new", layer_norm_epsilon=self.layer_norm_epsilon,
            resid_pdrop=self.dropout, embd_pdrop=self.dropout, attn_pdrop=self.dropout,
            initializer_range=0.02, scale_attn_weights=True, tie_word_embeddings=True,
            # GPT-2's <|endoftext|> is 50256: only where the vocabulary holds it (transformers warns otherwise)
            bos_token_id=50256 if self.vocab_size > 50256 else None,
            eos_token_id=50256 if self.vocab_size > 50256 else None,
        )

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], *, source: str = "config.json") -> "GPTConfig":
        """Build from a Hugging Face ``config.json`` mapping, refusing what GPT-2 code can't represent."""
        if hf.get("model_type", "gpt2") != "gpt2":
            raise ConfigError(f"{source}: model_type is {hf.get('model_type')!r}, not 'gpt2'; "
                              "jaxgpt loads GPT-2 checkpoints only")
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"{source}: activation_function {act!r} is not GPT-2's tanh GELU "
                              "('gelu_new'); jaxgpt cannot represent it")
        n_embd = hf.get("n_embd", 768)
        if hf.get("n_inner") not in (None, 4 * n_embd):
            raise ConfigError(f"{source}: n_inner = {hf['n_inner']} but jaxgpt's MLP is 4 * n_embd")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(flag):
                raise ConfigError(f"{source}: {flag} = true is not supported by jaxgpt")
        if hf.get("scale_attn_weights", True) is not True:
            raise ConfigError(f"{source}: scale_attn_weights = false is not supported by jaxgpt")
        if hf.get("tie_word_embeddings", True) is not True:
            raise ConfigError(f"{source}: tie_word_embeddings = false; GPT-2's lm_head is tied to wte")
        return from_dict(cls, dict(
            block_size=hf.get("n_positions", 1024), vocab_size=hf.get("vocab_size", 50257),
            n_layer=hf.get("n_layer", 12), n_head=hf.get("n_head", 12), n_embd=n_embd,
            dropout=float(hf.get("resid_pdrop", 0.0)),
            layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)), bias=True,
        ))


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; presets live in configs/*.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of fields, got {type(data).__name__}")
    return data


# Hugging Face's GPT-2 family (n_positions 1024, vocab 50257, biases, tied lm_head), plus CPU-sized shapes.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    # CPU presets. `small` is the benchmark shape (16.1M params with the padded vocab).
    "small": dict(n_layer=4, n_head=4, n_embd=256, block_size=256, padded_vocab_size=50304),
    "mini": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, padded_vocab_size=50304),
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=64),  # for unit tests
}
PRESETS = {k: {**dict(block_size=1024, vocab_size=50257), **v} for k, v in PRESETS.items()}
