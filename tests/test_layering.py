"""The layers: protocol/ at the bottom, router/ and replica/ on it and never on each other,
controller/ (the app wiring) on top. A policy author reads protocol/ alone; the engine
process never loads router code, and the router never loads vLLM's scheduler adapters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the blockserve folders its modules may import
ALLOWED = {
    "protocol": {"protocol"},
    "router": {"protocol", "router"},
    "replica": {"protocol", "replica"},
}


def imported_folders(path: Path) -> set[str]:
    """The blockserve folders a module imports, at its top or inside a function."""
    folders = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "blockserve" and len(parts) > 1:
                folders.add(parts[1])
    return folders


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_layer_imports_only_what_lies_below_it(folder):
    wrong = {f"{path.relative_to(ROOT)} imports blockserve.{sorted(imported - ALLOWED[folder])}"
             for path in sorted((ROOT / folder).glob("*.py"))
             if (imported := imported_folders(path)) - ALLOWED[folder]}
    assert not wrong, sorted(wrong)


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from blockserve.replica.scheduler import X\n")
    assert imported_folders(module) == {"replica"}


def module_imports(root: Path) -> dict[str, set[str]]:
    """blockserve module -> the blockserve modules it imports, at its top or in a function
    (`from blockserve.bench import traces` names the module blockserve.bench.traces)."""
    modules = {f"blockserve.{path.parent.name}.{path.stem}": path
               for folder in ("controller", "router", "replica", "protocol", "bench", "tools")
               for path in (root / folder).glob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = (imported & modules.keys()) - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other, directly or around a loop (each strongly
    connected component of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            component.append(module)
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_two_modules_import_each_other():
    """An import inside a function counts: a cycle hidden behind a lazy import is still
    one (bench/traces.py and bench/workloads.py were one)."""
    assert import_cycles(module_imports(ROOT)) == []


def test_an_import_cycle_is_reported(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "a.py").write_text("from blockserve.bench.b import x\n")
    (tmp_path / "bench" / "b.py").write_text("def f():\n    from blockserve.bench import c\n")
    (tmp_path / "bench" / "c.py").write_text("import blockserve.bench.a\n")
    (tmp_path / "bench" / "d.py").write_text("from blockserve.bench import a\n")
    assert import_cycles(module_imports(tmp_path)) == [
        ["blockserve.bench.a", "blockserve.bench.b", "blockserve.bench.c"]]
