"""What the launcher checks about a job's entrypoint before anything is spawned.

The module must be found where the ranks will look (this Python path plus the spec's own
``PYTHONPATH``) and must define the function. A module that declares a ``Params`` model (a
pydantic ``BaseModel``) also gets the spec's ``params`` validated against it here, so a typo or
a wrong type is one line and exit 2 instead of a traceback in every rank.

A module is read with ``ast``, never imported, unless it declares ``Params`` (the packages above
it are imported, to find it): importing a user's module could import torch or run its code. A
module with ``Params`` has opted in, and keeps its top level light (torch is imported inside
``run``), as the built-in workloads do.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import importlib.machinery
import importlib.util
import os
import pkgutil
import sys
import threading
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Iterator

from pydantic import BaseModel

from launcher.errors import SpecError

PARAMS_MODEL = "Params"


# One job's module at a time: run_job may be called from several threads of one process.
_lock = threading.RLock()


@contextlib.contextmanager
def _search_path(pythonpath: str) -> Iterator[None]:
    """The ranks also see the spec's own PYTHONPATH; look where they will, then put sys.path
    back (by value: the module's own import may have changed it too)."""
    extra = [p for p in pythonpath.split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = extra
    try:
        yield
    finally:
        for entry in extra:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)


def _shadowed(module: str) -> bool:
    """Whether a package above ``module`` is already loaded from somewhere other than where it
    is found now (another project's ``pkg``): then ``pkg.mod`` cannot be found or loaded for
    this job in this process without replacing what the other one uses."""
    parts = module.split(".")
    locations: list[str] | None = None  # None: sys.path
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name)
        if loaded is None:
            return False  # not loaded: finding the module imports it from the right place
        found = _find_unloaded(name, locations)
        if found is None:
            return True
        here = list(found.submodule_search_locations or [])
        if here != list(getattr(loaded, "__path__", []) or []):
            return True
        locations = here
    return False


def _find_unloaded(name: str, locations: list[str] | None) -> ModuleSpec | None:
    """What importing ``name`` would find if it were not loaded yet: the import system's own
    finders (an editable install's too), asked without looking at ``sys.modules``."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        found = find(name, locations) if find is not None else None
        if isinstance(found, ModuleSpec):
            return found
    return None


def _find(module: str) -> ModuleSpec | None:
    """Where ``module`` is now, even when a module of that name is already loaded (another job's
    ``work.py``, or this one before an edit): ``find_spec`` alone answers from ``sys.modules``.
    Its parent packages are imported (that is how a submodule is found); what they raise, raises."""
    loaded = sys.modules.pop(module, None)
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    finally:
        if loaded is not None:
            sys.modules[module] = loaded


# modules this process loaded from a file, with the file's mtime then: an edit means load again
_loaded_at: dict[str, tuple[str, int]] = {}


def load_module(module: str, pythonpath: str = "") -> ModuleType:
    """The entrypoint's module as the ranks will import it: found on the spec's PYTHONPATH too,
    and loaded afresh from its source when the one in ``sys.modules`` is another file, or one
    this process did not load, or an older version (a notebook that edits its workload between
    ``run_job`` calls). Raises what its import raises; ModuleNotFoundError when it is not found
    or a package above it belongs to another project loaded here."""
    with _lock, _search_path(pythonpath):
        importlib.invalidate_caches()  # a notebook may have written the module since the last run
        found = None if _shadowed(module) else _find(module)
        if found is None:
            raise ModuleNotFoundError(f"no module named '{module}' here", name=module)
        return _load_found(module, found)


def _load_found(module: str, found: ModuleSpec) -> ModuleType:
    """``module`` from where ``found`` says it is: the loaded one if this process loaded that very
    file version, else run afresh from its source (called under ``_lock``)."""
    current = sys.modules.get(module)
    stamp = _stamp(found)
    if current is not None and stamp is not None and _loaded_at.get(module) == stamp:
        return current
    fresh = importlib.util.module_from_spec(found)
    sys.modules[module] = fresh
    try:
        _execute(found, fresh)
    except BaseException:
        if current is None:
            sys.modules.pop(module, None)
        else:
            sys.modules[module] = current
        raise
    if stamp is not None:
        _loaded_at[module] = stamp
    parent, _, child = module.rpartition(".")
    if parent in sys.modules:  # as an import does: `from pkg import mod` then finds this one
        setattr(sys.modules[parent], child, fresh)
    return fresh


def _execute(found: ModuleSpec, module: ModuleType) -> None:
    """Run the module's code from its source: a cached .pyc can be stale for an edit within the
    same second that kept the file's size."""
    loader = found.loader
    if isinstance(loader, importlib.machinery.SourceFileLoader) and found.origin:
        code = loader.source_to_code(loader.get_data(found.origin), found.origin)
        exec(code, module.__dict__)  # noqa: S102 - what importing it would run
    else:
        assert loader is not None
        loader.exec_module(module)


