"""The job spec: YAML in, one immutable, validated ``JobSpec`` out.

Every problem in a file is collected and reported together, each as one line naming the file,
the line and the dotted field path, with a "did you mean" for misspelt keys.

Every setting's default is stated here, once: what carries a setting on (the rank contract's
``WorkerConfig``, the stage plan, ``launcher.policies``) takes its value from a loaded spec and
states no default of its own (tests/unit/test_defaults_once.py holds that).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Callable, Literal, Mapping

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    StrictInt,
    StringConstraints,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from launcher.errors import SpecError
from launcher.fieldtypes import Real
from launcher.spec.entrypoint import check_entrypoint
from launcher.spec.validation import did_you_mean, field_label, located_problems
from launcher.spec.yamlsource import Location, SourcedData, deep_merge, load_yaml, set_path

ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _scalar_to_str(value: Any) -> Any:
    # YAML turns `OMP_NUM_THREADS: 4` into an int; env values are strings by nature.
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("expected text without NUL characters")
    return value


def _freeze(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


FrozenMap = Annotated[
    dict[str, Any], AfterValidator(_freeze), PlainSerializer(lambda m: dict(m), return_type=dict)
]
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # what a process environment (and a shell) accepts as a name
PATTERN_HINTS = {
    ENV_NAME: "expected an environment variable name (letters, digits and _, not starting with a digit)",
    ENTRYPOINT.pattern: "expected module:function, e.g. launcher.workloads.matmul:run",
}
EnvMap = Annotated[
    dict[
        Annotated[str, StringConstraints(pattern=ENV_NAME)],
        Annotated[str, BeforeValidator(_scalar_to_str), AfterValidator(_no_nul)],
    ],
    AfterValidator(_freeze),
    PlainSerializer(lambda m: dict(m), return_type=dict),
]


RestartClass = Literal["all", "job_error", "oom", "host_lost", "rank_lost", "hang", "rendezvous", "timeout"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_ELASTIC_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


class Resources(_Frozen):
    # How many hosts (a cluster file's, in its order; the ones after them are spares). An elastic
    # world: `nodes: {min: 2, max: 4}` or `nodes: 2..4`: the job starts on as many healthy hosts as
    # there are, up to max, and when a host is lost with no spare left it goes on with the rest
    # (at least min), the stage restarted at the smaller world size from its last checkpoint.
    nodes: StrictInt = Field(1, ge=1, le=4096)
    min_nodes: StrictInt | None = Field(None, ge=1, le=4096)  # set by the {min, max} form (or directly)
    gpus_per_node: Literal["auto"] | Annotated[StrictInt, Field(ge=0, le=1024)] = "auto"
    cpu_workers: Literal["auto"] | Annotated[StrictInt, Field(ge=1, le=1024)] = 2
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # Ranks that share each GPU, as Ray's fractional GPUs (num_gpus: 1/k): a node runs k ranks per
    # GPU it uses, each rank computing on cuda:<local_rank // k>. NCCL refuses two ranks on one GPU,
    # so above 1 the process group is gloo over CUDA tensors (the plan says so). It lets every
    # multi-rank GPU path run on one GPU; ignored on the CPU (cpu_workers counts the ranks there).
    ranks_per_gpu: StrictInt = Field(1, ge=1, le=64)

    @model_validator(mode="before")
    @classmethod
    def _elastic_nodes(cls, data: Any) -> Any:
        """``nodes: {min: A, max: B}`` or ``nodes: "A..B"`` -> ``nodes: B, min_nodes: A``."""
        if not isinstance(data, Mapping):
            return data
        nodes = data.get("nodes")
        if isinstance(nodes, str) and (m := _ELASTIC_RANGE.match(nodes)):
            nodes = {"min": int(m.group(1)), "max": int(m.group(2))}
        if isinstance(nodes, Mapping):
            unknown = sorted(set(nodes) - {"min", "max"})
            if unknown or "max" not in nodes:
                raise ValueError(f"nodes: expected a count, {{min: A, max: B}} or 'A..B' (got {dict(nodes)!r})")
            return {**data, "nodes": nodes["max"], "min_nodes": nodes.get("min", 1)}
        return data

    @model_validator(mode="after")
    def _min_within_max(self) -> "Resources":
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"nodes: min {self.min_nodes} is larger than max {self.nodes}")
        return self

    @property
    def fewest_nodes(self) -> int:
        """The fewest hosts the job runs on: ``min`` of an elastic world, else ``nodes``."""
        return self.nodes if self.min_nodes is None else self.min_nodes

    @property
    def elastic(self) -> bool:
        return self.fewest_nodes < self.nodes

    def gpus_used(self) -> int | None:
        """How many of a node's visible GPUs the job may use: the first N, None for all, 0 for none."""
        if self.device == "cpu":
            return 0
        return None if self.gpus_per_node == "auto" else self.gpus_per_node


