"""``python -m jaxgpt.compile``: compile a training config's real train step for a GPU this machine does not
have, and print its memory, the largest micro-batch that fits, how it lowered, and its step time: the estimate
calibrated to a measured H100 (:mod:`jaxgpt.compile.calibrated`) beside the roofline bound.

    python -m jaxgpt.compile --config configs/gpt2-124m.yaml --target h100 [--devices 8] [--micro-batch 16]
                             [--no-search] [--mem-fraction 0.75] [--json FILE] [--set FIELD=VALUE ...]
    python -m jaxgpt.compile --hlo SAVED.hlo.txt.gz --target h100 [--config FILE] [--json FILE]  # nothing compiled

Needs JAX's CUDA plugin at jaxlib's version (``pip install "jax-cuda12-plugin[with-cuda]==$(python -c 'import
jaxlib; print(jaxlib.__version__)')"``); runs on a CPU-only machine (JAX_PLATFORMS=cpu is set here, before jax
is imported). Exit codes: 0 fits, 2 a usage or set-up problem (plugin, target, config) or the config's micro-batch
does not fit.
"""

import os

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"  # before jax is imported: the plugin stays loaded for compile-only use
    from jaxgpt.interrupt import run_cli  # a Ctrl-C (during the imports too) is one line and exit 130

    run_cli("jaxgpt.compile.cli:main", "jaxgpt.compile", left="nothing was written", watch=True)
