"""A notebook's view: one Python process runs several jobs through ``launcher.run_job``. Each
job's module (found on its own ``env.PYTHONPATH``) is the one its params are checked against and
its summary comes from, even when another project's module has the same name or the file was
edited since the last run. Real torchrun ranks, one per job."""

from __future__ import annotations

import io
import os
from pathlib import Path

from rich.console import Console

from launcher.control.api import run_job
from launcher.ui.console import RunUI

WORKLOAD = """\
from pydantic import BaseModel, ConfigDict


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    {field}: int = 1


def run(ctx):
    return {{"seen": dict(ctx.params)}}


def summarize(stages, params):
    return {{"title": "{title}", "rows": [{{"params": str(dict(params))}}]}}
"""


def _project(root: Path, name: str, field: str, title: str) -> Path:
    directory = root / name
    directory.mkdir(exist_ok=True)
    source = directory / "gl_nb_work.py"
    source.write_text(WORKLOAD.format(field=field, title=title))
    return directory


def _run(root: Path, project: Path, params: str) -> dict:
    spec = root / f"{project.name}.yaml"
    spec.write_text(
        f"name: nb\nentrypoint: gl_nb_work:run\nparams: {params}\nresources: {{cpu_workers: 1}}\n"
        f"env: {{PYTHONPATH: '{project}'}}\n"
    )
    quiet = RunUI(Console(file=io.StringIO()), quiet=True)
    run = run_job(spec, out=root / "runs", events=quiet)
    assert run.ok, run.data.get("failure")
    return run.data


def test_each_run_uses_its_own_module_and_the_latest_edit(tmp_path):
    a = _project(tmp_path, "a", "alpha", "from a")
    b = _project(tmp_path, "b", "beta", "from b")
    first = _run(tmp_path, a, "{alpha: 2}")
    assert first["summary"]["title"] == "from a" and first["ranks"][0]["result"]["seen"] == {"alpha": 2}
    second = _run(tmp_path, b, "{beta: 3}")
    assert second["summary"]["title"] == "from b" and second["params"] == {"beta": 3}

    source = a / "gl_nb_work.py"
    _project(tmp_path, "a", "alpha", "from a, edited")
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later edit, whatever the clock's grain
    third = _run(tmp_path, a, "{alpha: 4}")
    assert third["summary"]["title"] == "from a, edited" and third["params"] == {"alpha": 4}
