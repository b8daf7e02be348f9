"""``python -m jaxgpt.data``."""

from jaxgpt.interrupt import run_cli  # first: a Ctrl-C during the tool's imports is one line too

run_cli("jaxgpt.data.cli:main", "jaxgpt.data", left="no shards were committed: the staging directory is removed "
        "and the shards already there (if any) are untouched")
