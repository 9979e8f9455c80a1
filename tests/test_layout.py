"""The package's layout: no import cycle between any two modules, type-only imports included.

The layers themselves are checked by ``lint-imports`` (the contracts in ``pyproject.toml``), which
CI runs with the other checks; this test also runs it, so that ``pytest`` alone catches a breach.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in modules:
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_between_modules():
    graph = grimp.build_graph("ray_lightning_sgd", exclude_type_checking_imports=False)
    # the package's own __init__ re-exports from below; a module importing the package root
    # (tune's lazy lookup) is no cycle of implementation modules
    graph.remove_module("ray_lightning_sgd")
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    assert _cycles(graph) == []
    graph.add_import(importer="c", imported="a")
    assert _cycles(graph) == [["a", "b", "c"]]


def test_layers_contracts_are_kept():
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports is not None, "import-linter is part of the test extra"
    result = subprocess.run([lint_imports], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
