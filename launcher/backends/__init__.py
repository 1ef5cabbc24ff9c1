"""Engines and submitters by name: the one registry. Imported lazily so that Ray stays an optional extra.

Built in: the ``torchrun`` engine (this machine, or hosts over SSH), the ``ray`` engine (actors in a
placement group) and the ``slurm`` engine (srun steps inside an allocation); the ``ray`` submitter
(Ray Jobs API, for ``--address``) and the ``slurm`` submitter (sbatch). A new engine is one module
and one ``register_engine`` call (docs/architecture.md, "Adding an engine"); nothing else changes.
"""

from __future__ import annotations

import importlib
import os
from typing import Union

from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.protocol import ENV_SLURM_INSIDE
from launcher.records import BackendName
from launcher.stage.engine import StageEngine, Submitter

Target = Union[str, type]  # "module:Class", or the class itself

_ENGINES: dict[str, Target] = {
    BackendName.TORCHRUN.value: "launcher.backends.torchrun:TorchrunEngine",
    BackendName.RAY.value: "launcher.backends.ray:RayEngine",
    BackendName.SLURM.value: "launcher.backends.slurm.backend:SrunEngine",
}
_SUBMITTERS: dict[str, Target] = {
    BackendName.RAY.value: "launcher.backends.ray_jobs:RayJobsSubmitter",
    BackendName.SLURM.value: "launcher.backends.slurm.submit:SlurmSubmitter",
}


def register_engine(name: str, target: Target) -> None:
    """Make ``name`` an engine ``run_job(backend=name)`` and ``--backend name`` can use."""
    _ENGINES[name] = target


def register_submitter(name: str, target: Target) -> None:
    _SUBMITTERS[name] = target


def names() -> list[str]:
    return list(_ENGINES)


def _load(name: str, target: Target, what: str) -> type:
    if not isinstance(target, str):
        return target
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name and exc.name.startswith("launcher"):
            raise
        raise LauncherError(
            f"{what} '{name}' needs an optional dependency ({exc.name}); install it with: pip install 'gpulaunch[{name}]'",
            exit_code=EXIT_BAD_INPUT,
        ) from None
    return getattr(module, cls_name)


def engine(name: str) -> StageEngine:
    if name not in _ENGINES:
        raise LauncherError(f"--backend: unknown backend '{name}' (expected one of: {', '.join(names())})", exit_code=EXIT_BAD_INPUT)
    return _load(name, _ENGINES[name], "backend")()


def submitter(name: str, **options: object) -> Submitter:
    return _load(name, _SUBMITTERS[name], "backend")(**options)


def choose(name: str, *, address: str | None) -> StageEngine | Submitter:
    """What runs a job on backend ``name``: the Ray Jobs submitter for a cluster address, the
    Slurm submitter outside a Slurm job, otherwise the engine of that name (stages from here)."""
    if address:
        if name != BackendName.RAY.value:
            raise LauncherError(f"--address: submits to a Ray cluster, but the backend is {name} (use --backend ray)", exit_code=EXIT_BAD_INPUT)
        return submitter(name, address=address)
    if name == BackendName.SLURM.value and os.environ.get(ENV_SLURM_INSIDE) != "1":
        return submitter(name)
    return engine(name)


def submitter_for_id(job_id: str, address: str | None) -> Submitter:
    """The submitter whose scheduler has ``job_id`` (``launch status|logs|stop``): each is asked."""
    for name in _SUBMITTERS:
        cls: type[Submitter] = _load(name, _SUBMITTERS[name], "backend")
        if cls.claims(job_id, address):
            return cls(address=address)
    raise LauncherError(
        f"{job_id!r}: not a job id any scheduler here knows (a Ray submission id needs --address or RAY_API_SERVER_ADDRESS; "
        "a Slurm job id is a number)",
        exit_code=EXIT_BAD_INPUT,
    )
