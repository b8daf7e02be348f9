"""Divergence detection: a step's loss or gradient norm that is not finite, or that jumps far above the running
median of the recent healthy steps (a loss spike).

The loss rule compares each step's loss with ``spike_loss_factor`` times the median of the last ``spike_window``
healthy losses; the gradient-norm rule likewise with ``spike_grad_norm_factor`` (0 turns a rule off). Both start
from the second step: the first step's loss (about ln(vocab) = 10.8 for a fresh GPT-2) is the first history.

The defaults were set against healthy runs' logged losses (see tests/test_guard.py and the README): on the
default Shakespeare run (600 steps, dropout 0.1), on the tiny test run and on a grad-accumulated gpt2-shaped run,
the largest ratio of a step's loss to the median of the preceding 100 was below 1.25 and of a gradient norm to
its median below 12, so a loss factor of 2 and a gradient-norm factor of 50 leave wide margins, while an
explosion (10.1 -> 1.4e13, or a tenfold loss) trips the loss rule at once. A spike whose loss stays below twice
the median is not caught: lower ``spike_loss_factor`` (1.5 still clears the runs above) for a tighter guard.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Why a step counts as diverged (``reason`` is a sentence naming the value and the rule)."""

    step: int
    loss: float
    grad_norm: float
    reason: str


class DivergenceGuard:
    """Feed it every step's (loss, grad norm) in order; :meth:`check` returns a :class:`Verdict` for a diverged
    step (and does not add it to the history) or None for a healthy one."""

    def __init__(self, *, loss_factor: float, grad_norm_factor: float, window: int):
        self.loss_factor, self.grad_norm_factor = loss_factor, grad_norm_factor
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.grad_norms: collections.deque[float] = collections.deque(maxlen=window)

    def check(self, step: int, loss: float, grad_norm: float) -> Verdict | None:
        reason = None
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            reason = f"loss {loss}, grad norm {grad_norm}: not finite"
        elif self.losses:
            reason = (self._spike("loss", loss, self.losses, self.loss_factor)
                      or self._spike("grad norm", grad_norm, self.grad_norms, self.grad_norm_factor))
        if reason is not None:
            return Verdict(step, loss, grad_norm, reason)
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        return None

    @staticmethod
    def _spike(name: str, value: float, history: collections.deque[float], factor: float) -> str | None:
        if not factor:
            return None
        median = statistics.median(history)
        if value > factor * median:
            return (f"{name} {value:.6g} is {value / median:.3g}x the median {median:.6g} of the last {len(history)} "
                    f"healthy steps (spike factor {factor:g})")
        return None

    def state_dict(self) -> dict[str, list[float]]:
        """The history (JSON-serialisable): a resumed run's guard continues where the checkpoint's left off."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: dict[str, list[float]] | None) -> None:
        self.losses.clear()
        self.grad_norms.clear()
        for k, dq in (("losses", self.losses), ("grad_norms", self.grad_norms)):
            dq.extend(float(v) for v in (state or {}).get(k, []))
