"""Ctrl-C (SIGINT) in the command-line tools: one line and the conventional exit status 130, no traceback.

Every CLI's ``__main__`` imports this module first (it imports nothing heavy) and runs its ``main`` through
:func:`run_cli`, which imports the tool itself (jax, orbax, torch: a second or more) inside its handler, so a
Ctrl-C during those imports is the same one line as a Ctrl-C later; what Python imports before the ``__main__``
runs (a package whose ``__init__`` imports its CLI, as ``jaxgpt.data``, ``jaxgpt.checkpoint`` and ``jaxgpt.train``
do) is covered by :func:`guard_package_imports`, which ``jaxgpt``'s ``__init__`` installs. What the tools write is
all-or-nothing already
(shards are staged and committed with a manifest last, exports are staged beside their target and renamed into
place, checkpoints are committed by orbax's rename), so an interrupted tool leaves nothing half-written behind;
the line says so. A failed write (a full disk: :class:`jaxgpt.diskspace.WriteFailed`) exits 2 with its message.
(``python -m jaxgpt.train`` handles SIGINT and SIGTERM itself once its run begins: it saves the step in hand,
:mod:`jaxgpt.train.preempt`.)

After the line the process ends with ``os._exit``: a normal interpreter shutdown with XLA's compiler threads still
running can crash (SIGSEGV) after the message was printed. A Ctrl-C that library code swallowed (JAX's garbage
collection callback would print ``Exception ignored in: ... KeyboardInterrupt`` and carry on; JAX's plugin start-up
logs it with its traceback, :data:`SWALLOWING_LOGGERS`, where that record is dropped) is delivered again a moment
later, to the tool's own code; and the handler records every SIGINT, so a tool that returns normally after one
exits 130 too.

But Python runs a signal handler only when the main thread returns to Python, and an XLA compilation (seconds
here, half a minute for GPT-2 compiled for an H100) does not; when it does return, the ``KeyboardInterrupt`` may
be raised inside one of JAX's bare ``except:`` clauses and swallowed there, so the tool ran on to its end (seen on
CI: ``jaxgpt.compile`` wrote its report after a Ctrl-C). Tools that write only at their end, atomically
(``compile``, ``eval``, ``generate``, ``account``: ``run_cli(..., watch=True)``), get a watcher thread that reads
the signal from :func:`signal.set_wakeup_fd` (written by the C-level handler at once): if the main thread has not
taken it within :data:`HANDLER_GRACE_S`, or has but is still in the tool :data:`EXIT_GRACE_S` later, the watcher
prints the line and ends the process itself. (The data and checkpoint tools clean up their staging on a Ctrl-C and
say so: they keep the main thread's handling alone; ``jaxgpt.train`` has its own watcher once its run begins,
:mod:`jaxgpt.train.preempt`, which takes the wakeup fd over and gives it back.)"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a job ended by Ctrl-C
HANDLER_GRACE_S = 1.0  # watch=True: the main thread's handler's time to take a Ctrl-C before the watcher acts
EXIT_GRACE_S = 3.0  # ... and, once it has, the time the tool may take to reach its exit
# loggers of library code that swallows an exception with a bare ``except:`` and logs it with its traceback (JAX's
# plugin start-up: a Ctrl-C while the CUDA plugin loads its libraries, seen on CI, printed a traceback before the line)
SWALLOWING_LOGGERS = ("jax._src.xla_bridge",)


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C that a tool caught to say what it had already done: ``left`` replaces :func:`run_cli`'s line."""

    def __init__(self, left: str):
        super().__init__(left)
        self.left = left


class _SigintSeen:
    """The SIGINT handler while a tool runs: record the signal, then raise ``KeyboardInterrupt`` as Python's
    default handler does (so a Ctrl-C that something swallows is still known)."""

    def __init__(self) -> None:
        self.count = 0
        self.raising = True

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.raising:
            raise KeyboardInterrupt

    def unraisable(self, previous: Callable[[Any], None]) -> Callable[[Any], None]:
        """A ``sys.unraisablehook`` that, for the Ctrl-C's KeyboardInterrupt swallowed where it was raised (a
        callback, a ``__del__``), sends SIGINT again a moment later instead of printing a traceback."""

        def hook(info: Any) -> None:
            if isinstance(info.exc_value, KeyboardInterrupt) and self.raising:
                timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
                timer.daemon = True
                timer.start()
                return
            previous(info)

        return hook

    def swallowed(self, record: logging.LogRecord) -> bool:
        """A logging filter for :data:`SWALLOWING_LOGGERS`: a record of the Ctrl-C's KeyboardInterrupt, which the
        library swallowed, is not printed (the tool's line says it), and SIGINT is sent again a moment later so that
        the tool's own code is interrupted, as for :meth:`unraisable`; every other record passes."""
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, KeyboardInterrupt) and self.raising and self.count:
            timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
            timer.daemon = True
            timer.start()
            return False
        return True


