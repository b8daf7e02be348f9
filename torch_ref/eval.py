"""HellaSwag scoring in PyTorch, as build-nanogpt's ``hellaswag.py`` evaluates: the oracle for jaxgpt.eval.hellaswag.

``tokens`` holds the four endings' rows (context + ending, zero-padded), ``mask`` is 1 on each row's ending tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def ending_losses(model, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, mean) of each row's loss over its ending tokens; the predictions are their argmins."""
    logits, _ = model(tokens)
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1),
                             reduction="none").view(tokens.size(0), -1)
    m = mask[:, 1:].float()
    total = (losses * m).sum(dim=1)
    return total, total / m.sum(dim=1)
