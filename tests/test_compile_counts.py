"""parity_tests/compile_counts.py counts what it claims: one XLA compilation per executable JAX builds (a function
jitted anew compiles again, a shared one once), the persistent cache's hits among them, and per test case through
its pytest hooks (JAXGPT_COMPILE_COUNTS). Under pytest-xdist the parity harness shares nothing unsafely: each worker
has a persistent cache directory of its own, the parity report's merges take turns, and the per-process compile
counts refuse a distributed run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from parity_tests.compile_cache import cache_dir, cpu_kind, persistent_cache
from parity_tests.compile_counts import compare, counting

ROOT = Path(__file__).resolve().parent.parent


def _fresh(offset: float):
    """A new function object each call (a closure, as a jax.jit(lambda ...) inside a helper makes)."""
    return lambda x: jnp.sin(x) * 3.0 + offset


def test_rejitting_counts_each_compilation_and_sharing_counts_one():
    x, x1, x4 = (jax.block_until_ready(jnp.asarray(np.arange(n, dtype=np.float32))) for n in (8, 8, 4))
    with persistent_cache(None), counting() as twice:
        jax.jit(_fresh(0.125))(x)
        jax.jit(_fresh(0.125))(x)  # the same code in a new closure: traced and compiled again
    shared = jax.jit(_fresh(0.25))
    with counting() as once:
        shared(x)
        shared(x1)  # same shapes: jit's cache answers
    with counting() as new_shape:
        shared(x4)
    assert twice.xla_compiles == 2 and twice.persistent_cache_hits == 0, twice  # (no cache dir set)
    assert once.xla_compiles == 1, once
    assert new_shape.xla_compiles == 1, new_shape
    assert twice.compile_s > 0 and sum(twice.functions.values()) == 2
    assert twice.torch_graphs == 0 and twice.torch_cuda_init == 0


def test_nested_counters_both_count():
    x = jnp.asarray(np.arange(3, dtype=np.float32))
    with counting() as outer:
        jax.jit(_fresh(0.5))(x)
        with counting() as inner:
            jax.jit(_fresh(0.75))(x)
    assert (outer.xla_compiles, inner.xla_compiles) == (2, 1)


def test_persistent_cache_hits_are_counted(tmp_path):
    """The same program jitted anew, with the persistent cache on: compiled once, loaded from disk once."""
    x = jnp.asarray(np.arange(5, dtype=np.float32))
    before = jax.config.jax_compilation_cache_dir
    with persistent_cache(tmp_path), counting() as c:
        a = jax.jit(_fresh(0.875))(x)
        b = jax.jit(_fresh(0.875))(x)  # compiled anew: the identical program is on disk now
    np.testing.assert_array_equal(a, b)
    assert (c.xla_compiles, c.persistent_cache_hits) == (2, 1), c
    assert any(tmp_path.iterdir()) and jax.config.jax_compilation_cache_dir == before  # written; restored


def test_pytest_hooks_write_per_case_counts(tmp_path):
    """A test file run under the hooks: per case, the compilations its body and fixtures caused."""
    (tmp_path / "conftest.py").write_text(
        "from parity_tests.compile_counts import (pytest_runtest_logreport, pytest_runtest_protocol,  # noqa\n"
        "                                         pytest_sessionfinish, pytest_terminal_summary)\n")
    (tmp_path / "test_cases.py").write_text(
        "import jax, jax.numpy as jnp, pytest\n"
        "shared = jax.jit(lambda x: jnp.cos(x) * 7.0)\n"
        "def test_two_fresh():\n"
        "    for _ in range(2):\n"
        "        jax.jit(lambda x: jnp.tanh(x) * 5.0)(jnp.arange(6.0))  # a new lambda each time\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_shared(n):\n"
        "    shared(jnp.arange(9.0) * n)\n"
        "def test_skipped():\n"
        "    pytest.skip('nothing')\n")
    out = tmp_path / "counts.json"
    env = dict(os.environ, JAXGPT_COMPILE_COUNTS=str(out), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          str(tmp_path / "test_cases.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    cases = {k.rpartition("::")[2]: v for k, v in data["cases"].items()}
    # the arange and multiply are eager ops: each compiles once, on first use, so the first user pays for them
    fresh = cases["test_two_fresh"]["functions"]
    assert fresh.get("jit(<lambda>)") == 2, fresh
    assert cases["test_shared[1]"]["functions"].get("jit(<lambda>)") == 1
    assert cases["test_shared[2]"]["functions"].get("jit(<lambda>)") is None
    assert cases["test_skipped"]["outcome"] == "skipped" and cases["test_shared[2]"]["outcome"] == "passed"
    total = data["total"]
    assert total["cases"] == 3 and total["xla_compiles"] == sum(c["xla_compiles"] for c in cases.values())
    assert "compile counts: 3 cases" in run.stdout
    assert "test_two_fresh" in compare(data, data)


def test_each_xdist_worker_has_a_cache_directory_of_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXGPT_PARITY_JAX_CACHE", raising=False)
    assert cache_dir(tmp_path) == tmp_path / cpu_kind()
    assert cache_dir(tmp_path, "gw1") == tmp_path / cpu_kind() / "gw1"
    monkeypatch.setenv("JAXGPT_PARITY_JAX_CACHE", "off")
    assert cache_dir(tmp_path, "gw1") is None


def test_compile_counts_refuse_a_run_split_over_xdist_workers(tmp_path):
    (tmp_path / "conftest.py").write_text("from parity_tests.compile_counts import pytest_configure  # noqa\n")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    env = dict(os.environ, JAXGPT_COMPILE_COUNTS=str(tmp_path / "counts.json"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)]
    split = subprocess.run([*args, "-n", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert split.returncode == 4 and "run it without -n" in split.stderr, split.stdout[-2000:] + split.stderr[-2000:]
    assert not (tmp_path / "counts.json").exists()
    serial = subprocess.run([*args, "-n", "0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert serial.returncode == 0, serial.stdout[-2000:] + serial.stderr[-2000:]


MERGER = """
import sys
from parity_tests.report_file import merge_into
for i in range(int(sys.argv[3])):
    merge_into(sys.argv[1], {f"{sys.argv[2]}-{i}": {"x": float(i)}})
"""


def test_parity_report_merges_from_processes_ending_at_once_lose_nothing(tmp_path):
    """Two processes merging into $JAXGPT_PARITY_REPORT at the same time (as xdist's workers do at their sessions'
    ends), 150 merges each: every key of both is in the report."""
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"earlier": {"x": 1.0}}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", MERGER, str(report), name, "150"], cwd=tmp_path, env=env)
             for name in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    data = json.loads(report.read_text())
    assert set(data) == {"earlier"} | {f"{n}-{i}" for n in "ab" for i in range(150)}
    assert data["b-149"] == {"x": 149.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.json.lock"]  # no temporary left