class _Watcher:
    """``run_cli(..., watch=True)``: a daemon thread that reads each SIGINT from the wakeup fd and ends the process
    with ``interrupted``'s line when the main thread cannot (stuck in compiled code) or did not (its
    ``KeyboardInterrupt`` swallowed by a library) act on it in time, while the tool runs (``seen.raising``)."""

    def __init__(self, seen: _SigintSeen, interrupted: Callable[[str], NoReturn], left: str) -> None:
        self.seen, self.interrupted, self.left = seen, interrupted, left
        self.received = 0  # SIGINTs the C-level handler wrote to the wakeup fd

    def install(self) -> bool:
        r, w = os.pipe()
        os.set_blocking(w, False)  # (the C handler must never block on a full pipe)
        try:
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter: the handler alone
            os.close(r)
            os.close(w)
            return False
        threading.Thread(target=self._watch, args=(r,), name="jaxgpt-interrupt-watcher", daemon=True).start()
        return True

    def _watch(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            if signal.SIGINT in data:
                self.received += 1
                self._act_if_stuck(self.received)

    def _act_if_stuck(self, nth: int) -> None:
        deadline = time.monotonic() + HANDLER_GRACE_S
        while time.monotonic() < deadline and self.seen.count < nth:
            time.sleep(0.01)
        if self.seen.count >= nth:  # taken: the tool's own way out (its line, or its Interrupted's) goes first
            deadline = time.monotonic() + EXIT_GRACE_S
            while time.monotonic() < deadline:
                time.sleep(0.02)
        if self.seen.raising:  # still in the tool (during the imports a Ctrl-C waits for them, by design)
            self.interrupted(self.left)


def guard_package_imports() -> None:
    """``python -m jaxgpt.<tool>``: Python imports the tool's package (``jaxgpt.train``, ``jaxgpt.checkpoint``:
    jax, orbax, flax; a second or so) before the tool's ``__main__`` runs and reaches :func:`run_cli`. A Ctrl-C in
    that window ends the process with the tool's one line and 130 (nothing has been written yet). ``jaxgpt``'s
    ``__init__`` installs this while ``sys.argv[0] == "-m"``, which is exactly that window: Python sets it to the
    module's path once the packages are imported, and from then on the handler is Python's default (a
    ``KeyboardInterrupt``) until the tool installs its own."""
    argv = getattr(sys, "orig_argv", [])
    prog = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else "jaxgpt"

    def handler(signum: int, frame: Any) -> None:
        if sys.argv[:1] != ["-m"]:  # the tool's __main__ is running: Python's default
            raise KeyboardInterrupt
        print(f"{prog}: interrupted (Ctrl-C) while starting; nothing was written", file=sys.stderr)
        exit_now(EXIT_INTERRUPTED)

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is \
            signal.default_int_handler:
        signal.signal(signal.SIGINT, handler)
        delay = float(os.environ.get("JAXGPT_DEBUG_STARTUP_SLEEP", "0"))  # tests: time to signal this window
        if delay:
            time.sleep(delay)


def _load(main: Callable[[], int] | str) -> Callable[[], int]:
    """``main`` itself, or ``"package.module:function"`` imported now."""
    if callable(main):
        return main
    module, _, name = main.partition(":")
    return getattr(importlib.import_module(module), name or "main")


def exit_now(code: int) -> NoReturn:
    """Flush stdout and stderr, then end the process with ``code`` at once (``os._exit``: no interpreter shutdown,
    which can crash with XLA's threads mid-way; what jaxgpt writes is safe against a kill at any moment)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more to say there
            pass
    os._exit(code)


def run_cli(main: Callable[[], int] | str, prog: str, *, left: str = "nothing was written",
            watch: bool = False) -> NoReturn:
    """``sys.exit(main())``, with Ctrl-C as ``PROG: interrupted (Ctrl-C); LEFT`` and exit status 130.

    ``main``: the tool's ``main`` or, so that its imports are covered too, ``"module:function"`` to import here
    (a Ctrl-C during the imports is held until they are done, a second or so: an interrupted import of a compiled
    extension fails in odd ways or crashes). A tool that catches the Ctrl-C to say what it had done raises
    :class:`Interrupted` with the line's end. ``watch``: a tool that writes only at its end, atomically, is also
    ended by a watcher thread when its main thread is stuck in compiled code (:class:`_Watcher`)."""
    seen = _SigintSeen()
    one_line = threading.Lock()  # the main thread or the watcher: one line, one exit

    def interrupted(end: str) -> NoReturn:
        one_line.acquire()
        seen.raising = False
        print(f"{prog}: interrupted (Ctrl-C); {end}", file=sys.stderr)
        exit_now(EXIT_INTERRUPTED)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, seen)
        sys.unraisablehook = seen.unraisable(sys.unraisablehook)
        for name in SWALLOWING_LOGGERS:
            logging.getLogger(name).addFilter(seen.swallowed)
        if watch:
            _Watcher(seen, interrupted, left).install()

    try:
        seen.raising = False  # the imports: a Ctrl-C is counted, and honoured once they are done
        from jaxgpt.diskspace import WriteFailed

        tool = _load(main)
        if seen.count:
            interrupted(left)
        seen.raising = True
        try:
            code = tool()
        except WriteFailed as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            code = 2
        seen.raising = False  # from here a Ctrl-C is only counted: the tool is done, the exit is under way
    except KeyboardInterrupt as e:
        interrupted(e.left if isinstance(e, Interrupted) else left)
    except Exception:
        if not seen.count:
            raise
        interrupted(left)  # an error the Ctrl-C caused (e.g. an ImportError around it): the Ctrl-C is the news
    if seen.count:  # swallowed on the way (a library's bare except), or it came as the tool finished
        one_line.acquire()
        print(f"{prog}: interrupted (Ctrl-C), but the command had already run to its end (its exit status would "
              f"have been {code or 0})", file=sys.stderr)
        exit_now(EXIT_INTERRUPTED)
    sys.exit(code)
