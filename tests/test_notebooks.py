"""docs/notebooks/*.ipynb: each is executed top to bottom with nbclient (Jupyter's own executor, in a fresh kernel
of this interpreter, in a scratch working directory), fails on any error, and must reproduce its committed
outputs, so a change of the API the notebooks use, or of the numbers and plots they show, fails here until the
notebook is re-executed and committed (`python tests/test_notebooks.py --update`).

What "reproduce" means, cell by cell (code cells):

* every code cell of the committed notebook was executed, in order, in one run (execution counts 1, 2, ...), and
  no committed output is an error, a traceback or a local path (``/home/...``, this checkout's or the
  interpreter's directory: ``--update`` writes those as ``<repo>``, ``<python>``, ``~``);
* text is compared after masking only what is genuinely volatile: memory addresses (``0x7f...``) and local paths.
  That is stdout (all chunks joined: how the kernel splits a stream depends on timing) and the text forms of rich
  outputs (``text/plain``, e.g. an execute_result's value or a figure's size and number of axes; ``text/html``,
  e.g. a table; any other ``text/*`` or JSON);
* plots (``image/png``) are compared by their pixels: the same size, and at most ``IMAGE_TOLERANCE`` of the pixels
  visibly different (anti-aliasing of a last-bit change; the PNG bytes themselves depend on zlib);
* stderr is not compared (warnings and progress bars depend on the environment), but must hold no traceback;
* a cell tagged ``volatile`` prints numbers that depend on the machine (timings, the measured peak FLOP/s, the
  last digits of floating-point differences): its text must be the same with every number masked, and each
  number within the cell's tolerance of the committed one (``metadata.tolerance``: ``factor``, the two of the
  same sign and the larger at most that many times the smaller, or ``atol``, at most that far apart; default
  factor 2, atol 0). Its plots are compared by their text form only (size and axes), since they draw those
  numbers: what they show is printed as numbers too (there or in the cell before), and a cell that measures
  asserts its own physical bounds (an MFU below 100%, say);
* a cell tagged ``float`` prints numbers computed by floating-point kernels (losses, gradients, weights drawn by
  XLA's random normal): their last digits are the CPU's (vector width, AMX or not, summation order), not the
  code's, so, as the parity tests compare such numbers, its text must be the same with every number masked and
  each number within the bound the cell states (``metadata.tolerance``: ``atol`` and ``rtol``, |new - old| <=
  atol + rtol x |old|; default 4 fp32 ulps relative). Unlike a volatile cell's, its plots are compared by their
  pixels (a last-digit change moves no pixel). A cell whose numbers decide what it prints (an argmax, a sorted
  list) prints them in an order that does not depend on those digits;
* a cell tagged ``environment`` depends on what is installed (e.g. the H100 compile needs JAX's CUDA plugin):
  where the committed and the fresh run took the same branch (both printed ``skipped: ...``, or neither did) it
  is compared as a volatile cell; otherwise only its execution must succeed.
"""

from __future__ import annotations

import base64
import copy
import io
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
# a number: optional sign, digits (with thousands commas) or a leading dot, decimals, exponent; not inside a word
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d*|\d+|\.\d+)(?:[eE][-+]?\d+)?(?!\w)")
LOCAL_PATH = re.compile(r"(?<![\w.<>~-])/(?:home|root|tmp|work|Users|usr|opt|var|private|mnt|scratch)/")
IMAGE_TOLERANCE = 0.002  # the fraction of a plot's pixels that may differ (by more than 5% of the range)
DEFAULT_TOLERANCE = {"factor": 2.0, "atol": 0.0}
FLOAT_TOLERANCE = {"atol": 0.0, "rtol": 4 * 2.0**-23}  # a float cell's default: 4 fp32 ulps


