"""The test and benchmark harnesses keep the caller's PYTHONPATH (not marked ``gpu``: it runs here).

On the GPU machine the packages the CUDA image lacks (pydantic, py-spy, ...) come as wheels
installed to /tmp/site and put on PYTHONPATH (``benchmarks/gpu_session.sh``). A harness that set
``PYTHONPATH`` to the repository alone gave its child launcher no pydantic: the launcher died in
a second and a GPU hang test failed for it. Every child environment the harnesses build puts the
repository in front of the caller's entries and keeps them; proven here with a module that only
the caller's PYTHONPATH can find, imported by a real ``python -m launcher`` run (its entrypoint
check in the launcher process) and by its rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from benchmarks.common import bench_env
from tests.conftest import REPO
from tests.integration.faultkit import Launched, child_env, pythonpath, result_of, write_spec

MODULE = "gl_caller_site_probe"


@pytest.fixture
def caller_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on this process's PYTHONPATH only (as /tmp/site is on the GPU machine)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{MODULE}.py").write_text("import os\n\ndef run(ctx):\n    return {'found_at': __file__, 'rank': ctx.rank}\n")
    # in front of what this process already has, which stays: on the GPU machine that is /tmp/site
    # with pydantic, and a child without it cannot start the launcher at all
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), "/nonexistent/other-entry", *_callers_entries()]))
    return site


def _callers_entries() -> list[str]:
    return [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]


def test_every_child_env_puts_the_repository_first_and_keeps_the_callers_entries(caller_site: Path, tmp_path: Path) -> None:
    entries = list(dict.fromkeys([str(REPO), *_callers_entries()]))  # the repository first, each entry once
    assert entries[1:3] == [str(caller_site), "/nonexistent/other-entry"]
    expected = os.pathsep.join(entries)
    assert child_env()["PYTHONPATH"] == expected
    assert pythonpath() == expected
    assert pythonpath(tmp_path) == os.pathsep.join([str(tmp_path), expected])  # the front first, nothing twice
    assert pythonpath(REPO, tmp_path).split(os.pathsep) == [str(REPO), str(tmp_path), *entries[1:]]
    assert pythonpath(base="") == str(REPO)  # nothing inherited: no empty entry (that would mean the working directory)
    spec = yaml.safe_load(write_spec(tmp_path).read_text())
    assert spec["env"]["PYTHONPATH"] == expected  # what the ranks get from the spec keeps it too
    assert str(caller_site) in bench_env()["PYTHONPATH"].split(os.pathsep)  # the benchmarks' children


def test_a_launch_started_by_the_harness_imports_from_the_callers_pythonpath(caller_site: Path, tmp_path: Path) -> None:
    spec = tmp_path / "probe.yaml"
    # no env: in the spec: the launcher and its rank see the module only through the inherited PYTHONPATH
    spec.write_text(yaml.safe_dump({"name": "probe", "entrypoint": f"{MODULE}:run", "resources": {"cpu_workers": 1},
                                    "timeouts": {"rendezvous_s": 120, "run_s": 120}}, sort_keys=False))
    run = Launched(spec, tmp_path / "runs", "--no-metrics")
    try:
        rc = run.wait(180)
        out = run.output()
        run_dir = run.run_dir(5)
    finally:
        run.close()
    assert rc == 0, out[-3000:]
    (rank,) = result_of(run_dir)["ranks"]
    assert rank["status"] == "ok" and rank["result"]["found_at"] == str(caller_site / f"{MODULE}.py"), rank
