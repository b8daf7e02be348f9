"""SIGTERM and SIGINT during training: finish the step in hand, save it, say how to resume, exit 143 / 130.

Schedulers and spot instances send SIGTERM and then, after a grace period (often 30 s), SIGKILL. While the step
loop runs, :class:`Preemption` turns SIGTERM and SIGINT (Ctrl-C) into a request that the loop reads once per
step, after the step in hand (and whatever was due at it: an evaluation, a checkpoint) is done, so no update is
ever half applied. The run then saves that step through the usual checked path (see
:meth:`jaxgpt.train.run.Run.stop_on_signal`), waits until it is committed, prints what it saved and how to resume,
and exits with ``128 + signal``: 143 for SIGTERM, 130 for SIGINT (what shells and Slurm report for a job ended by
that signal, and what requeueing wrappers test for).

A second signal while the save is under way does not interrupt it: the save goes on (an interrupted save would
be lost anyway, and orbax commits a step only once it is whole), and the message says so. A third one ends the
process at once (``os._exit``), saying what is true at that moment: the save had not begun (nothing of the step
was written), was being written (what orbax had written shows as ``incomplete`` in ``checkpoint list`` until the
next run removes it) or was already committed; every earlier checkpoint stays intact.

Until the first step of this process has completed (set-up, restoring a checkpoint, the step-0 evaluation, the
first step's compilation and run) a signal ends the run at once with the same exit codes and a message naming the
newest checkpoint, which is all there is to resume from: nothing has been trained since, so nothing is lost.
The main thread's handler raises :class:`InterruptedBeforeTraining` and the run closes its files on the way out.
But Python runs a signal handler only when the main thread returns to Python, and compiling the train step
(seconds on a CPU, a minute for GPT-2 on a GPU after a restart) does not: a watcher thread reads the signal from
:func:`signal.set_wakeup_fd` and, if the main thread has not taken it within :data:`HANDLER_GRACE_S` (it is stuck
in a compilation or another long call), or has but its run has not ended :data:`EXIT_GRACE_S` later, prints the
message and ends the process itself (``os._exit``: what the run writes is safe against a kill at any moment, the
lock included). An exception a library swallowed (JAX's garbage-collection callback) ends the run at once, from
``sys.unraisablehook``. The previous wakeup fd and hook are put back by :meth:`Preemption.uninstall` (nothing else
in the process uses a wakeup fd: asyncio only for ``loop.add_signal_handler``, which jax and orbax do not call).

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
import time
from typing import Any, Callable

from jaxgpt.interrupt import exit_now

SIGNALS = (signal.SIGTERM, signal.SIGINT)
STEP_KEY = "jaxgpt/preemption/step/"  # + "<step>/<process index>": the signal that process has received (0: none)
HANDLER_GRACE_S = 0.5  # before the first step: the main thread's handler's time to act before the watcher does
EXIT_GRACE_S = 3.0  # ... and, once it has, the time its ordinary exit (closing the run's files) may take
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
    """A signal before the first step of this process completed: nothing was trained, so nothing needs saving.
    ``message``: what to print (naming the newest checkpoint and how to resume)."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(signal_name(signum))
        self.signum, self.code = int(signum), exit_code(signum)
        self.message = message or f"interrupted by {signal_name(signum)} before the first step: nothing was trained"


