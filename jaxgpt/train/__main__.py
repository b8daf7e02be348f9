"""``python -m jaxgpt.train``."""

from jaxgpt.interrupt import run_cli  # first: a Ctrl-C during the imports is one line too

# (once set up, the run handles SIGINT and SIGTERM itself: it saves the step in hand, jaxgpt.train.preempt)
run_cli("jaxgpt.train.cli:main", "jaxgpt.train", left="nothing was trained or written")
