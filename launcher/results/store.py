"""``result.json``: the run's one document, written atomically and read back (``RunResult``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from launcher.procutil import read_json, write_json_atomic
from launcher.records import RESULT_FILE, RunStatus
from launcher.results.run_record import SCHEMA_VERSION, RunRecord

__all__ = ["SCHEMA_VERSION", "RESULT_FILE", "RunResult", "write_result", "load_result"]


@dataclass(frozen=True)
class RunResult:
    """What ``run_job`` returns and ``result.json`` holds: the document (``data``), and where a
    run made here has it, its typed record (``record``)."""

    data: Mapping[str, Any]
    run_dir: Path
    plots: tuple[str, ...] = field(default_factory=tuple)
    record: RunRecord | None = None

    @classmethod
    def of(cls, record: RunRecord, run_dir: Path) -> "RunResult":
        return cls(record.to_dict(), run_dir, tuple(str(run_dir / p) for p in record.plots), record)

    @property
    def status(self) -> str:
        return str(self.data["status"])

    @property
    def run_status(self) -> RunStatus:
        return RunStatus(self.status)

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.SUCCEEDED.value

    @property
    def exit_code(self) -> int:
        return self.run_status.exit_code

    @property
    def path(self) -> Path:
        return self.run_dir / RESULT_FILE

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def write_result(run_dir: Path, result: Mapping[str, Any] | RunRecord) -> Path:
    path = run_dir / RESULT_FILE
    write_json_atomic(path, result.to_dict() if isinstance(result, RunRecord) else result)
    return path


def load_result(run_dir: str | Path) -> dict[str, Any] | None:
    return read_json(Path(run_dir) / RESULT_FILE)