# ---- executing -----------------------------------------------------------------------------------------------
def kernel_env(xla_cache: Path | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The kernel's environment: inline plots, a fixed hash seed, JAX_PLATFORMS=cpu where there is no NVIDIA
    driver (as the root conftest.py sets for the tests: with JAX's CUDA plugin installed, jax would otherwise
    print the plugin's failed start as a traceback), and a persistent XLA cache in ``xla_cache``."""
    from jaxgpt.gpu_env import cuda_driver_present

    env = {**(os.environ if base is None else base), "MPLBACKEND": "module://matplotlib_inline.backend_inline",
           "PYTHONHASHSEED": "0"}
    if not cuda_driver_present():
        env.setdefault("JAX_PLATFORMS", "cpu")
    if xla_cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(xla_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def execute(path: Path, workdir: Path, xla_cache: Path | None = None):
    """The notebook at ``path``, executed in a new kernel whose working directory is ``workdir`` (with a persistent
    XLA compilation cache in ``xla_cache``: a notebook that compiles the same step twice, as a resumed run does,
    compiles it once), its outputs' local paths replaced (``sanitise``)."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute(env=kernel_env(xla_cache))
    return sanitise(nb, workdir)


def local_paths(workdir: Path | None = None) -> list[tuple[str, str]]:
    """(local path, what it is written as), longest first."""
    pairs = [(str(REPO), "<repo>"), (sys.prefix, "<python>"), (os.path.realpath(sys.prefix), "<python>"),
             (str(Path.home()), "~")]
    if workdir is not None:
        pairs += [(str(workdir), "."), (os.path.realpath(workdir), ".")]
    return sorted({p: r for p, r in pairs if len(p) > 1}.items(), key=lambda pr: -len(pr[0]))


def _replace_paths(text: str, pairs) -> str:
    for path, written in pairs:
        text = text.replace(path, written)
    return text


def sanitise(nb, workdir: Path | None = None):
    """The notebook with this machine's paths in its outputs written as <repo>, <python>, ~ and . (in place)."""
    pairs = local_paths(workdir)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                o.text = _replace_paths(o.text, pairs)
            elif o.output_type == "error":
                o.traceback = [_replace_paths(t, pairs) for t in o.traceback]
            else:
                for mime, value in o.get("data", {}).items():
                    if mime.startswith("text/") and isinstance(value, str):
                        o.data[mime] = _replace_paths(value, pairs)
    return nb


# ---- comparing -------------------------------------------------------------------------------------------------
def code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _normal(text: str) -> str:
    return ADDRESS.sub("0x...", _replace_paths(text, local_paths()))


def summarise(cell) -> dict:
    """What is compared of one code cell's outputs (see the module docstring)."""
    stdout = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    stderr = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stderr")
    rich = []
    for o in cell.outputs:
        if o.output_type in ("display_data", "execute_result"):
            text = {m: _normal(v if isinstance(v, str) else "".join(v)) for m, v in o.data.items()
                    if m.startswith("text/")}
            text.update({m: _normal(repr(v)) for m, v in o.data.items() if m.endswith("json")})
            rich.append({"kinds": sorted(o.data), "text": text, "png": o.data.get("image/png")})
    return {"stdout": _normal(stdout), "rich": rich, "stderr": stderr,
            "errors": [o.ename for o in cell.outputs if o.output_type == "error"]}


def tolerance(cell) -> dict[str, float]:
    """A volatile or environment cell's tolerance (factor, atol), or a float cell's (atol, rtol)."""
    base = FLOAT_TOLERANCE if "float" in cell.metadata.get("tags", []) else DEFAULT_TOLERANCE
    return {**base, **cell.metadata.get("tolerance", {})}


def _numbers(text: str) -> tuple[str, list[float]]:
    return NUMBER.sub("#", text), [float(m.group().replace(",", "")) for m in NUMBER.finditer(text)]


def text_differences(old: str, new: str, tol: dict[str, float] | None) -> list[str]:
    """Why ``new`` is not ``old`` (exactly, or with ``tol``: the same text with numbers masked, each number within
    ``tol``'s factor, atol or rtol of the old one); [] when it is."""
    if tol is None:
        if old == new:
            return []
        at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        return [f"text differs at {old[max(0, at - 40):at + 40]!r} -> {new[max(0, at - 40):at + 40]!r}"]
    (old_skeleton, old_nums), (new_skeleton, new_nums) = _numbers(old), _numbers(new)
    if old_skeleton != new_skeleton:
        return text_differences(old_skeleton, new_skeleton, None)
    allowed = ", ".join(f"{k} {v:g}" for k, v in sorted(tol.items()))
    if "rtol" in tol:  # a float cell: two values within the bound may print one unit of their last place apart
        places = [_last_place(a) + _last_place(b) for a, b in zip(_tokens(old), _tokens(new))]
        return [f"{a:g} -> {b:g} (beyond {allowed}, and half a unit of the last printed place)"
                for a, b, u in zip(old_nums, new_nums, places) if not _close(a, b, **{**tol, "atol": tol["atol"] + u / 2})]
    return [f"{a:g} -> {b:g} (beyond {allowed})" for a, b in zip(old_nums, new_nums) if not _close(a, b, **tol)]


def _tokens(text: str) -> list[str]:
    return [m.group().replace(",", "") for m in NUMBER.finditer(text)]


def _last_place(token: str) -> float:
    """One unit of a printed number's last digit: '10.8790503' -> 1e-7, '5.7e-06' -> 1e-7, '2,359' -> 1."""
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def _close(a: float, b: float, factor: float | None = None, atol: float = 0.0, rtol: float = 0.0) -> bool:
    """Within ``atol + rtol |a|`` of each other, or (with ``factor``) of one sign and at most ``factor`` x apart."""
    if abs(a - b) <= atol + rtol * abs(a):
        return True
    return factor is not None and a * b > 0 and max(abs(a), abs(b)) <= factor * min(abs(a), abs(b))


def image_differences(old_png: str, new_png: str) -> list[str]:
    import matplotlib.image
    import numpy as np

    old, new = (matplotlib.image.imread(io.BytesIO(base64.b64decode(p)), format="png") for p in (old_png, new_png))
    if old.shape != new.shape:
        return [f"plot of {old.shape[1]} x {old.shape[0]} pixels -> {new.shape[1]} x {new.shape[0]}"]
    changed = float((np.abs(old - new).max(axis=-1) > 0.05).mean())
    return [f"{changed:.1%} of the plot's pixels changed"] if changed > IMAGE_TOLERANCE else []


def _skipped(summary: dict) -> bool:
    return summary["stdout"].lstrip().startswith("skipped:")


def cell_differences(old_cell, new_cell) -> list[str]:
    """Why the fresh cell's outputs are not the committed cell's (see the module docstring); [] when current."""
    tags = set(old_cell.metadata.get("tags", []))
    old, new = summarise(old_cell), summarise(new_cell)
    if new["errors"]:
        return [f"the cell raised {new['errors']}"]
    if "environment" in tags and _skipped(old) != _skipped(new):
        return []  # the other branch (the CUDA plugin installed here and not there): running it is the check
    volatile = bool(tags & {"volatile", "environment"})
    tol = tolerance(old_cell) if volatile or "float" in tags else None
    out = [f"stdout: {d}" for d in text_differences(old["stdout"], new["stdout"], tol)]
    if [r["kinds"] for r in old["rich"]] != [r["kinds"] for r in new["rich"]]:
        return out + [f"rich outputs {[r['kinds'] for r in old['rich']]} -> {[r['kinds'] for r in new['rich']]}"]
    for i, (a, b) in enumerate(zip(old["rich"], new["rich"])):
        for mime in a["text"]:
            out += [f"output {i} {mime}: {d}" for d in text_differences(a["text"][mime], b["text"][mime], tol)]
        if a["png"] and not volatile:
            out += [f"output {i}: {d}" for d in image_differences(a["png"], b["png"])]
    return out


def notebook_differences(committed, fresh) -> list[str]:
    """Every code cell whose fresh outputs are not its committed ones, with why."""
    out = []
    for i, (old, new) in enumerate(zip(code_cells(committed), code_cells(fresh), strict=True)):
        first = old.source.splitlines()[0] if old.source else ""
        out += [f"code cell {i} ({first!r}): {d}" for d in cell_differences(old, new)]
    return out


def committed_problems(nb) -> list[str]:
    """What must not be in a committed notebook: unexecuted cells or cells out of order, errors, tracebacks,
    local paths."""
    out = []
    counts = [c.execution_count for c in code_cells(nb)]
    if counts != list(range(1, len(counts) + 1)):
        out.append(f"execution counts {counts}: not one top-to-bottom run; re-execute it")
    for i, cell in enumerate(code_cells(nb)):
        texts = []
        for o in cell.outputs:
            if o.output_type == "stream":
                texts.append(o.text)
            elif o.output_type == "error":
                out.append(f"code cell {i}: an error output ({o.ename})")
            else:
                texts += [v for m, v in o.get("data", {}).items() if m.startswith("text/") and isinstance(v, str)]
        text = "\n".join(texts)
        if "Traceback" in text:
            out.append(f"code cell {i}: a traceback in its outputs")
        found = LOCAL_PATH.search(text)
        local = found.group() if found else next((p for p, _ in local_paths() if p in text), None)
        if local:
            out.append(f"code cell {i}: a local path in its outputs ({local}...)")
    return out


# ---- the notebooks ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("notebooks_xla_cache")


SLOW_NOTEBOOKS = {"01_resource_accounting", "03_training_run_read_back"}  # 35-40 s each on 2 cores: `pytest -m slow`


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem in SLOW_NOTEBOOKS
                                               else []) for p in NOTEBOOKS])
