"""Loading GPT-2 weights into torch_ref: a Hugging Face checkpoint, or a jaxgpt run's ``--to-torch`` export.

Reading and validating the checkpoint is shared with jaxgpt (``jaxgpt.weights.load_hf``: one place that knows
HF's key names, the old causal-mask buffers and the tied lm_head); torch_ref's own parameter names are HF's
without the ``transformer.`` prefix and its Linear weights are (in, out) like HF's Conv1D, so the arrays are
copied as they are. The independent check of all this is ``transformers.GPT2LMHeadModel`` in parity_tests/.
"""

from __future__ import annotations

import os

import torch

from torch_ref.model import GPT


def from_hf(name_or_path: str | os.PathLike, *, attention: str = "sdpa",
            padded_vocab_size: int | None = None) -> GPT:
    from jaxgpt.weights import load_hf

    config, ref = load_hf(name_or_path, padded_vocab_size=padded_vocab_size)
    model = GPT(config, attention=attention)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in ref.items()}, strict=True)
    return model.eval()


def from_export(path: str | os.PathLike, *, attention: str = "sdpa") -> GPT:
    """A torch_ref GPT from ``python -m jaxgpt.checkpoint export RUN --to-torch FILE``: the model config comes from
    the record the export carries, the weights from its ``state_dict`` (loaded with ``weights_only=True``)."""
    from jaxgpt.config import ConfigError, GPTConfig
    from jaxgpt.exportdir import export_record

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; make one with `python -m jaxgpt.checkpoint export RUN "
                                f"--to-torch {path}`")
    record = export_record(path)
    if not isinstance(record.get("model"), dict):
        raise ValueError(f"{path}: not a jaxgpt --to-torch export that records its model config (an older export, "
                         "or another file); export the run again, or build torch_ref.model.GPT(GPTConfig(...)) "
                         "and load_state_dict(torch.load(path, weights_only=True)) yourself")
    try:
        config = GPTConfig.from_dict(record["model"])
    except ConfigError as e:
        raise ValueError(f"{path}: its recorded model config is not valid here: {e}") from None
    model = GPT(config, attention=attention)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
    return model.eval()
