"""Time from a rank's death to the first step of the resumed attempt, against a cold start of the stage.

The job: ``jobs/ddp_train.yaml`` (DDP, 2 CPU ranks, gloo) at a size that trains in seconds,
through the test wrapper ``tests.jobs.killed_train:run``: 6 epochs of 4 steps, a checkpoint
through ``ctx.checkpoint`` every epoch, ``max_restarts: 1``. Two variants, in pairs (the order
alternating), after one untimed run of each:

  resume  rank ``kill_rank`` SIGKILLs itself at its step 10 of the first attempt (after the
          checkpoint of step 8; the wrapper writes its marker file just before the kill, so the
          marker's mtime is the moment of death); the launcher restarts the stage, whose ranks
          load step 8 and go on. Measured: death -> the last rank's first step of the second
          attempt (``phases.first_step`` of the final ranks' reports in result.json), and where it
          went: death -> the attempt recorded as ended (``attempts[0].ended_at``: the loss
          noticed, the rest of the group stopped), -> the second attempt's start
          (``attempts[1].started_at``), -> its ranks spawned (``phases.spawned``, the last rank),
          -> process group ready (``pg_ready``), -> first step (the job's own start: data, model,
          ``ctx.checkpoint.load``, one step).
  cold    the same command, nothing killed (``params.kill_at=-1``): a fresh run. Measured: spawn of
          ``launch`` -> the last rank's first step (a cold start, as a user sees it), and the
          stage's own start (``attempts[0].started_at``) -> the last rank's first step (a cold
          start of the stage, without the launcher's own start before it); where it went: the
          launcher's start (-> ``attempts[0].started_at``), spawn, rendezvous + process group, the
          job's own start to its first step.

Goal: death -> first step of the resumed attempt under 2x a cold start. Reported per pair:
resume / cold (both denominators), median [min..max].

A third variant, ``resume_proposed`` (``--no-proposal`` leaves it out), is ``resume`` with a
prototype of a proposed change, in this script only (``launcher/`` is not touched): a
``sitecustomize`` on PYTHONPATH drops the traceback from torch elastic's "failed (exitcode ...)"
error line in the agent. Formatting that traceback is what makes torch's log formatter import
``torch._dynamo`` (with sympy, inductor, onnx) in the agent after a rank died, 1-2 s here, before
the agent can exit and the attempt end (seen with ``py-spy dump`` of the agent).

Two places: ``local`` (the torchrun backend on this machine) and ``ssh`` (two hosts, one rank on
each, in network namespaces with their own sshd and private run directories: the rig of
``tests/cluster/conftest.py``; needs root; the checkpoint exists on rank 0's host and is sent to
the other host by ``ctx.checkpoint``; rank 1, on the second host, is the one killed).

    python benchmarks/resume_time.py [--smoke] [--reps N] [--no-ssh] [--no-local] [--no-proposal]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, base_parser, bench_env, fmt, machine_info, ratio, rotate, run_timed, summary, write_result  # noqa: E402

JOB = REPO / "jobs" / "ddp_train.yaml"
VARIANTS = ("resume", "cold")
PROPOSED = "resume_proposed"
# The proposal's prototype (BENCHMARKS.md, "Checkpoints and resume"): in every process of the run
# (a sitecustomize on PYTHONPATH; launcher/ untouched), torch elastic's "failed (exitcode ...)" error
# line keeps its text but loses its traceback. Formatting that traceback is what makes torch's log
# formatter import torch._dynamo (sympy, inductor, onnx: 1-2 s here) in the agent, after a rank died
# and before the agent can exit; the launcher reports the failure from the agent's own records.
SITECUSTOMIZE = """\
import logging


class _NoTraceback(logging.Filter):
    def filter(self, record):
        record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoTraceback())
