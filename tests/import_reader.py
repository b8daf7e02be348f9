"""Reading a module's imports from its source with ast, for the tests of import direction (tests/test_imports.py)
and import cycles (tests/test_benchmarks.py). Every import counts, at any depth of the file (functions,
conditionals, try blocks): a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_names(path: Path, package: str) -> set[str]:
    """Every dotted name the module at ``path`` imports, relative imports resolved against ``package`` (the package
    the module lives in; for an ``__init__.py``, its own). ``from a import b`` yields both ``a`` and ``a.b``: the
    reader cannot tell a submodule from a name defined in ``a``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` levels above this module's
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return found
