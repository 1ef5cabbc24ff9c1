"""What a job's entrypoint receives in every rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

    from launcher.runtime.checkpoint import Checkpoints, StopNotice
    from launcher.runtime.metrics import MetricsRecorder


@dataclass(frozen=True)
class WorkerContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    host: str
    device: "torch.device"
    pg_backend: str
    params: Mapping[str, Any]
    metrics: "MetricsRecorder"
    stage_dir: Path
    threads: int
    checkpoint: "Checkpoints"  # save(state, step=...), load(): see launcher.runtime.checkpoint
    stop_notice: "StopNotice"
    # how many ranks of the node compute on this rank's GPU (resources.ranks_per_gpu; 1 on the CPU):
    # above 1 the process group is gloo over CUDA tensors, since NCCL refuses two ranks on one GPU
    ranks_per_gpu: int
    # what the job's ``prepare(params)`` returned in this process (spec: prepare; None without
    # one): its rank-independent start, made just before the entrypoint (ahead, in a warm spare)
    prepared: Any

    @property
    def should_stop(self) -> bool:
        """True once the job was asked to stop (a preemption, Ctrl-C, its host's SIGTERM): save
        at this step boundary and return; ``stop_notice.seconds_left`` says how long it has."""
        return self.stop_notice.requested

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def param(self, name: str, default: Any = None) -> Any:
        return self.params.get(name, default)
