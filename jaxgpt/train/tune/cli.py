"""``python -m jaxgpt.tune --config FILE [--FIELD=VALUE ...]``: ``kernels: auto``'s search alone, for the run that
config describes (its model, precision, micro-batch, mesh): prints the table and the choice and caches it; a second
call prints the cached choice without measuring.

Options besides the config's fields: ``--budget-s S`` (the search's time bound, default 300), ``--force`` (measure
again, ignoring committed and cached choices), ``--out DIR`` (also write the choice file there: a GPU session writes
``jaxgpt/kernels/tuned`` and commits it), ``--no-progress``."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxgpt.config import ConfigError

EXIT_CONFIG = 2


def _tune_options(argv: list[str]) -> tuple[dict, list[str]]:
    opts: dict = {"budget_s": 300.0, "force": False, "out": None, "progress": True}
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        key, eq, value = arg.partition("=")
        if key in ("--budget-s", "--out"):
            if not eq:
                if i >= len(argv):
                    raise ConfigError(f"{key} needs a value ({key}=VALUE)")
                value, i = argv[i], i + 1
            if key == "--out":
                opts["out"] = Path(value)
                continue
            try:
                opts["budget_s"] = float(value)
            except ValueError:
                raise ConfigError(f"--budget-s = {value!r}: seconds, e.g. --budget-s=120") from None
            if opts["budget_s"] <= 0:
                raise ConfigError(f"--budget-s = {value}: must be > 0 (seconds)")
        elif arg == "--force":
            opts["force"] = True
        elif arg == "--no-progress":
            opts["progress"] = False
        else:
            rest.append(arg)
    return opts, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from jaxgpt.train.cli import parse_args
    from jaxgpt.train.config import TrainConfig

    try:
        opts, rest = _tune_options(argv)
        config_path, overrides, _ = parse_args(rest)
        cfg = TrainConfig.load(config_path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from jaxgpt import mesh as mesh_lib
    from jaxgpt.train.tune.auto import select

    try:
        mesh = mesh_lib.make_mesh(cfg.mesh)
        choice = select(cfg, mesh=mesh, steps_to_train=cfg.max_steps, micro_steps=cfg.micro_steps(),
                        budget_s=opts["budget_s"], force=opts["force"], store_in=opts["out"],
                        progress=opts["progress"])
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if choice.source in ("cached", "committed") and choice.table:
        print(choice.table)
    print(f"auto: choice {choice.summary()['choice']} ({choice.source}; {choice.path})")
    return 0
