"""jaxgpt: GPT-2 in JAX/Flax, checked number by number against PyTorch and Hugging Face."""

import sys as _sys

if _sys.argv[:1] == ["-m"]:  # `python -m jaxgpt.<tool>` is importing the tool's package: Ctrl-C is one line
    from jaxgpt.interrupt import guard_package_imports

    guard_package_imports()

from jaxgpt.gpu_env import quiet_cuda_plugin_without_gpu  # noqa: E402

quiet_cuda_plugin_without_gpu()  # (make gpu-compile on a machine without a GPU: one line, not a traceback)

from jaxgpt.config import ConfigError, GPTConfig  # noqa: E402

__all__ = ["ConfigError", "GPTConfig"]
__version__ = "0.1.0"