class Scaling(_Frozen):
    # The world sizes, one stage each: a list ([1, 2, 4]), or "auto": 1, 2, 4, ... up to every
    # worker slot the plan has (GPUs x ranks_per_gpu across the nodes, or CPU workers), and that
    # total where it is not a power of two; over several nodes, each size a multiple of the nodes.
    # Listed sizes that do not fit the nodes are skipped and said; none fitting is an error.
    workers: Literal["auto"] | tuple[Annotated[StrictInt, Field(ge=1, le=65536)], ...] = "auto"

    @field_validator("workers", mode="before")
    @classmethod
    def _world_sizes(cls, workers: Any) -> Any:
        """Checked whole, before the union sees it: one line in the spec's words, not one per form."""
        form = "expected 'auto' or a list of world sizes, e.g. [1, 2, 4]"
        if workers == "auto":
            return workers
        if isinstance(workers, int) and not isinstance(workers, bool):
            workers = [workers]  # one world size
        if not isinstance(workers, (list, tuple)):
            raise ValueError(form)  # the line adds what it got
        if not workers:
            raise ValueError(f"{form} (got an empty list)")
        bad = [w for w in workers if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= 65536]
        if bad:
            raise ValueError(f"{form}, each a whole number from 1 to 65536 (got {bad[0]!r})")
        if len(workers) > 64:
            raise ValueError(f"at most 64 world sizes (got {len(workers)})")
        if len(set(workers)) != len(workers):
            raise ValueError("each world size may appear once")
        return tuple(workers)

    @property
    def auto(self) -> bool:
        return self.workers == "auto"


class Timeouts(_Frozen):
    rendezvous_s: Real = Field(60, gt=0, le=86_400)
    run_s: Real = Field(3600, gt=0, le=30 * 86_400)
    # How long a collective may wait for its slowest rank (a rank saving a checkpoint while the
    # others wait in an all-reduce); None keeps torch's default for the process-group backend.
    collective_s: Real | None = Field(None, gt=0, le=30 * 86_400)
    # A stage whose ranks have been counting steps and none advanced for this long (or some fell
    # behind the rest, or went silent) is hung: its evidence is gathered from every rank and the
    # culprit named. Well under torch's collective timeouts (NCCL 10 min, gloo 30); null: off.
    hang_s: Real | None = Field(300, gt=0, le=30 * 86_400)
    # What a hang does then: "stop" the run (exit 1, results kept) or "restart" the group
    # (counts against max_restarts; each attempt's diagnosis is kept); null: as restart_on says.
    on_hang: Literal["stop", "restart"] | None = None


class CheckpointSettings(_Frozen):
    # Where ctx.checkpoint keeps each stage's checkpoints (<dir>/world<N>): a shared filesystem or
    # a mounted bucket; null: the run directory's world<N>/checkpoints on each host (hosts that
    # share no filesystem each keep a copy of rank 0's)
    dir: str | None = None
    keep: StrictInt = Field(2, ge=1, le=1000)  # the newest complete checkpoints kept
    # A replicated save (DDP) blocks the step only for a copy of rank 0's state to host memory; the
    # file is written, synced and published on a thread while the job steps on (one at a time)
    async_save: bool = False
    # Recovery in place (ctx.checkpoint.in_place, torchrun on one node): processes per node kept
    # ready to take a lost rank's place, each with the job's `prepare` already run (its model
    # built, its data warmed up), so a replacement starts no job of its own. Each holds what
    # `prepare` returns (a model's worth of memory) and spends one `prepare` of CPU, once the
    # ranks are stepping and again after each recovery. 0: a replacement is forked at the loss.
    warm_spares: StrictInt = Field(0, ge=0, le=8)


class Preemption(_Frozen):
    # After a stop notice (SIGTERM or Ctrl-C to launch, a host's SIGTERM, Slurm's signal) a job
    # that watches ctx.should_stop has this long to save and return before everything is stopped
    grace_s: Real = Field(60, gt=0, le=3600)


