"""docs/notebooks/*.ipynb: each is executed top to bottom with nbclient (Jupyter's own executor, in a fresh kernel
of this interpreter, in a scratch working directory), fails on any error, and must reproduce its committed
outputs, so a change of the API the notebooks use, or of the numbers they show, fails here until the notebook is
re-executed and committed (`python tests/test_notebooks.py --update`).

What "reproduce" means, cell by cell (code cells):

* every code cell of the committed notebook has been executed (an execution count) and has no error output;
* its stdout (all chunks joined: how the kernel splits a stream depends on timing) must be equal, after masking
  memory addresses (``0x7f...``), and its rich outputs must be the same kinds in the same order (a plot stays a
  plot; the PNG bytes are not compared, they depend on the fonts and matplotlib's version);
* stderr is not compared (warnings and progress bars depend on the environment);
* a cell tagged ``volatile`` prints numbers that depend on the machine (timings, measured peak FLOP/s, the last
  digits of floating-point differences, losses after many steps): only the kinds of its outputs are compared (it
  printed something, it showed a plot). Each such cell asserts its own bounds, so its numbers are still checked
  by running it;
* a cell tagged ``environment`` depends on what is installed or where data was found (e.g. the H100 compile
  needs JAX's CUDA plugin): its outputs are not compared at all, only its execution must succeed.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "docs" / "notebooks").glob("*.ipynb"))
TIMEOUT_S = 300  # per cell; each notebook takes well under a minute on a 2-core CPU
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def execute(path: Path, workdir: Path, xla_cache: Path | None = None):
    """The notebook at ``path``, executed in a new kernel whose working directory is ``workdir`` (with a persistent
    XLA compilation cache in ``xla_cache``: a notebook that compiles the same step twice, as a resumed run does,
    compiles it once)."""
    nb = nbformat.read(path, as_version=4)
    env = {**os.environ, "MPLBACKEND": "module://matplotlib_inline.backend_inline", "PYTHONHASHSEED": "0"}
    if xla_cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(xla_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute(env=env)
    return nb


def summarise(cell) -> dict:
    """What is compared of one code cell's outputs (see the module docstring)."""
    tags = set(cell.metadata.get("tags", []))
    stdout = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    rich = [sorted(o.data) for o in cell.outputs if o.output_type in ("display_data", "execute_result")]
    errors = [o.ename for o in cell.outputs if o.output_type == "error"]
    if "environment" in tags:
        return {"errors": errors}
    if "volatile" in tags:
        return {"stdout": bool(stdout.strip()), "rich": rich, "errors": errors}
    return {"stdout": ADDRESS.sub("0x...", stdout), "rich": rich, "errors": errors}


def code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("notebooks_xla_cache")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_and_its_committed_outputs_are_current(path, tmp_path, xla_cache):
    committed = nbformat.read(path, as_version=4)
    unexecuted = [i for i, c in enumerate(code_cells(committed)) if c.execution_count is None]
    assert not unexecuted, f"{path.name}: code cells {unexecuted} were committed without outputs; re-execute it"
    fresh = execute(path, tmp_path, xla_cache)  # raises nbclient.exceptions.CellExecutionError on any error
    for i, (old, new) in enumerate(zip(code_cells(committed), code_cells(fresh), strict=True)):
        assert old.source == new.source
        before, after = summarise(old), summarise(new)
        assert not before["errors"], f"{path.name}, code cell {i}: the committed output is an error"
        assert after == before, (
            f"{path.name}, code cell {i} ({old.source.splitlines()[0]!r}): its outputs differ from the committed "
            f"ones; if the change is intended, re-execute and commit the notebook (python tests/test_notebooks.py "
            f"--update {path.relative_to(REPO)})")


def test_the_comparison_tells_changed_outputs_from_timings_and_addresses():
    """What the notebook test compares, on hand-made cells: changed text or a lost plot is a difference; a memory
    address, a stderr warning, or how the kernel split a stream is not; volatile cells compare kinds only."""
    v4 = nbformat.v4

    def cell(*outputs, tags=()):
        c = v4.new_code_cell("x", outputs=list(outputs))
        if tags:
            c.metadata["tags"] = list(tags)
        return c

    out = lambda text, name="stdout": v4.new_output("stream", name=name, text=text)  # noqa: E731
    plot = v4.new_output("display_data", data={"image/png": "iVBORw0", "text/plain": "<Figure>"})
    base = summarise(cell(out("loss 2.5 at <object at 0x7f3a2b1c9d10>\n"), plot))
    assert summarise(cell(out("loss 2.5 at <object at 0x7f00deadbeef>\n"), plot)) == base  # address masked
    assert summarise(cell(out("loss 2.5 at "), out("<object at 0x7f3a2b1c9d10>\n"), out("warn", "stderr"),
                          plot)) == base  # split stream, stderr
    assert summarise(cell(out("loss 2.6 at <object at 0x7f3a2b1c9d10>\n"), plot)) != base  # a number changed
    assert summarise(cell(out("loss 2.5 at <object at 0x7f3a2b1c9d10>\n"))) != base  # the plot is gone
    vol = summarise(cell(out("12.3 ms\n"), plot, tags=["volatile"]))
    assert summarise(cell(out("45.6 ms\n"), plot, tags=["volatile"])) == vol
    assert summarise(cell(plot, tags=["volatile"])) != vol  # printed nothing
    assert summarise(cell(out("skipped\n"), tags=["environment"])) == summarise(cell(out("9 GiB\n"), plot,
                                                                                     tags=["environment"]))
    err = v4.new_output("error", ename="ValueError", evalue="bad", traceback=[])
    assert summarise(cell(err, tags=["environment"]))["errors"] == ["ValueError"]


def test_every_notebook_is_listed_in_the_readme():
    readme = (REPO / "README.md").read_text()
    assert NOTEBOOKS, "no notebooks under docs/notebooks"
    for path in NOTEBOOKS:
        assert f"docs/notebooks/{path.name}" in readme, f"README.md does not link {path.name}"


def _update(paths: list[str]) -> None:
    """Re-execute notebooks in place (their outputs become the committed ones)."""
    import tempfile
    import time

    for p in paths or [str(p) for p in NOTEBOOKS]:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            nb = execute(Path(p), Path(d), Path(d) / "xla_cache")
        nbformat.write(nb, p)
        print(f"{p}: executed in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "--update":
        sys.exit("usage: python tests/test_notebooks.py --update [NOTEBOOK.ipynb ...]")
    _update(sys.argv[2:])