def test_notebook_executes_and_its_committed_outputs_are_current(path, tmp_path, xla_cache):
    committed = nbformat.read(path, as_version=4)
    problems = committed_problems(committed)
    assert not problems, f"{path.name}: " + "; ".join(problems)
    fresh = execute(path, tmp_path, xla_cache)  # raises nbclient.exceptions.CellExecutionError on any error
    differences = notebook_differences(committed, fresh)
    assert not differences, (
        f"{path.name}: outputs differ from the committed ones; if the change is intended, re-execute and commit "
        f"the notebook (python tests/test_notebooks.py --update {path.relative_to(REPO)}):\n"
        + "\n".join(differences))


def test_every_notebook_is_listed_in_the_readme():
    readme = (REPO / "README.md").read_text()
    assert NOTEBOOKS, "no notebooks under docs/notebooks"
    for path in NOTEBOOKS:
        assert f"docs/notebooks/{path.name}" in readme, f"README.md does not link {path.name}"


# ---- the comparison itself -------------------------------------------------------------------------------------
v4 = nbformat.v4


def cell(*outputs, tags=(), **tolerance):
    c = v4.new_code_cell("x", outputs=list(outputs))
    if tags:
        c.metadata["tags"] = list(tags)
    if tolerance:
        c.metadata["tolerance"] = tolerance
    return c


