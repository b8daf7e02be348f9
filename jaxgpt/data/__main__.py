"""``python -m jaxgpt.data``."""

import sys

from jaxgpt.data.cli import main

sys.exit(main())
