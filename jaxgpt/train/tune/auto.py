"""``kernels: auto`` for a run: the committed choice for its key, else the cached one ("auto: cached choice ..."),
else a bounded search where the run is long enough to pay for it (:mod:`jaxgpt.train.tune.search`), else the default
program (the ``xla`` preset) with a line saying why.

When a run searches (``kernels_search_s``, :func:`search_budget`):

* ``null`` (the default): on GPUs and TPUs, runs of at least :data:`MIN_STEPS` optimizer steps still to train,
  within ``min(CAP_S, FRACTION x the run's expected time)``, the expected time being the default program's measured
  step x micro-steps x steps to train; on CPUs never (a CPU run uses a committed or cached choice, else the default
  program, so ``make train``'s losses stay the default program's unless such a choice says otherwise);
* ``0``: never (committed or cached choices only);
* a number of seconds: always, within that many seconds (``python -m jaxgpt.tune`` searches likewise)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxgpt.config import ConfigError, to_dict
from jaxgpt.kernels.registry import Kernels
from jaxgpt.train.tune import cache
from jaxgpt.train.tune.measure import pinned

MIN_STEPS = 500  # a shorter run (steps still to train) never searches by default: its search would not pay back
FRACTION = 0.10  # of the run's expected time, at most, spent searching by default
CAP_S = 300.0  # seconds, at most, spent searching by default


@dataclasses.dataclass
class Choice:
    """What auto chose and where the choice came from: "committed", "cached", "measured" or "default"."""

    kernels: Kernels
    source: str
    why: str
    path: Path | None = None
    record: dict[str, Any] | None = None  # the cache file's fields (committed / cached / measured)
    table: str | None = None

    def summary(self) -> dict[str, Any]:
        k = self.kernels
        return {"source": self.source, "why": self.why, "path": None if self.path is None else str(self.path),
                "choice": {"preset": k.preset, **{op: v for op, v in k.overrides().items() if v is not None}},
                **({} if self.record is None else {"name": self.record.get("name"), "impls": self.record.get("impls"),
                                                    "chosen_ms": self.record.get("chosen_ms"),
                                                    "default_ms": self.record.get("default_ms")})}


def device_kind(device) -> str:
    """The device's kind; for CPUs also the CPU model (two CPUs may choose differently)."""
    if device.platform != "cpu":
        return device.device_kind
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"cpu {device.device_kind}"


def cache_key(cfg, model_cfg, policy, mesh) -> dict[str, Any]:
    """The (device kind, jax/jaxlib version, model shape, micro-batch, precision) key of a run's choice (and the
    mesh, and the ops the config pins)."""
    import jax
    import jaxlib

    dev = mesh.devices.flat[0]
    return {"device_kind": device_kind(dev), "platform": dev.platform, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "mesh": {k: int(v) for k, v in mesh.shape.items()},
            "model": to_dict(model_cfg), "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
            "precision": {f: getattr(policy, f) for f in ("compute_dtype", "param_dtype", "matmul_precision",
                                                           "fast_kernels", "gemm_output", "logits_dtype",
                                                           "gelu_h_dtype", "fp8")},
            "pinned": pinned(cfg.kernels)}


def model_config(cfg):
    """The run's model shape without building it (a checkpoint's config.json for init_from), with its dropout."""
    if cfg.init_from == "scratch":
        model_cfg = cfg.model
    else:
        from jaxgpt import weights

        model_cfg = weights.read_config(weights.resolve(cfg.init_from))
    return model_cfg if cfg.dropout is None else model_cfg.replace(dropout=cfg.dropout)


def from_record(record: dict[str, Any]) -> Kernels:
    return Kernels.parse(dict(record["choice"]))


def search_budget(cfg, platform: str, steps_to_train: int, micro_steps: int
                  ) -> tuple[float | Callable | None, str]:
    """The search's budget for a run (None: no search) and a sentence saying which rule gave it."""
    if cfg.kernels_search_s is not None:
        if cfg.kernels_search_s == 0:
            return None, "kernels_search_s: 0 (no search)"
        return float(cfg.kernels_search_s), f"kernels_search_s: {cfg.kernels_search_s:g} s"
    if platform == "cpu":
        return None, ("no search on CPUs by default (python -m jaxgpt.tune --config FILE measures this CPU's choice; "
                      "--kernels_search_s=N searches here)")
    if steps_to_train < MIN_STEPS:
        return None, f"a short run ({steps_to_train} steps to train < {MIN_STEPS}): no search"

    def budget(default) -> float:
        expected = default.median_ms / 1e3 * micro_steps * steps_to_train
        return min(CAP_S, FRACTION * expected)

    return budget, (f"min({CAP_S:.0f} s, {FRACTION:.0%} of the run's expected time: {steps_to_train} steps x "
                    f"{micro_steps} micro step(s) x the default program's step)")


