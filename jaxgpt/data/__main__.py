"""``python -m jaxgpt.data``."""

from jaxgpt.data.cli import main
from jaxgpt.interrupt import run_cli

run_cli(main, "jaxgpt.data", left="no shards were committed: the staging directory is removed and the shards "
        "already there (if any) are untouched")
