"""One name, one module: a newcomer who reads ``store`` or ``checkpoint`` in a traceback or an
import finds one file. Module names (singular and plural counted as one) are unique across
``launcher/``, except inside an engine's own folder (``launcher/backends/<engine>/``), where each
engine names its parts by their role (``submit``, ``inside``, ``command``) as its peers do."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

LAUNCHER = Path(__file__).resolve().parents[2] / "launcher"


def _stem(path: Path) -> str:
    return path.stem[:-1] if path.stem.endswith("s") else path.stem


def _in_an_engine_folder(path: Path) -> bool:
    parts = path.relative_to(LAUNCHER).parts
    return len(parts) >= 3 and parts[0] == "backends"


def test_no_module_name_is_used_twice_outside_the_engines_folders() -> None:
    modules = [p for p in LAUNCHER.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts]
    assert len(modules) > 50  # the package, not an empty glob
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in modules:
        if not _in_an_engine_folder(path):
            by_name[_stem(path)].append(str(path.relative_to(LAUNCHER)))
    twice = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert twice == {}, f"module names used twice: {twice}"
