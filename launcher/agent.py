"""``python -m launcher.agent ARGS`` is ``torchrun ARGS``: PyTorch's own parser and elastic agent.

Two additions only: the agent dies with the launcher (a parent-death signal, so a SIGKILLed
launcher leaves no agent and hence no worker behind), and when workers fail it prints one
machine-readable line per failure (rank, exit code, signal, OOM) for the launcher's report.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from launcher.procutil import die_with_parent, oom_kill_count

FAILURE_TAG = "gpulaunch-agent-failure: "


def main(argv: list[str] | None = None) -> int:
    parent = os.environ.get("LAUNCHER_PARENT_PID")
    die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    oom_before = oom_kill_count()

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    config, entrypoint, entry_args = config_from_args(parse_args(argv))
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as exc:
        oom = (oom_kill_count() or 0) > (oom_before or 0)
        for rank, failure in sorted(exc.failures.items()):
            record = {
                "rank": rank,
                "local_rank": failure.local_rank,
                "exitcode": failure.exitcode,
                "signal": failure.signal_name() if failure.exitcode < 0 else None,
                "pid": failure.pid,
                "oom_suspected": oom and failure.exitcode == -signal.SIGKILL,
                "timestamp": failure.timestamp,
            }
            print(FAILURE_TAG + json.dumps(record), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
