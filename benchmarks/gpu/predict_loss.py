"""``python -m benchmarks.gpu.predict_loss --logits-dtype bfloat16 -- JAXGPT_COMPILE_ARGS...``: the calibrated
prediction of a train step whose fused lm_head cross-entropy writes its logits in ``--logits-dtype``, before a
precision policy selects it: ``python -m jaxgpt.compile`` with :func:`jaxgpt.fused_loss.lm_head_cross_entropy`'s
``logits_dtype`` default replaced (compile-only; nothing runs). With ``--logits-dtype float32`` it is exactly
``python -m jaxgpt.compile``."""

import os
import sys

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"  # before jax is imported, as python -m jaxgpt.compile does
    import argparse
    import functools

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.predict_loss", description=__doc__)
    p.add_argument("--logits-dtype", choices=("float32", "bfloat16"), required=True)
    p.add_argument("compile_args", nargs=argparse.REMAINDER, help="python -m jaxgpt.compile's arguments, after --")
    args = p.parse_args()
    rest = args.compile_args[1:] if args.compile_args[:1] == ["--"] else args.compile_args

    from jaxgpt import fused_loss
    from jaxgpt.compile import cli

    fused_loss.lm_head_cross_entropy = functools.partial(fused_loss.lm_head_cross_entropy,
                                                         logits_dtype=args.logits_dtype)
    sys.exit(cli.main(rest))