def out(text, name="stdout"):
    return v4.new_output("stream", name=name, text=text)


def rich(kind="display_data", **data):
    return v4.new_output(kind, data=data, **({"execution_count": 1} if kind == "execute_result" else {}))


def png(draw) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    draw(ax)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=60)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def same(a, b) -> bool:
    return cell_differences(a, b) == []


def test_the_comparison_tells_changed_outputs_from_addresses_paths_and_split_streams():
    plot = rich(**{"image/png": png(lambda ax: ax.plot([1, 2, 3])), "text/plain": "<Figure size 300x200 with 1 Axes>"})
    base = cell(out("loss 2.5 at <object at 0x7f3a2b1c9d10>\n"), plot)
    assert same(base, cell(out("loss 2.5 at <object at 0x7f00deadbeef>\n"), plot))  # an address is masked
    assert same(base, cell(out("loss 2.5 at "), out("<object at 0x7f3a2b1c9d10>\n"), out("warn", "stderr"), plot))
    assert not same(base, cell(out("loss 2.6 at <object at 0x7f3a2b1c9d10>\n"), plot))  # a number changed
    assert not same(base, cell(out("loss 2.5 at <object at 0x7f3a2b1c9d10>\n")))  # the plot is gone
    assert same(cell(out(f"data in {REPO}/data_cache\n")), cell(out("data in <repo>/data_cache\n")))  # a path
    # the values of rich outputs: an execute_result's text, a table, a figure's size
    value = lambda text: cell(rich("execute_result", **{"text/plain": text}))  # noqa: E731
    assert same(value("2.5"), value("2.5")) and not same(value("2.5"), value("2.6"))
    table = lambda v: cell(rich(**{"text/html": f"<table><tr><td>{v}</td></tr></table>",  # noqa: E731
                                   "text/plain": "<DataFrame>"}))
    assert same(table(1), table(1)) and not same(table(1), table(2))
    fig = lambda size: cell(rich(**{"image/png": plot.data["image/png"], "text/plain": size}))  # noqa: E731
    assert not same(fig("<Figure size 300x200 with 1 Axes>"), fig("<Figure size 300x200 with 2 Axes>"))


