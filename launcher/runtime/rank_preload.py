"""What every rank imports before the job's own code, imported once per node by the agent before it
forks the node's rank server (``start_method: forkserver``), so no rank imports it again.

Nothing here may touch CUDA: a process that has initialised CUDA cannot fork usable children.
"""

import atexit
import os

import torch  # noqa: F401
import torch.distributed  # noqa: F401

import launcher.runtime.context  # noqa: F401
import launcher.runtime.metrics  # noqa: F401
import launcher.runtime.worker  # noqa: F401

from launcher.protocol import ENV_RANK_SERVER_PID  # noqa: E402

SERVER_PID = 0  # the ranks' parent, once this process has become the rank server


def become_rank_server() -> None:
    """Called in the rank server itself (the agent's fork), before it serves a fork request: its
    ranks ask to die with it, and it leaves without an interpreter teardown."""
    global SERVER_PID
    SERVER_PID = os.getpid()
    os.environ[ENV_RANK_SERVER_PID] = str(SERVER_PID)  # every rank forked from here inherits it
    atexit.register(_exit_without_teardown)


def _exit_without_teardown() -> None:
    # The server has nothing to clean up, and tearing down an interpreter that holds torch takes
    # ~1 s; the launcher reads the node's output until the server, which shares it, is gone.
    # (Its ranks inherit this handler: they run their exit handlers and must not stop here.)
    if os.getpid() == SERVER_PID:
        os._exit(0)
