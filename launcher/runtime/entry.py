"""The job's own functions, found by name (``module:function``): its entrypoint and its ``prepare``."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def load_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """``module:function``, imported (the spec's check found it before anything was spawned)."""
    module_name, _, func_name = entrypoint.partition(":")
    function: Callable[..., Any] = getattr(importlib.import_module(module_name), func_name)
    return function
