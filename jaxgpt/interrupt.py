"""Ctrl-C (SIGINT) in the command-line tools: one line and the conventional exit status 130, no traceback.

Every CLI's ``__main__`` runs its ``main`` through :func:`run_cli`. What the tools write is all-or-nothing already
(shards are staged and committed with a manifest last, exports are staged beside their target and renamed into
place, checkpoints are committed by orbax's rename), so an interrupted tool leaves nothing half-written behind;
the line says so. A failed write (a full disk: :class:`jaxgpt.diskspace.WriteFailed`) exits 2 with its message.
(``python -m jaxgpt.train`` handles SIGINT itself: it saves the step in hand, :mod:`jaxgpt.train.preempt`.)"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a job ended by Ctrl-C


def run_cli(main: Callable[[], int], prog: str, *, left: str = "nothing was written") -> NoReturn:
    """``sys.exit(main())``, with Ctrl-C as ``PROG: interrupted (Ctrl-C); LEFT`` and exit status 130."""
    from jaxgpt.diskspace import WriteFailed

    try:
        code = main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C); {left}", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except WriteFailed as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)
