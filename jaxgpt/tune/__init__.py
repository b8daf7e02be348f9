"""``python -m jaxgpt.tune --config FILE``: ``kernels: auto``'s search alone, with its table (docs/auto.md).

The search itself is part of training (:mod:`jaxgpt.train.tune`: a run selects its kernels at its start) and the
tiles part of the kernel layer (:mod:`jaxgpt.kernels.tiles`); this package is only the command's name."""
