"""What a job's entrypoint receives in every rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def param(self, name: str, default: Any = None) -> Any:
        return self.params.get(name, default)
