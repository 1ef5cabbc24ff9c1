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
from typing import Any

from launcher.procutil import die_with_parent, fast_exit, oom_kill_count

FAILURE_TAG = "gpulaunch-agent-failure: "


class _LossyStream:
    """stdout/stderr that go quiet once the launcher (the pipe's reader) is gone.

    Without it, when a SIGKILLed launcher takes the pipe with it, torchrun's log tailers fail on
    EPIPE and the agent spends seconds importing torch._dynamo just to format that error,
    outliving its launcher. Nobody is left to read the output then anyway.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._broken = False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):
                self._broken = True
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._broken = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    sys.stdout, sys.stderr = _LossyStream(sys.stdout), _LossyStream(sys.stderr)  # before torch binds them
    parent = os.environ.get("LAUNCHER_PARENT_PID")
    die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    # Workers inherit this: it lets them check their own parent-death request against the race
    # where the agent died before the request was made (see procutil.die_with_parent).
    os.environ["LAUNCHER_AGENT_PID"] = str(os.getpid())
    oom_before = oom_kill_count()

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    config, entrypoint, entry_args = config_from_args(parse_args(argv))
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as exc:
        oom = (oom_kill_count() or 0) > (oom_before or 0)
        # The agent stops the surviving workers with SIGTERM when one fails, and torch lists them
        # as failures too (same timestamp): those are collateral when another rank failed otherwise.
        stopped = {r for r, f in exc.failures.items() if f.exitcode == -signal.SIGTERM}
        own_failures = len(stopped) < len(exc.failures)
        for rank, failure in sorted(exc.failures.items()):
            record = {
                "rank": rank,
                "local_rank": failure.local_rank,
                "exitcode": failure.exitcode,
                "signal": failure.signal_name() if failure.exitcode < 0 else None,
                "pid": failure.pid,
                "oom_suspected": oom and failure.exitcode == -signal.SIGKILL,
                "timestamp": failure.timestamp,
                "collateral": own_failures and rank in stopped,
            }
            print(FAILURE_TAG + json.dumps(record), flush=True)
        return 1
    except SignalException as exc:
        # The launcher (or the launcher's death) stopped us: the elastic agent has already stopped
        # its workers. One line, not a traceback: this is teardown, not the failure.
        print(f"gpulaunch-agent: stopped by {exc.sigval.name}; workers stopped", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    fast_exit(main())  # the agent holds torch: a normal interpreter exit costs ~0.4 s
