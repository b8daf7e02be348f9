import sys

from jaxgpt.tune.cli import main

sys.exit(main())
