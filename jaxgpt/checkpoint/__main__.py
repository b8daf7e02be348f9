"""``python -m jaxgpt.checkpoint``."""

import sys

from jaxgpt.checkpoint.cli import main

sys.exit(main())
