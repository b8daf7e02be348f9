"""The accountant's shared constants and its error type."""

from __future__ import annotations

from jaxgpt.devices import GiB, MATMUL_DTYPES, DeviceError  # noqa: F401  (re-exported)

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "adagrad": 1, "rmsprop": 1}
OPTIMIZERS = (*OPTIMIZER_STATES, "muon")  # muon's state is per part: optimizer_state_elements
PRECISIONS = ("fp32", "bf16", "fp8")  # fp8: bf16 with the forward GEMMs of fp8_gemms in e4m3 (jaxgpt.kernels.fp8)
FP8_SCALE_BYTES = 2 * 4  # per e4m3 GEMM: two fp32 scales (== jaxgpt.kernels.fp8.scales_bytes(1); jax-free here)
ATTENTION_IMPLS = ("xla", "cudnn", "einsum")
CE_CHUNK_ELEMENTS = 1 << 26  # == jaxgpt.kernels.loss.CE_CHUNK_ELEMENTS (not imported: the accountant stays jax-free)
CE_CHUNK_ELEMENTS_GPU = 1 << 28  # == jaxgpt.kernels.loss.CE_CHUNK_ELEMENTS_GPU
ATTENTION_QUERY_BLOCKS = 4  # == jaxgpt.kernels.attention.ATTENTION_QUERY_BLOCKS

AccountError = DeviceError  # a bad argument to the accountant or its device table; the message says what is allowed
