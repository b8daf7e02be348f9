"""JAX's persistent compilation cache for the parity run (a session fixture in conftest.py turns it on).

Every executable JAX compiles is written to the cache directory and looked up there before compiling, keyed by
the program (its HLO), the compile options, the devices and the jax/jaxlib versions. Within one run that answers the
identical programs that fresh ``jax.jit`` objects compile again (a train step made anew for each optimizer test
compiles the same gradient code, the logits of a checkpoint in fp32 under two tests, ...); across runs on the
same machine it answers nearly everything, and on a GPU it also keeps XLA's per-fusion autotuning results
(jax's ``jax_persistent_cache_enable_xla_caches``). A loaded executable is the compiled program itself: results
are bit for bit those of compiling it.

Where: ``$JAXGPT_PARITY_JAX_CACHE`` if set (``off`` disables it), else pytest's cache directory
(``.pytest_cache/d/jax-compilation-cache``, ignored by git; a fresh clone, as in CI, starts empty and gains only
the within-run hits), else ``$XDG_CACHE_HOME/jaxgpt`` (``~/.cache``) when pytest runs with ``-p
no:cacheprovider``; a cache directory the user set for JAX (``JAX_COMPILATION_CACHE_DIR``) is used as it is. Below
it, one directory per CPU kind (the host's instruction-set flags), so an executable compiled for an AVX-512 or
AMX host is never loaded on an AVX2-only one that shares the working tree. Under pytest-xdist (``pytest -n 2``)
each worker has a directory of its own below that (``gw0``, ``gw1``, ...): JAX writes a cache entry in place, not
by renaming a finished file, so a worker could otherwise load another's half-written entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
from pathlib import Path

ENV = "JAXGPT_PARITY_JAX_CACHE"
_KEYS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
         "jax_persistent_cache_min_entry_size_bytes")


def cpu_kind() -> str:
    """A short stable name for this host's CPU: its architecture and a hash of its instruction-set flags."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return f"{platform.machine()}-{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def cache_dir(pytest_cache_dir: Path | None, worker: str | None = None) -> Path | None:
    """Where the parity run's cache goes (None: off, or the user's own JAX cache directory is in charge); ``worker``:
    the pytest-xdist worker's id (``gw0``, ...), whose directory is its own."""
    import jax

    choice = os.environ.get(ENV, "")
    if choice.lower() == "off" or jax.config.jax_compilation_cache_dir:
        return None
    if choice:
        base = Path(choice)
    elif pytest_cache_dir is not None:
        base = pytest_cache_dir
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxgpt" / "jax-compilation-cache"
    return base / cpu_kind() / worker if worker else base / cpu_kind()


@contextlib.contextmanager
def persistent_cache(path: str | os.PathLike | None):
    """Every compilation inside goes through the persistent cache at ``path`` (None: no persistent cache), whatever
    the size or compile time; JAX's settings (and its cache's state) are restored after."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
    old = {k: getattr(jax.config, k) for k in _KEYS}
    try:
        jax.config.update("jax_compilation_cache_dir", None if path is None else str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor
        compilation_cache.reset_cache()  # JAX decides once per process whether a cache is used: decide again
        yield path
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
