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

With several processes every process must save the same step (the save is a collective). A signal may reach one
process only, or each at a different step, so the processes agree through the JAX distributed runtime's key-value
store: a signalled process posts a notice; every process looks for it once per step (one non-blocking read),
and once it has seen it posts the last step it has dispatched and reads everyone's; all stop at the largest
(the others train on up to it). This is what JAX's own preemption sync point does for SIGTERM; done here it also
covers SIGINT and works with Python's signal handlers, which replace the runtime's SIGTERM notifier.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)
NOTICE_KEY = "jaxgpt/preemption/notice"
STEP_KEY = "jaxgpt/preemption/step/"  # + process index
AGREE_TIMEOUT_MS = 120_000  # a process that never reports its step (it died): the runtime stops the job first


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

    def stop_at(self, step: int) -> int | None:
        """Called once per step, after step ``step`` (the last one dispatched) and what was due at it: the step
        to stop after, once a signal has been received here or (with several processes) anywhere; else None.
        With one process that is ``step`` itself; with several, the largest step any process had reached when it
        learned of the signal (it may be later than ``step``: keep training until then)."""
        if self._stop is not None:
            return self._stop
        if self.pcount == 1:
            if self.signum is None:
                return None
            self._stop = step
            return step
        client = _client()
        if self.signum is not None and not self._posted:
            _set(client, NOTICE_KEY, str(self.signum))
            self._posted = True
        if self.signum is None:
            notice = _try_get(client, NOTICE_KEY)
            if notice is None:
                return None
            self.signum = int(notice)
            self.say(f"jaxgpt.train: another process received {signal_name(self.signum)}: stopping with it")
        _set(client, f"{STEP_KEY}{self.pindex}", str(step))
        steps = [int(client.blocking_key_value_get(f"{STEP_KEY}{q}", AGREE_TIMEOUT_MS)) for q in range(self.pcount)]
        self._stop = max(steps)
        return self._stop


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


def _try_get(client: Any, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception:  # NOT_FOUND (the runtime raises a generic error for a missing key)
        return None


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
