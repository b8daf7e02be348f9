"""How a run stops early without losing work (mixed into :class:`jaxgpt.train.run.Run`): on SIGTERM / SIGINT
(:mod:`jaxgpt.train.preempt`) it saves the step in hand; on a failed checkpoint save (a full disk) it stops at
the next step with one message; on XLA's out-of-memory error it stops with one line naming the step and the newest
checkpoint (:mod:`jaxgpt.memory_fit`); and before the first step it checks that the disk can hold what the run keeps.

Disk space (``keep_checkpoints`` checkpoints of the run's size, plus the one being written before the oldest is
deleted, plus the best one with ``keep_best_checkpoint``) is checked against the free space of ``out_dir``'s
file system, counting the checkpoints already there. Not enough: the run refuses to start (exit 2), naming the
sizes; ``allow_low_disk: true`` turns that into a warning. The checkpoint size is measured (the newest saved
step's files) when the run resumes, else estimated from the arrays (params + optimizer state; orbax adds a few
kB of metadata and compresses little)."""

from __future__ import annotations

import os
import shlex
import sys
import time

from jaxgpt import diskspace
from jaxgpt.train.preempt import Preempted, signal_name

DEBUG_SAVE_SLEEP = float(os.environ.get("JAXGPT_DEBUG_SAVE_SLEEP", "0"))  # tests: time to signal mid-save
METADATA_BYTES = 1 << 20  # orbax's per-step metadata, the JSON items and the run's logs: a generous allowance


class LowDisk(diskspace.WriteFailed):
    """The disk cannot hold the checkpoints the run would keep (refused before the first step)."""


