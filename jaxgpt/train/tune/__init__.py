"""``kernels: auto``: the fastest program measured on the user's own device, chosen among the kernel layer's
implementations (:mod:`jaxgpt.kernels.registry`) for a run's model, precision and micro-batch, cached per device
and shape, never slower than the default program by more than the noise it measured (docs/auto.md).

* :mod:`jaxgpt.train.tune.auto` -- a run's choice: committed file, cached file, bounded search, or the default program;
* :mod:`jaxgpt.train.tune.search` -- the candidates, their order, the budget and the rule that picks one;
* :mod:`jaxgpt.train.tune.measure` -- one candidate: its step lowered, compiled, checked and timed;
* :mod:`jaxgpt.train.tune.cache` -- where choices live (jaxgpt/kernels/tuned/, then the user's cache directory);
* :mod:`jaxgpt.kernels.tiles` -- a Pallas GEMM's tiles per shape, chosen by op-level timing;
* ``python -m jaxgpt.tune --config FILE`` -- the search alone (:mod:`jaxgpt.train.tune.cli`)."""