class PreflightSettings(_Frozen):
    # The GPUs the job will use are refused (exit 2, nothing started; a spare host takes the place
    # of a host that has one) when NVML reports uncorrectable ECC errors, retired pages or row
    # remapping pending or failed, clocks held down by heat or a power brake, or a compute mode
    # that forbids the job, or when less than min_free_gpu_memory of a GPU's memory is free.
    gpu_health: bool = True
    min_free_gpu_memory: float = Field(0.75, ge=0, le=1)
    # A multi-host job (SSH): every host's link to its peers on the job's interface, measured in a
    # ring each way within network_budget_s before the start; a link under min_link_fraction of the
    # median, or a host that does not answer, is named (and a spare takes the bad host's place).
    network: bool = True
    network_budget_s: Real = Field(3, gt=0, le=120)
    min_link_fraction: float = Field(0.5, ge=0, le=1)


class RaySettings(_Frozen):
    address: str | None = None
    dashboard_host: str = "127.0.0.1"
    expose_dashboard: bool = False
    namespace: str = "gpulaunch"
    # Ray's placement-group strategy for the ranks' gang: "pack" fills as few nodes as possible
    # (NVLink-friendly, spills over to more nodes when one is full), "spread" one rank per node
    # where it can; the strict_ forms fail instead of falling back.
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    # What ``--address`` ships as the Ray job's working directory: this directory (relative to the
    # spec; default: the spec's own), its regular files only, less what a .gitignore/.rayignore or
    # ``excludes`` (gitignore patterns, as Ray's runtime_env excludes) leave out; a larger one than
    # ``working_dir_max_mb`` is refused before anything is submitted.
    working_dir: str | None = None
    excludes: tuple[Annotated[str, StringConstraints(min_length=1, max_length=1024)], ...] = Field((), max_length=1024)
    working_dir_max_mb: Real = Field(50, gt=0, le=500)


# Slurm's own words for a time limit: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS,
# DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS
SLURM_TIME = r"^(\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|INFINITE|UNLIMITED)$"
SLURM_WORD = r"^[^\s'\"\\]+$"  # one token on an #SBATCH line: no blanks, quotes or backslashes
PATTERN_HINTS[SLURM_TIME] = "expected a Slurm time limit: MINUTES, HH:MM:SS, D-HH or D-HH:MM:SS"
PATTERN_HINTS[SLURM_WORD] = "expected one word (no blanks, quotes or backslashes)"
# sbatch options the launcher writes itself: a spec field says them, or they are the launcher's
# (where the output goes, that a job which lost a node is not run again into the same directory)
_SBATCH_OWNED = {
    "nodes": "resources.nodes", "ntasks": "resources", "ntasks-per-node": "resources",
    "gpus-per-node": "resources.gpus_per_node", "gpus": "resources.gpus_per_node",
    "cpus-per-task": "slurm.cpus_per_task", "partition": "slurm.partition", "account": "slurm.account",
    "qos": "slurm.qos", "time": "slurm.time", "constraint": "slurm.constraint", "job-name": "name",
    "output": None, "error": None, "chdir": None, "requeue": None, "array": None, "wrap": None,
    "parsable": None, "wait": None, "signal": "preemption.grace_s", "no-requeue": None, "open-mode": None,
}  # fmt: skip
SlurmWord = Annotated[str, StringConstraints(pattern=SLURM_WORD, max_length=1024)]


def _sbatch_option(line: str) -> str:
    if not re.fullmatch(r"--[A-Za-z][\w-]*(=\S.*)?", line) or any(c in line for c in "\r\n\0"):
        raise ValueError("expected one long sbatch option, e.g. --mem=64G")
    option = line[2:].split("=", 1)[0]
    if option in _SBATCH_OWNED:
        field = _SBATCH_OWNED[option]
        raise ValueError(f"--{option} is written by the launcher ({f'set {field} instead' if field else 'not an option here'})")
    return line


