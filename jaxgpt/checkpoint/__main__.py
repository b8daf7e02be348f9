"""``python -m jaxgpt.checkpoint``."""

from jaxgpt.checkpoint.cli import main
from jaxgpt.interrupt import run_cli

run_cli(main, "jaxgpt.checkpoint", left="nothing was changed (an export is staged beside its target and "
        "removed; the checkpoints are only read)")