def _stamp(found: ModuleSpec) -> tuple[str, int] | None:
    try:
        return (str(found.origin), os.stat(str(found.origin)).st_mtime_ns) if found.has_location else None
    except OSError:
        return None


def _close(name: str, choices: Iterator[str] | list[str]) -> str | None:
    found = difflib.get_close_matches(name, sorted(set(choices)), n=1, cutoff=0.7)
    return found[0] if found else None


def _siblings(module: str) -> list[str]:
    """The modules that ``module`` could have been meant as: those beside it in its package
    (found, not imported), or the top-level ones on the Python path."""
    parent, _, _ = module.rpartition(".")
    if not parent:
        return [m.name for m in pkgutil.iter_modules()]
    try:
        found = importlib.util.find_spec(parent)
    except (ImportError, ValueError):
        return []
    if found is None or not found.submodule_search_locations:
        return []
    return [f"{parent}.{m.name}" for m in pkgutil.iter_modules(found.submodule_search_locations)]


def module_not_found(module: str, label: str, base_dir: Path | None) -> str:
    """Where the module was looked for, the likely fix, and a near name if there is one."""
    message = f"{label}: module '{module}' not found on the Python path (PYTHONPATH and installed packages)"
    near = _close(module, _siblings(module))
    if near:
        return f"{message}; did you mean '{near}'?"
    if base_dir is not None:
        beside = base_dir / (module.replace(".", os.sep) + ".py")
        if beside.is_file():
            return (
                f"{message}; {beside} is beside the spec: put its directory on the Python path for the launcher "
                f"and the ranks (PYTHONPATH={base_dir} launch ..., or env: {{PYTHONPATH: {base_dir}}} in the spec)"
            )
    return f"{message}; install it, or add its directory to PYTHONPATH (or to env: PYTHONPATH in the spec)"


def _defined_functions(source: Path) -> list[str]:
    try:
        tree = ast.parse(source.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def check_entrypoint(entrypoint: str, pythonpath: str, label: str, base_dir: Path | None = None) -> type[BaseModel] | None:
    """Raise SpecError unless ``module:function`` exists; return the module's ``Params`` model,
    if it declares one. ``label``: where the entrypoint was given (``FILE:LINE: entrypoint``);
    ``base_dir``: the spec's directory, where a module not on the path may sit."""
    module, _, function = entrypoint.partition(":")
    with _lock, _search_path(pythonpath):
        if _shadowed(module):
            return None  # another project's package of that name is loaded here: the ranks check
        importlib.invalidate_caches()
        try:
            found = _find(module)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a parent package's __init__ raised
            raise SpecError([f"{label}: importing the packages above '{module}' failed: {type(exc).__name__}: {exc}"]) from None
        if found is None:
            raise SpecError([module_not_found(module, label, base_dir)])
        source = Path(found.origin) if found.origin and found.origin.endswith(".py") else None
        if source is None:
            return None  # compiled or namespace module: the rank's import is the check
        if not defines(source, function):
            near = _close(function, _defined_functions(source))
            hint = f", did you mean '{near}'?" if near else ""
            raise SpecError([f"{label}: module '{module}' ({found.origin}) has no function '{function}'{hint}"])
        if not defines(source, PARAMS_MODEL, strict=True):
            return None
        try:
            model = getattr(_load_found(module, found), PARAMS_MODEL, None)  # found above, under the same lock
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module: what it raises is the answer
            raise SpecError([f"{label}: importing '{module}' to check its params failed: {type(exc).__name__}: {exc}"]) from None
    # a Params that is not a pydantic model (a dataclass, say) is the module's own business
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


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
