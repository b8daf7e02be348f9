"""Evaluation: ``python -m jaxgpt.eval`` (HellaSwag as build-nanogpt scores it; the loss, perplexity and bits per
byte on prepared shards) and an lm-evaluation-harness model (:mod:`jaxgpt.eval.harness`, ``--model jaxgpt``).

Modules: :mod:`~jaxgpt.eval.hellaswag`, :mod:`~jaxgpt.eval.val_loss`, :mod:`~jaxgpt.eval.harness` (needs
``pip install -e ".[eval]"``), :mod:`~jaxgpt.eval.cli`. The training loop scores HellaSwag every
``hellaswag_interval`` steps with :class:`jaxgpt.eval.hellaswag.Scorer`.
"""

from jaxgpt.eval.common import EvalError, load_model

__all__ = ["EvalError", "load_model"]
