"""Issue 6: eight jobs launched at the same time on one machine all succeed, each with its own
run directory and its own rendezvous port (no collisions on a fixed 29500), nothing shared."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.conftest import REPO, pids_mentioning
from tests.integration.faultkit import child_env, kill_pids, record, write_spec

JOBS = 8


def test_eight_concurrent_jobs_all_succeed_without_sharing(tmp_path):
    spec = write_spec(tmp_path, name="many", params={"fault": "none"}, resources={"cpu_workers": 1})
    out = tmp_path / "runs"
    procs = []
    t0 = time.monotonic()
    try:
        for i in range(JOBS):
            log = open(tmp_path / f"job{i}.log", "wb")  # noqa: SIM115
            procs.append((log, subprocess.Popen(
                [sys.executable, "-m", "launcher", str(spec), "--out", str(out), "--quiet"],
                cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
            )))
        codes = [proc.wait(timeout=280) for _, proc in procs]
    finally:
        for log, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        kill_pids(pids_mentioning(str(out)))
    record(f"{JOBS} concurrent 1-worker jobs, wall", time.monotonic() - t0)
    outputs = [(tmp_path / f"job{i}.log").read_text(errors="replace")[-3000:] for i in range(JOBS)]
    assert codes == [0] * JOBS, "\n\n".join(o for c, o in zip(codes, outputs) if c)
    run_dirs = sorted((out / "many").iterdir())
    assert len(run_dirs) == JOBS  # one run directory each (run ids never collide)
    endpoints, pids = set(), set()
    for run_dir in run_dirs:
        result = json.loads((run_dir / "result.json").read_text())
        assert result["status"] == "succeeded" and result["run_dir"] == str(run_dir)
        (rank,) = result["ranks"]
        assert rank["status"] == "ok" and rank["log"].startswith(str(run_dir))
        endpoints.add(rank["rendezvous"])
        pids.add(rank["pid"])
        assert (run_dir / "world1" / "logs" / "rank0.log").read_text().startswith("faulty: rank 0")
    assert len(endpoints) == JOBS, f"rendezvous endpoints shared: {sorted(endpoints)}"
    assert all(e.startswith("127.0.0.1:") and not e.endswith(":29500") for e in endpoints)
    assert len(pids) == JOBS
    assert pids_mentioning(str(out)) == []
