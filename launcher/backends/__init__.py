"""Engines and submitters by name: the one registry. Imported lazily so that Ray stays an optional extra.

Built in: the ``torchrun`` engine (this machine, or hosts over SSH), the ``ray`` engine (actors in a
placement group) and the ``slurm`` engine (srun steps inside an allocation); the ``ray`` submitter
(Ray Jobs API, for ``--address``) and the ``slurm`` submitter (sbatch). A new engine is one folder
and one ``register_engine`` call (docs/architecture.md, "Adding an engine"): its settings block in
the spec (``settings=``, a pydantic model), its submitter (``submitter=``) with the inside half of a
submitted run, its dry run, status, logs and stop; nothing else changes. The spec accepts the
names registered here as ``backend:`` and their settings blocks (``launcher.spec.model`` asks this
registry, which tells it on import).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, ContextManager, Mapping, Union

from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.spec import model as _spec
from launcher.spec.validation import did_you_mean
from launcher.stage.engine import Detacher, StageEngine, Submitter

if TYPE_CHECKING:
    from pydantic import BaseModel

    from launcher.backends.ssh.preflight import PreflightOutcome
    from launcher.spec.cluster import ClusterConfig
    from launcher.spec.model import LoadedJob
    from launcher.stage.plan import NodeTarget

Target = Union[str, type]  # "module:Class", or the class itself

_ENGINES: dict[str, Target] = {
    "torchrun": "launcher.backends.torchrun:TorchrunEngine",
    "ray": "launcher.backends.ray:RayEngine",
    "slurm": "launcher.backends.slurm.backend:SrunEngine",
}
_SUBMITTERS: dict[str, Target] = {
    "ray": "launcher.backends.ray_jobs:RayJobsSubmitter",
    "slurm": "launcher.backends.slurm.submit:SlurmSubmitter",
}
# the engines whose run loop a cluster file's controller host runs (``--cluster FILE --detach``),
# reached over their transport
_DETACHERS: dict[str, Target] = {
    "torchrun": "launcher.backends.ssh.detached:SshDetacher",
}
# each engine's settings block in the spec (``NAME: {...}``); the built-in ones are the spec's own
# ``ray:`` and ``slurm:`` fields
_SETTINGS: dict[str, Target] = {}


def register_engine(name: str, target: Target, *, settings: Target | None = None, submitter: Target | None = None, detacher: Target | None = None) -> None:
    """Make ``name`` an engine ``run_job(backend=name)``, ``--backend name`` and a spec's
    ``backend: name`` can use; ``settings``: the pydantic model of its block in the spec
    (``name: {...}``, read with ``job.spec.engine_settings(name)``); ``submitter``: its
    ``Submitter``, for runs handed to a scheduler (``Submitter.takes_run``); ``detacher``: its
    ``Detacher``, for runs whose run loop goes to a cluster file's controller host (``--detach``)."""
    _ENGINES[name] = target
    if settings is not None:
        _SETTINGS[name] = settings
    if submitter is not None:
        _SUBMITTERS[name] = submitter
    if detacher is not None:
        _DETACHERS[name] = detacher


def register_submitter(name: str, target: Target) -> None:
    _SUBMITTERS[name] = target


def names() -> list[str]:
    return list(_ENGINES)


def submitter_names() -> list[str]:
    return list(_SUBMITTERS)


def settings_models() -> dict[str, type[BaseModel]]:
    """Each engine's settings model by its name, for the spec (``NAME: {...}`` blocks)."""
    return {name: _load(name, target, "backend") for name, target in _SETTINGS.items() if name in _ENGINES}


def _catalogue() -> Mapping[str, type[BaseModel] | None]:
    models = settings_models()
    return {name: models.get(name) for name in _ENGINES}


_spec.use_engine_catalogue(_catalogue)


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
        hint = did_you_mean(name, names())
        hint = f" (expected one of: {', '.join(names())})" if hint.startswith(" (") else hint
        raise LauncherError(f"--backend: unknown backend '{name}'{hint}", exit_code=EXIT_BAD_INPUT)
    return _load(name, _ENGINES[name], "backend")()


def detacher_names() -> list[str]:
    return list(_DETACHERS)


