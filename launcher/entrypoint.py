"""What the launcher checks about a job's entrypoint before anything is spawned.

The module must be found where the ranks will look (this Python path plus the spec's own
``PYTHONPATH``) and must define the function. A module that declares a ``Params`` model (a
pydantic ``BaseModel``) also gets the spec's ``params`` validated against it here, so a typo or
a wrong type is one line and exit 2 instead of a traceback in every rank.

A module is read with ``ast``, never imported, unless it declares ``Params``: importing a user's
module could import torch or run its code. A module with ``Params`` has opted in, and keeps its
top level light (torch is imported inside ``run``), as the built-in workloads do.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel

from launcher.errors import SpecError

PARAMS_MODEL = "Params"


@contextlib.contextmanager
def _search_path(pythonpath: str) -> Iterator[None]:
    """The ranks also see the spec's own PYTHONPATH; look where they will."""
    extra = [p for p in pythonpath.split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = extra
    try:
        yield
    finally:
        del sys.path[: len(extra)]


def check_entrypoint(entrypoint: str, pythonpath: str, where: object) -> type[BaseModel] | None:
    """Raise SpecError unless ``module:function`` exists; return the module's ``Params`` model, if any."""
    module, _, function = entrypoint.partition(":")
    importlib.invalidate_caches()  # a notebook may have written the module since the last run
    with _search_path(pythonpath):
        try:
            found: ModuleSpec | None = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise SpecError([f"{where}: entrypoint: module '{module}' not found on the Python path"])
        source = Path(found.origin) if found.origin and found.origin.endswith(".py") else None
        if source is None:
            return None  # compiled or namespace module: the rank's import is the check
        if not defines(source, function):
            raise SpecError([f"{where}: entrypoint: module '{module}' ({found.origin}) has no function '{function}'"])
        if not defines(source, PARAMS_MODEL, strict=True):
            return None
        return _params_model(module, where)


def _params_model(module: str, where: object) -> type[BaseModel]:
    try:
        model = getattr(importlib.import_module(module), PARAMS_MODEL, None)
    except Exception as exc:  # noqa: BLE001 - the user's module: whatever it raises is the answer
        raise SpecError([f"{where}: entrypoint: importing '{module}' to check its params failed: {type(exc).__name__}: {exc}"]) from None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise SpecError([f"{where}: entrypoint: '{module}.{PARAMS_MODEL}' must be a pydantic BaseModel describing params"])
    return model


def defines(source: Path, name: str, *, strict: bool = False) -> bool:
    """Whether a module's source binds ``name`` at top level (read, never imported). When the
    source cannot be read or parsed, the answer is ``not strict``: the rank's import reports it."""
    try:
        tree = ast.parse(source.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return not strict
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.name == "*" and not strict) or (alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return True
        elif not isinstance(node, (ast.Expr, ast.Pass)) and any(
            isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(node)
        ):
            return True  # assigned, or bound inside an if/try at top level
    return False
