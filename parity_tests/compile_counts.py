"""Count, per test case, what a parity case costs before it computes anything: XLA compilations, torch.compile
graphs, torch's CUDA start-up.

* XLA compilations: JAX's ``/jax/core/compile/backend_compile_duration`` monitoring event, recorded once for
  every executable JAX asks the backend for (a miss of jit's in-memory caches, eager ops' first use included),
  with the function's name and the seconds it took; ``/jax/compilation_cache/cache_hits`` says how many of them
  the persistent compilation cache answered from disk instead of compiling.
* torch.compile graphs: torch._dynamo's ``unique_graphs`` counter.
* torch CUDA start-up: 1 for the case during which ``torch.cuda`` became initialized.

Everything a case's set-up (its fixtures) and teardown cause is counted with the case, so a module- or session-
scoped fixture's compilations land on the first case that uses it.

Enabled by ``JAXGPT_COMPILE_COUNTS=FILE`` (parity_tests/conftest.py loads the hooks): at the end of the session the
per-case counts and their totals go to FILE as JSON and a summary table (the totals and the most-compiling cases)
is printed. Unset, nothing is registered. The counts are one process's (a case pays for what no case before it in
that process compiled), so a run split over pytest-xdist workers is refused: count without ``-n``. ``python -m
parity_tests.compile_counts BEFORE.json AFTER.json`` prints the two side by side.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

ENV = "JAXGPT_COMPILE_COUNTS"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class Counts:
    """What happened while one counter was active."""

    xla_compiles: int = 0  # executables requested from the backend (compiled, or loaded from the persistent cache)
    persistent_cache_hits: int = 0  # of those, loaded from disk
    compile_s: float = 0.0  # seconds inside the backend compile (or cache load)
    torch_graphs: int = 0  # torch.compile (dynamo) graphs
    torch_cuda_init: int = 0  # 1 if torch's CUDA context was created here
    wall_s: float = 0.0
    outcome: str = ""  # passed / failed / skipped (pytest's)
    functions: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compile_s"], d["wall_s"] = round(self.compile_s, 3), round(self.wall_s, 3)
        d["functions"] = dict(sorted(self.functions.items(), key=lambda kv: (-kv[1], kv[0])))
        return d


_active: list[Counts] = []
_listening = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
        for c in _active:
            c.xla_compiles += 1
            c.compile_s += duration
            c.functions[str(kwargs.get("fun_name", "?"))] += 1


def _on_event(event: str, **kwargs) -> None:
    if event == CACHE_HIT_EVENT:
        for c in _active:
            c.persistent_cache_hits += 1


def _listen() -> None:
    global _listening
    if not _listening:
        from jax._src import monitoring

        monitoring.register_event_duration_secs_listener(_on_duration)
        monitoring.register_event_listener(_on_event)
        _listening = True


def _torch_state() -> tuple[int, bool]:
    torch = sys.modules.get("torch")  # never imported here just to count
    if torch is None:
        return 0, False
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), bool(torch.cuda.is_initialized())


@contextlib.contextmanager
def counting():
    """``with counting() as c:`` -- c holds the counts of what ran inside (nested counters each count all)."""
    _listen()
    c = Counts()
    graphs0, cuda0 = _torch_state()
    t0 = time.perf_counter()
    _active.append(c)
    try:
        yield c
    finally:
        _active.remove(c)
        c.wall_s = time.perf_counter() - t0
        graphs1, cuda1 = _torch_state()
        c.torch_graphs, c.torch_cuda_init = graphs1 - graphs0, int(cuda1 and not cuda0)


# ---- pytest hooks (imported by parity_tests/conftest.py) -------------------------------------------------------
_per_case: dict[str, Counts] = {}


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def pytest_configure(config):
    if enabled() and (getattr(config.option, "dist", "no") != "no" or hasattr(config, "workerinput")):
        raise pytest.UsageError(f"${ENV} counts the compilations of one pytest process, and this run is split over "
                                "pytest-xdist workers (-n): run it without -n (or with -n 0)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not enabled():
        yield
        return
    with counting() as c:
        yield
    _per_case[item.nodeid] = c
    c.outcome = _outcomes.pop(item.nodeid, "?")


_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if enabled() and (report.when == "call" or report.outcome != "passed"):
        _outcomes.setdefault(report.nodeid, report.outcome)


def summary(cases: dict[str, dict]) -> dict:
    """Totals over the cases that ran (skipped ones left out)."""
    cases = {n: c for n, c in cases.items() if c["outcome"] != "skipped"}
    keys = ("xla_compiles", "persistent_cache_hits", "torch_graphs", "torch_cuda_init", "compile_s", "wall_s")
    total = {k: round(sum(c[k] for c in cases.values()), 3) for k in keys}
    total["cases"] = len(cases)
    for device in ("cpu", "cuda"):
        mine = [c for n, c in cases.items() if _device(n) == device]
        total[f"xla_compiles_{device}"] = sum(c["xla_compiles"] for c in mine)
    return total


def _device(nodeid: str) -> str:
    params = nodeid.rpartition("[")[2].rstrip("]").split("-") if nodeid.endswith("]") else []
    return "cuda" if "cuda" in params else "cpu"


def write(path: str | os.PathLike, cases: dict[str, Counts], **meta) -> dict:
    data = {"meta": meta, "cases": {n: c.as_dict() for n, c in cases.items()}}
    data["total"] = summary(data["cases"])
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data


def table(data: dict, worst: int = 12) -> str:
    t = data["total"]
    lines = [f"compile counts: {t['cases']} cases, {t['xla_compiles']} XLA compilations ({t['persistent_cache_hits']} "
             f"from the persistent cache, {t['compile_s']:.1f} s), {t['torch_graphs']} torch.compile graphs, "
             f"torch CUDA start-ups {t['torch_cuda_init']}"]
    ranked = sorted(data["cases"].items(), key=lambda kv: -kv[1]["xla_compiles"])[:worst]  # skipped: 0
    lines += [f"  {c['xla_compiles']:5d} compiles {c['compile_s']:7.1f} s  {n}" for n, c in ranked]
    return "\n".join(lines)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(ENV)
    if path and _per_case:
        import jax

        meta = dict(jax=jax.__version__, backend=jax.default_backend(), exitstatus=int(exitstatus),
                    persistent_cache_dir=jax.config.jax_compilation_cache_dir, cpu=_cpu_name(),
                    cores=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    args=" ".join(session.config.invocation_params.args))
        session.config._compile_counts = write(path, _per_case, **meta)


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def pytest_terminal_summary(terminalreporter):
    data = getattr(terminalreporter.config, "_compile_counts", None)
    if data:
        terminalreporter.write_line(table(data) + f"\n  written to ${ENV} = {os.environ[ENV]}")


def compare(before: dict, after: dict, worst: int = 15) -> str:
    """Before and after side by side: totals, then the cases that compiled most before."""
    tb, ta = before["total"], after["total"]
    lines = [f"{'':<24}{'before':>10}{'after':>10}"]
    for k in ("cases", "xla_compiles", "xla_compiles_cpu", "persistent_cache_hits", "torch_graphs",
              "torch_cuda_init", "compile_s", "wall_s"):
        lines.append(f"{k:<24}{tb.get(k, 0):>10}{ta.get(k, 0):>10}")
    lines.append(f"\n{'before':>7}{'after':>7}  case (XLA compilations)")
    ranked = sorted(before["cases"], key=lambda n: -before["cases"][n]["xla_compiles"])[:worst]
    for n in ranked:
        a = after["cases"].get(n, {}).get("xla_compiles", "-")
        lines.append(f"{before['cases'][n]['xla_compiles']:>7}{a:>7}  {n}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m parity_tests.compile_counts BEFORE.json AFTER.json")
    print(compare(*(json.loads(Path(p).read_text()) for p in sys.argv[1:])))
