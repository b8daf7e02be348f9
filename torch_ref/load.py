"""Loading Hugging Face GPT-2 weights into torch_ref.

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
