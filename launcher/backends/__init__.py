"""Backends by name. Imported lazily so that Ray stays an optional extra."""

from __future__ import annotations

import importlib

from launcher.backends.base import Backend
from launcher.errors import LauncherError

_REGISTRY = {
    "torchrun": "launcher.backends.torchrun:TorchrunBackend",
    "ray": "launcher.backends.ray:RayBackend",
}


def names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> type[Backend]:
    try:
        module_name, _, cls_name = _REGISTRY[name].partition(":")
    except KeyError:
        raise LauncherError(f"--backend: unknown backend '{name}' (expected one of: {', '.join(_REGISTRY)})", exit_code=2) from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LauncherError(
            f"backend '{name}' needs an optional dependency ({exc.name}); install it with: pip install 'gpulaunch[{name}]'",
            exit_code=2,
        ) from None
    return getattr(module, cls_name)
