"""The spec loader: immutable typed values, every problem with file:line and field, overrides."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from launcher.errors import SpecError
from launcher.masking import mask_env
from launcher.spec.model import load_job
from tests.conftest import REPO

GOOD = """\
name: tiny
entrypoint: launcher.workloads.matmul:run
params: {sizes: [32], iters: 2}
resources: {cpu_workers: 2}
scaling: {workers: [1, 2]}
env: {OMP_PROC_BIND: "false", NUM: 4}
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path, overrides=()) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_job(path, list(overrides))
    return info.value.problems


def test_good_spec_loads_into_frozen_values(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    spec = job.spec
    assert spec.name == "tiny" and spec.world_sizes == (1, 2)
    assert spec.env["NUM"] == "4"  # scalars become strings for the environment
    with pytest.raises(ValidationError):  # frozen
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.params["iters"] = 5  # type: ignore[index]


def test_unknown_key_gets_a_suggestion_with_line(tmp_path):
    path = write(tmp_path, GOOD.replace("resources: {cpu_workers: 2}", "resources:\n  gpus_per_nod: 2"))
    (line,) = problems(path)
    assert line == f"{path}:5: resources.gpus_per_nod: unknown key, did you mean 'gpus_per_node'?"


def test_every_problem_is_reported_together(tmp_path):
    path = write(
        tmp_path,
        """\
        name: Not Valid
        entrypoint: launcher.workloads.matmul:run
        timeouts: {run_s: -1}
        max_restarts: lots
        """,
    )
    found = problems(path)
    assert len(found) == 3
    assert any(p.startswith(f"{path}:1: name:") for p in found)
    assert any(p.startswith(f"{path}:3: timeouts.run_s:") and "greater than 0" in p for p in found)
    assert any(p.startswith(f"{path}:4: max_restarts:") and "integer" in p for p in found)


def test_union_field_is_one_line_naming_both_forms(tmp_path):
    path = write(tmp_path, GOOD.replace("{cpu_workers: 2}", "{cpu_workers: 0}"))
    (line,) = problems(path)
    assert "resources.cpu_workers" in line and "'auto'" in line and "greater than or equal to 1" in line


def test_entrypoint_and_script_are_exclusive(tmp_path):
    path = write(tmp_path, GOOD + "script: train.py\n")
    (line,) = problems(path)
    assert "exactly one of 'entrypoint'" in line


def test_missing_module_and_script_are_caught_before_spawn(tmp_path):
    path = write(tmp_path, GOOD.replace("launcher.workloads.matmul:run", "no_such_module_xyz:run"))
    assert "module 'no_such_module_xyz' not found" in problems(path)[0]
    path = write(tmp_path, "name: s\nscript: missing.py\n", "s.yaml")
    assert "no such file" in problems(path)[0]


def test_overrides_parse_yaml_values_and_name_the_flag(tmp_path):
    path = write(tmp_path, GOOD)
    job = load_job(path, ["params.iters=7", "scaling.workers=[2]", "env.NEW=x"])
    assert job.spec.params["iters"] == 7 and job.spec.world_sizes == (2,) and job.spec.env["NEW"] == "x"
    (line,) = problems(path, ["resources.cpu_workers=many"])
    assert line.startswith("--set resources.cpu_workers: expected")
    (line,) = problems(path, ["novalue"])
    assert line.startswith("--set novalue: no '=' in it; expected FIELD=VALUE")


def test_extends_merges_defaults_under_the_spec(tmp_path):
    write(tmp_path, "timeouts: {run_s: 10}\nenv: {A: base, B: base}\n", "defaults.yaml")
    path = write(tmp_path, GOOD.replace("env: {", "extends: defaults.yaml\nenv: {A: top, "))
    spec = load_job(path).spec
    assert spec.timeouts.run_s == 10 and spec.env["A"] == "top" and spec.env["B"] == "base"


def test_duplicate_keys_are_errors(tmp_path):
    path = write(tmp_path, GOOD + "name: again\n")
    (line,) = problems(path)
    assert line == f"{path}:7: name: duplicate key"


def test_yaml_is_loaded_safely(tmp_path):
    path = write(tmp_path, GOOD.replace("params: {sizes: [32], iters: 2}", "params: !!python/object/apply:os.system [echo pwned]"))
    (line,) = problems(path)
    assert "YAML syntax error" in line and ":3" in line


def test_secret_env_values_are_masked():
    masked = mask_env({"HF_TOKEN": "abc", "AWS_SECRET_ACCESS_KEY": "x", "db_password": "p", "OMP_NUM_THREADS": "4"})
    assert masked == {"HF_TOKEN": "****", "AWS_SECRET_ACCESS_KEY": "****", "db_password": "****", "OMP_NUM_THREADS": "4"}


def test_every_shipped_job_validates(repo):
    for path in sorted((repo / "jobs").glob("*.yaml")):
        assert load_job(path).spec.name == path.stem


def test_extends_chains_through_several_files(tmp_path):
    write(tmp_path, "timeouts: {run_s: 10}\nenv: {A: root, B: root, C: root}\n", "root.yaml")
    write(tmp_path, "extends: root.yaml\nenv: {B: middle, C: middle}\n", "middle.yaml")
    path = write(tmp_path, GOOD.replace("env: {", "extends: middle.yaml\nenv: {C: top, "))
    spec = load_job(path).spec
    assert spec.timeouts.run_s == 10
    assert (spec.env["A"], spec.env["B"], spec.env["C"]) == ("root", "middle", "top")


def test_extends_cycle_is_bad_input(tmp_path):
    write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    path = write(tmp_path, GOOD.replace("env: {", "extends: a.yaml\nenv: {"))
    (line,) = problems(path)
    assert "extends: files extend each other in a cycle" in line and "a.yaml -> " in line


def test_an_entrypoint_is_found_on_the_specs_own_pythonpath(tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "gl_probe_workload.py").write_text("def run(ctx):\n    return {}\n")
    text = f"name: j\nentrypoint: gl_probe_workload:run\nenv: {{PYTHONPATH: '{tmp_path / 'proj'}'}}\n"
    assert load_job(write(tmp_path, text)).spec.entrypoint == "gl_probe_workload:run"
    (line,) = problems(write(tmp_path, "name: j\nentrypoint: gl_probe_workload:run\n", "bare.yaml"))
    assert "module 'gl_probe_workload' not found on the Python path" in line


def test_a_module_without_params_is_read_never_imported(tmp_path):
    (tmp_path / "gl_heavy_workload.py").write_text("raise SystemExit('imported by the launcher')\n\ndef run(ctx):\n    return {}\n")
    text = f"name: j\nentrypoint: gl_heavy_workload:run\nenv: {{PYTHONPATH: '{tmp_path}'}}\nparams: {{anything: [1, 2]}}\n"
    assert load_job(write(tmp_path, text)).spec.params["anything"] == [1, 2]


def test_a_users_params_model_checks_params_with_file_and_line(tmp_path):
    (tmp_path / "gl_typed_workload.py").write_text(
        "from pydantic import BaseModel, ConfigDict, PositiveInt\n\n\n"
        "class Params(BaseModel):\n    model_config = ConfigDict(extra='forbid')\n    epochs: PositiveInt = 1\n    lr: float = 0.1\n\n\n"
        "def run(ctx):\n    return {}\n"
    )
    head = f"name: j\nentrypoint: gl_typed_workload:run\nenv: {{PYTHONPATH: '{tmp_path}'}}\n"
    assert load_job(write(tmp_path, head + "params: {epochs: 3, lr: 0.5}\n")).spec.params == {"epochs": 3, "lr": 0.5}
    bad = write(tmp_path, head + "params:\n  epoch: 3\n  lr: fast\n", "bad.yaml")
    assert sorted(problems(bad)) == [
        f"{bad}:5: params.epoch: unknown key, did you mean 'epochs'?",
        f"{bad}:6: params.lr: expected a valid number, unable to parse string as a number (got 'fast')",
    ]


def test_resolved_params_fill_in_the_workloads_defaults(tmp_path):
    job = load_job(write(tmp_path, "name: j\nentrypoint: launcher.workloads.sync_logging:run\nparams: {steps: 40, n: 16}\n"))
    assert dict(job.spec.params) == {"steps": 40, "n": 16}  # as written
    assert dict(job.params) == {"steps": 40, "n": 16, "repeats": 3, "warmup": 1, "dtype": "float32", "seed": 0}
    untyped = tmp_path / "gl_untyped_workload.py"
    untyped.write_text("def run(ctx):\n    return {}\n")
    text = f"name: j\nentrypoint: gl_untyped_workload:run\nenv: {{PYTHONPATH: '{tmp_path}'}}\nparams: {{a: 1}}\n"
    untyped_job = load_job(write(tmp_path, text, "untyped.yaml"))
    assert untyped_job.resolved_params is None and dict(untyped_job.params) == {"a": 1}


@pytest.mark.parametrize("job", sorted(p.stem for p in (REPO / "jobs").glob("*.yaml")))
def test_every_shipped_job_fits_its_workloads_params(job):
    from launcher.spec.entrypoint import check_entrypoint

    loaded = load_job(REPO / "jobs" / f"{job}.yaml")
    model = check_entrypoint(loaded.spec.entrypoint, "", loaded.path)
    assert model is not None and model.model_validate(dict(loaded.spec.params))


def _typed_module(directory: Path, name: str, fields: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(
        f"from pydantic import BaseModel, ConfigDict\n\n\nclass Params(BaseModel):\n    model_config = ConfigDict(extra='forbid')\n"
        f"{fields}\n\ndef run(ctx):\n    return {{}}\n"
    )


def test_same_named_modules_of_two_projects_and_edited_modules_are_each_checked_as_they_are_now(tmp_path):
    import os
    import sys

    for project, field in (("a", "alpha"), ("b", "beta")):
        _typed_module(tmp_path / project, "gl_work", f"    {field}: int = 1\n")
    def spec(project: str, params: str) -> Path:
        text = f"name: j\nentrypoint: gl_work:run\nenv: {{PYTHONPATH: '{tmp_path / project}'}}\nparams: {params}\n"
        return write(tmp_path, text, f"{project}.yaml")

    path_before = list(sys.path)
    assert dict(load_job(spec("a", "{alpha: 2}")).params) == {"alpha": 2}
    assert dict(load_job(spec("b", "{beta: 3}")).params) == {"beta": 3}  # b's Params, not a's (already loaded)
    _typed_module(tmp_path / "a", "gl_work", "    alpha: int = 1\n    gamma: int = 5\n")
    stat = (tmp_path / "a" / "gl_work.py").stat()
    os.utime(tmp_path / "a" / "gl_work.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # an edit, a second later
    assert dict(load_job(spec("a", "{gamma: 6}")).params) == {"alpha": 1, "gamma": 6}
    assert sys.path == path_before


def test_the_spec_pythonpath_leaves_sys_path_as_found_even_when_the_module_changes_it(tmp_path):
    import sys

    (tmp_path / "gl_pathy.py").write_text(
        "import sys\nfrom pydantic import BaseModel\n\nsys.path.insert(0, '/gl/vendor')\n\n\n"
        "class Params(BaseModel):\n    n: int = 1\n\n\ndef run(ctx):\n    return {}\n"
    )
    before = list(sys.path)
    try:
        load_job(write(tmp_path, f"name: j\nentrypoint: gl_pathy:run\nenv: {{PYTHONPATH: '{tmp_path}'}}\n"))
        assert str(tmp_path) not in sys.path and "/gl/vendor" in sys.path  # the module's own change stays
    finally:
        sys.path[:] = before


def test_a_params_that_is_not_pydantic_is_the_modules_own_business(tmp_path):
    (tmp_path / "gl_dc_params.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Params:\n    n: int = 1\n\n\ndef run(ctx):\n    return {}\n"
    )
    job = load_job(write(tmp_path, f"name: j\nentrypoint: gl_dc_params:run\nenv: {{PYTHONPATH: '{tmp_path}'}}\nparams: {{x: 1}}\n"))
    assert job.resolved_params is None and dict(job.params) == {"x": 1}


def test_resolved_params_validate_again_with_aliases_and_computed_fields(tmp_path):
    (tmp_path / "gl_alias_params.py").write_text(
        "from pydantic import BaseModel, ConfigDict, Field, computed_field\n\n\n"
        "class Params(BaseModel):\n    model_config = ConfigDict(extra='forbid')\n"
        "    lr: float = Field(0.1, alias='learning-rate')\n    steps: int = 10\n\n"
        "    @computed_field\n    @property\n    def total(self) -> int:\n        return self.steps * 2\n\n\n"
        "def run(ctx):\n    return {}\n"
    )
    job = load_job(write(tmp_path, f"name: j\nentrypoint: gl_alias_params:run\nenv: {{PYTHONPATH: '{tmp_path}'}}\nparams: {{learning-rate: 0.5}}\n"))
    assert dict(job.params) == {"learning-rate": 0.5, "steps": 10}
    from gl_alias_params import Params  # what the ranks and summarize do with the stored params

    assert Params.model_validate(dict(job.params)).lr == 0.5


def test_numbers_as_yaml_writes_them_and_null_for_a_workloads_default(tmp_path):
    job = load_job(REPO / "jobs" / "ddp_train.yaml", ["params.lr=1e-3", "params.epochs=null", "timeouts.run_s=1e3"])
    assert job.params["lr"] == 0.001 and job.params["epochs"] == 4 and job.spec.timeouts.run_s == 1000.0
    (line,) = problems(REPO / "jobs" / "ddp_train.yaml", ["params.lr=true"])
    assert line == "--set params.lr: expected a valid number (got True)"


def test_errors_name_the_line_that_holds_the_value_not_an_older_one(tmp_path):
    write(tmp_path, "name: j\nentrypoint: launcher.workloads.matmul:run\nparams:\n  sizes:\n    - 8\n    - 16\n", "base.yaml")
    child = write(tmp_path, "extends: base.yaml\nparams:\n  sizes: [0]\n", "child.yaml")
    assert problems(child) == [f"{child}:3: params.sizes.0: expected greater than or equal to 1 (got 0)"]
    # a --set names itself, but not for parents the file already has
    (tmp_path / "gl_needs_data.py").write_text(
        "from pydantic import BaseModel\n\n\nclass Params(BaseModel):\n    data: str\n    epochs: int = 1\n\n\ndef run(ctx):\n    return {}\n"
    )
    spec = write(tmp_path, f"name: j\nentrypoint: gl_needs_data:run\nenv: {{PYTHONPATH: '{tmp_path}'}}\nparams: {{}}\n", "needs.yaml")
    assert problems(spec, ["params.epochs=2"]) == [f"{spec}:4: params.data: required field is missing"]


def _package(root: Path, who: str, steps: int) -> None:
    (root / "gl_pkg").mkdir(parents=True, exist_ok=True)
    (root / "gl_pkg" / "__init__.py").write_text("")
    (root / "gl_pkg" / "work.py").write_text(
        f"from pydantic import BaseModel, ConfigDict\n\nWHO = '{who}'\n\n\nclass Params(BaseModel):\n"
        f"    model_config = ConfigDict(extra='forbid')\n    steps: int = {steps}\n\n\ndef run(ctx):\n    return {{}}\n"
    )


def test_a_package_another_project_already_loaded_is_never_taken_for_this_jobs(tmp_path):
    _package(tmp_path / "a", "a", 1)
    _package(tmp_path / "b", "b", 2)

    def spec(project: str) -> Path:
        text = f"name: j\nentrypoint: gl_pkg.work:run\nenv: {{PYTHONPATH: '{tmp_path / project}'}}\n"
        return write(tmp_path, text, f"{project}.yaml")

    assert dict(load_job(spec("a")).params) == {"steps": 1}
    # a's gl_pkg is loaded in this process: b's params are not checked against a's model (the
    # ranks, in processes of their own, check them against b's), nor resolved with a's defaults
    job_b = load_job(spec("b"))
    assert job_b.resolved_params is None and dict(job_b.params) == {}


def test_packages_above_the_module_that_raise_are_a_spec_error(tmp_path):
    (tmp_path / "gl_broken_pkg").mkdir()
    (tmp_path / "gl_broken_pkg" / "__init__.py").write_text("raise RuntimeError('half-installed')\n")
    spec = write(tmp_path, f"name: j\nentrypoint: gl_broken_pkg.work:run\nenv: {{PYTHONPATH: '{tmp_path}'}}\n")
    assert problems(spec) == [f"{spec}:2: entrypoint: importing the packages above 'gl_broken_pkg.work' failed: "
                              "RuntimeError: half-installed"]


def test_a_module_imported_before_is_checked_as_its_file_is_now(tmp_path):
    import importlib
    import sys

    _typed_module(tmp_path, "gl_pre_imported", "    steps: int = 3\n")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("gl_pre_imported")  # the notebook's own import, then an edit of the same size
        _typed_module(tmp_path, "gl_pre_imported", "    steps: int = 4\n")
        job = load_job(write(tmp_path, "name: j\nentrypoint: gl_pre_imported:run\n"))
    finally:
        sys.path.remove(str(tmp_path))
    assert dict(job.params) == {"steps": 4}


def test_two_threads_checking_one_slow_module_both_get_its_params(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "gl_slow_params.py").write_text(
        "import time\n\nfrom pydantic import BaseModel\n\ntime.sleep(0.5)\n\n\nclass Params(BaseModel):\n    steps: int = 5\n\n\n"
        "def run(ctx):\n    return {}\n"
    )
    spec = write(tmp_path, f"name: j\nentrypoint: gl_slow_params:run\nenv: {{PYTHONPATH: '{tmp_path}'}}\n")
    with ThreadPoolExecutor(2) as pool:
        jobs = list(pool.map(lambda _: load_job(spec), range(2)))
    assert [j.resolved_params for j in jobs] == [{"steps": 5}, {"steps": 5}]


def test_a_yaml_alias_bomb_is_refused_before_anything_expands_it(tmp_path):
    lines = ["name: bomb", "entrypoint: launcher.workloads.matmul:run", 'a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]  # 9**10 values
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError, match=r"bomb.yaml:\d+: YAML aliases expand this document to more than 100,000 values"):
        load_job(path)


def test_ordinary_aliases_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("name: anchors\nentrypoint: launcher.workloads.matmul:run\nenv: &common {A: '1'}\nparams: {sizes: &s [32]}\n"
                    "scaling: {workers: [1]}\n")
    job = load_job(path)
    assert job.spec.env["A"] == "1" and list(job.spec.params["sizes"]) == [32]


def test_spec_and_params_problems_come_in_one_round_sorted_by_line(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text("name: m\nbackend: torchrunn\nentrypoint: launcher.workloads.matmul:run\n"
                    "resources: {gpus_per_nod: 2}\nparams: {iter: 3}\n")
    with pytest.raises(SpecError) as caught:
        load_job(path)
    lines = [int(p.split(":")[1]) for p in caught.value.problems]
    assert lines == sorted(lines) == [2, 4, 5]
    assert "params.iter: unknown key, did you mean 'iters'?" in caught.value.problems[-1]


def test_a_missing_module_says_where_it_looked_and_how_to_fix_it(tmp_path):
    (tmp_path / "mytrain.py").write_text("def run(ctx):\n    return {}\n")
    path = tmp_path / "job.yaml"
    path.write_text("name: mine\nentrypoint: mytrain:run\n")
    with pytest.raises(SpecError) as caught:
        load_job(path)
    (problem,) = caught.value.problems
    assert problem.startswith(f"{path}:2: entrypoint: module 'mytrain' not found on the Python path")
    assert f"{tmp_path / 'mytrain.py'} is beside the spec" in problem and f"env: {{PYTHONPATH: {tmp_path}}}" in problem


@pytest.mark.parametrize("entrypoint, hint", [
    ("launcher.workloads.matmull:run", "did you mean 'launcher.workloads.matmul'?"),
    ("launcher.workloads.matmul:runn", "has no function 'runn', did you mean 'run'?"),
])
def test_misspelt_modules_and_functions_get_a_suggestion(tmp_path, entrypoint, hint):
    path = tmp_path / "job.yaml"
    path.write_text(f"name: m\nentrypoint: {entrypoint}\n")
    with pytest.raises(SpecError, match=re.escape(hint)):
        load_job(path)


def test_hang_settings_are_checked_and_reach_the_plan(tmp_path):
    path = write(tmp_path, "name: h\nentrypoint: launcher.workloads.matmul:run\ntimeouts: {hang_s: 0, on_hang: wait}\n")
    found = problems(path)
    assert any(p.startswith(f"{path}:3: timeouts.hang_s:") and "greater than 0" in p for p in found), found
    assert any(p.startswith(f"{path}:3: timeouts.on_hang:") and "'stop' or 'restart'" in p for p in found), found
    from launcher.spec.model import load_job

    off = load_job(write(tmp_path, "name: h\nentrypoint: launcher.workloads.matmul:run\ntimeouts: {hang_s: null, on_hang: restart}\n"))
    assert (off.spec.timeouts.hang_s, off.spec.timeouts.on_hang) == (None, "restart")
    assert load_job(write(tmp_path, "name: h\nentrypoint: launcher.workloads.matmul:run\n")).spec.timeouts.hang_s == 300


def test_restart_checkpoint_and_preemption_settings_are_checked_and_reach_the_plan(tmp_path):
    body = "name: r\nentrypoint: launcher.workloads.matmul:run\nrestart_on: [rank_lost, bugs]\ncheckpoint: {keep: 0}\npreemption: {grace_s: -1}\n"
    path = write(tmp_path, body)
    found = problems(path)
    assert any(p.startswith(f"{path}:3: restart_on.1:") and "'job_error'" in p and "'all'" in p for p in found), found
    assert any(p.startswith(f"{path}:4: checkpoint.keep:") for p in found), found
    assert any(p.startswith(f"{path}:5: preemption.grace_s:") for p in found), found

    from launcher.control.planning import plan_stage
    from launcher.policies import FailureClass
    from launcher.hardware.devices import NodeInventory
    from launcher.stage.plan import NodeTarget

    node = NodeTarget("h", "127.0.0.1", NodeInventory("h", 2), "python3")
    job = load_job(write(tmp_path, "name: r\nentrypoint: launcher.workloads.matmul:run\nmax_restarts: 2\nrestart_on: [all]\n"
                                   "checkpoint: {dir: ckpt, keep: 3}\npreemption: {grace_s: 20}\n"))  # fmt: skip
    plan = plan_stage(job, [node], 2, "cpu", run_dir=tmp_path / "run", master_port=1, backend=None, attempt=1)
    assert plan.restart.max_restarts == 2 and plan.restart.stop_grace_s == 20
    assert plan.restart.restart_on == frozenset(FailureClass.restartable())  # "all": every class but a user's stop
    assert plan.worker.checkpoint_dir == str(tmp_path / "ckpt" / "world2")  # relative to the spec, one folder per stage
    assert (plan.worker.checkpoint_keep, plan.worker.attempt, plan.worker.stop_grace_s) == (3, 1, 20.0)
    default = plan_stage(load_job(write(tmp_path, "name: r\nentrypoint: launcher.workloads.matmul:run\n")), [node], 2, "cpu",
                         run_dir=tmp_path / "run", master_port=1, backend=None)  # fmt: skip
    assert default.worker.checkpoint_dir == str(tmp_path / "run" / "world2" / "checkpoints")
    assert {c.value for c in default.restart.restart_on} == {"oom", "host_lost", "rank_lost", "hang", "rendezvous"}


def test_restart_on_names_every_restartable_class():
    import typing

    from launcher.policies import FailureClass
    from launcher.spec.model import RestartClass

    assert set(typing.get_args(RestartClass)) == {"all", *(c.value for c in FailureClass.restartable())}