"""
TINY = ["params.n_train=1024", "params.n_test=256", "params.hidden=32", "params.batch_size=128"]  # tests/jobs/conftest.py's TINY_TRAIN
SETS = ["entrypoint=tests.jobs.killed_train:run", "params.epochs=6", "params.in_place=false", "max_restarts=1", "checkpoint.keep=2", *TINY]
KILL_AT = 10  # the checkpoints are at steps 4, 8, ...: 2 steps are done again
TIMEOUT_S = 300
SEGMENTS = ("detect_and_stop", "restart_decision", "spawn", "rendezvous_and_pg", "job_start_to_first_step")
COLD_SEGMENTS = ("launcher_start", "spawn", "rendezvous_and_pg", "job_start_to_first_step")


def sets_for(variant: str, marker: Path, *, kill_rank: int, workers: int) -> list[str]:
    kill = ["params.kill_at=-1"] if variant == "cold" else [f"params.kill_rank={kill_rank}", f"params.kill_at={KILL_AT}"]
    return [*SETS, f"scaling.workers=[{workers}]", *kill, f"params.marker={marker}"]


def argv_for(out: Path, sets: list[str]) -> list[str]:
    return [sys.executable, "-m", "launcher", str(JOB), "--out", str(out), "--quiet", *(a for s in sets for a in ("--set", s))]


def read_record(variant: str, out: Path, marker: Path, t_spawn: float, wall_s: float, rc: int, output: str) -> dict[str, Any]:
    """The timestamps of one run (its result.json, and the marker's mtime: the moment of death)."""
    found = sorted(out.glob("ddp_train/*/result.json"))
    if rc != 0 or not found:
        raise RuntimeError(f"{variant}: launch exit {rc}, {len(found)} result.json under {out}:\n{output[-3000:]}")
    result = json.loads(found[-1].read_text())
    (stage,) = result["stages"]
    attempts = stage["attempts"]
    ranks = result["ranks"]  # the final attempt's reports
    phase = {name: [r["phases"].get(name) for r in ranks] for name in ("spawned", "pg_ready", "first_step")}
    if any(v is None for v in phase["first_step"]):
        raise RuntimeError(f"{variant}: a rank without a first_step stamp: {phase}")
    first = max(phase["first_step"])
    spawned, pg_ready = max(phase["spawned"]), max(p for p in phase["pg_ready"] if p is not None)
    record: dict[str, Any] = {"wall_s": round(wall_s, 4), "status": result["status"], "attempts": len(attempts), "hosts": sorted({str(r.get("host")) for r in ranks}),
                              "restarts": result.get("restarts"), "load_avg": stage.get("load_avg"),
                              "checkpoint_load_s": [(r.get("checkpoint") or {}).get("load_s") for r in ranks]}  # fmt: skip
    if variant == "cold":
        if len(attempts) != 1:
            raise RuntimeError(f"cold: {len(attempts)} attempts: {attempts}")
        start = attempts[0]["started_at"]
        record.update(launch_to_first_step_s=first - t_spawn, stage_to_first_step_s=first - start,
                      segments={"launcher_start": start - t_spawn, "spawn": spawned - start, "rendezvous_and_pg": pg_ready - spawned,
                                "job_start_to_first_step": first - pg_ready})  # fmt: skip
        return _rounded(record)
    if len(attempts) != 2 or not marker.exists():
        raise RuntimeError(f"resume: {len(attempts)} attempts, marker {'there' if marker.exists() else 'missing'}: {attempts}")
    death = marker.stat().st_mtime
    first_attempt, second = attempts
    record.update(
        death_to_first_step_s=first - death,
        launch_to_death_s=death - t_spawn,
        resumed_step=second.get("resumed_step"),
        failure_class=first_attempt.get("failure_class"),
        lost_steps=first_attempt.get("lost_steps"),
        segments={
            "detect_and_stop": first_attempt["ended_at"] - death,
            "restart_decision": second["started_at"] - first_attempt["ended_at"],
            "spawn": spawned - second["started_at"],
            "rendezvous_and_pg": pg_ready - spawned,
            "job_start_to_first_step": first - pg_ready,
        },
    )
    if record["resumed_step"] != 8 or record["failure_class"] != "rank_lost":
        raise RuntimeError(f"resume: expected a rank_lost restart from step 8: {attempts}")
    return _rounded(record)


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def pairs(runner: Callable[[str, int], dict[str, Any]], reps: int, label: str, variants: tuple[str, ...], warm_up: bool) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for k in range(0 if warm_up else 1, reps + 1):  # k = 0: untimed (page cache, the first fork of everything)
        for variant in rotate(variants, k):
            record = runner(variant, k)
            if k:
                runs[variant].append(record)
            head = "warm-up" if k == 0 else f"pair {k}/{reps}"
            said = (f"death -> first step {record['death_to_first_step_s']:.2f}s {record['segments']}" if variant != "cold"
                    else f"launch -> first step {record['launch_to_first_step_s']:.2f}s, stage -> first step {record['stage_to_first_step_s']:.2f}s")  # fmt: skip
            print(f"  {label} {head} {variant}: {said}; load {os.getloadavg()[0]:.2f}", flush=True)
    return runs


def tabulate(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    resume, cold = runs["resume"], runs["cold"]
    table: dict[str, Any] = {
        "resume_death_to_first_step_s": summary([r["death_to_first_step_s"] for r in resume]),
        "cold_launch_to_first_step_s": summary([r["launch_to_first_step_s"] for r in cold]),
        "cold_stage_to_first_step_s": summary([r["stage_to_first_step_s"] for r in cold]),
        "resume_segments_s": {s: summary([r["segments"][s] for r in resume]) for s in SEGMENTS},
        "cold_segments_s": {s: summary([r["segments"][s] for r in cold]) for s in COLD_SEGMENTS},
        "resume_over_cold_launch": summary([ratio(a["death_to_first_step_s"], b["launch_to_first_step_s"]) for a, b in zip(resume, cold)]),
        "resume_over_cold_stage": summary([ratio(a["death_to_first_step_s"], b["stage_to_first_step_s"]) for a, b in zip(resume, cold)]),
    }
    for key in ("resume_over_cold_launch", "resume_over_cold_stage"):
        med = table[key]["median"]
        table[f"{key}_goal_met"] = None if med is None else med < 2.0
    proposed = runs.get(PROPOSED)
    if proposed:
        table["proposed_death_to_first_step_s"] = summary([r["death_to_first_step_s"] for r in proposed])
        table["proposed_segments_s"] = {s: summary([r["segments"][s] for r in proposed]) for s in SEGMENTS}
        table["proposed_over_resume"] = summary([ratio(a["death_to_first_step_s"], b["death_to_first_step_s"]) for a, b in zip(proposed, resume)])
        table["proposed_over_cold_launch"] = summary([ratio(a["death_to_first_step_s"], b["launch_to_first_step_s"]) for a, b in zip(proposed, cold)])
    return table


# --- on this machine ----------------------------------------------------------------------------
def proposal_site(scratch: Path) -> Path:
    site = scratch / "proposal-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return site


def part_local(reps: int, scratch: Path, proposal: bool, warm_up: bool) -> dict[str, Any]:
    site = proposal_site(scratch)

    def run(variant: str, k: int) -> dict[str, Any]:
        out = scratch / f"local-{variant}-{k}"
        marker = scratch / f"local-marker-{variant}-{k}"
        sets = sets_for(variant, marker, kill_rank=1, workers=2)
        env = bench_env({"COLUMNS": "200"}, pythonpath=str(site) if variant == PROPOSED else None)
        done = run_timed(argv_for(out, sets), env=env, timeout_s=TIMEOUT_S)
        try:
            return read_record("resume" if variant == PROPOSED else variant, out, marker, done.t_start, done.wall_s, done.rc, done.output)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    runs = pairs(run, reps, "local", (*VARIANTS, PROPOSED) if proposal else VARIANTS, warm_up)
    return {"config": {"hosts": 1, "ranks": 2, "backend": "torchrun", "kill_rank": 1, "kill_at": KILL_AT, "sets": SETS,
                       "proposal_sitecustomize": SITECUSTOMIZE if proposal else None},
            "runs": runs, "table": tabulate(runs)}  # fmt: skip


# --- over SSH -------------------------------------------------------------------------------------
def part_ssh(reps: int, scratch: Path, proposal: bool, warm_up: bool) -> dict[str, Any]:
    from tests.cluster.conftest import missing_tools, netns_rig, remove_stale_sets

    reason = missing_tools()
    if reason:
        return {"skipped": reason}
    remove_stale_sets()
    site = proposal_site(scratch)  # outside the private run roots: every host sees it
    with netns_rig(scratch / "rig", count=2, prefix=f"glt-{os.getpid()}") as cluster:
        cfg = cluster.cluster_yaml(scratch / "cluster.yaml", hosts=cluster.hosts[:2])

        def run(variant: str, k: int) -> dict[str, Any]:
            out = cluster.out_dir(f"ssh-{variant}-{k}")  # private to each host: the launcher brings the reports back
            marker = scratch / f"ssh-marker-{variant}-{k}"  # outside the private run root: both attempts see it
            path = f"{site}:{REPO}" if variant == PROPOSED else str(REPO)
            sets = [*sets_for(variant, marker, kill_rank=1, workers=2), "resources.nodes=2", "resources.cpu_workers=1", f"env.PYTHONPATH={path}"]
            argv = cluster.ns_cmd(*argv_for(out, sets), "--cluster", str(cfg), "--no-metrics")
            done = run_timed(argv, env={**os.environ, "COLUMNS": "200"}, timeout_s=TIMEOUT_S)
            try:
                record = read_record("resume" if variant == PROPOSED else variant, out, marker, done.t_start, done.wall_s, done.rc, done.output)
            finally:
                shutil.rmtree(out, ignore_errors=True)
                cluster.kill_leftovers()
            return record

        runs = pairs(run, reps, "ssh", (*VARIANTS, PROPOSED) if proposal else VARIANTS, warm_up)
        hosts = [h.name for h in cluster.hosts]
    return {"config": {"hosts": hosts, "ranks": 2, "ranks_per_host": 1, "backend": "ssh (--cluster)", "kill_rank": 1, "kill_at": KILL_AT,
                       "sets": SETS, "checkpoint_dir": "each host's own run directory (private: no shared filesystem)",
                       "proposal_sitecustomize": SITECUSTOMIZE if proposal else None},
            "runs": runs, "table": tabulate(runs)}  # fmt: skip


# --- report -------------------------------------------------------------------------------------
def _spread(s: dict[str, Any], digits: int = 2) -> str:
    return f"{fmt(s['median'], digits)} [{fmt(s['min'], digits)}..{fmt(s['max'], digits)}]"


def table_lines(where: str, t: dict[str, Any]) -> list[str]:
    seg = t["resume_segments_s"]
    return [
        f"{where}: death -> first step of the resumed attempt {_spread(t['resume_death_to_first_step_s'])} s; "
        f"cold start: launch -> first step {_spread(t['cold_launch_to_first_step_s'])} s, stage -> first step {_spread(t['cold_stage_to_first_step_s'])} s",
        f"  resume / cold (paired): vs launch -> first step {_spread(t['resume_over_cold_launch'])}, vs stage -> first step {_spread(t['resume_over_cold_stage'])}",
        "  where the resume went (s, medians): " + ", ".join(f"{s} {fmt(seg[s]['median'], 2)}" for s in SEGMENTS),
        "  where the cold start went (s, medians): " + ", ".join(f"{s} {fmt(t['cold_segments_s'][s]['median'], 2)}" for s in COLD_SEGMENTS),
    ] + ([
        f"  proposal (no traceback on torch elastic's failure line): death -> first step {_spread(t['proposed_death_to_first_step_s'])} s, "
        f"/ resume {_spread(t['proposed_over_resume'])}, / cold launch {_spread(t['proposed_over_cold_launch'])}; where it went: "
        + ", ".join(f"{s} {fmt(t['proposed_segments_s'][s]['median'], 2)}" for s in SEGMENTS),
    ] if "proposed_death_to_first_step_s" in t else [])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--no-ssh", action="store_true", help="this machine only")
    p.add_argument("--no-local", action="store_true", help="over SSH only")
    p.add_argument("--no-proposal", action="store_true", help=f"leave out {PROPOSED}")
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.smoke else 5)
    data: dict[str, Any] = {"mode": "smoke" if args.smoke else "full", "machine": machine_info(), "config": {"reps": reps, "warm_up": not args.smoke}}
    scratch = Path(tempfile.mkdtemp(prefix="glb-resume-", dir="/tmp"))
    errors: dict[str, str] = {}
    try:
        warm_up = not args.smoke  # smoke: one timed pair, nothing untimed
        parts = (("local", lambda: part_local(reps, scratch, not args.no_proposal, warm_up), args.no_local),
                 ("ssh", lambda: part_ssh(reps, scratch, not args.no_proposal, warm_up), args.no_ssh))  # fmt: skip
        for name, fn, skip in parts:
            if skip:
                continue
            try:
                data[name] = fn()
            except Exception as exc:  # noqa: BLE001 - one part's failure must not hide the other's figures
                errors[name] = f"{type(exc).__name__}: {exc}"
                print(f"{name}: FAILED {errors[name][:3000]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    data["errors"] = errors
    data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    for name in ("local", "ssh"):
        part = data.get(name)
        if part and "table" in part:
            print("\n".join(table_lines(name, part["table"])))
        elif part:
            print(f"{name}: skipped: {part['skipped']}")
    write_result("resume_time-smoke" if args.smoke and not args.out else "resume_time", data, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
