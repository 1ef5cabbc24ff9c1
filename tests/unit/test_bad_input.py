"""Issue 6, bad input: a corpus of malformed specs and flag combinations. Each one exits 2 with
one clear line per problem naming the file (and line and field where there is one) or the flag,
no traceback, no run directory, nothing spawned. Runs the CLI in-process (``main(argv)``),
plus a few as real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from launcher.ui.cli import main
from tests.conftest import REPO

BASE = "name: bad\nentrypoint: launcher.workloads.matmul:run\n"  # lines 1-2


@dataclass(frozen=True)
class Case:
    id: str
    text: str | bytes | None  # the spec file's content; None: see `kind`
    expect: tuple[str, ...]  # substrings of the error line(s)
    line: int | None = None  # the line the (first) error must name as FILE:LINE
    argv: tuple[str, ...] = ()  # extra flags
    kind: str = "file"  # file | dir | missing | nofile (flags only, no spec given)
    lines: int = 1  # how many error lines (one per problem)
    files: dict[str, str] = field(default_factory=dict)  # extra files beside the spec


CASES = [
    # --- the file itself -------------------------------------------------------------------------
    Case("yaml-syntax-unclosed-list", BASE + "params: {sizes: [1, 2}\n", ("YAML syntax error",), line=3),
    Case("yaml-syntax-bad-indent", BASE + "resources:\n  nodes: 1\n cpu_workers: 2\n", ("YAML syntax error",), line=5),
    Case("yaml-tab-indent", BASE + "resources:\n\tnodes: 1\n", ("YAML syntax error",), line=4),
    Case("yaml-two-documents", BASE + "---\nname: other\n", ("found another document",), line=3),
    Case("empty-file", "", ("empty file, expected a YAML mapping",)),
    Case("only-comments", "# nothing here\n\n", ("empty file",)),
    Case("top-level-list", "- name: bad\n", ("expected a YAML mapping of fields, got a list",)),
    Case("top-level-scalar", "just words\n", ("expected a YAML mapping of fields, got a str",)),
    Case("directory-not-file", None, ("is a directory, expected a YAML job spec",), kind="dir"),
    Case("missing-file", None, ("no such job spec",), kind="missing"),
    Case("non-utf8", b"name: caf\xe9\nentrypoint: launcher.workloads.matmul:run\n", ("not UTF-8 text (byte 9)",)),
    Case("utf16-bom", "name: bad\n".encode("utf-16"), ("not UTF-8 text",)),
    Case("duplicate-key", BASE + "name: again\n", ("name: duplicate key",), line=3),
    Case("unsafe-python-tag", BASE + "params: !!python/object/apply:os.system ['touch /tmp/gpulaunch-pwned']\n",
         ("YAML",), line=3),
    # --- unknown keys and wrong types ---------------------------------------------------------------
    Case("unknown-top-key", BASE + "max_restart: 1\n", ("max_restart: unknown key, did you mean 'max_restarts'?",), line=3),
    Case("unknown-nested-key", BASE + "resources: {gpus_per_nod: 2}\n", ("resources.gpus_per_nod: unknown key",), line=3),
    Case("unknown-key-no-match", BASE + "zzz: 1\n", ("zzz: unknown key (expected one of:",), line=3),
    Case("missing-name", "entrypoint: launcher.workloads.matmul:run\n", ("name: required field is missing",), line=1),
    Case("name-not-text", "name: 123\nentrypoint: launcher.workloads.matmul:run\n", ("name: expected a valid string",), line=1),
    Case("name-bad-chars", "name: My Job\nentrypoint: launcher.workloads.matmul:run\n", ("name: expected text matching",), line=1),
    Case("name-too-long", f"name: {'a' * 65}\nentrypoint: launcher.workloads.matmul:run\n", ("name:", "at most 64"), line=1),
    Case("entrypoint-and-script", BASE + "script: train.py\n", ("exactly one of 'entrypoint'",)),
    Case("neither-entrypoint-nor-script", "name: bad\n", ("exactly one of 'entrypoint'",)),
    Case("entrypoint-no-function", "name: bad\nentrypoint: launcher.workloads.matmul\n", ("entrypoint: expected module:function",), line=2),
    Case("entrypoint-function-missing", "name: bad\nentrypoint: launcher.workloads.matmul:nope\n", ("entrypoint: module 'launcher.workloads.matmul'", "has no function 'nope'")),
    Case("entrypoint-shell-injection", "name: bad\nentrypoint: 'os:system; rm -rf /'\n", ("entrypoint: expected module:function",), line=2),
    Case("args-without-script", BASE + "args: [--lr, 1]\n", ("'args' is for 'script' mode",)),
    Case("prepare-function-missing", BASE + "prepare: launcher.workloads.matmul:prepar\n", ("prepare: module 'launcher.workloads.matmul'", "has no function 'prepar'"), line=3),
    Case("prepare-with-a-script", "name: bad\nscript: train.py\nprepare: launcher.workloads.matmul:run\n", ("'prepare' (module:function) goes with an 'entrypoint'",)),
    Case("warm-spares-without-prepare", BASE + "checkpoint: {warm_spares: 1}\n", ("checkpoint.warm_spares: a spare runs the job's 'prepare' ahead",)),
    Case("warm-spares-negative", BASE + "checkpoint: {warm_spares: -1}\n", ("checkpoint.warm_spares:", "greater than or equal to 0"), line=3),
    Case("params-a-list", BASE + "params: [1, 2]\n", ("params: expected a valid dictionary",), line=3),
    Case("backend-unknown", BASE + "backend: pbs\n", ("backend: expected 'torchrun', 'ray' or 'slurm'", "pbs"), line=3),
    Case("env-a-list", BASE + "env: [A, B]\n", ("env: expected a valid dictionary",), line=3),
    Case("env-value-mapping", BASE + "env: {A: {b: 1}}\n", ("env.A: expected a valid string",), line=3),
    Case("env-value-null", BASE + "env: {A: null}\n", ("env.A: expected a valid string",), line=3),
    Case("env-name-with-equals", BASE + "env: {'A=B': 1}\n", ("env.A=B: expected an environment variable name",), line=3),
    Case("env-name-leading-digit", BASE + "env:\n  OK: 1\n  1X: 2\n", ("env.1X: expected an environment variable name",), line=5),
    Case("env-value-nul", BASE + 'env: {A: "x\\0y"}\n', ("env.A: expected text without NUL characters",), line=3),
    Case("device-unknown", BASE + "resources: {device: tpu}\n", ("resources.device: expected 'auto', 'cuda' or 'cpu'",), line=3),
    Case("cpu-workers-text", BASE + "resources: {cpu_workers: two}\n", ("resources.cpu_workers:", "'auto'", "two"), line=3),
    Case("ray-expose-not-bool", BASE + "ray: {expose_dashboard: maybe}\n", ("ray.expose_dashboard: expected a valid boolean",), line=3),
    Case("scaling-text", BASE + "scaling: {workers: two}\n", ("scaling.workers:",), line=3),
    Case("timeouts-text", BASE + "timeouts: {run_s: soon}\n", ("timeouts.run_s: expected a valid number",), line=3),
    Case("restarts-float", BASE + "max_restarts: 1.5\n", ("max_restarts: expected a valid integer",), line=3),
    # --- negative, zero and huge numbers -------------------------------------------------------------
    Case("nodes-zero", BASE + "resources: {nodes: 0}\n", ("resources.nodes: expected greater than or equal to 1",), line=3),
    Case("nodes-negative", BASE + "resources: {nodes: -1}\n", ("resources.nodes: expected greater than or equal to 1",), line=3),
    Case("nodes-huge", BASE + "resources: {nodes: 1000000000000}\n", ("resources.nodes: expected less than or equal to 4096",), line=3),
    Case("cpu-workers-zero", BASE + "resources: {cpu_workers: 0}\n", ("resources.cpu_workers:", "greater than or equal to 1"), line=3),
    Case("cpu-workers-huge", BASE + "resources: {cpu_workers: 100000}\n", ("resources.cpu_workers:", "less than or equal to 1024"), line=3),
    Case("gpus-negative", BASE + "resources: {gpus_per_node: -1}\n", ("resources.gpus_per_node:",), line=3),
    Case("scaling-empty", BASE + "scaling: {workers: []}\n", ("scaling.workers:", "expected 'auto' or a list of world sizes", "empty list"), line=3),
    Case("scaling-zero", BASE + "scaling: {workers: [0]}\n", ("scaling.workers: expected 'auto' or a list of world sizes", "from 1 to 65536 (got 0)"), line=3),
    Case("scaling-duplicate", BASE + "scaling: {workers: [1, 1]}\n", ("each world size may appear once",), line=3),
    Case("run-s-negative", BASE + "timeouts: {run_s: -5}\n", ("timeouts.run_s: expected greater than 0",), line=3),
    Case("run-s-huge", BASE + "timeouts: {run_s: 1.0e+12}\n", ("timeouts.run_s: expected less than or equal to",), line=3),
    Case("rendezvous-zero", BASE + "timeouts: {rendezvous_s: 0}\n", ("timeouts.rendezvous_s: expected greater than 0",), line=3),
    Case("restarts-negative", BASE + "max_restarts: -1\n", ("max_restarts: expected greater than or equal to 0",), line=3),
    Case("restarts-huge", BASE + "max_restarts: 1000\n", ("max_restarts: expected less than or equal to 100",), line=3),
    # --- several problems: one line each ------------------------------------------------------------
    Case("three-problems", BASE + "resources: {nodes: 0, cpu_workers: -2}\nmax_restarts: -1\n",
         ("resources.nodes", "resources.cpu_workers", "max_restarts"), line=3, lines=3),
    # --- references that do not exist -------------------------------------------------------------
    Case("module-missing", "name: bad\nentrypoint: no_such_module_xyz:run\n", ("entrypoint: module 'no_such_module_xyz' not found",)),
    Case("script-missing", "name: bad\nscript: nowhere.py\n", ("script: no such file",)),
    Case("script-is-directory", "name: bad\nscript: adir\n", ("script: no such file",), files={"adir/": ""}),
    Case("extends-missing", BASE + "extends: nope.yaml\n", ("extends: no such config file", "nope.yaml"), line=3),
    Case("extends-broken", BASE + "extends: base.yaml\n", ("base.yaml:2: YAML syntax error",), files={"base.yaml": "a: [\n"}),
    # --- a workload's params, checked against its Params model before anything starts ----------------
    Case("params-misspelt", BASE + "params: {iter: 3}\n", ("params.iter: unknown key, did you mean 'iters'?",), line=3),
    Case("params-zero-iters", BASE + "params: {iters: 0}\n", ("params.iters: expected greater than or equal to 1 (got 0)",), line=3),
    Case("params-dtype", BASE + "params: {dtype: float128}\n", ("params.dtype: expected 'float16', 'bfloat16', 'float32' or 'float64' (got 'float128')",), line=3),
    Case("params-size-text", BASE + "params:\n  sizes: [64, big]\n", ("params.sizes.1: expected a valid integer (got 'big')",), line=4),
    Case("params-size-twice", BASE + "params: {sizes: [64, 64]}\n", ("params.sizes: expected each size once",), line=3),
    Case("params-boolean-count", BASE + "params: {warmup: true}\n", ("params.warmup: expected a valid integer (got True)",), line=3),
    Case("set-params-misspelt", BASE, ("--set params.warmpu: unknown key, did you mean 'warmup'?",), argv=("--set", "params.warmpu=1")),
    Case("params-iters-range", "name: bad\nentrypoint: launcher.workloads.cpu_vs_gpu:run\nparams: {min_iters: 10, max_iters: 2}\n",
         ("params.max_iters: expected at least min_iters (10) (got 2)",), line=3),
    Case("params-one-class", "name: bad\nentrypoint: launcher.workloads.train:run\nparams:\n  epochs: 2\n  classes: 1\n",
         ("params.classes: expected greater than or equal to 2 (got 1)",), line=5),
    Case("params-module-raises", "name: bad\nentrypoint: gl_raising_params:run\nenv: {PYTHONPATH: .}\n",
         ("entrypoint: importing 'gl_raising_params' to check its params failed: RuntimeError: no GPU driver",),
         files={"gl_raising_params.py": "from pydantic import BaseModel\n\nraise RuntimeError('no GPU driver')\n\n\n"
                "class Params(BaseModel):\n    pass\n\n\ndef run(ctx):\n    return {}\n"}),
    Case("params-module-exits", "name: bad\nentrypoint: gl_exiting_params:run\nenv: {PYTHONPATH: .}\n",
         ("bad.yaml:2: entrypoint: importing 'gl_exiting_params' to check its params failed: SystemExit: 3",), line=2,
         files={"gl_exiting_params.py": "import sys\n\nfrom pydantic import BaseModel\n\nsys.exit(3)\n\n\n"
                "class Params(BaseModel):\n    pass\n\n\ndef run(ctx):\n    return {}\n"}),
    Case("params-null-where-required", "name: bad\nentrypoint: gl_required_params:run\nenv: {PYTHONPATH: .}\nparams: {data: null}\n",
         ("params.data: expected a valid string (got null)",), line=4,
         files={"gl_required_params.py": "from pydantic import BaseModel\n\n\nclass Params(BaseModel):\n    data: str\n\n\n"
                "def run(ctx):\n    return {}\n"}),
    # --- impossible resources (valid spec, no such machine): caught before any spawn -------------------
    Case("cuda-without-gpu", BASE + "resources: {device: cuda}\n", ("resources.device: 'cuda' requested but",)),
    Case("world-larger-than-slots", BASE + "resources: {cpu_workers: 2}\nscaling: {workers: [64]}\n",
         ("scaling.workers: no world size of [64] fits: world size 64 needs 64 worker slot(s) per node but resources.cpu_workers gives 2",
          "--set resources.cpu_workers=64")),
    Case("nodes-without-cluster", BASE + "resources: {nodes: 2}\n", ("resources.nodes: 2 node(s) requested but 1 available",)),
    # --- flags --------------------------------------------------------------------------------------
    Case("set-without-equals", BASE, ("--set resources.cpu_workers: no '=' in it; expected FIELD=VALUE", "e.g. --set params.iters=50"), argv=("--set", "resources.cpu_workers")),
    Case("set-bad-key", BASE, ("--set a..b=1: 'a..b' is not a field path", "expected FIELD=VALUE"), argv=("--set", "a..b=1")),
    Case("set-unknown-field", BASE, ("--set resources.gpus: unknown key",), argv=("--set", "resources.gpus=2")),
    Case("set-wrong-type", BASE, ("--set resources.cpu_workers: expected", "abc"), argv=("--set", "resources.cpu_workers=abc")),
    Case("set-boolean-for-a-number", BASE, ("--set timeouts.run_s: expected a valid number (got True)",), argv=("--set", "timeouts.run_s=true")),
    Case("boolean-for-a-count", BASE + "resources: {cpu_workers: yes}\n", ("resources.cpu_workers: expected 'auto' or a valid integer (got True)",), line=3),
    Case("ray-with-a-cluster-file", BASE + "backend: ray\ncluster: hosts.yaml\n", ("cluster: a cluster file is for the torchrun backend",)),
    Case("ray-several-nodes", BASE + "backend: ray\nresources: {nodes: 2}\n", ("resources.nodes: 2 is not used with the Ray backend",)),
    Case("set-inside-a-list", BASE + "params: {sizes: [8, 16]}\n", ("--set params.sizes.1: params.sizes is not a mapping of fields; set it whole",),
         argv=("--set", "params.sizes.1=-1")),
    Case("set-negative", BASE, ("--set max_restarts: expected greater than or equal to 0",), argv=("--set", "max_restarts=-3")),
    Case("backend-flag-unknown", BASE, ("--backend: unknown backend 'pbs' (expected one of: torchrun, ray, slurm)",), argv=("--backend", "pbs")),
    Case("unknown-flag", BASE, ("unrecognized arguments: --frobnicate",), argv=("--frobnicate",)),
    Case("no-job-given", None, ("the following arguments are required: job",), kind="nofile"),
    Case("cluster-file-missing", BASE, ("no-such-cluster.yaml: no such cluster file",), argv=("--cluster", "no-such-cluster.yaml")),
]


def _materialize(case: Case, tmp_path: Path) -> tuple[list[str], str | None]:
    path = tmp_path / "bad.yaml"
    for name, content in case.files.items():
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_text(content)
    if case.kind == "dir":
        path.mkdir()
    elif case.kind == "file":
        path.write_bytes(case.text if isinstance(case.text, bytes) else (case.text or "").encode())
    if case.kind == "nofile":
        return [*case.argv], None
    return [str(path), *case.argv], str(path)


def _child_pids() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    found.add(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


def test_the_corpus_is_big_enough():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_exits_2_with_one_clear_line(case: Case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative --cluster paths and any stray run dir land here
    argv, spec = _materialize(case, tmp_path)
    out = tmp_path / "runs"
    children = _child_pids()
    rc = main([*argv, "--out", str(out)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, captured.err + captured.out
    assert "Traceback" not in captured.err + captured.out
    assert len(lines) == case.lines, lines
    assert all(line.startswith("error: ") for line in lines), lines
    text = "\n".join(lines)
    for needle in case.expect:
        assert needle in text, f"{needle!r} not in {text!r}"
    if spec is not None and not case.argv[:1] == ("--backend",) and case.id not in ("unknown-flag", "cluster-file-missing"):
        where = "--set" if case.argv[:1] == ("--set",) else spec if not case.files else str(tmp_path)
        assert all(where in line for line in lines), f"{where!r} not named in {lines}"
    if case.line is not None:
        assert f"{spec}:{case.line}:" in lines[0], lines[0]
    assert not out.exists(), "a run directory was created for bad input"
    assert not Path("/tmp/gpulaunch-pwned").exists()
    assert _child_pids() <= children, "a process was spawned for bad input"


@pytest.mark.parametrize("args", [["validate"], ["report", "/nonexistent/run"]], ids=["validate-no-args", "report-missing"])
def test_subcommands_with_bad_input_exit_2(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]


@pytest.mark.parametrize("content", ["name: bad\nresources: {nodes: 0}\n", b"\xff\xfe\x00garbage"], ids=["invalid", "binary"])
def test_as_a_real_process_bad_input_exits_2_without_traceback(content, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_bytes(content if isinstance(content, bytes) else content.encode())
    done = subprocess.run(
        [sys.executable, "-m", "launcher", str(spec), "--out", str(tmp_path / "runs")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines and all(line.startswith(f"error: {spec}") for line in lines), lines
    assert not (tmp_path / "runs").exists()


def test_an_out_that_cannot_hold_a_run_directory_exits_2(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    children = _child_pids()
    rc = main([str(REPO / "jobs" / "matmul_scaling.yaml"), "--out", str(blocker)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --out {blocker}: cannot create the run directory") and "Not a directory" in err[0]
    assert _child_pids() <= children


@pytest.mark.parametrize(
    "override, expect",
    [
        ("scaling.workers=[64,128]", "scaling.workers: no world size of [64, 128] fits"),
        ("resources.nodes=2", "several nodes need a cluster file"),
        ("cluster=no-such-cluster.yaml", "no such cluster file"),
    ],
    ids=["world-too-big", "nodes-without-cluster", "cluster-file-missing"],
)
def test_validate_rejects_what_launch_would(override, expect, capsys):
    rc = main(["validate", str(REPO / "jobs" / "matmul_scaling.yaml"), "--set", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and expect in err[0], err