class SlurmSettings(_Frozen):
    """What Slurm users always set; anything else as ``extra_sbatch`` options, one per item."""

    partition: SlurmWord | None = None  # default: the cluster's default partition
    account: SlurmWord | None = None
    qos: SlurmWord | None = None
    # default: every stage's timeouts.rendezvous_s + run_s, plus a minute and the preemption
    # warning's lead (preemption.grace_s + 30 s), rounded up to minutes
    time: Annotated[str, StringConstraints(pattern=SLURM_TIME)] | None = None
    constraint: SlurmWord | None = None
    # CPUs per node (one task per node runs its torchrun agent and ranks); default: one per rank
    cpus_per_task: Annotated[StrictInt, Field(ge=1, le=4096)] | None = None
    # e.g. ["--mem=64G", "--exclusive"]: written after the launcher's own #SBATCH lines
    extra_sbatch: tuple[Annotated[str, AfterValidator(_sbatch_option)], ...] = Field((), max_length=64)


# The engines ``backend:`` may name, and the settings model of each one's block (``NAME: {...}``;
# None: no block of its own, or a field of JobSpec as ``ray:`` and ``slurm:`` are). The spec knows
# no engine: the registry (``launcher.backends``) tells it on import, and is imported by name the
# first time a spec is validated without it.
ENGINE_REGISTRY = "launcher.backends"
EngineCatalogue = Callable[[], Mapping[str, "type[BaseModel] | None"]]
_engine_catalogue: EngineCatalogue | None = None


def use_engine_catalogue(catalogue: EngineCatalogue) -> None:
    """What the registry calls on import: the engines by name, each with its settings model."""
    global _engine_catalogue
    _engine_catalogue = catalogue


def engine_catalogue() -> Mapping[str, type[BaseModel] | None]:
    if _engine_catalogue is None:
        importlib.import_module(ENGINE_REGISTRY)  # it calls use_engine_catalogue
    assert _engine_catalogue is not None, f"{ENGINE_REGISTRY} did not register its engines"
    return _engine_catalogue()


def _registered_engine(value: str) -> str:
    known = list(engine_catalogue())
    if value not in known:
        listed = ", ".join(repr(n) for n in known[:-1]) + (f" or {known[-1]!r}" if len(known) > 1 else repr(known[0]) if known else "")
        hint = did_you_mean(value, known)
        raise ValueError(f"expected {listed}" + ("" if hint.startswith(" (") else hint))
    return value


class Monitoring(_Frozen):
    # while a run is live the launcher serves Prometheus metrics on 127.0.0.1:port (0: a free one)
    enabled: bool = True
    port: StrictInt = Field(0, ge=0, le=65535)
    # per rank and step, for samples/s on the dashboard (the job's global batch / world size)
    samples_per_step: StrictInt | None = Field(None, ge=1)
    # each rank measures its own work per step (DDP models through hooks the runtime adds)
    stragglers: bool = True
    # a rank is a straggler when its own work per step (not waiting for peers) stays above this
    # many times its peers' median for straggler_hold_s seconds: console line, metric, result.json
    straggler_factor: float = Field(1.5, gt=1.0)
    straggler_hold_s: float = Field(5.0, ge=0.0)


