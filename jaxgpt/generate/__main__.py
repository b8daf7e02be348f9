"""``python -m jaxgpt.generate``: see :mod:`jaxgpt.generate.cli`."""

from jaxgpt.interrupt import run_cli  # first: a Ctrl-C during the tool's imports is one line too

run_cli("jaxgpt.generate.cli:main", "jaxgpt.generate", left="the samples printed so far are complete", watch=True)
