"""Imported once per node by the forkserver that ranks are forked from (``start_method:
forkserver``): everything a rank imports before the job's own code, so no rank imports it again.

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

# The ranks' parent: each rank asks to die with it (the server itself ends with its agent).
SERVER_PID = os.getpid()
os.environ[ENV_RANK_SERVER_PID] = str(SERVER_PID)  # every rank forked from here inherits it


def _exit_without_teardown() -> None:
    # The server has nothing to clean up, and tearing down an interpreter that holds torch takes
    # ~1 s; the launcher reads the node's output until the server, which shares it, is gone.
    # (Its ranks inherit this handler: they run their exit handlers and must not stop here.)
    if os.getpid() == SERVER_PID:
        os._exit(0)


atexit.register(_exit_without_teardown)