class JobSpec(_Frozen):
    name: str = Field(pattern=r"^[a-z0-9_-]+$", max_length=64)
    entrypoint: str | None = Field(None, pattern=ENTRYPOINT.pattern)
    # The job's start that does not depend on its rank (module:function, called with the params
    # just before the entrypoint; ctx.prepared holds what it returns): build the model on the
    # CPU, warm the data pipeline. A warm spare (checkpoint.warm_spares) runs it ahead of a loss,
    # before it has a rank.
    prepare: str | None = Field(None, pattern=ENTRYPOINT.pattern)
    script: str | None = None
    args: tuple[Annotated[str, BeforeValidator(_scalar_to_str)], ...] = ()
    params: FrozenMap = Field(default_factory=dict)
    backend: Annotated[str, AfterValidator(_registered_engine)] = "torchrun"  # an engine of launcher.backends
    resources: Resources = Resources()
    scaling: Scaling | None = None
    env: EnvMap = Field(default_factory=dict)
    timeouts: Timeouts = Timeouts()
    max_restarts: StrictInt = Field(0, ge=0, le=100)
    # Which failures spend a restart: job_error (an exception in the job's code), oom, host_lost,
    # rank_lost (killed, exited), hang, rendezvous, timeout (timeouts.run_s); "all" for every one.
    # A user's stop never restarts, nor a job error that repeats the previous attempt's traceback.
    # The default: what a restart is for (not a bug in the job, not a timeout it was given).
    restart_on: tuple[RestartClass, ...] = Field(("oom", "host_lost", "rank_lost", "hang", "rendezvous"), min_length=1, max_length=16)
    checkpoint: CheckpointSettings = CheckpointSettings()
    preemption: Preemption = Preemption()
    preflight: PreflightSettings = PreflightSettings()
    # How the torchrun backend starts an entrypoint's ranks: "forkserver" forks each one from a
    # server process that has imported torch once per node (sooner to the first step, one import
    # instead of one per rank); "spawn" starts a fresh interpreter per rank, as plain torchrun
    # does. A script job always gets a fresh interpreter (it expects to be __main__).
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    cluster: str | None = None
    ray: RaySettings = RaySettings()
    slurm: SlurmSettings = SlurmSettings()
    monitoring: Monitoring = Monitoring()
    extends: str | None = None
    # the settings blocks of registered engines that are not fields here (``NAME: {...}``)
    _engine_blocks: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    @model_serializer(mode="wrap")
    def _with_engine_blocks(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name, block in self._engine_blocks.items():
            data[name] = block.model_dump(mode=info.mode)
        return data

    def engine_settings(self, name: str) -> BaseModel | None:
        """Engine ``name``'s settings block: as the spec gave it, or its model's defaults (None:
        an engine without a settings model)."""
        if name in self._engine_blocks:
            return self._engine_blocks[name]
        own = getattr(self, name, None) if name in type(self).model_fields else None
        if isinstance(own, BaseModel):
            return own
        model = engine_catalogue().get(name)
        return None if model is None else model()

    @model_validator(mode="after")
    def _one_program(self) -> "JobSpec":
        if (self.entrypoint is None) == (self.script is None):
            raise ValueError("set exactly one of 'entrypoint' (module:function) or 'script' (a file)")
        if self.resources.elastic and self.scaling is not None and not self.scaling.auto:
            raise ValueError("resources.nodes: an elastic world ({min, max}) runs one stage at the size of the hosts it has; "
                             "set scaling.workers: auto (or drop it), or give nodes one count")
        if self.args and self.script is None:
            raise ValueError("'args' is for 'script' mode; give an entrypoint its 'params'")
        if self.prepare is not None and self.entrypoint is None:
            raise ValueError("'prepare' (module:function) goes with an 'entrypoint'; a script prepares itself")
        if self.checkpoint.warm_spares and self.prepare is None:
            raise ValueError("checkpoint.warm_spares: a spare runs the job's 'prepare' ahead; set prepare: module:function")
        return self

    @property
    def world_sizes(self) -> tuple[int, ...] | None:
        """The listed world sizes; None where the nodes decide (``workers: auto``, or no ``scaling``)."""
        if self.scaling is None or isinstance(self.scaling.workers, str):
            return None
        return self.scaling.workers

    @property
    def scales_auto(self) -> bool:
        """``scaling.workers: auto``: one stage per power of two up to every slot (no ``scaling``: one stage, every slot)."""
        return self.scaling is not None and self.scaling.auto

    def fingerprint(self) -> str:
        """A short hash of the effective spec, shown in results and Ray metadata."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


class LoadedJob(BaseModel):
    """A spec plus where it came from: relative paths resolve against ``base_dir``."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    spec: JobSpec
    path: Path
    base_dir: Path
    # the params with the workload's defaults filled in, where its module declares a Params model
    resolved_params: FrozenMap | None = None
    overrides: tuple[str, ...] = ()  # the --set KEY=VALUE it was loaded with (``launch resume`` loads it again)

    @property
    def params(self) -> Mapping[str, Any]:
        """The params the ranks will run with: resolved where they could be, else as written."""
        return self.spec.params if self.resolved_params is None else self.resolved_params

    def script_path(self) -> Path | None:
        return None if self.spec.script is None else (self.base_dir / self.spec.script).resolve()


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> LoadedJob:
    """Load, merge (``extends``, ``--set``) and validate a job spec; raise SpecError with every problem."""
    path = Path(path)
    sourced = _with_bases(load_yaml(path, what="job spec"), path, chain=(path.resolve(),))
    sourced = _apply_overrides(sourced, overrides)
    try:
        spec = _validate(sourced)
    except SpecError as exc:  # the params' problems too, in the same round, every one by file and line
        raise SpecError(sorted_problems([*exc.problems, *_entrypoint_problems(sourced, path.resolve().parent)])) from None
    loaded = LoadedJob(spec=spec, path=path, base_dir=path.resolve().parent, overrides=tuple(overrides))
    resolved = check_references(loaded, sourced)
    return loaded if resolved is None else loaded.model_copy(update={"resolved_params": MappingProxyType(resolved)})


def _with_bases(sourced: SourcedData, path: Path, chain: tuple[Path, ...]) -> SourcedData:
    """``sourced`` merged over what it ``extends`` (which may extend another file in turn)."""
    _require_mapping(sourced)
    extends = sourced.data.get("extends")
    if not isinstance(extends, str):
        return sourced  # absent, or a wrong type that validation reports
    base_file = (path.parent / extends).resolve()
    where = sourced.locate(("extends",))
    if base_file in chain:
        cycle = " -> ".join(str(p) for p in (*chain, base_file))
        raise SpecError([f"{where}: extends: files extend each other in a cycle ({cycle})"])
    if not base_file.is_file():
        raise SpecError([f"{where}: extends: no such config file {base_file}"])
    base = _with_bases(load_yaml(base_file, what="config"), base_file, (*chain, base_file))
    return deep_merge(base, sourced)


def _require_mapping(sourced: SourcedData) -> None:
    if not isinstance(sourced.data, dict):
        kind = type(sourced.data).__name__
        raise SpecError([f"{sourced.origin}: expected a YAML mapping of fields, got a {kind}"])


def _apply_overrides(sourced: SourcedData, overrides: list[str] | tuple[str, ...]) -> SourcedData:
    problems = []
    data = json.loads(json.dumps(sourced.data, default=str))  # a private deep copy
    locations = dict(sourced.locations)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()  # "params.iters = 5": spaces around the "=" as YAML allows them around its ":"
        if not sep or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_0-9][\w]*)*", key):
            problems.append(_bad_override(item, key, sep))
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            if raw.lstrip()[:1] in ("[", "{"):  # meant as a YAML list or mapping: not plain text (other text is kept as written)
                problems.append(_bad_yaml_value(key, raw.strip(), exc))
                continue
            value = raw
        inside = _not_a_mapping(data, key)
        if inside is not None:
            problems.append(f"--set {key}: {inside} is not a mapping of fields; set it whole, e.g. --set {inside}=[...]")
            continue
        set_path(data, key, value)
        keys = tuple(int(k) if k.isdigit() else k for k in key.split("."))
        # what was under the key in the file is gone: its lines must not be blamed
        locations = {path: at for path, at in locations.items() if path[: len(keys)] != keys}
        locations[keys] = Location(f"--set {key}")
        for end in range(1, len(keys)):  # parents the file has keep their lines; new ones are the flag's
            locations.setdefault(keys[:end], Location(f"--set {key}"))
    if problems:
        raise SpecError(problems)
    return SourcedData(data, locations, sourced.origin)