def select(cfg, *, mesh, steps_to_train: int, micro_steps: int = 1, say: Callable[[str], None] = print,
           progress: bool = True, force: bool = False, budget_s: float | Callable | None = None,
           store_in: Path | None = None, processes: int = 1) -> Choice:
    """``kernels: auto`` for ``cfg`` on ``mesh``'s devices. ``budget_s`` given: search within it (the tune CLI);
    else :func:`search_budget`'s rule. ``force``: ignore committed and cached choices. ``store_in``: also write the
    choice file there (e.g. jaxgpt/kernels/tuned/ on a GPU). ``processes`` > 1: every process must run the same
    program, so only a committed choice (the same file everywhere) is used: no user cache, no search."""
    from jaxgpt.precision import Policy
    from jaxgpt.train.tune.measure import Bench
    from jaxgpt.kernels import tiles
    from jaxgpt.train.tune.search import format_table, search

    platform = mesh.devices.flat[0].platform
    fixed = pinned(cfg.kernels)
    default = Kernels("xla", **fixed)
    if budget_s is None:
        budget_s, rule = search_budget(cfg, platform, steps_to_train, micro_steps)
    else:
        rule = f"a search within {budget_s:g} s" if not callable(budget_s) else "the caller's budget"
    policy = Policy.named(cfg.precision, **{**cfg.policy_options(), "kernels": default})
    key = cache_key(cfg, model_config(cfg), policy, mesh)
    hit = None if force else cache.lookup(key, committed_only=processes > 1)
    if processes > 1:
        budget_s, rule = None, f"{processes} processes (each must run the same program: committed choices only)"
    if hit is not None:
        record, path = hit
        source = "committed" if path.parent == cache.COMMITTED_DIR else "cached"
        try:  # a file from an older registry may name an implementation that is gone: measured again
            kernels = from_record(record)
            Policy.named(cfg.precision, **{**cfg.policy_options(), "kernels": kernels})
        except (ConfigError, KeyError, TypeError) as e:
            say(f"auto: ignoring the choice in {path}: {e}")
            hit = None
    if hit is not None:
        say(f"auto: {source} choice {record.get('name', kernels.preset)} ({path}; measured "
            f"{record.get('chosen_ms', float('nan')):.2f} ms per step against the default program's "
            f"{record.get('default_ms', float('nan')):.2f})")
        table = format_table(record.get("candidates", []), record.get("name"))
        tiles.install(record.get("tiles"))  # the GEMM tiles chosen with the program (GPUs)
        return Choice(kernels, source, f"{source} choice file", path, record, table)
    if budget_s is None:
        tiles.install(None)
        say(f"auto: no committed or cached choice; {rule}: running the default program (the xla preset)")
        return Choice(default, "default", rule)
    say(f"auto: no committed or cached choice: measuring candidate programs ({rule})")
    result = search(Bench(cfg, mesh=mesh), platform=platform, budget_s=budget_s, say=say, progress=progress)
    for note in result.notes:
        say(f"auto: {note}")
    record = result.record()
    if tiles.install(result.tiles):
        say(f"auto: tiles chosen for {sum(len(v) for v in result.tiles.values())} GEMM shape(s)")
    path = cache.store(key, record)
    table = result.table()
    if store_in is not None:  # the committed file and its table beside it (a GPU session's)
        stored = cache.store(key, record, store_in)
        stored.with_suffix(".txt").write_text(table + "\n")
    say(table)
    say(f"auto: chose {result.chosen.name} ({result.chosen.median_ms:.2f} ms per step; the default program "
        f"{result.default.median_ms:.2f}); cached in {path}")
    return Choice(result.chosen.kernels, "measured", rule, path, record, table)


def record_in_run(choice: Choice, policy, run_dir: Path, metrics, *, say: Callable[[str], None], step: int) -> None:
    """A run's ``kernels: auto`` choice: one header line, ``kernels-auto.json`` (the choice, what each op ran, the
    search's record) and ``kernels-auto.txt`` (its table) in the run directory, and a ``kernels`` record in
    metrics.jsonl (``metrics``: the run's MetricsLog; None on processes that write no files)."""
    import json

    from jaxgpt.kernels.registry import OPS

    ran = {op: policy.kernel(op) for op in OPS}
    say(f"  kernels: auto -> {choice.source} {choice.summary()['choice']} ("
        + ", ".join(f"{op}={name}" for op, name in ran.items()) + ")")
    if metrics is None:
        return
    summary = {**choice.summary(), "ran": ran}
    (Path(run_dir) / "kernels-auto.json").write_text(json.dumps({**summary, "search": choice.record}, indent=2) + "\n")
    if choice.table is not None:
        (Path(run_dir) / "kernels-auto.txt").write_text(choice.table + "\n")
    metrics.write({"type": "kernels", "step": step, **summary})