class Preemption:
    """The run's SIGTERM / SIGINT handlers (installed by :meth:`install`, put back by :meth:`uninstall`).

    ``mode`` ``"raise"`` (until the first step of this process has completed): a signal raises
    :class:`InterruptedBeforeTraining`, or the watcher thread ends the process when the main thread cannot act.
    ``"flag"`` (the step loop): a signal is recorded; :meth:`stop_at` tells the loop when to stop.
    ``"saving"`` (the save on a signal; ``phase`` ``"checking"``, ``"writing"``, ``"committed"``): a second signal
    is reported and ignored, a third ends the process. ``untrained``: what a signal in ``"raise"`` mode leaves
    (the run names its newest checkpoint once it has resumed)."""

    def __init__(self, *, process_index: int = 0, process_count: int = 1, say: Callable[[str], Any] | None = None):
        self.pindex, self.pcount = process_index, process_count
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.signum: int | None = None  # the first signal received (or noticed from another process)
        self.mode = "raise"
        self.count = 0
        self.saving_step: int | None = None
        self.phase: str | None = None
        self.untrained = ("nothing was trained, nothing needed saving; re-run the same command to start (or "
                          "resume) the run")
        self._previous: dict[int, Any] = {}
        self._stop: int | None = None  # the step all processes stop after, once agreed
        self._posted = False
        self._lock = threading.RLock()  # the mode, between the main thread and the watcher
        self._raised: int | None = None  # a signal the main thread's handler took in "raise" mode
        self._closed = False  # uninstalled: the run is over, the watcher stands down
        self._wakeup: tuple[int, int, int] | None = None  # (read end, write end, the previous wakeup fd)
        self._unraisablehook: Any = None
        self._committed: Callable[[], bool] = lambda: False

    # ---- handlers -----------------------------------------------------------------------------------------
    def install(self) -> "Preemption":
        """Take SIGTERM and SIGINT, and start the watcher (only from the main thread: a library caller's thread
        keeps the defaults)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        r, w = os.pipe()
        os.set_blocking(w, False)  # (the C handler must never block on a full pipe)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter: no watcher, the handlers alone
            os.close(r)
            os.close(w)
            return self
        self._wakeup = (r, w, previous)
        threading.Thread(target=self._watch, args=(r,), name="jaxgpt-preemption-watcher", daemon=True).start()
        self._unraisablehook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        return self

    def uninstall(self) -> None:
        with self._lock:  # (not while the watcher is ending the process)
            self._closed = True
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
        if self._wakeup is not None:
            r, w, previous = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(previous)
            os.close(w)  # the watcher reads end-of-file, closes its end and returns
        if self._unraisablehook is not None:
            sys.unraisablehook, self._unraisablehook = self._unraisablehook, None

    def _unraisable(self, info: Any) -> None:
        """The signal's exception raised where Python cannot pass it on, so the run would go on (JAX's
        garbage-collection callback swallows it with ``Exception ignored in ... Traceback``): the run ends here, as
        it would have."""
        if isinstance(info.exc_value, InterruptedBeforeTraining):
            with self._lock:
                if self._raised is not None and self.mode == "raise" and not self._closed:
                    self.say(f"jaxgpt.train: {self.untrained_message(self._raised)}")
                    exit_now(exit_code(self._raised))
        (self._unraisablehook or sys.__unraisablehook__)(info)

    def untrained_message(self, signum: int) -> str:
        return f"interrupted by {signal_name(signum)} before the first step of this process completed: {self.untrained}"

    def _watch(self, r: int) -> None:
        """The watcher thread: each SIGTERM / SIGINT, as the C-level handler writes it to the wakeup fd."""
        try:
            while True:
                try:
                    data = os.read(r, 64)
                except InterruptedError:
                    continue
                if not data:
                    return
                for signum in data:
                    if signum in SIGNALS:
                        self._untrained_exit(signum)
        except OSError:  # the pipe is gone: nothing more to watch
            return
        finally:
            try:
                os.close(r)
            except OSError:
                pass

    def _untrained_exit(self, signum: int) -> None:
        """Before the first step has completed: unless the main thread's handler takes the signal within
        :data:`HANDLER_GRACE_S` and its run ends within :data:`EXIT_GRACE_S` (the ordinary way, closing its
        files), print the message and end the process now. (A main thread stuck in a compilation never takes it
        in time; one whose exception was swallowed by a library's callback never ends its run.)"""
        deadline = time.monotonic() + HANDLER_GRACE_S
        while time.monotonic() < deadline and self._raised is None:
            if self.mode != "raise" or self._closed:
                return
            time.sleep(0.01)
        if self._raised is not None:
            deadline = time.monotonic() + EXIT_GRACE_S
            while time.monotonic() < deadline and not self._closed:
                time.sleep(0.02)
        with self._lock:
            if self.mode != "raise" or self._closed:
                return
            self.say(f"jaxgpt.train: {self.untrained_message(self._raised or signum)}")
            exit_now(exit_code(self._raised or signum))

    def _handle(self, signum: int, frame: Any) -> None:
        with self._lock:  # (not while the watcher is ending the process)
            self.count += 1
            if self.mode == "raise":
                self._raised = self._raised or signum
                raise InterruptedBeforeTraining(signum, self.untrained_message(signum))
        name = signal_name(signum)
        if self.signum is None:
            self.signum = signum
            self.say(f"jaxgpt.train: {name} received: finishing the step in hand, then saving it (send it twice "
                     "more to exit at once)")
            return
        if self.count >= 3:
            self.say(f"jaxgpt.train: {name} a third time: {self._abandoning()}")
            exit_now(exit_code(self.signum))
        if self.mode != "saving":
            self.say(f"jaxgpt.train: {name} again: the step in hand is being finished and saved; a third signal "
                     "exits at once (the earlier checkpoints stay intact)")
            return
        what = (f"the checks and the save of step {self.saving_step}" if self.phase == "checking"
                else f"the save of step {self.saving_step}")
        self.say(f"jaxgpt.train: {name} again: letting {what} finish (a step is committed only once whole; the "
                 "earlier checkpoints stay intact whatever happens); a third signal exits at once")

    def _abandoning(self) -> str:
        """What a third signal leaves, now."""
        step = self.saving_step
        if self.mode != "saving":
            return ("exiting now, before the step in hand was saved: the earlier checkpoints are intact, the steps "
                    "trained since the newest of them are lost")
        if self.phase == "checking":
            return (f"exiting now, before the save of step {step} began (its checks were running): nothing of "
                    f"step {step} was written; the earlier checkpoints are intact")
        if self.phase == "writing" and not self._committed():
            return (f"abandoning the save of step {step} now; the earlier checkpoints are intact (what was written of "
                    f"step {step} shows as incomplete in `python -m jaxgpt.checkpoint list` until the next run "
                    "removes it)")
        return f"checkpoint step {step} is already committed; exiting now"

    def start_loop(self) -> None:
        """The first step of this process has completed: from here on a signal is a request the step loop honours
        (:meth:`stop_at`)."""
        with self._lock:
            if self._raised is not None:  # the signal's exception was swallowed (a library's callback): end here
                self.say(f"jaxgpt.train: {self.untrained_message(self._raised)}")
                exit_now(exit_code(self._raised))
            self.mode = "flag"

    def start_saving(self, step: int) -> None:
        """The save on a signal begins (its checks first; then :meth:`saving_phase` ``"writing"``, ``"committed"``)."""
        self.mode, self.saving_step, self.phase = "saving", step, "checking"

    def saving_phase(self, phase: str, *, committed: Callable[[], bool] | None = None) -> None:
        """``committed``: whether the step's save is already on disk whole (orbax commits in the background)."""
        self.phase = phase
        if committed is not None:
            self._committed = committed

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