def _bad_override(item: str, key: str, sep: str) -> str:
    """A ``--set`` that is not FIELD=VALUE, in the spec's terms, with the right form."""
    form = "expected FIELD=VALUE: a field of the spec as a dotted path and its value as YAML, e.g. --set params.iters=50"
    if not sep:
        return f"--set {item}: no '=' in it; {form}"
    if not key:
        return f"--set {item}: no field before the '='; {form}"
    return f"--set {item}: '{key}' is not a field path (names of letters, digits and _, joined by single dots); {form}"


def _bad_yaml_value(key: str, raw: str, exc: yaml.YAMLError) -> str:
    """A ``--set`` value that starts a YAML list or mapping and does not end it."""
    pairs = (("[", "]", "list"), ("{", "}", "mapping"))
    unclosed = next((f"its {what} is not closed (no '{close}' for its '{open_}')" for open_, close, what in pairs
                     if raw.count(open_) > raw.count(close)), None)  # fmt: skip
    why = unclosed or f"{getattr(exc, 'problem', None) or 'it does not parse'}"
    example = f"--set '{key}=[1, 2]'" if raw[:1] == "[" else f"--set '{key}={{name: value}}'"
    return f"--set {key}={raw}: the value is not valid YAML: {why}; quote the whole of it for the shell, e.g. {example}"


def _not_a_mapping(data: Any, dotted: str) -> str | None:
    """The first part of ``dotted`` above its last key that holds something other than a
    mapping (``params.sizes`` for ``params.sizes.1``): setting inside it would replace it."""
    keys = dotted.split(".")
    cursor = data
    for end, key in enumerate(keys[:-1], start=1):
        cursor = cursor.get(key) if isinstance(cursor, dict) else None
        if cursor is None:
            return None  # created by the override
        if not isinstance(cursor, dict):
            return ".".join(keys[:end])
    return None


