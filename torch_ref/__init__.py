"""torch_ref: a minimal nanoGPT-style PyTorch GPT-2, the oracle jaxgpt is checked against."""
