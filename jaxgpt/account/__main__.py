"""``python -m jaxgpt.account``: see :mod:`jaxgpt.account.cli`."""

from jaxgpt.interrupt import run_cli  # first: a Ctrl-C during the imports below is one line too

run_cli("jaxgpt.account.cli:main", "jaxgpt.account", left="nothing was written", watch=True)
