"""``python -m jaxgpt.eval``."""

import sys

from jaxgpt.eval.cli import main

sys.exit(main())
