"""The kernel layer: one module per op the model calls, each with its reference (the XLA expression: the CPU's path
and the oracle) beside its Pallas implementations and their VJPs; :mod:`jaxgpt.kernels.registry` lists them
(docs/kernels.md)."""