def _validate(sourced: SourcedData) -> JobSpec:
    data = sourced.data
    block_models = {name: model for name, model in engine_catalogue().items() if model is not None and name not in JobSpec.model_fields}
    raw_blocks = {name: data[name] for name in block_models if name in data} if isinstance(data, dict) else {}
    if isinstance(data, dict) and data.get("backend") in block_models:  # the engine's own block, its defaults checked too
        raw_blocks.setdefault(data["backend"], {})
    problems: list[str] = []
    blocks: dict[str, BaseModel] = {}
    for name, raw in raw_blocks.items():
        try:
            blocks[name] = block_models[name].model_validate({} if raw is None else raw)
        except ValidationError as exc:
            problems += located_problems(exc, sourced, block_models[name], (name,), pattern_hints=PATTERN_HINTS)
    try:
        spec = JobSpec.model_validate({k: v for k, v in data.items() if k not in block_models} if isinstance(data, dict) else data)
    except ValidationError as exc:
        raise SpecError([*located_problems(exc, sourced, JobSpec, pattern_hints=PATTERN_HINTS), *problems]) from None
    if problems:
        raise SpecError(problems)
    spec._engine_blocks.update(blocks)
    return spec


def _entrypoint_problems(sourced: SourcedData, base_dir: Path) -> list[str]:
    """The entrypoint's and the params' problems of a spec whose other fields failed validation:
    checked from the raw values when they are usable, so one round shows every problem."""
    data = sourced.data if isinstance(sourced.data, dict) else {}
    entrypoint, params, env = data.get("entrypoint"), data.get("params", {}), data.get("env", {})
    if not isinstance(entrypoint, str) or not ENTRYPOINT.match(entrypoint) or not isinstance(params, dict):
        return []
    pythonpath = env.get("PYTHONPATH", "") if isinstance(env, dict) and isinstance(env.get("PYTHONPATH", ""), str) else ""
    try:
        model = check_entrypoint(entrypoint, pythonpath, field_label(sourced.locate(("entrypoint",)), "entrypoint"), base_dir)
        if model is not None:
            model.model_validate(params)
    except SpecError as exc:
        return exc.problems
    except ValidationError as exc:
        assert model is not None  # only its own validation raises ValidationError here
        return located_problems(exc, sourced, model, ("params",))
    return []


_LOCATED = re.compile(r"^(?P<file>.+?):(?P<line>\d+): ")


def sorted_problems(problems: list[str]) -> list[str]:
    """By file, then line; problems without a location (``--set ...``) first, as given."""

    def key(problem: str) -> tuple[int, str, int]:
        found = _LOCATED.match(problem)
        return (1, found["file"], int(found["line"])) if found else (0, "", 0)

    return sorted(dict.fromkeys(problems), key=key)


def check_references(loaded: LoadedJob, sourced: SourcedData | None = None) -> dict[str, Any] | None:
    """The entrypoint's module and the script must exist before anything is spawned, and the
    params must fit the entrypoint's ``Params`` model when it declares one. Returns the params
    with the model's defaults filled in (None without a model)."""
    spec = loaded.spec
    at = sourced or SourcedData(None, origin=Location(str(loaded.path)))
    if spec.script is not None:
        script = loaded.script_path()
        assert script is not None
        if not script.is_file():
            raise SpecError([f"{field_label(at.locate(('script',)), 'script')}: no such file {script}"])
    if spec.prepare is not None:
        check_entrypoint(spec.prepare, spec.env.get("PYTHONPATH", ""), field_label(at.locate(("prepare",)), "prepare"), loaded.base_dir)
    if spec.entrypoint is not None:
        label = field_label(at.locate(("entrypoint",)), "entrypoint")
        model = check_entrypoint(spec.entrypoint, spec.env.get("PYTHONPATH", ""), label, loaded.base_dir)
        if model is not None:
            try:
                # by alias and round-trip: what is stored must validate again, in the ranks and in summarize
                return model.model_validate(dict(spec.params)).model_dump(mode="json", by_alias=True, round_trip=True)
            except ValidationError as exc:
                raise SpecError(located_problems(exc, at, model, ("params",))) from None
    return None
