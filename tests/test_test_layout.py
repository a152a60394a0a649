"""Test modules never import each other: what several share lives in conftest.py or a
helper module (deployed.py, router_parts.py, scheduler_runs.py, cluster_load.py), so that
running one test module never collects or runs another's tests."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_test_module_imports_another():
    imports = {path.name: sorted(m for m in imported_modules(path)
                                 if m.rpartition(".")[2].startswith("test_"))
               for path in sorted(TESTS.glob("test_*.py"))}
    assert {name: found for name, found in imports.items() if found} == {}
