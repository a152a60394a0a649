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