def test_plots_are_compared_by_their_pixels():
    line = png(lambda ax: ax.plot([1, 2, 3]))
    a = cell(rich(**{"image/png": line, "text/plain": "<Figure>"}))
    assert same(a, cell(rich(**{"image/png": png(lambda ax: ax.plot([1, 2, 3 + 1e-9])), "text/plain": "<Figure>"})))
    spike = cell(rich(**{"image/png": png(lambda ax: ax.plot([1, 9, 3])), "text/plain": "<Figure>"}))
    assert not same(a, spike)
    assert same(cell(a.outputs[0], tags=["volatile"]), cell(spike.outputs[0], tags=["volatile"]))  # by text there


def test_volatile_numbers_within_their_tolerance_and_the_rest_exactly():
    vol = lambda text, **tol: cell(out(text), tags=["volatile"], **tol)  # noqa: E731
    committed = vol("mini step: 435.3 ms, 12.08 GFLOP -> 27.7 GFLOP/s, MFU 42.8%\n")
    assert same(committed, vol("mini step: 300.1 ms, 12.08 GFLOP -> 40.3 GFLOP/s, MFU 35.0%\n"))  # within 2x
    assert not same(committed, vol("mini step: 300.1 ms, 12.08 GFLOP -> 40.3 GFLOP/s, MFU -35.0%\n"))  # sign
    assert not same(committed, vol("mini step: 43.5 ms, 12.08 GFLOP -> 277 GFLOP/s, MFU 428%\n"))  # 10x: stale
    assert not same(committed, vol("mini step: 435.3 ms, 12.08 GFLOP -> 27.7 GFLOP/s\n"))  # the MFU is gone
    assert not same(committed, vol("mini step: 435.3 ms, 12.08 GFLOPs -> 27.7 GFLOP/s, MFU 42.8%\n"))  # words
    loose = {"factor": 10, "atol": 1e-5}  # a cell's own tolerance
    assert same(vol("|diff| 0.0e+00, 5.7e-06\n", **loose), vol("|diff| 1.9e-06, 9.5e-07\n", **loose))
    assert not same(vol("|diff| 0.0e+00\n", **loose), vol("|diff| 3.0e-05\n", **loose))
    assert _numbers("w[:4] = [ 0.0201 -0.0181], 2,359,296 weights, steps 3-4, 1e-08, fp32 e4m3") == (
        "w[:#] = [ # #], # weights, steps #-#, #, fp32 e4m3", [4, 0.0201, -0.0181, 2359296, 3, 4, 1e-08])


def test_float_cells_compare_numbers_within_the_bound_they_state():
    """issue 30: notebook 02's loss printed 10.8790503 where it was committed and 10.8790512 on an AMX Xeon (fp32
    digits below the parity bound): a float cell compares them within its own bound, and nothing else loosens."""
    flt = lambda text, **tol: cell(out(text), tags=["float"], **tol)  # noqa: E731
    committed = flt("loss: jaxgpt 10.8790503, torch_ref 10.8790493, float64 10.8790504\n", atol=1.1e-5)
    assert same(committed, flt("loss: jaxgpt 10.8790512, torch_ref 10.8790493, float64 10.8790504\n", atol=1.1e-5))
    assert not same(committed, flt("loss: jaxgpt 10.8791503, torch_ref 10.8790493, float64 10.8790504\n",
                                   atol=1.1e-5))  # 1e-4: beyond the bound
    assert not same(committed, flt("loss: jaxgpt 10.8790512, torch_ref 10.8790493\n", atol=1.1e-5))  # text
    # no stated bound: 4 fp32 ulps relative, plus the printing's rounding: a last-digit change of an 8-digit print
    # passes (a value one ulp away can round either way), 5e-5 relative does not
    assert same(flt("std 0.02008029\n"), flt("std 0.02008030\n"))
    assert not same(flt("std 0.02008029\n"), flt("std 0.02008129\n"))
    assert _last_place("10.8790503") == pytest.approx(1e-7) and _last_place("5.7e-06") == pytest.approx(1e-7)
    assert _last_place("2359296") == 1
    # not a factor: 2x passes a volatile cell, never a float cell
    assert not same(flt("|diff| 5.7e-06\n", atol=1e-6), flt("|diff| 9.5e-06\n", atol=1e-6))
    # and a float cell's plots are compared by their pixels (a volatile cell's by their text only)
    line, spike = (png(lambda ax, v=v: ax.plot([1, v, 3])) for v in (2, 9))
    figure = lambda p: cell(rich(**{"image/png": p, "text/plain": "<Figure>"}), tags=["float"])  # noqa: E731
    assert same(figure(line), figure(line)) and not same(figure(line), figure(spike))


