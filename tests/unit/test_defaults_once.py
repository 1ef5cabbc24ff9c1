"""Every default is stated once: the spec's model (``launcher/spec/model.py``) states each setting's
default, and what carries a setting on (the rank contract, the records, the policies, the stage
plan, the rank's context, the metrics' samples) takes its value from a loaded spec. Read from the
source with ``ast``: a field (of a dataclass or a pydantic model) whose default is stated in two
of these modules fails, naming the field and both places."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]

SPEC = "launcher/spec/model.py"  # the source of every setting's default
CARRIERS = (
    "launcher/records.py",
    "launcher/protocol.py",
    "launcher/policies.py",
    "launcher/stage/plan.py",
    "launcher/runtime/context.py",
    "launcher/monitoring/endpoint.py",
    "launcher/monitoring/live.py",
)

# A carrier's field that holds a spec setting under a name of its own -> the spec's name for it.
CARRIED_AS = {
    "WorkerConfig.rendezvous_timeout_s": "rendezvous_s",  # timeouts.rendezvous_s
    "WorkerConfig.collective_timeout_s": "collective_s",  # timeouts.collective_s
    "WorkerConfig.time_ddp": "stragglers",  # monitoring.stragglers
    "WorkerConfig.checkpoint_keep": "keep",  # checkpoint.keep
    "WorkerConfig.checkpoint_async_save": "async_save",  # checkpoint.async_save
    "WorkerConfig.stop_grace_s": "grace_s",  # preemption.grace_s
    "RestartPolicy.stop_grace_s": "grace_s",
    "StragglerPolicy.factor": "straggler_factor",  # monitoring.straggler_factor
    "StragglerPolicy.hold_s": "straggler_hold_s",  # monitoring.straggler_hold_s
    "StagePlan.run_timeout_s": "run_s",  # timeouts.run_s
    "StagePlan.spec_env": "env",
}

# Fields that share a name with a field of another of these modules and hold something else:
# not a setting restated, so their defaults are their own. Each one says what it is.
HOMONYMS = {
    "launcher/records.py:StageOutcome.script": "whether the stage ran a script (the spec's script is its path)",
    "launcher/records.py:StageOutcome.stragglers": "the ranks flagged in the stage (the spec's says whether to look)",
    "launcher/records.py:PreflightRecord.network": "the network check's measurements (the spec's says whether to measure)",
    "launcher/records.py:AttemptRecord.steps": "an attempt's furthest step count",
    "launcher/records.py:AttemptRecord.resumed_step": "the checkpoint step an attempt started from, none: fresh",
    "launcher/records.py:LinkMeasure.error": "why a link has no figure",
    "launcher/protocol.py:RankReport.checkpoint": "what ctx.checkpoint did in a rank (the spec's are its settings)",
    "launcher/protocol.py:RankReport.error": "what a rank raised",
    "launcher/protocol.py:RankProgress.steps": "a rank's beacon: its step count",
    "launcher/protocol.py:RankProgress.resumed_step": "a rank's beacon: the step it resumed from",
    "launcher/protocol.py:RankProgress.work_s": "a rank's beacon: its own work per step",
    "launcher/protocol.py:CheckpointActivity.resumed_step": "a rank's report: the step it resumed from",
    "launcher/stage/plan.py:RankSlot.env": "what one rank alone gets (the spec's env is the job's)",
    "launcher/stage/plan.py:RankPlacement.port": "a rank's port in Ray's placement (the spec's is the metrics port)",
    "launcher/monitoring/endpoint.py:RankSample.work_s": "a sample of a rank's beacon's work per step",
    # a parameter: the endpoint's own API (tests start bare endpoints); the run passes monitoring.port
    "launcher/monitoring/endpoint.py:start(port)": "what a bare endpoint binds: 0, a free port",
}


class Default(NamedTuple):
    module: str
    owner: str  # "Class.field", or "function(param)"
    line: int
    text: str  # the default as written

    def place(self) -> str:
        return f"{self.module}:{self.line} ({self.owner} = {self.text})"


def _field_default(value: ast.expr) -> str | None:
    """The default a field's right-hand side states; None for ``Field(...)``/``field(...)`` without one."""
    if isinstance(value, ast.Call):
        called = value.func.id if isinstance(value.func, ast.Name) else value.func.attr if isinstance(value.func, ast.Attribute) else ""
        if called in ("Field", "field"):
            if value.args and not (isinstance(value.args[0], ast.Constant) and value.args[0].value is Ellipsis):
                return ast.unparse(value.args[0])
            for keyword in value.keywords:
                if keyword.arg == "default":
                    return ast.unparse(keyword.value)
                if keyword.arg == "default_factory":
                    return f"{ast.unparse(keyword.value)}()"
            return None
    return ast.unparse(value)


def field_defaults(module: str, source: str) -> list[Default]:
    """Every annotated class attribute with a default (``ClassVar`` aside): the fields of the
    module's dataclasses, pydantic models and named tuples, nested classes included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                if "ClassVar" in ast.unparse(item.annotation):
                    continue
                text = _field_default(item.value)
                if text is not None:
                    found.append(Default(module, f"{node.name}.{item.target.id}", item.lineno, text))
    return found


def parameter_defaults(module: str, source: str, names: set[str]) -> list[Default]:
    """Function parameters named for a spec setting that state a default of their own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        positional = [*node.args.posonlyargs, *node.args.args]
        pairs = [*zip(positional[len(positional) - len(node.args.defaults) :], node.args.defaults)]
        pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
        found += [Default(module, f"{node.name}({arg.arg})", arg.lineno, ast.unparse(d)) for arg, d in pairs if arg.arg in names]
    return found


