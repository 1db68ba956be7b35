"""The library's shape, checked over its import graph (every import, also those inside functions):
dependencies point one way (records -> storage -> engine, models, algo -> gateway, judge, train,
sync -> services -> flows -> CLI and benchmarks), there are no import cycles, and no file or function
grows past what one reader can hold."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# flows/ and storage/ are installed as clawrl.flows and clawrl.storage
PACKAGES = {"clawrl": ROOT / "clawrl", "clawrl.flows": ROOT / "flows", "clawrl.storage": ROOT / "storage"}

# Lowest floor first. A module may import from its own floor and the floors below, never above.
FLOORS: list[tuple[str, ...]] = [
    ("clawrl.records", "clawrl.ids", "clawrl.config", "clawrl.config_defaults",
     "clawrl.config_sections", "clawrl.config_removed"),
    ("clawrl.storage",),
    ("clawrl.engine", "clawrl.models", "clawrl.algo", "clawrl.gate", "clawrl.chat", "clawrl.checkpoint", "clawrl.mix",
     "clawrl.hooks", "clawrl.runtime", "clawrl.interrupts", "clawrl.ports", "clawrl.adapters"),
    ("clawrl.gateway", "clawrl.judge", "clawrl.train", "clawrl.sync", "clawrl.sim", "clawrl.lineage", "clawrl.doctor",
     "clawrl.evaluation"),
    ("clawrl.trainer_service", "clawrl.replay", "clawrl.supervisor", "clawrl.serving", "clawrl.promotion"),
    ("clawrl.flows",),
    ("clawrl.cli", "clawrl.bench"),
]
# Parts of one floor that must not know each other (each is built and tested on its own).
SIBLINGS = ("clawrl.gateway", "clawrl.judge", "clawrl.train", "clawrl.sync", "clawrl.sim", "clawrl.lineage")
# Further edges that the floors allow but the design does not: the trainer takes batches as
# arguments and never reads the tables itself.
FORBIDDEN = [("clawrl.train", "clawrl.storage")]

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The clawrl modules ``name`` imports (a package import counts as its ``__init__``)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t in MODULES:
                out.add(t)
    out.discard(name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _part(module: str, parts: tuple[str, ...]) -> str | None:
    return next((p for p in parts if module == p or module.startswith(p + ".")), None)


def _floor(module: str) -> int:
    for i, parts in enumerate(FLOORS):
        if _part(module, parts):
            return i
    raise AssertionError(f"{module} is on no floor of tests/test_layering.py: add it where it belongs")


def test_every_module_is_on_a_floor():
    for name in MODULES:
        if name != "clawrl":
            _floor(name)


def test_imports_point_down():
    wrong = [f"{a} imports {b}" for a, deps in GRAPH.items() if a != "clawrl" for b in deps
             if b != "clawrl" and _floor(b) > _floor(a)]
    assert not wrong, "imports that point up a floor:\n" + "\n".join(sorted(wrong))


def test_siblings_do_not_import_each_other():
    wrong = []
    for a, deps in GRAPH.items():
        pa = _part(a, SIBLINGS)
        wrong += [f"{a} imports {b}" for b in deps if pa and _part(b, SIBLINGS) not in (None, pa)]
    wrong += [f"{a} imports {b}" for a, deps in GRAPH.items() for low, high in FORBIDDEN
              if _part(a, (low,)) for b in deps if _part(b, (high,))]
    assert not wrong, "\n".join(sorted(wrong))


def test_flows_and_storage_are_imported_under_clawrl():
    bare = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bare += [f"{name}: {m}" for m in mods if m.split(".")[0] in ("flows", "storage")]
    assert not bare


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_functions_stay_small(name):
    text = MODULES[name].read_text()
    lines = text.count("\n")
    assert lines <= MAX_FILE_LINES, f"{MODULES[name]}: {lines} lines; split it along its jobs"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{MODULES[name]}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (no __init__.py in tests/): two files of one name in different
    folders stop the whole run at collection ("import file mismatch")."""
    names: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: paths for n, paths in names.items() if len(paths) > 1} == {}
