"""``python -m jaxgpt.train``."""

import sys

from jaxgpt.train.cli import main

sys.exit(main())
