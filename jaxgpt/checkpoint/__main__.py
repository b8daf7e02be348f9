"""``python -m jaxgpt.checkpoint``."""

from jaxgpt.interrupt import run_cli  # first: a Ctrl-C during the tool's imports is one line too

run_cli("jaxgpt.checkpoint.cli:main", "jaxgpt.checkpoint", left="nothing was changed (an export is staged beside "
        "its target and removed; the checkpoints are only read)")
