"""Running a session part's commands within a time budget: each step has a budget (its expected process time,
from measured ones), the plan is checked to fit before anything runs, and every step ends in a record, measured
or not (ok / failed with its one-line error / timed out / "not measured: budget").

Steps run in plan order (the order of value). A *required* step is part of what the plan promises to fit; an
*optional* one (``required=False``) runs only where time is left. Before each step, the later required steps'
budgets (and :data:`SLACK_S` each) are set aside; a step that cannot get its own budget out of the rest is not
started ("not measured: budget") and the next is tried. A started step may run past its budget up to its cap
(default 1.5 x its budget), never into what the later required steps need, and is killed at that timeout. Its
output goes to ``<log_dir>/<step>.log``; a failed step's record holds the last error line of it.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import common

SLACK_S = 2.0  # set aside per later step beyond its budget: a killed step's exit, a process start
NOT_MEASURED = "not measured: budget"


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of a budgeted part. ``budget_s``: its expected process time (``why``: from which measurement);
    ``rows``: what a multi-row step (the bench) measures, each (name, budget_s, why)."""

    name: str
    argv: list[str]
    budget_s: float
    why: str
    required: bool = True
    cap_s: float | None = None
    rows: tuple[tuple[str, float, str], ...] = ()

    @property
    def cap(self) -> float:
        return self.cap_s if self.cap_s is not None else 1.5 * self.budget_s


def planned_s(steps: list[Step]) -> float:
    """What the required steps take by their budgets, slack included."""
    return sum(s.budget_s + SLACK_S for s in steps if s.required)


def plan_lines(steps: list[Step], budget_s: float) -> list[str]:
    """The plan as printed: every step (and bench row) with its budget and where it comes from, and whether the
    required steps fit ``budget_s``."""
    out = [f"{'step':<44}{'budget s':>9}  from", "-" * 100]
    at = 0.0
    for s in steps:
        at += s.budget_s + SLACK_S if s.required else 0.0
        tag = f"  (ends by {at:.0f} s)" if s.required else "  (if time is left)"
        out.append(f"{s.name:<44}{s.budget_s:>9.1f}  {s.why}{tag}")
        out += [f"  {name:<42}{b:>9.1f}  {why}" for name, b, why in s.rows]
    total = planned_s(steps)
    verdict = "fits" if total <= budget_s else "DOES NOT FIT"
    out.append(f"required steps {total:.0f} s (with {SLACK_S:.0f} s slack each) of the {budget_s:.0f} s budget: "
               f"{verdict}; optional steps run only in what the required ones leave")
    return out


def one_line_error(text: str) -> str:
    """The line that says what went wrong in a failed command's output: the last exception line, else the last
    non-empty line (at most 300 characters)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    exc = [ln for ln in lines if re.match(r"^([\w.]+(Error|Exception|Exit)|error|AssertionError|FAILED)\b", ln)]
    return (exc or lines or ["(no output)"])[-1][:300]


def _shown(argv: list[str]) -> str:
    return " ".join(c if c else "''" for c in (["python", *argv[1:]] if argv[0] == sys.executable else argv))


def run_budgeted(steps: list[Step], *, budget_s: float, env: dict[str, str], log_dir: Path,
                 log: Callable[[str], Any] = print, after: Callable[[dict], Any] = lambda rec: None,
                 margin_s: float = 10.0) -> list[dict]:
    """Run ``steps`` in order within ``budget_s`` seconds (see the module's docstring); one record per step,
    ``after`` seeing each as it is made. An argument ``{timeout_s}`` of a step is replaced by its timeout less
    ``margin_s`` (a bench given it stops starting rows in time to write its results)."""
    started, records = time.monotonic(), []
    log_dir.mkdir(parents=True, exist_ok=True)
    for i, step in enumerate(steps):
        left = budget_s - (time.monotonic() - started)
        reserve = sum(s.budget_s + SLACK_S for s in steps[i + 1:] if s.required)
        timeout = min(step.cap, left - reserve)
        rec = {"step": step.name, "command": _shown(step.argv), "budget_s": step.budget_s, "why": step.why,
               "required": step.required, "left_s": round(left, 1), "timeout_s": round(max(timeout, 0.0), 1)}
        if timeout < step.budget_s:
            rec.update(status=NOT_MEASURED, seconds=0.0,
                       error=f"{left:.0f} s of the {budget_s:.0f} s left, {reserve:.0f} s of it set aside for the "
                             f"later required steps; this one's budget is {step.budget_s:.0f} s")
            log(f"[{step.name}: {NOT_MEASURED}]")
        else:
            argv = [a.replace("{timeout_s}", f"{max(1.0, timeout - margin_s):.0f}") for a in step.argv]
            rec["command"] = _shown(argv)
            log(f"\n$ {rec['command']}   [{step.name}: budget {step.budget_s:.0f} s, up to {timeout:.0f} s]")
            out = log_dir / (re.sub(r"[^\w.-]+", "-", step.name).strip("-") + ".log")
            t0 = time.monotonic()
            with open(out, "w") as f:
                try:
                    rc = subprocess.run(argv, cwd=common.ROOT, env=env, check=False, timeout=timeout, stdout=f,
                                        stderr=subprocess.STDOUT).returncode
                    rec.update(status="ok" if rc == 0 else "failed", rc=rc)
                except subprocess.TimeoutExpired:
                    rec.update(status="timed out", rc=None, error=f"killed after {timeout:.0f} s")
            rec["seconds"] = round(time.monotonic() - t0, 1)
            text = out.read_text(errors="replace")
            if rec["status"] == "failed":
                rec["error"] = one_line_error(text)
            rec["log"] = out.name
            tail = text.splitlines()[-15:]
            log("\n".join(tail) + f"\n[{step.name}: {rec['status']} after {rec['seconds']:.0f} s"
                + (f": {rec['error']}" if rec.get("error") else "") + "]")
        records.append(rec)
        after(rec)
    return records
