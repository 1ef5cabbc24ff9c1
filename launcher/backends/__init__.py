"""Backends by name: the one registry. Imported lazily so that Ray stays an optional extra."""

from __future__ import annotations

import importlib

from launcher.backends.base import Backend
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.records import BackendName

_REGISTRY: dict[BackendName, str] = {
    BackendName.TORCHRUN: "launcher.backends.torchrun:TorchrunBackend",
    BackendName.RAY: "launcher.backends.ray:RayBackend",
    BackendName.SLURM: "launcher.backends.slurm:SlurmBackend",
}


def names() -> list[str]:
    return [name.value for name in _REGISTRY]


def get_backend(name: str) -> type[Backend]:
    try:
        module_name, _, cls_name = _REGISTRY[BackendName(name)].partition(":")
    except (KeyError, ValueError):
        raise LauncherError(f"--backend: unknown backend '{name}' (expected one of: {', '.join(names())})", exit_code=EXIT_BAD_INPUT) from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LauncherError(
            f"backend '{name}' needs an optional dependency ({exc.name}); install it with: pip install 'gpulaunch[{name}]'",
            exit_code=EXIT_BAD_INPUT,
        ) from None
    return getattr(module, cls_name)
