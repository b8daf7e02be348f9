"""jaxgpt: GPT-2 in JAX/Flax, checked number by number against PyTorch and Hugging Face."""

from jaxgpt.config import ConfigError, GPTConfig

__all__ = ["ConfigError", "GPTConfig"]
__version__ = "0.1.0"
