"""``python -m jaxgpt.eval``."""

from jaxgpt.interrupt import run_cli  # first: a Ctrl-C during the tool's imports is one line too

run_cli("jaxgpt.eval.cli:main", "jaxgpt.eval", left="no results were written", watch=True)