def stated_twice(sources: dict[str, str]) -> list[str]:
    """One line per setting whose default more than one module states: the field and every place.
    ``sources``: module path -> its text; the spec's model among them."""
    spec_fields = field_defaults(SPEC, sources[SPEC])
    settings = spec_settings(sources[SPEC])
    by_name: dict[str, list[Default]] = defaultdict(list)
    for d in spec_fields:
        by_name[d.owner.split(".", 1)[1]].append(d)
    for module, source in sources.items():
        if module == SPEC:
            continue
        for d in field_defaults(module, source):
            if f"{module}:{d.owner}" not in HOMONYMS:
                by_name[CARRIED_AS.get(d.owner, d.owner.split(".", 1)[1])].append(d)
        for d in parameter_defaults(module, source, settings):
            if f"{module}:{d.owner}" not in HOMONYMS:
                by_name[d.owner.split("(", 1)[1].rstrip(")")].append(d)
    problems = []
    for name, places in sorted(by_name.items()):
        if len({d.module for d in places}) > 1:
            problems.append(f"{name}: its default is stated in {' and in '.join(d.place() for d in places)}")
    return problems


def module_constants(module: str, source: str, settings: set[str]) -> list[str]:
    """Module-level ``DEFAULT_<SETTING>`` names (``DEFAULT_RESTART_ON``): a setting's default kept beside the spec's."""
    tree = ast.parse(source)
    targets = [t for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign)) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    return [f"{module}:{t.lineno} {t.id}" for t in targets if isinstance(t, ast.Name) and t.id.lower().removeprefix("default_") in settings]


def spec_settings(spec_source: str) -> set[str]:
    """The names of the spec model's fields that have a default."""
    return {d.owner.split(".", 1)[1] for d in field_defaults(SPEC, spec_source)}


def _sources() -> dict[str, str]:
    return {module: (REPO / module).read_text() for module in (SPEC, *CARRIERS)}


def test_every_default_is_stated_once():
    problems = stated_twice(_sources())
    assert not problems, "a default stated in two places (the spec's model states it; a carrier takes the value):\n" + "\n".join(problems)


def test_no_carrier_keeps_a_default_constant_of_its_own():
    sources = _sources()
    settings = spec_settings(sources[SPEC])
    found = [c for module, source in sources.items() if module != SPEC for c in module_constants(module, source, settings)]
    assert not found, f"defaults belong in {SPEC}: {found}"


def test_the_lists_name_fields_that_exist():
    """A renamed or removed field leaves no stale entry behind (which would hide a duplicate)."""
    sources = _sources()
    declared = set()
    for module in CARRIERS:
        for node in ast.walk(ast.parse(sources[module])):
            if isinstance(node, ast.ClassDef):
                declared |= {f"{node.name}.{i.target.id}" for i in node.body if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
    assert not set(CARRIED_AS) - declared, f"CARRIED_AS names no field: {sorted(set(CARRIED_AS) - declared)}"
    settings = spec_settings(sources[SPEC])
    with_default = {f"{m}:{d.owner}" for m in CARRIERS for d in [*field_defaults(m, sources[m]), *parameter_defaults(m, sources[m], settings)]}
    assert not set(HOMONYMS) - with_default, f"HOMONYMS names no field with a default: {sorted(set(HOMONYMS) - with_default)}"


def test_a_default_stated_twice_is_named_with_both_places():
    """The check itself: the issue's cases (hang_s twice, grace_s under another name, gpu_health disagreeing)."""
    spec = (
        "class Timeouts(_Frozen):\n    hang_s: Real | None = Field(300, gt=0)\n"
        "class Preemption(_Frozen):\n    grace_s: Real = Field(60, gt=0)\n"
        "class PreflightSettings(_Frozen):\n    gpu_health: bool = True\n"
        "class JobSpec(_Frozen):\n    name: str = Field(pattern='x')\n"
    )
    sources = {SPEC: spec, "launcher/policies.py": "@dataclass\nclass HangPolicy:\n    hang_s: float | None = 300.0\n",
               "launcher/protocol.py": "@dataclass\nclass WorkerConfig:\n    stop_grace_s: float = 60.0\n    gpu_health: bool = False\n"
                                       "def rank_device(device_type: str, gpu_health: bool = False) -> str: ...\n"}  # fmt: skip
    problems = stated_twice(sources)
    assert len(problems) == 3, problems
    gpu, grace, hang = problems
    assert hang.startswith("hang_s: ") and f"{SPEC}:2 (Timeouts.hang_s = 300)" in hang and "launcher/policies.py:3 (HangPolicy.hang_s = 300.0)" in hang
    assert grace.startswith("grace_s: ") and "launcher/protocol.py:3 (WorkerConfig.stop_grace_s = 60.0)" in grace
    assert "(WorkerConfig.gpu_health = False)" in gpu and "(rank_device(gpu_health) = False)" in gpu and "(PreflightSettings.gpu_health = True)" in gpu
    # required fields state nothing: the same classes without defaults pass
    sources["launcher/policies.py"] = "@dataclass\nclass HangPolicy:\n    hang_s: float | None\n"
    sources["launcher/protocol.py"] = "@dataclass\nclass WorkerConfig:\n    stop_grace_s: float\n    gpu_health: bool = field(repr=False)\n"
    assert stated_twice(sources) == []
    constants = "DEFAULT_RESTART_ON: tuple = ('oom',)\nDEFAULT_SD_DIR = '/tmp'\n"
    assert module_constants("launcher/records.py", constants, {"restart_on"}) == ["launcher/records.py:1 DEFAULT_RESTART_ON"]
