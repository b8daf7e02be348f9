"""``python -m benchmarks.gpu.predict_loss --logits-dtype bfloat16 -- JAXGPT_COMPILE_ARGS...``: the calibrated
prediction of a train step whose fused lm_head cross-entropy writes its logits in ``--logits-dtype``: now that a
policy selects it (``TrainConfig.logits_dtype``), ``python -m jaxgpt.compile ... --set logits_dtype=bfloat16`` itself
(compile-only; nothing runs). With ``--logits-dtype float32`` it is exactly ``python -m jaxgpt.compile``. (It used to
replace :func:`jaxgpt.kernels.loss.lm_head_cross_entropy`'s default, which the model's explicit ``logits_dtype``
argument has overridden since, so it compiled the default program.)"""

import os
import sys

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"  # before jax is imported, as python -m jaxgpt.compile does
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.predict_loss", description=__doc__)
    p.add_argument("--logits-dtype", choices=("float32", "bfloat16"), required=True)
    p.add_argument("compile_args", nargs=argparse.REMAINDER, help="python -m jaxgpt.compile's arguments, after --")
    args = p.parse_args()
    rest = args.compile_args[1:] if args.compile_args[:1] == ["--"] else args.compile_args

    from jaxgpt.compile import cli

    sys.exit(cli.main(rest + (["--set", "logits_dtype=bfloat16"] if args.logits_dtype == "bfloat16" else [])))