def detacher(name: str | None = None) -> Detacher | None:
    """Engine ``name``'s detacher (None: its run loop stays where ``launch`` runs). Without a name:
    the one that reaches runs detached to a cluster file's controller host (``launch attach|status|
    logs|stop|fetch|resume RUN --cluster FILE``), the first registered."""
    if name is None:
        name = next(iter(_DETACHERS), None)
    if name is None or name not in _DETACHERS:
        return None
    cls: type[Detacher] = _load(name, _DETACHERS[name], "backend")
    return cls()


def submitter_class(name: str) -> type[Submitter]:
    cls: type[Submitter] = _load(name, _SUBMITTERS[name], "backend")
    return cls


def choose(job: LoadedJob, *, backend: str | None, address: str | None) -> StageEngine | Submitter:
    """What runs ``job`` on ``backend`` (None: the spec's; with an ``address``: the backend whose
    submitter takes one): that backend's submitter where it takes the run (``Submitter.takes_run``:
    given a cluster address, or outside the scheduler's job), otherwise the engine of that name
    (stages from here). No engine is named here: each submitter says what it takes."""
    name = backend or (_address_taker() if address else job.spec.backend)
    cls = submitter_class(name) if name in _SUBMITTERS else None
    if address and (cls is None or not cls.takes_address):
        takers = " or ".join(f"--backend {n}" for n in _address_takers())
        kinds = " or ".join(dict.fromkeys(submitter_class(n).address_kind for n in _address_takers())) or "a cluster"
        raise LauncherError(f"--address: submits to {kinds}, but the backend is {name} (use {takers or 'a backend whose submitter takes one'})",
                            exit_code=EXIT_BAD_INPUT)  # fmt: skip
    if cls is None:
        return engine(name)
    where = address or (cls.address_of(job) if cls.takes_address else None)
    if cls.takes_run(job, where, os.environ):
        return cls(address=where)
    return engine(name)


def _address_takers() -> list[str]:
    return [name for name in _SUBMITTERS if submitter_class(name).takes_address]


def _address_taker() -> str:
    takers = _address_takers()
    if len(takers) != 1:
        raise LauncherError(f"--address: name the backend to submit with (--backend {' or '.join(takers) or '?'})", exit_code=EXIT_BAD_INPUT)
    return takers[0]


def submitter_for_id(job_id: str, address: str | None) -> Submitter:
    """The submitter whose scheduler has ``job_id`` (``launch status|logs|stop``): each is asked,
    the last registered first (an engine's own submitter before the built-in Ray Jobs one, which
    takes any id that is not a number)."""
    for name in reversed(_SUBMITTERS):
        cls = submitter_class(name)
        if cls.claims(job_id, address):
            return cls(address=address)
    raise LauncherError(
        f"{job_id!r}: not a job id any scheduler here knows (a Ray submission id needs --address or RAY_API_SERVER_ADDRESS; "
        "a Slurm job id is a number)",
        exit_code=EXIT_BAD_INPUT,
    )


def resume_refusal(run_dir: Path) -> str | None:
    """Why ``launch resume`` must leave ``run_dir`` to a scheduler (a submitter's run: its
    scheduler continues it), or None: each submitter is asked."""
    for name in _SUBMITTERS:
        why = submitter_class(name).resume_refusal(run_dir)
        if why is not None:
            return why
    return None


# The hosts of a cluster file (``--cluster``) are reached over SSH (``launcher.backends.ssh``, the
# torchrun engine's transport to other hosts): the control side asks for them here.


def preflight_hosts(cluster: ClusterConfig, job: LoadedJob, *, network: bool) -> PreflightOutcome:
    """Every host of the cluster file checked (a failed one replaced by a spare)."""
    from launcher.backends.ssh import preflight_hosts as check

    return check(cluster, job, network=network)


def host_free_port(target: NodeTarget) -> int:
    """A TCP port free right now on a host of the cluster file."""
    from launcher.backends.ssh import remote_free_port

    return remote_free_port(target)


def host_connections() -> ContextManager[object]:
    """One connection per host for a run, closed when the block ends."""
    from launcher.backends.ssh import connection_scope

    return connection_scope()
