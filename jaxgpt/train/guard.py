"""Divergence detection: a step's loss or gradient norm that is not finite, or that jumps far above the running
median of the recent healthy steps (a loss spike).

The loss rule compares each step's loss with ``spike_loss_factor`` times the median of the last ``spike_window``
healthy losses; the gradient-norm rule likewise with ``spike_grad_norm_factor`` (0 turns a rule off). Both start
from the second step: the first step's loss (about ln(vocab) = 10.8 for a fresh GPT-2) is the first history.

The defaults were set against healthy runs' logged values (tests/data/healthy_runs.json, checked by
tests/test_guard.py). On the default Shakespeare run (600 steps, dropout 0.1, lr 3e-3) the largest ratio of a
step's loss to the median of the steps before it is 1.44, at step 37, where the loss jumps from 6.5 to 12.8 and
its gradient norm from 0.9 to 164 (99x the median) before clipping brings both back: the run ends at a val loss
of 5.06. On a 300-step tiny run the ratios are 1.08 (loss) and 2.3 (gradient norm). So the loss factor is 3
(twice the largest healthy jump) and the gradient-norm rule is off by default: a 100x jump that recovers is
part of a healthy run here. An explosion (10.1 -> 1.4e13, or a tenfold loss) trips the loss rule at once; a
spike that stays below three times the median is not caught (``spike_loss_factor: 2`` is tighter and still
clears the runs above, with less margin).
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

    def check_loss(self, step: int, loss: float) -> Verdict | None:
        """A loss measured without a training step (the final state's check): the loss rules only, and not
        added to the history."""
        if not math.isfinite(loss):
            return Verdict(step, loss, math.nan, f"loss {loss}: not finite")
        reason = self._spike("loss", loss, self.losses, self.loss_factor) if self.losses else None
        return None if reason is None else Verdict(step, loss, math.nan, reason)

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
