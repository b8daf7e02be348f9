"""Only checked states are saved, and a divergence costs no healthy checkpoint (mixed into
:class:`jaxgpt.train.run.Run`).

The params after step ``s`` are first evaluated by step ``s + 1``'s loss. So at a checkpoint step the state is
copied on the device (:meth:`Safeguards.hold`: one extra copy of params and optimizer state, for one step) and
written once step ``s + 1``'s loss and gradient norm have passed the divergence guard; had they not, the copy is
dropped. The final state, which no training step evaluates, is checked the same way by :meth:`check_final`: the
loss of the batch the next step would train on, through the guard's loss rules. Every saved checkpoint is
therefore a state that was seen healthy, and "the last good checkpoint" in any message is one.

On divergence (:meth:`Safeguards.recover`) the run stops, naming the newest healthy state and checkpoint, or with
``on_divergence: rollback`` restores the newest checkpoint, skips the batches that followed it up to the
diverged step (PaLM's remedy for loss spikes) and continues, at most ``max_rollbacks`` times. A second rollback
to the same checkpoint also skips the batches the first attempt trained on, so no attempt repeats another.
"""

from __future__ import annotations

import math
import time
from typing import Any

from jaxgpt.train.guard import Verdict
from jaxgpt.train.resume import now_iso


class NonFiniteLoss(RuntimeError):
    """Training diverged (a non-finite or spiking loss or gradient norm) and could not roll back; the message
    names the step, the rule, the newest healthy state and the newest checkpoint."""


Diverged = NonFiniteLoss


def copy_on_device(tree: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.copy, tree)


def json_number(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)


class Safeguards:
    """``hold``, ``write_held``, ``save_now``, ``check_final`` and ``recover`` of a
    :class:`~jaxgpt.train.run.Run`."""

    def checkpoint_record(self, step: int, params: Any, opt_state: Any, extra: dict[str, Any]) -> dict[str, Any]:
        val = {"val_loss": self.val_loss} if self.val_step == step and self.val_loss is not None else None
        return {"step": step, "params": params, "opt_state": opt_state, "rng_key": self.rng,
                "loader_state": self.feed.position, "metrics": val,  # the val loss of this very state, if measured
                "extra": {**extra, "guard": self.guard.state_dict(), "lineage": list(self.lineage),
                          "tokenizer": self.tokenizer_record}}

    def hold(self, step: int) -> None:
        """Keep a device copy of the state after ``step`` (its RNG, data position and guard history too), to be
        written once the next step has checked it."""
        params, opt_state = copy_on_device((self.state.params, self.state.opt_state))
        self.held = self.checkpoint_record(step, params, opt_state, {"loss": self.last.get("loss"), "checked": True})

    def write_held(self) -> None:
        held, self.held = self.held, None
        if self.ckpts.latest_step() != held["step"]:
            self.ckpts.save(held.pop("step"), config=self.saved_config, **held)

    def save_now(self, step: int, extra: dict[str, Any]) -> None:
        """Save the current state (only for a state already checked: the final one, after :meth:`check_final`)."""
        if self.ckpts.latest_step() != step:
            c = self.checkpoint_record(step, self.state.params, self.state.opt_state, extra)
            self.ckpts.save(c.pop("step"), config=self.saved_config, **c)

    def check_final(self, step: int) -> Verdict | None:
        """The final state's check: its mean loss on the global batch step ``step + 1`` would train on (read and
        put back: the data position stays where it is), through the guard's loss rules (not recorded in its
        history). A :class:`Verdict` for step ``step + 1`` if that loss is not finite or spikes."""
        import numpy as np

        loader = self.train_loader
        position = loader.state_dict()
        try:
            x, y = loader.next_batch()
        finally:
            loader.load_state_dict(position)
        rows = self.cfg.batch_size
        losses = [self.eval_step(self.state.params, x[i:i + rows], y[i:i + rows]) for i in range(0, len(x), rows)]
        loss = float(np.mean([float(v) for v in losses]))
        verdict = self.guard.check_loss(step + 1, loss)
        if verdict is not None:
            verdict = Verdict(verdict.step, verdict.loss, verdict.grad_norm,
                              f"the final state, evaluated on the next training batch: {verdict.reason}")
        return verdict

    def recover(self, verdict: Verdict, *, may_roll_back: bool = True) -> int:
        """After a diverged step: roll back to the newest checkpoint and skip the data up to the diverged step
        (``on_divergence: rollback``, while rollbacks remain), returning the step rolled back to; else raise
        :class:`NonFiniteLoss` naming the newest healthy state and checkpoint."""
        cfg, v = self.cfg, verdict
        self.pending, self.held = [], None
        self.ckpts.wait()
        healthy_step = v.step - 2  # step v's loss judged the state after v - 1; v - 1's loss judged v - 2's
        last = max((s for s in self.ckpts.all_steps() if s <= healthy_step), default=None)
        self.metrics.write({"type": "divergence", "step": v.step, "loss": json_number(v.loss),
                            "grad_norm": json_number(v.grad_norm), "reason": v.reason})
        if may_roll_back and cfg.on_divergence == "rollback" and last is not None \
                and self.rollbacks < cfg.max_rollbacks:
            return self._roll_back(v)
        healthy = (f"The newest healthy state is step {healthy_step} (its loss, at step {v.step - 1}, passed)"
                   if v.step >= 2 else "No state was seen healthy")
        if last is None:
            where = "no checkpoint was written before it"
        else:
            skip = self.rollback_skips.get(last, 0) + v.step - last
            where = (f"the last good checkpoint is step {last} in {self.ckpts.directory}: resume from it with a lower "
                     f"optim.lr, or skip the data that followed it with --resume_step={last} --skip_batches={skip}"
                     + ("" if self.rollbacks else ", or set on_divergence: rollback"))
        why = f" ({self.rollbacks} rollback(s) done)" if self.rollbacks else ""
        raise NonFiniteLoss(f"step {v.step}: {v.reason}: training diverged{why} (lower optim.lr or raise "
                            f"optim.warmup_steps). {healthy}; {where}")

    def _roll_back(self, v: Verdict) -> int:
        """Restore the newest intact checkpoint and skip every batch trained on since it (by this attempt and by
        earlier rollbacks to it); the step rolled back to."""
        self.rollbacks += 1
        last = self.restore(None)
        skip = self.rollback_skips.get(last, 0) + v.step - last  # this attempt's batches last+1 .. v.step
        self.rollback_skips[last] = skip
        self.feed = self.new_feed()
        self.feed.skip(skip)
        self.lineage.append({"resumed_from": last, "skip_batches": skip, "time": now_iso(),
                             "reason": f"rollback after step {v.step}: {v.reason}"})
        self.metrics.write({"type": "rollback", "step": v.step, "to_step": last, "skip_batches": skip})
        self.bar.n = last
        self.say(f"step {v.step}: {v.reason}; rolled back to checkpoint {last} and skipped its next {skip} "
                 f"batch(es) (rollback {self.rollbacks} of {self.cfg.max_rollbacks})")
        self.t_mark = time.perf_counter()
        return last
