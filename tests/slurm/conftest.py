"""Fixtures for a real, private Slurm cluster (see ``slurmrig.py`` for the layout).

    slurm_rig        session-scoped: 2 nodes (n1, n2), 2 CPUs each, partition ``debug``
    slurm_gpu_rig    session-scoped: the same with 2 fake GPUs per node (``Gres=gpu:2``, files
                     are character devices in the rig's directory; Slurm sets CUDA_VISIBLE_DEVICES)
    slurm_requeue_rig  module-scoped: 2 nodes, 2 CPUs each, a requeued job starting again within
                     seconds (Slurm holds one back cred_expire + 1 s: 121 s by default; here 11 s,
                     and the scheduler looks every 2 s), KillWait 10 s (Slurm's default is 30)
    make_slurm_rig   a factory for a private rig a test may break (kill a node, ...):
                     ``rig = make_slurm_rig(nodes=2, gpus_per_node=0, ...)``; torn down after the test

Skipped only when this machine cannot build one (not Linux, not root, a tool missing); a rig that
fails to start with the tools present is an error, not a skip.
"""

from __future__ import annotations

import pytest

from tests.slurm.slurmrig import SlurmRig, missing_tools, remove_stale_rigs

_stale_checked = False


def _require_tools() -> None:
    global _stale_checked
    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    if not _stale_checked:
        remove_stale_rigs()
        _stale_checked = True


def _session_rig(tmp_path_factory, **kwargs) -> SlurmRig:
    _require_tools()
    rig = SlurmRig(tmp_path_factory.mktemp("slurm"), **kwargs)
    rig.start()
    return rig


@pytest.fixture(scope="session")
def slurm_rig(tmp_path_factory):
    rig = _session_rig(tmp_path_factory)
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture(scope="session")
def slurm_gpu_rig(tmp_path_factory):
    rig = _session_rig(tmp_path_factory, gpus_per_node=2)
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture(scope="module")
def slurm_requeue_rig(tmp_path_factory):
    rig = _session_rig(tmp_path_factory, cred_expire=10, sched_interval=2, kill_wait=10)
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture
def make_slurm_rig(tmp_path_factory):
    _require_tools()
    rigs: list[SlurmRig] = []

    def make(**kwargs) -> SlurmRig:
        rig = SlurmRig(tmp_path_factory.mktemp("slurm"), **kwargs)
        rigs.append(rig)
        return rig.start()

    yield make
    errors = []
    for rig in reversed(rigs):
        try:
            rig.stop()
        except Exception as e:  # noqa: BLE001 - stop every rig, then report
            errors.append(e)
    if errors:
        raise errors[0]
