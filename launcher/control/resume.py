"""``launch resume RUN_DIR``: the same run (its id, its directory, its checkpoints) continued.

A run made here writes ``launch.json`` into its directory as it starts: the spec file, the
``--set`` overrides, the backend and cluster file it ran with, and the spec's hash. Resuming loads
that spec again (secrets and all, which the run directory's masked copy lacks), refuses one that
changed since, keeps the stages that had succeeded (their reports from ``result.json``), sets the
unfinished stage's files aside and runs it again: its job loads its last checkpoint through
``ctx.checkpoint``. Also here: the checks of a stage's checkpoint directory made before anything
starts (a directory that is not writable, another job's checkpoint, a corrupted manifest).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from launcher.checkpoint_store import CheckpointError, check_writable, latest
from launcher.control.planning import job_identity_of
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.procutil import read_json, write_json_atomic
from launcher.protocol import RankReport, StagePaths
from launcher.records import RunStatus, StageOutcome
from launcher.spec.model import LoadedJob

LAUNCH_FILE = "launch.json"


@dataclass(frozen=True)
class LaunchRecord:
    """How a run was launched: what ``launch resume`` needs to launch it again."""

    spec: str  # the spec file, absolute
    overrides: tuple[str, ...]
    backend: str | None
    cluster: str | None  # the cluster file, absolute
    spec_hash: str

    def write(self, run_dir: Path) -> None:
        write_json_atomic(run_dir / LAUNCH_FILE, {**asdict(self), "overrides": list(self.overrides)})

    @classmethod
    def read(cls, run_dir: Path) -> "LaunchRecord":
        data = read_json(run_dir / LAUNCH_FILE)
        if not isinstance(data, dict):
            raise LauncherError(
                f"launch resume {run_dir}: no readable {LAUNCH_FILE} there; expected the directory of a run launched here "
                "(runs/<job>/<run-id>); a Slurm job is requeued by Slurm instead",
                exit_code=EXIT_BAD_INPUT,
            )
        try:
            return cls(str(data["spec"]), tuple(data["overrides"]), data.get("backend"), data.get("cluster"), str(data["spec_hash"]))
        except (KeyError, TypeError) as exc:
            raise LauncherError(f"launch resume {run_dir / LAUNCH_FILE}: corrupted ({exc}); expected what launch wrote there", exit_code=EXIT_BAD_INPUT) from None


def record_launch(job: LoadedJob, run_dir: Path, backend: str | None, cluster: Path | None) -> None:
    LaunchRecord(str(job.path.resolve()), job.overrides, backend, str(cluster.resolve()) if cluster else None, job.spec.fingerprint()).write(run_dir)


def check_unchanged(job: LoadedJob, record: LaunchRecord, run_dir: Path) -> None:
    """Refuse to resume with a spec that is not the run's any more (it would mix two jobs)."""
    now = job.spec.fingerprint()
    if now != record.spec_hash:
        raise LauncherError(
            f"launch resume {run_dir}: {record.spec} changed since the run (spec hash {record.spec_hash}, now {now}); "
            "expected the same spec: start a new run, with --set params.resume=<a checkpoint> to carry one over",
            exit_code=EXIT_BAD_INPUT,
        )


def nothing_to_resume(run_dir: Path, spec: str) -> tuple[str, dict[str, Any]] | None:
    """A run whose record says it succeeded: what to say (nothing to resume) and that record,
    left as it is; None for a run there is something to go on with."""
    result = read_json(run_dir / "result.json")
    if not isinstance(result, dict) or result.get("status") != RunStatus.SUCCEEDED.value:
        return None
    sizes = ", ".join(str(s.get("world_size")) for s in result.get("stages") or ()) or "none"
    wall = result.get("wall_s")
    took = f" in {wall:.1f} s" if isinstance(wall, (int, float)) else ""
    return (
        f"launch resume {run_dir}: nothing to resume; the run succeeded{took} (world sizes {sizes}) and its result.json "
        f"stays as it is; to run the job again: launch {spec}",
        result,
    )


def finished_stages(run_dir: Path) -> dict[int, StageOutcome]:
    """The stages of a run's last ``result.json`` that succeeded, rebuilt from their records and
    reports (world size -> outcome); none when the run ended without one (it was killed)."""
    result = read_json(run_dir / "result.json")
    if not isinstance(result, dict):
        return {}
    ranks: Sequence[Mapping[str, Any]] = result.get("ranks") or []
    done: dict[int, StageOutcome] = {}
    for stage in result.get("stages") or []:
        if stage.get("status") != RunStatus.SUCCEEDED.value:
            continue
        size = int(stage["world_size"])
        reports = [RankReport.from_dict({k: v for k, v in r.items() if k != "timeline_s"}) for r in ranks if r.get("world_size") == size]
        started = min((r.phases.get("spawned", r.phases.get("started", 0.0)) for r in reports), default=0.0)
        done[size] = StageOutcome(size, RunStatus.SUCCEEDED, started, started + float(stage.get("wall_s") or 0.0), restarts=int(stage.get("restarts") or 0), reports=reports)
    return done


def set_aside(paths: StagePaths) -> Path | None:
    """Move an unfinished stage's files (reports, beacons, logs, evidence, earlier attempts) into
    ``resumed<k>/`` so the resumed attempt starts clean; its checkpoints stay where they are."""
    if not paths.root.is_dir():
        return None
    k = 1 + sum(1 for p in paths.root.glob("resumed*") if p.is_dir())
    folder = paths.root / f"resumed{k}"
    moved = False
    for entry in sorted(paths.root.iterdir()):
        if entry.name in (paths.checkpoints.name, "worker.json") or entry.name.startswith("resumed"):
            continue
        folder.mkdir(exist_ok=True)
        shutil.move(str(entry), str(folder / entry.name))
        moved = True
    return folder if moved else None


def check_checkpoint_dirs(job: LoadedJob, roots: Sequence[Path]) -> list[str]:
    """Before anything starts, on this machine: each stage's checkpoint directory can be written,
    and what is in it is this job's; else one line naming the path (exit 2). Returns a line for
    each stage that will resume from a checkpoint already there (so it is never a surprise)."""
    found = []
    for root in roots:
        try:
            if job.spec.checkpoint.dir is not None:
                check_writable(root)
            newest = latest(root, job_identity_of(job), verify_files=False)
        except CheckpointError as exc:
            raise LauncherError(str(exc), exit_code=EXIT_BAD_INPUT) from None
        if newest is not None:
            found.append(f"{root.name}: the job finds its checkpoint of step {newest[0].step} in {root} and resumes from it")
    return found
