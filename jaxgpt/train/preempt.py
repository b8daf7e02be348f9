"""SIGTERM and SIGINT during training: finish the step in hand, save it, say how to resume, exit 143 / 130.

Schedulers and spot instances send SIGTERM and then, after a grace period (often 30 s), SIGKILL. While the step
loop runs, :class:`Preemption` turns SIGTERM and SIGINT (Ctrl-C) into a request that the loop reads once per
step, after the step in hand (and whatever was due at it: an evaluation, a checkpoint) is done, so no update is
ever half applied. The run then saves that step through the usual checked path (see
:meth:`jaxgpt.train.run.Run.stop_on_signal`), waits until it is committed, prints what it saved and how to resume,
and exits with ``128 + signal``: 143 for SIGTERM, 130 for SIGINT (what shells and Slurm report for a job ended by
that signal, and what requeueing wrappers test for).

A second signal while the save is under way does not interrupt it: the save goes on (an interrupted save would
be lost anyway, and orbax commits a step only once it is whole), and the message says so. A third one abandons
the save at once (``os._exit``): orbax's temporary directory is left behind (``checkpoint list`` shows it as
``incomplete``; the next run removes it) and every earlier checkpoint stays intact. Before the step loop starts
(set-up, compilation, the step-0 evaluation) a signal ends the run at once as ``KeyboardInterrupt`` does: nothing
has been trained, so nothing is lost.

With several processes every process must save the same step (the save is a collective). A signal may reach
one process only, or each at a different step, so the processes agree, through the JAX distributed runtime's
key-value store, at the step loop's synchronisations (every ``log_interval`` steps and at evaluations and
checkpoints: the same steps on every process, each with nothing left in flight): each posts whether it has
received a signal and reads the others' posts, and if any has, all stop after that step. With
``log_interval: 1`` (our configs) that is the very next step. JAX's own preemption sync point does this for
SIGTERM; done here it also covers SIGINT and works with Python's signal handlers, which replace the runtime's
SIGTERM notifier.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)
STEP_KEY = "jaxgpt/preemption/step/"  # + "<step>/<process index>": the signal that process has received (0: none)
AGREE_TIMEOUT_MS = 3_600_000  # the others may still be evaluating (HellaSwag); a dead process ends the job first


def exit_code(signum: int) -> int:
    """The conventional status of a process ended by ``signum``: 128 + its number (143 SIGTERM, 130 SIGINT)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Preempted(Exception):
    """The run stopped on a signal; the message says what was saved and how to resume. ``code``: the exit status."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum, self.code = int(signum), exit_code(signum)


class InterruptedBeforeTraining(KeyboardInterrupt):
    """A signal before the step loop began: nothing was trained, so nothing needs saving."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum, self.code = int(signum), exit_code(signum)


class Preemption:
    """The run's SIGTERM / SIGINT handlers (installed by :meth:`install`, put back by :meth:`uninstall`).

    ``mode`` ``"raise"`` (before the step loop): a signal raises :class:`InterruptedBeforeTraining`.
    ``"flag"`` (the step loop): a signal is recorded; :meth:`stop_at` tells the loop when to stop.
    ``"saving"`` (the save on a signal): a second signal is reported and ignored, a third abandons the save."""

    def __init__(self, *, process_index: int = 0, process_count: int = 1, say: Callable[[str], Any] | None = None):
        self.pindex, self.pcount = process_index, process_count
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.signum: int | None = None  # the first signal received (or noticed from another process)
        self.mode = "raise"
        self.count = 0
        self.saving_what = ""
        self._previous: dict[int, Any] = {}
        self._stop: int | None = None  # the step all processes stop after, once agreed
        self._posted = False

    # ---- handlers -----------------------------------------------------------------------------------------
    def install(self) -> "Preemption":
        """Take SIGTERM and SIGINT (only from the main thread: a library caller's thread keeps the defaults)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.mode == "raise":
            raise InterruptedBeforeTraining(signum)
        if self.signum is None:
            self.signum = signum
            self.say(f"jaxgpt.train: {signal_name(signum)} received: finishing the step in hand, then saving it "
                     f"(send it twice more to abandon the save)")
            return
        if self.mode != "saving":
            self.say(f"jaxgpt.train: {signal_name(signum)} again: the step in hand is being finished and saved; "
                     "a third signal abandons the save (the earlier checkpoints stay intact)")
            if self.count < 3:
                return
        if self.count >= 3:
            self.say(f"jaxgpt.train: {signal_name(signum)} a third time: abandoning {self.saving_what or 'the save'} "
                     "now; the earlier checkpoints are intact (the interrupted save shows as incomplete in `python "
                     "-m jaxgpt.checkpoint list` until the next run removes it)")
            sys.stderr.flush()
            os._exit(exit_code(self.signum or signum))
        self.say(f"jaxgpt.train: {signal_name(signum)} again: letting {self.saving_what or 'the save'} finish (it "
                 "is committed only once whole; the earlier checkpoints stay intact whatever happens); a third "
                 "signal abandons it")

    def start_loop(self) -> None:
        """From here on a signal is a request the step loop honours (:meth:`stop_at`)."""
        self.mode = "flag"

    def start_saving(self, what: str) -> None:
        self.mode, self.saving_what = "saving", what

    # ---- when to stop -------------------------------------------------------------------------------------
    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stop_at(self, step: int, *, synced: bool = True) -> int | None:
        """Called once per step, after step ``step`` and what was due at it: the step to stop after once a signal
        has been received here or (with several processes) anywhere; else None.

        With one process that is ``step`` itself, as soon as the signal arrived. With several, the processes agree
        only where every one of them stands at the same step with nothing in flight: after a synchronisation of
        the step loop (``synced``: every ``log_interval`` steps and at evaluations and checkpoints, the same
        steps on every process). There each posts whether it has received a signal and reads the others' posts;
        if any has, all stop at this step. A process never blocks while another may still need it to finish a
        step, so the agreement cannot deadlock."""
        if self._stop is not None:
            return self._stop
        if self.pcount == 1:
            if self.signum is None:
                return None
            self._stop = step
            return step
        if not synced:
            return None
        client = _client()
        _set(client, f"{STEP_KEY}{step}/{self.pindex}", str(self.signum or 0))
        posts = [int(client.blocking_key_value_get(f"{STEP_KEY}{step}/{q}", AGREE_TIMEOUT_MS))
                 for q in range(self.pcount)]
        if self._posted is not False:  # everyone has read my previous post (they posted this one after it)
            _delete(client, f"{STEP_KEY}{self._posted}/{self.pindex}")
        self._posted = step
        signalled = [q for q, sig in enumerate(posts) if sig]
        if not signalled:
            return None
        if self.signum is None:
            self.signum = posts[signalled[0]]
            self.say(f"jaxgpt.train: another process (process {signalled[0]}) received "
                     f"{signal_name(self.signum)}: stopping with it after step {step}")
        self._stop = step
        return step


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("several processes but no JAX distributed client: jax.distributed.initialize was not called")
    return client


def _set(client: Any, key: str, value: str) -> None:
    try:
        client.key_value_set(key, value, allow_overwrite=True)
    except TypeError:  # an older jaxlib without allow_overwrite
        client.key_value_set(key, value)


def _delete(client: Any, key: str) -> None:
    try:
        client.key_value_delete(key)
    except Exception:  # already gone: nothing to free
        pass
