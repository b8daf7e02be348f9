"""``python -m jaxgpt.eval``."""

from jaxgpt.eval.cli import main
from jaxgpt.interrupt import run_cli

run_cli(main, "jaxgpt.eval", left="no results were written")
