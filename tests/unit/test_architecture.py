"""The layers hold: no import cycles (function-level imports count), a standard-library-only
contract between the launcher and its ranks, and the import-linter contracts in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("launcher")  # function-level and TYPE_CHECKING imports included
    assert _cycles(graph) == []


def test_the_contract_modules_pull_in_nothing_but_the_standard_library():
    code = (
        "import sys\n"
        "import launcher.protocol, launcher.records, launcher.masking, launcher.errors\n"
        "third = sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'yaml', 'torch', 'ray', 'rich', 'psutil', 'matplotlib'})\n"
        "print('THIRD', third)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert "THIRD []" in done.stdout


@pytest.mark.skipif(shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None, reason="import-linter not installed")
def test_the_import_linter_contracts_are_kept():
    lint = str(Path(sys.executable).parent / "lint-imports")
    done = subprocess.run([lint], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "0 broken" in done.stdout