class Stopping:
    """``between_steps``, ``stop_on_signal`` and ``check_disk_space`` of a :class:`~jaxgpt.train.run.Run`."""

    def between_steps(self, step: int) -> None:
        """After step ``step`` and whatever was due at it: report a failed checkpoint save now (raises
        :class:`~jaxgpt.checkpoint.manager.CheckpointWriteFailed`), and stop here on a signal (all processes at
        the same step)."""
        self.ckpts.check()
        p = self.preemption
        if p is not None:
            stop = p.stop_at(step, synced=getattr(self, "synced_at", None) == step)
            if stop is not None and step >= stop:
                self.stop_on_signal(step)

    def stop_on_signal(self, step: int) -> None:
        """Save step ``step`` (after its checks: the pending steps through the divergence guard, then the state's
        loss on the next batch, as for the final state; a diverged state is not saved), wait until it is
        committed, and raise :class:`Preempted` saying what was saved and how to resume."""
        p = self.preemption
        t0 = time.perf_counter()
        name = signal_name(p.signum)
        p.start_saving(step)
        self.stopped_early = True
        previous = self.ckpts.latest_step()
        verdict = self.sync() if self.pending else None
        if verdict is None:
            self.feed.seek(self.feed.position)  # drop the batch read ahead: the check reads step + 1's batch
            verdict = self.check_final(step)
        if verdict is not None:
            self.recover(verdict, may_roll_back=False)  # raises NonFiniteLoss naming the last good checkpoint
        self.held = None  # (a held checkpoint is of this very step, or was written by the sync above)
        saved = self.ckpts.latest_step() != step
        if DEBUG_SAVE_SLEEP:  # a test's room to send more signals around the save
            time.sleep(DEBUG_SAVE_SLEEP)
        p.saving_phase("writing", committed=lambda: (self.ckpts.directory / str(step)).is_dir())  # (orbax renames)
        self.save_now(step, {"loss": self.last.get("loss"), "checked": True, "preempted": name})
        if DEBUG_SAVE_SLEEP:
            time.sleep(DEBUG_SAVE_SLEEP)
        self.ckpts.wait()
        p.saving_phase("committed")
        since = "" if previous is None else f" (the previous checkpoint was step {previous})"
        what = (f"saved checkpoint step {step} in {time.perf_counter() - t0:.1f} s{since}" if saved
                else f"checkpoint step {step} was already saved")
        raise Preempted(f"{name}: stopped after step {step}; {what}, in {self.ckpts.directory}. "
                        f"{self.resume_hint(step)}", p.signum)

    def resume_hint(self, step: int) -> str:
        """How to continue from checkpoint ``step``: the same command, unless it says ``resume: never`` (which
        refuses a run directory that holds checkpoints): then that command with ``--resume=auto``."""
        if self.cfg.resume != "never":
            return f"Resume with the same command (resume: {self.cfg.resume} continues from step {step}, bit for bit)."
        argv = _cli_argv()
        if argv is None:
            how = "the same call with resume='auto'"
        else:
            kept, skip = [], False
            for a in argv:  # the command without its --resume=never / --resume never
                if skip or a.startswith("--resume="):
                    skip = False
                    continue
                if a == "--resume":
                    skip = True
                    continue
                kept.append(a)
            how = "`" + shlex.join(["python", "-m", "jaxgpt.train", *kept, "--resume=auto"]) + "`"
        return (f"Resume with {how} (resume: never refuses a run directory that holds checkpoints; auto continues "
                f"from step {step}, bit for bit).")

    def out_of_memory(self, e: BaseException) -> Exception:
        """XLA's out-of-memory error ``e`` in the step loop as one line, an
        :class:`~jaxgpt.memory_fit.OutOfDeviceMemory`: the step, the newest checkpoint (every saved one was checked;
        the state in hand is not saved: its buffers were donated to the step that failed) and how to resume."""
        from jaxgpt.memory_fit import OutOfDeviceMemory, oom_summary

        self.stopped_early = True
        pending = [s for s, _ in self.pending]
        self.pending, self.held = [], None  # (the held copy was not yet checked by the step after it)
        last = self.step_in_hand
        at = (f"step {last}" if not pending or pending[0] == last else f"one of steps {pending[0]}-{last} (the device "
              f"runs ahead of the host: the error surfaced at step {last})")
        try:
            self.ckpts.wait()  # a save in flight commits first
        except Exception:  # (its own failure leaves the earlier checkpoints, named below)
            pass
        steps = self.ckpts.all_steps()
        fix = ("free the GPU's memory (another process on it?), or lower batch_size with total_batch_tokens kept (a "
               "resume allows it: more micro-steps, the same tokens per step)")
        if not steps:
            where = f"no checkpoint was written yet: {fix}, then re-run the same command to start the run again"
        else:
            where = (f"the newest checkpoint is step {steps[-1]} in {self.ckpts.directory}: {fix}. "
                     f"{self.resume_hint(steps[-1])}")
        return OutOfDeviceMemory(f"out of device memory at {at} ({oom_summary(e)}); {where}")

    def note_untrained(self) -> None:
        """After resuming, before the first step: what a signal from now until the first step completes leaves
        (the newest checkpoint, or none), for :class:`~jaxgpt.train.preempt.Preemption`'s message."""
        p = self.preemption
        if p is None:
            return
        if self.resumed_from is None:
            p.untrained = "nothing was trained, and the run has no checkpoint yet; re-run the same command to start it"
        else:
            p.untrained = (f"nothing was trained since checkpoint step {self.resumed_from} (in {self.ckpts.directory}),"
                           f" nothing needed saving. {self.resume_hint(self.resumed_from)}")

    def check_disk_space(self) -> None:
        """Before the first step: can the disk hold the checkpoints this run keeps? Refuse (:class:`LowDisk`) or,
        with ``allow_low_disk``, warn."""
        cfg = self.cfg
        if self.start_step >= cfg.max_steps:
            return
        steps = self.ckpts.all_steps()
        if steps:
            size = diskspace.dir_bytes(self.ckpts.directory / str(steps[-1]))
            how = f"measured: step {steps[-1]}"
        else:
            size = diskspace.tree_nbytes((self.state.params, self.state.opt_state)) + METADATA_BYTES
            how = "estimated from the params and optimizer state"
        at_peak = cfg.keep_checkpoints + 1 + int(cfg.keep_best_checkpoint)  # + the save being written
        every = cfg.checkpoint_interval
        saves_left = 1 + (len(range(self.start_step + every, cfg.max_steps, every)) if every else 0)
        existing = sum(diskspace.dir_bytes(self.ckpts.directory / str(s)) for s in steps)
        peak = min(at_peak, len(steps) + saves_left) * size
        need = max(0, peak - existing)
        free = diskspace.free_bytes(self.ckpts.directory)
        if free is None or need <= free:
            return
        n = min(at_peak, len(steps) + saves_left)
        msg = (f"{self.ckpts.directory}: the run will keep up to {n} checkpoint{'s' if n != 1 else ''} of "
               f"{diskspace.human(size)} each ({how}; keep_checkpoints {cfg.keep_checkpoints}, plus "
               "the one being written" + (", plus the best one" if cfg.keep_best_checkpoint else "") + "): "
               f"{diskspace.human(need)} more than the {diskspace.human(existing)} there now, but only "
               f"{diskspace.human(free)} is free on that file system")
        if not cfg.allow_low_disk:
            raise LowDisk(msg + ". Free space, choose an out_dir on a larger disk, lower keep_checkpoints, or "
                          "train anyway with --allow_low_disk=true (a save that runs out of space then stops the "
                          "run with exit status 2; the earlier checkpoints stay intact).")
        self.say(f"  warning: {msg}; training anyway (allow_low_disk): a save that runs out of space will stop "
                 "the run with exit status 2")


def _cli_argv() -> list[str] | None:
    """The arguments of ``python -m jaxgpt.train ARGS`` when that is this process; None when train() was called
    from Python."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return sys.argv[1:] if spec is not None and spec.name == "jaxgpt.train.__main__" else None
