"""The control side names no engine (issue 34): it reaches engines and submitters only through the
registry (``launcher.backends``: ``choose``, ``submitter_class``, ``preflight_hosts``, ...) and the
two seams (``launcher.stage.engine``), so that a new engine is one folder and one registry line.

Read from the code, not by grep: no import of an engine's module (``launcher.backends.<anything>``),
no string in the code that is an engine's name (``name == "slurm"``), no ``BackendName.<ENGINE>``
and no engine's settings block read by its field (``spec.ray``). Words in messages and docstrings
("a Slurm run") are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from launcher import backends
from launcher.records import SubmittedRun
from launcher.stage.engine import Submitter

REPO = Path(__file__).resolve().parents[2]
CONTROL = REPO / "launcher" / "control"
ENGINES = ("ray", "slurm", "ssh", "torchrun")


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def engine_names_in(source: str) -> list[str]:
    """Every place ``source`` names an engine in code, as ``what`` strings."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("launcher.backends.")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("launcher.backends."):
                found.append(f"from {node.module} import ...")
            elif node.module == "launcher.backends":
                found += [f"from launcher.backends import {a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs and node.value.strip().lower() in ENGINES:
            found.append(f"string {node.value!r}")
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "BackendName":
                found.append(f"BackendName.{node.attr}")
            elif node.attr in ("ray", "slurm"):  # a built-in engine's settings block (``ssh``: a NodeTarget's host access)
                found.append(f".{node.attr}")
    return found


def test_the_check_sees_what_it_must() -> None:
    code = (
        "from launcher.backends.ssh import preflight_hosts\nimport launcher.backends.slurm.script\n"
        "from launcher.backends import ssh\nx = job.spec.ray.address\nif name == 'slurm': pass\n"
        "y = BackendName.RAY\nz = f'use --backend {name}'\nmsg = 'only Slurm submits'\nw = node.ssh\n"
        "def f():\n    'a docstring may say Ray'\n    return backends.choose(job, backend=None, address=None)\n"
    )
    assert sorted(engine_names_in(code)) == sorted([
        "from launcher.backends.ssh import ...", "import launcher.backends.slurm.script", "from launcher.backends import ssh",
        ".ray", "string 'slurm'", "BackendName.RAY",
    ])  # fmt: skip


@pytest.mark.parametrize("path", sorted(CONTROL.glob("*.py")), ids=lambda p: p.name)
def test_the_control_side_names_no_engine(path: Path) -> None:
    assert engine_names_in(path.read_text()) == []


def test_the_engines_are_the_registrys_to_name() -> None:
    assert backends.names()[:3] == ["torchrun", "ray", "slurm"] and backends.submitter_names()[:2] == ["ray", "slurm"]
    for name in backends.submitter_names():
        cls = backends.submitter_class(name)
        assert cls.name == name and cls.usage, name  # its inside half, with the arguments it takes


def test_each_plan_carries_its_engines_own_settings_block_unread(tmp_path: Path) -> None:
    """The planner names no engine: a stage's plan carries the spec's block of the engine it is
    for, as it is (the Ray engine reads its ``placement`` there)."""
    from launcher.control.planning import make_plans, size_run
    from launcher.hardware.devices import discover
    from launcher.spec.model import load_job
    from launcher.stage.plan import NodeTarget

    spec = tmp_path / "j.yaml"
    spec.write_text("name: j\nentrypoint: launcher.workloads.matmul:run\nray: {placement: spread}\n")
    job = load_job(spec)
    nodes = [NodeTarget(name="n", address="127.0.0.1", inventory=discover(query=lambda: None, env={}), python="python3")]
    sizing = size_run(job, nodes)
    (ray_plan,) = make_plans(job, nodes, sizing, run_dir=tmp_path / "run", master_port=0, backend="ray")
    (torchrun_plan,) = make_plans(job, nodes, sizing, run_dir=tmp_path / "run", master_port=0, backend="torchrun")
    assert ray_plan.engine_settings is job.spec.ray and ray_plan.engine_settings.placement == "spread"
    assert torchrun_plan.engine_settings is None  # an engine without a settings block


def test_a_detached_run_is_reached_through_the_registry() -> None:
    """``--cluster FILE --detach``: the control side asks the registry for the engine's detacher."""
    remote = backends.detacher("torchrun")
    assert remote is not None and remote.engine == "torchrun" and backends.detacher_names() == ["torchrun"]
    assert backends.detacher() is not None and backends.detacher("ray") is None  # Ray's run loop is never detached over SSH


def _run(tmp_path: Path, **kw: object) -> SubmittedRun:
    return SubmittedRun("mine", "job", "r1", tmp_path, **kw)  # type: ignore[arg-type]


def test_the_results_layer_makes_a_submitted_runs_result_from_its_record(tmp_path: Path) -> None:
    """A submitter hands back the run's record; the results layer reads what the launcher inside
    wrote, completes it with the scheduler's words, or makes one where it wrote none."""
    from launcher.records import Failure, FailureReason
    from launcher.results.handed_back import result_of
    from launcher.results.store import load_result, write_result

    pending = result_of(_run(tmp_path, job_id="7", scheduler_address="http://h:1", pending_hint="launch attach 7"))
    assert pending is not None and pending.data == {"job": "job", "run_id": "r1", "backend": "mine", "status": "pending", "job_id": "7",
                                                    "run_dir": str(tmp_path), "address": "http://h:1", "hint": "launch attach 7"}  # fmt: skip
    assert load_result(tmp_path) is None  # a pending run has no result.json yet
    assert result_of(_run(tmp_path)) is None  # none came back and the scheduler cannot say why: the submitter explains
    lost = Failure(FailureReason.FAILED, "lost node n1")
    made = result_of(_run(tmp_path, ended_without=lost, scheduler={"job_id": "7", "state": "NODE_FAIL"}))
    assert made is not None and made.status == "failed" and made.data["failure"]["summary"] == "lost node n1"
    assert made.data["mine"] == {"job_id": "7", "state": "NODE_FAIL"} and load_result(tmp_path) == made.data
    inside = {"job": "job", "run_id": "r1", "status": "interrupted", "finished_at": 100.0, "stages": [], "ranks": [],
              "failure": {"reason": "interrupted", "summary": "SIGTERM"}, "run_dir": "/cluster/job/r1"}  # fmt: skip
    write_result(tmp_path, inside)
    stopped = Failure(FailureReason.INTERRUPTED, "interrupted (SIGINT; job 7 cancelled)")
    kept = result_of(_run(tmp_path, ended_without=lost, interrupted=stopped, brought_back=True, stale_before=50.0))
    assert kept is not None and kept.data["failure"] == {"reason": "interrupted", "summary": "interrupted (SIGINT; job 7 cancelled)"}
    assert kept.data["run_dir"] == str(tmp_path)  # brought back: where it is now
    write_result(tmp_path, inside)
    stale = result_of(_run(tmp_path, ended_without=lost, stale_before=200.0))  # an earlier allocation's result
    assert stale is not None and stale.status == "failed" and stale.data["failure"]["summary"] == "lost node n1"


def test_a_submitter_says_why_no_result_came_back(tmp_path: Path) -> None:
    from launcher.errors import LauncherError
    from launcher.stage.watch import RunEvents

    class Mine(Submitter):
        name = "mine"

        @classmethod
        def claims(cls, job_id: str, address: str | None) -> bool:
            return False

        def dry_run(self, submission):  # type: ignore[no-untyped-def]
            return [], []

        def submit_run(self, submission, *, events, stop, detach):  # type: ignore[no-untyped-def]
            return SubmittedRun("mine", "job", "r1", None, job_id="7", state="FAILED")

        def status(self, job_id):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def logs(self, job_id, *, follow, echo):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def stop(self, job_id):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    with pytest.raises(LauncherError, match="mine job 7 ended FAILED without its result") as caught:
        Mine().submit(None, events=RunEvents(), stop=None, detach=False)  # type: ignore[arg-type]
    assert caught.value.exit_code == 1
