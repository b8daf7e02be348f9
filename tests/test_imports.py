"""The direction of jaxgpt's imports: the device table (jaxgpt.devices) at the bottom, the accountant above it, the
trainer above both, jaxgpt.compile (which compiles the trainer's step) on top; no circle among them. Read from the
source with ast, function-level (lazy) imports included: a lazy import is still a dependency."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.import_reader import imported_names

JAXGPT = Path(__file__).resolve().parents[1] / "jaxgpt"
UNITS = ("jaxgpt.devices", "jaxgpt.account", "jaxgpt.train", "jaxgpt.compile")


def unit_of(module: str) -> str:
    """The top-level unit of jaxgpt a module belongs to: jaxgpt.account.cli -> jaxgpt.account."""
    return ".".join(module.split(".")[:2])


def module_name(path: Path) -> str:
    rel = path.relative_to(JAXGPT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every jaxgpt module ``path`` imports, at any depth of the file (functions, conditionals, try blocks)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = imported_names(path, package)
    return {m for m in found if m == "jaxgpt" or m.startswith("jaxgpt.")}


def unit_graph() -> dict[str, set[str]]:
    """unit -> the other jaxgpt units it imports (a name that is not a module, `from jaxgpt.x import y`, maps to
    its unit jaxgpt.x all the same)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(JAXGPT.rglob("*.py")):
        src = unit_of(module_name(path))
        deps = {unit_of(m) for m in imported_modules(path)} - {src, "jaxgpt"}
        graph.setdefault(src, set()).update(deps)
    return graph


def reaches(graph: dict[str, set[str]], unit: str) -> set[str]:
    """Every unit ``unit`` imports, directly or through others."""
    seen, todo = set(), [unit]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_reader_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "jaxgpt" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .mod import x\n")
    (pkg / "mod.py").write_text("import os\n\ndef f():\n    if True:\n        from jaxgpt import train\n"
                                "    try:\n        import jaxgpt.compile.cli\n    except ImportError:\n        pass\n"
                                "    from ..devices import peak_flops\n")
    monkeypatch.setattr(sys.modules[__name__], "JAXGPT", tmp_path / "jaxgpt")
    assert imported_modules(pkg / "__init__.py") == {"jaxgpt.pkg.mod", "jaxgpt.pkg.mod.x"}
    assert {unit_of(m) for m in imported_modules(pkg / "mod.py")} == {"jaxgpt", "jaxgpt.train", "jaxgpt.compile",
                                                                        "jaxgpt.devices"}
    assert reaches({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, "a") == {"a", "b", "c"}
    assert reaches({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}


def test_no_import_circle_among_devices_account_train_compile():
    """A circle through any of them, through other jaxgpt units included (a unit that reaches itself)."""
    graph = unit_graph()
    assert set(UNITS) <= set(graph), sorted(graph)
    assert graph["jaxgpt.account"] and graph["jaxgpt.compile"]  # the reader found their imports at all
    assert [u for u in UNITS if u in reaches(graph, u)] == []


@pytest.mark.parametrize("unit, forbidden", [
    ("jaxgpt.devices", {"jaxgpt.account", "jaxgpt.train", "jaxgpt.compile"}),
    ("jaxgpt.account", {"jaxgpt.train", "jaxgpt.compile"}),
    ("jaxgpt.train", {"jaxgpt.compile"}),
])
def test_lower_units_do_not_import_higher_ones(unit, forbidden):
    """Directly or through any other jaxgpt unit."""
    seen = reaches(unit_graph(), unit)
    assert not seen & forbidden, f"{unit} reaches {sorted(seen & forbidden)}"


def test_the_device_table_is_one_object_everywhere():
    from jaxgpt import account, devices
    from jaxgpt.compile import targets

    assert account.DEVICES is devices.DEVICES and account.peak_flops is devices.peak_flops
    assert account.AccountError is devices.DeviceError
    assert all(t.peak_bf16 == devices.DEVICES[name].peak["bf16"] for name, t in targets.TARGETS.items())