def test_environment_cells_compare_where_both_runs_took_the_same_branch():
    env = lambda text: cell(out(text), tags=["environment"])  # noqa: E731
    compiled = env("GPT-2 on one H100: XLA 9.29 GiB, analytic 9.29 GiB (+0%)\n")
    assert same(compiled, env("skipped: JAX's CUDA plugin is not installed\n"))  # the other branch: ran, that's all
    assert same(env("skipped: no plugin\n"), env("skipped: no plugin\n"))
    assert same(compiled, env("GPT-2 on one H100: XLA 9.31 GiB, analytic 9.29 GiB (+0%)\n"))
    assert not same(compiled, env("GPT-2 on one H100: XLA 19.3 GiB, analytic 9.29 GiB (-52%)\n"))
    err = v4.new_output("error", ename="ValueError", evalue="bad", traceback=[])
    assert not same(compiled, cell(err, tags=["environment"]))


def test_committed_problems_are_found():
    nb = v4.new_notebook(cells=[cell(out("ok\n")), cell(out("fine\n"))])
    nb.cells[0].execution_count, nb.cells[1].execution_count = 1, 2
    assert committed_problems(nb) == []
    bad = copy.deepcopy(nb)
    bad.cells[1].execution_count = 5
    bad.cells[0].outputs.append(out("Traceback (most recent call last):\n  cuInit(0) failed\n", "stderr"))
    bad.cells[1].outputs.append(out("data from /work/shared/data/tinyshakespeare.txt\n"))
    problems = committed_problems(bad)
    assert len(problems) == 3 and "execution counts" in problems[0] and "traceback" in problems[1]
    assert "local path" in problems[2]


def test_the_kernel_runs_on_the_cpu_where_there_is_no_driver(monkeypatch):
    import jaxgpt.gpu_env

    monkeypatch.setattr(jaxgpt.gpu_env, "cuda_driver_present", lambda: False)
    assert kernel_env(base={})["JAX_PLATFORMS"] == "cpu"
    assert kernel_env(base={"JAX_PLATFORMS": "cuda"})["JAX_PLATFORMS"] == "cuda"  # what the caller set stays
    monkeypatch.setattr(jaxgpt.gpu_env, "cuda_driver_present", lambda: True)
    assert "JAX_PLATFORMS" not in kernel_env(base={})


def _fixture(name: str):
    """A notebook kept in tests/data as it was committed at a past revision (not read from git history, which a
    shallow clone or a rewritten history lacks)."""
    return nbformat.read(REPO / "tests" / "data" / name, as_version=4)


def test_notebook_03_committed_before_the_step_timing_fix_is_stale():
    """1fff68e's notebook 03 showed throughput spikes after each evaluation (a timing bug fixed by ee93965);
    3cd5a81 is the same code cells re-executed after the fix, i.e. what executing 1fff68e's notebook gives today.
    The comparison finds 1fff68e's outputs stale (its plots), and 3cd5a81's current against itself."""
    stale, refreshed = _fixture("notebook03_1fff68e_stale.ipynb"), _fixture("notebook03_3cd5a81_refreshed.ipynb")
    assert [c.source for c in code_cells(stale)] == [c.source for c in code_cells(refreshed)]
    differences = notebook_differences(stale, refreshed)
    assert any(d.startswith("code cell 5 ('def plot_run") and "plot" in d for d in differences), differences
    assert notebook_differences(refreshed, refreshed) == []


def _update(paths: list[str]) -> None:
    """Re-execute notebooks in place (their outputs become the committed ones)."""
    import tempfile
    import time

    for p in paths or [str(p) for p in NOTEBOOKS]:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            nb = execute(Path(p), Path(d), Path(d) / "xla_cache")
        nbformat.write(nb, p)
        problems = committed_problems(nb)
        print(f"{p}: executed in {time.perf_counter() - t0:.1f} s (load average {os.getloadavg()[0]:.2f})"
              + (f"; fix before committing: {'; '.join(problems)}" if problems else ""))


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "--update":
        sys.exit("usage: python tests/test_notebooks.py --update [NOTEBOOK.ipynb ...]")
    _update(sys.argv[2:])
