"""Test entrypoint: ``ddp_train`` as if rank 0's host were the only one holding the checkpoints.

On every rank but 0, ``params.private_dir`` is covered by an empty tmpfs in a mount namespace of
that rank's own before the job runs: files rank 0 writes there (or a checkpoint to resume from)
do not exist for the others, and what they write there rank 0 never sees, as on two hosts
without a shared filesystem. Needs CAP_SYS_ADMIN (root); ``mount_works`` says whether it has it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
from typing import Any

from launcher.workloads import train
from launcher.workloads.train import plot, summarize  # noqa: F401 - the job's own table and plots


class Params(train.Params):
    private_dir: str  # hidden from every rank but 0

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 0x40000


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def hide(directory: str) -> None:
    """This thread (the rank's main thread, which runs the job) gets its own mount namespace in
    which ``directory`` is an empty tmpfs; nothing propagates back to the host's namespace."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    _check(libc.mount(b"tmpfs", os.fsencode(directory), b"tmpfs", 0, b"size=64m"), f"mount tmpfs on {directory}")


def mount_works() -> bool:
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "none", "/mnt"],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def run(ctx: Any) -> dict[str, Any]:
    private = Params.model_validate(ctx.params).private_dir
    if ctx.rank != 0:
        hide(private)
    sees = sorted(os.listdir(private))  # what this rank sees before the job runs
    result = train.run(dataclasses.replace(ctx, params={k: v for k, v in ctx.params.items() if k != "private_dir"}))
    return {**result, "private_dir_listing": sees}
