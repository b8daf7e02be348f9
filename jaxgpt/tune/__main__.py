import sys

from jaxgpt.train.tune.cli import main

sys.exit(main())
