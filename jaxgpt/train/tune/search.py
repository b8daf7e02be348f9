"""The search: which candidate programs are built, in what order, within what time, and which one runs.

Candidates (``Kernels`` choices over :mod:`jaxgpt.kernels.registry`): the ``xla`` preset (the default program:
always measured first, always a candidate), the ``pallas`` preset, then, greedily from the faster of the two, each
op's other implementations one at a time (kept where faster). Only implementations whose own path runs on this
platform and compute dtype, whose needs the policy's numerics meet, and whose numerics keep the policy's values
("reference" or "reordered") are candidates: an implementation that changes numerics stays an explicit choice.

A candidate replaces the one it is compared with only when its median step time is lower by more than the noise
both measured (the larger of their interquartile ranges), so auto's choice is never slower than the default program
by more than that noise. Its first step's loss must equal the default program's within the policy's bound
(:func:`loss_bound`), else it is refused. The search's time is bounded: before each candidate after the first, it
stops if the time spent plus the mean cost of a candidate so far would pass the budget."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from jaxgpt.kernels import registry
from jaxgpt.kernels.registry import OPS, Kernels
from jaxgpt.train.tune.measure import Bench, Measurement, pinned

# the first step's loss against the default program's (relative): fp32 compute: parity_tests/tolerances.py's
# LOSS_FP32_REL, the bound on mean cross-entropies of two correct fp32 implementations (the same values but for
# the order of sums); bf16 compute (bf16 operands, fp32 sums): a reordered sum may flip the bf16 rounding of some
# GEMM operands by one bf16 ulp, which moves a mean over batch x seq terms far less than one rounding of the loss
# itself: 2^-9 (bf16's unit roundoff)
LOSS_REL_FP32 = 1e-6
LOSS_REL_BF16 = 2.0 ** -9


def loss_bound(policy) -> float:
    """The relative distance allowed between a candidate's first-step loss and the default program's."""
    return LOSS_REL_FP32 if policy.compute_dtype in ("float32", "float64") else LOSS_REL_BF16


def alternatives(op: str, policy, platform: str) -> list[str]:
    """``op``'s implementations that may be candidates under ``policy`` on ``platform``: their own path runs there
    with the policy's compute dtype, the policy's numerics allow them, and they keep its values."""
    return [n for n in registry.implementations(op, platform=platform, compute=policy.compute_dtype, policy=policy)
            if registry.REGISTRY[op][n].numerics != "changes"]


def describe(kernels: Kernels, fixed: dict[str, str] | None = None) -> str:
    """A candidate's name: its preset, then its per-op choices (``pallas+attention=xla``) but those the config
    pins (``fixed``: the same in every candidate)."""
    fixed = fixed or {}
    extra = [f"{op}={name}" for op, name in kernels.overrides().items() if name is not None and op not in fixed]
    return "+".join([kernels.preset, *extra])


@dataclasses.dataclass
class Result:
    """A search's outcome: every candidate's measurement, the choice, the budget and what stopped it."""

    measured: list[Measurement]
    chosen: Measurement
    default: Measurement
    budget_s: float
    spent_s: float
    notes: list[str]
    tiles: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)  # jaxgpt.kernels.tiles.tune's

    def table(self) -> str:
        return format_table([m.to_dict() for m in self.measured], self.chosen.name)

    def record(self) -> dict[str, Any]:
        """What the cache file and the run directory hold."""
        k = self.chosen.kernels
        return {"choice": {"preset": k.preset, **{op: v for op, v in k.overrides().items() if v is not None}},
                "name": self.chosen.name, "impls": self.chosen.impls, "default_ms": self.default.median_ms,
                "chosen_ms": self.chosen.median_ms, "budget_s": self.budget_s, "spent_s": self.spent_s,
                "notes": self.notes, "tiles": self.tiles, "candidates": [m.to_dict() for m in self.measured],
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def format_table(candidates: list[dict[str, Any]], chosen: str | None) -> str:
    """candidate, compile s, ms per step (its IQR), first-step loss, chosen: one row per candidate
    (:meth:`Measurement.to_dict`'s fields)."""
    rows = [("candidate", "compile s", "ms/step (IQR)", "first loss", "chosen")]
    for c in candidates:
        loss = "" if c.get("loss") is None else f"{c['loss']:.6f}"
        comp = "-" if c.get("compile_s") is None else f"{c['compile_s']:.1f}"
        if c.get("same_as") is not None:
            rows.append((c["name"], "-", f"the program of {c['same_as']}", "", ""))
        elif c.get("error") is not None:
            rows.append((c["name"], comp, f"dropped: {c['error']}", loss, ""))
        else:
            rows.append((c["name"], comp, f"{c['median_ms']:.2f} ({c['iqr_ms']:.2f})", loss,
                         "<-" if c["name"] == chosen else ""))
    long = ("dropped", "the program")  # a drop's reason is not a column's width
    widths = [max(len(r[i]) for r in rows if i != 2 or not r[2].startswith(long)) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def faster(a: Measurement, b: Measurement) -> bool:
    """Whether ``a`` beats ``b`` by more than the noise either measured."""
    return a.median_ms < b.median_ms - max(a.iqr_ms, b.iqr_ms)


def search(bench: Bench, *, platform: str, budget_s: float | Callable[[Measurement], float],
           say: Callable[[str], None] = print, progress: bool = True) -> Result:
    """Measure the candidates for ``bench``'s run and choose one. ``budget_s``: seconds, or a function of the
    default program's measurement giving them (e.g. 10% of the run's expected time). Raises RuntimeError only when
    the default program itself fails (then there is nothing to fall back on: the run would fail the same way)."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    fixed = pinned(bench.cfg.kernels)
    base_policy = bench.policy_for(Kernels("xla", **fixed))
    free = [op for op in OPS if op not in fixed]
    upper = 2 + sum(len(alternatives(op, base_policy, platform)) for op in free)
    bar = tqdm(total=upper, desc="auto: measuring", unit="program", disable=not progress, dynamic_ncols=True,
               leave=False)
    measured: list[Measurement] = []
    notes: list[str] = []
    bound = loss_bound(base_policy)

    def run(kernels: Kernels) -> Measurement:
        bar.set_postfix_str(describe(kernels, fixed), refresh=True)
        m = bench.measure(describe(kernels, fixed), kernels)
        bar.update(1)
        if m.ok and measured and measured[0].ok:
            ref = measured[0].loss
            if abs(m.loss - ref) > bound * abs(ref):
                m.error = (f"refused: first-step loss {m.loss:.9g} differs from the default program's {ref:.9g} by "
                           f"{abs(m.loss - ref) / abs(ref):.2e} relative (bound {bound:.2e}): not the policy's values")
        measured.append(m)
        if m.error is not None:
            say(f"auto: {m.name} dropped: {m.error}")
        return m

    try:
        default = run(Kernels("xla", **fixed))
        if not default.ok:
            raise RuntimeError(f"auto: the default program (xla preset) failed: {default.error}")
        budget = budget_s(default) if callable(budget_s) else float(budget_s)

        def affordable() -> bool:
            spent = time.perf_counter() - t_start
            cost = sum(m.spent_s for m in measured) / len(measured)
            if spent + cost > budget:
                notes.append(f"budget {budget:.0f} s reached after {len(measured)} candidate(s) ({spent:.0f} s spent, "
                             f"~{cost:.0f} s each)")
                return False
            return True

        best = default
        if affordable():
            pallas = run(Kernels("pallas", **fixed))
            if pallas.ok and faster(pallas, default):
                best = pallas
        tried = {m.name for m in measured}
        stopped = len(notes) > 0
        for op in free:
            if stopped:
                break
            policy = bench.policy_for(best.kernels)
            for name in alternatives(op, policy, platform):
                if name == policy.kernel(op):
                    continue
                kernels = dataclasses.replace(best.kernels, **{op: name})
                if describe(kernels, fixed) in tried:
                    continue
                if not affordable():
                    stopped = True
                    break
                tried.add(describe(kernels, fixed))
                m = run(kernels)
                if m.ok and faster(m, best):
                    best = m
    finally:
        bar.close()
    from jaxgpt.kernels import tiles

    tuned = {name: tiles.tune(name, shapes, say=say, deadline=t_start + budget)  # the chosen program's GEMM tiles
             for name, shapes in best.shapes.items() if platform in tiles.OPS[name].platforms}
    spent = time.perf_counter() - t_start
    return Result(measured=measured, chosen=best, default=default, budget_s=budget, spent_s=spent, notes=notes,
                  tiles={k: v for k, v in tuned.items() if v})
