"""A failed agent's last lines name the rank that failed; they must be read before the failure is.

The agent prints its failure records just before it exits. When the ranks were printing a lot,
those records can still be in the pipe, behind thousands of log lines, when the launcher sees the
agent's exit code. Here a real process stands in for the agent (a real agent cannot be made to
print this much at will) and the console is slow, as a busy terminal is.
"""

from __future__ import annotations

import sys
import time

from launcher.backends.torchrun import TorchrunEngine
from launcher.control.nodes import local_node
from launcher.control.planning import plan_stage
from launcher.protocol import AGENT_FAILURE_TAG as FAILURE_TAG
from launcher.spec.model import load_job
from launcher.stage.events import RankExited
from launcher.stage.logrouting import LogRouter
from tests.conftest import REPO

CHATTY_FAILED_AGENT = f"""\
import json
for i in range(20000):
    print(f"{{HOST}}:0| line {{i}} " + "x" * 80)
record = {{"rank": 1, "local_rank": 1, "exitcode": -9, "signal": "SIGKILL", "pid": 1,
          "oom_suspected": False, "timestamp": 0, "collateral": False}}
print({FAILURE_TAG!r} + json.dumps(record), flush=True)
raise SystemExit(1)
"""


def test_the_failed_rank_is_named_even_when_its_record_arrives_after_the_exit(tmp_path, monkeypatch):
    job = load_job(REPO / "benchmarks" / "jobs" / "allreduce.yaml")
    node = local_node()
    plan = plan_stage(job, [node], 2, "cpu", run_dir=tmp_path, master_port=1, backend="torchrun")
    script = CHATTY_FAILED_AGENT.replace("{HOST}", node.name)
    import launcher.backends.torchrun

    monkeypatch.setattr(launcher.backends.torchrun, "agent_argv", lambda plan, node: (sys.executable, "-c", script))
    logs = LogRouter(tmp_path / "logs", echo=lambda source, text: time.sleep(0.00005))
    stage = TorchrunEngine().start(plan, logs)
    try:
        deadline = time.monotonic() + 60
        status = stage.poll()
        while not status.done and time.monotonic() < deadline:
            time.sleep(0.05)
            status = stage.poll()
        events = stage.take_events()  # what the stage's channel delivered by the time poll said done
    finally:
        stage.stop()
        logs.close()
    assert status.done and not status.ok
    assert [(e.exit.rank, e.exit.signal) for e in events if isinstance(e, RankExited)] == [(1, "SIGKILL")], events
    last = (tmp_path / "logs" / "rank0.log").read_text().splitlines()[-1]
    assert last.startswith("line 19999 ")
    assert "gpulaunch-agent-failure" not in (tmp_path / "logs" / "rank0.log").read_text()
