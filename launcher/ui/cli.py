"""The command line: the only module that sees argv. It picks a file, a backend and a few
overrides, calls the API, and maps errors to exit codes (0 ok, 1 job failed, 2 bad input,
130 interrupted). Heavy modules are imported only on the paths that need them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn, Sequence

from launcher.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK, LauncherError
from launcher.records import BackendName

if TYPE_CHECKING:
    from launcher.spec.model import LoadedJob
    from launcher.stage.engine import JobInfo


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        raise LauncherError(f"{self.prog}: {message} (see {self.prog} --help)", exit_code=EXIT_BAD_INPUT)


def _run_parser() -> _Parser:
    p = _Parser(
        prog="launch",
        description="Run a YAML job spec on every GPU of one or more nodes (torchrun, Ray or Slurm).",
        epilog=(
            "other commands: launch selftest [--quick|--full] [--json] [--cluster FILE] | launch devices [--json] | launch validate JOB.yaml... | launch report RUN_DIR|JOB_DIR | launch resume RUN_DIR | launch runs [JOB] | "
            "launch status|logs|stop JOB_ID [--address URL] (a Ray job, or a numeric Slurm job id) | "
            "launch attach|status|logs|stop|fetch|resume RUN --cluster FILE (a run started with --cluster FILE --detach) | "
            "launch attach RUN_OR_JOB_ID [--address URL | --backend slurm] (a Ray or Slurm run, e.g. one started with --detach)"
        ),
    )
    p.add_argument("job", help="the job spec, e.g. jobs/matmul_scaling.yaml")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the exact commands; spawn nothing")
    p.add_argument(
        "--inventory", metavar="FILE",
        help="with --dry-run: plan for a recorded node instead of this one (launch devices --json, or python -m launcher.hardware.nvml --record)",
    )  # fmt: skip
    p.add_argument("--preflight", action="store_true", help="with --dry-run and a cluster file: log in to every host and plan on what it has")
    p.add_argument("--backend", help=f"override the spec's backend ({', '.join(BackendName.names())}, or an engine registered in launcher.backends)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a spec field, e.g. --set resources.cpu_workers=4")
    p.add_argument("--out", default="runs", help="root of run directories (default: runs/)")
    p.add_argument("--cluster", help="cluster file listing the hosts (configs/cluster.example.yaml)")
    p.add_argument("--address", help="Ray cluster to submit to, e.g. http://127.0.0.1:8265 (Ray Jobs API)")
    p.add_argument("--quiet", action="store_true", help="no rank output on the console (logs still written)")
    p.add_argument("--json", action="store_true", help="print result.json (or the dry-run plan) as JSON on stdout")
    p.add_argument("--no-metrics", action="store_true", help="serve no Prometheus /metrics endpoint while the run is live")
    p.add_argument(
        "--detach", action="store_true",
        help="start the run and return: with --cluster FILE (SSH) its run loop runs on the cluster's controller host, with --address URL (Ray) "
        "it is a Ray job, on the slurm backend a batch job; then launch attach|status|logs|stop RUN (with the same --cluster or --address)",
    )  # fmt: skip
    return p


def cmd_run(argv: Sequence[str]) -> int:
    args = _run_parser().parse_args(argv)
    from launcher.spec.model import load_job

    if args.preflight and not args.dry_run:
        raise LauncherError("--preflight goes with --dry-run (a run always checks its hosts first)", exit_code=EXIT_BAD_INPUT)
    if args.inventory and not args.dry_run:
        raise LauncherError("--inventory plans a dry run of a recorded node: add --dry-run (a run uses the nodes it is on)", exit_code=EXIT_BAD_INPUT)
    job = load_job(args.job, args.overrides)
    if args.dry_run:
        return _print_dry_run(job, args)
    if args.detach:
        from launcher.control.remote_runs import wants_detached

        if wants_detached(job, backend=args.backend, cluster=args.cluster, address=args.address):
            return _detach_over_ssh(job, args)
    from rich.console import Console

    from launcher.control.api import run_job
    from launcher.ui.console import RunUI

    # with --json, stdout carries the JSON alone: the human summary goes to stderr
    ui = RunUI(Console(stderr=True), quiet=True) if args.json else RunUI(quiet=args.quiet)
    result = run_job(
        job, backend=args.backend, out=args.out, cluster=args.cluster, address=args.address, events=ui, metrics=not args.no_metrics, detach=args.detach
    )
    if args.detach and not args.json:  # submitted: what to follow it with (the submitter says)
        print(result.data.get("hint") or f"{result.data.get('job_id')}: submitted; launch status {result.data.get('job_id')}")
        return EXIT_OK
    if args.json:
        print(json.dumps(result.data, indent=2, default=str))
    return EXIT_OK if args.detach else result.exit_code


def _detach_over_ssh(job: LoadedJob, args: argparse.Namespace) -> int:
    """The run loop started on the cluster's controller host; back within seconds."""
    from launcher.control.remote_runs import detach

    started = detach(job, backend=args.backend, cluster=args.cluster, out=args.out, metrics=not args.no_metrics)
    if args.json:
        print(json.dumps({"run_id": started.run_id, "run_dir": started.run_dir, "host": started.host, "pid": started.pid}, indent=2))
        return EXIT_OK
    cfg = started.cluster
    print(f"run {started.run_id}: detached on {started.host} (controller pid {started.pid}), run directory {started.host}:{started.run_dir}")
    print(f"follow it: launch attach {started.run_id} --cluster {cfg}  (Ctrl-C leaves it running)")
    print(f"  launch status|logs|stop|fetch {started.run_id} --cluster {cfg}")
    return EXIT_OK


def _print_dry_run(job: LoadedJob, args: argparse.Namespace) -> int:
    from launcher.control.api import dry_run

    dry = dry_run(job, backend=args.backend, out=args.out, cluster=args.cluster, address=args.address, inventory=args.inventory, preflight=args.preflight)
    if args.json:
        print(json.dumps([p.masked() for p in dry.plans], indent=2))
        return EXIT_OK
    from rich.console import Console

    from rich.text import Text

    from launcher.ui.console import plan_renderables

    console = Console()
    for thing in plan_renderables(dry.plans, dry.requests):
        # env lines and commands are never wrapped: piped or pasted, each stays one runnable line
        console.print(thing, soft_wrap=isinstance(thing, Text))
    if dry.job.params:  # what the ranks would run with, the workload's defaults included
        console.print(f"params: {json.dumps(dict(dry.job.params))}", markup=False, highlight=False, soft_wrap=True)
    for note in dry.notes:
        console.print(f"note: {note}", style="yellow", markup=False, highlight=False)
    console.print("dry run: nothing was started")
    return EXIT_OK


def cmd_devices(argv: Sequence[str]) -> int:
    p = _Parser(prog="launch devices", description="Show this node's GPUs (like a compact nvidia-smi).")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from launcher.hardware.devices import discover

    inventory = discover()
    if args.json:
        print(inventory.to_json())
        return EXIT_OK
    from rich.console import Console

    from launcher.ui.console import devices_table
    from launcher.spec.model import Resources

    default_workers = Resources().cpu_workers
    for thing in devices_table(inventory, default_workers if isinstance(default_workers, int) else inventory.cpu_count):
        Console().print(thing)
    return EXIT_OK


def cmd_validate(argv: Sequence[str]) -> int:
    p = _Parser(prog="launch validate", description="Check job specs without running them.")
    p.add_argument("jobs", nargs="+")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    from launcher.control.api import check_job
    from launcher.spec.model import load_job

    bad = 0
    for path in args.jobs:
        try:
            job = load_job(path, args.overrides)
            planned = check_job(job)
        except LauncherError as exc:
            bad += 1
            print(str(exc), file=sys.stderr)
            continue
        print(f"ok  {path}: {job.spec.name} ({planned})")
    return EXIT_BAD_INPUT if bad else EXIT_OK


def cmd_resume(argv: Sequence[str]) -> int:
    p = _Parser(
        prog="launch resume",
        description="Continue a run that was stopped or preempted: same run id and directory; its jobs load their last checkpoints.",
    )
    p.add_argument("run_dir", help="the run's directory, e.g. runs/ddp_train/20261125-101500-a1b2c3")
    p.add_argument("--quiet", action="store_true", help="no rank output on the console (logs still written)")
    p.add_argument("--json", action="store_true", help="print result.json as JSON on stdout")
    p.add_argument("--no-metrics", action="store_true", help="serve no Prometheus /metrics endpoint while the run is live")
    p.add_argument("--cluster", help="a detached run's cluster file: RUN_DIR is its run id; its controller starts again on the controller host")
    args = p.parse_args(argv)
    if args.cluster:
        from launcher.control.remote_runs import resume

        started = resume(args.cluster, args.run_dir)
        print(f"run {started.run_id}: resuming on {started.host} (controller pid {started.pid}); follow it: launch attach {started.run_id} --cluster {args.cluster}")
        return EXIT_OK
    from rich.console import Console

    from launcher.control.api import resume_run
    from launcher.ui.console import RunUI

    ui = RunUI(Console(stderr=True), quiet=True) if args.json else RunUI(quiet=args.quiet)
    result = resume_run(args.run_dir, events=ui, metrics=not args.no_metrics)
    if args.json:
        print(json.dumps(result.data, indent=2, default=str))
    return result.exit_code


def cmd_selftest(argv: Sequence[str]) -> int:
    p = _Parser(
        prog="launch selftest",
        description=(
            "Check this node's GPUs, links and the launcher's own GPU paths (or every host of a cluster file, at once): "
            "one rank per GPU, each figure against the hardware's limit; selftest.json in the run directory. "
            "Exit 0: passed; 1: a check failed or a figure is low."
        ),
    )
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_const", dest="level", const="quick", help="about 30 s")
    speed.add_argument("--full", action="store_const", dest="level", const="full", help="every size and sweep (under 8 min on an 8-GPU node)")
    p.add_argument("--json", action="store_true", help="print selftest.json on stdout (the table goes to stderr)")
    p.add_argument("--cluster", help="cluster file: run on every host listed (cross-node all-reduce included)")
    p.add_argument("--out", default="runs", help="root of run directories (default: runs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a field of the selftest's spec")
    p.add_argument("--quiet", action="store_true", help="no rank output on the console (logs still written)")
    args = p.parse_args(argv)
    from rich.console import Console

    from launcher.control.selftest_run import run_selftest
    from launcher.ui.console import RunUI

    console = Console(stderr=True) if args.json else Console()
    ui = RunUI(console, quiet=args.json or args.quiet)
    outcome = run_selftest(args.level or "default", cluster=args.cluster, out=args.out, overrides=args.overrides, events=ui)
    if args.json:
        print(json.dumps(outcome.report, indent=2, default=str))
    else:
        console.print(f"selftest.json: {outcome.report_path}", markup=False, highlight=False, soft_wrap=True)
    if outcome.result.exit_code != EXIT_OK:
        return outcome.result.exit_code
    return EXIT_OK if outcome.passed else EXIT_JOB_FAILED


def cmd_report(argv: Sequence[str]) -> int:
    p = _Parser(prog="launch report", description="Re-render the table and plots of a past run.")
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    from launcher.ui.report import rerender

    return rerender(Path(args.run_dir))


def _job_command(name: str) -> Callable[[Sequence[str]], int]:
    def command(argv: Sequence[str]) -> int:
        p = _Parser(
            prog=f"launch {name}",
            description=f"{name} a run submitted to a scheduler: a Ray job (Ray Jobs API) or a Slurm job (a numeric id); or, with --cluster, a detached run (its run id)",
        )  # fmt: skip
        p.add_argument("job_id")
        p.add_argument("--address", help="the Ray dashboard, e.g. http://127.0.0.1:8265 (default: $RAY_API_SERVER_ADDRESS)")
        p.add_argument("--cluster", help="the cluster file of a run started with --cluster FILE --detach (job_id: its run id)")
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
            p.add_argument("--rank", type=int, help="with --cluster: only this rank's lines")
        if name == "status":
            p.add_argument("--json", action="store_true")
        args = p.parse_args(list(argv))
        if args.cluster:
            return _detached_command(name, args)
        from launcher.backends import submitter_for_id

        scheduler = submitter_for_id(args.job_id, args.address)  # each submitter is asked whether the id is its own
        if name == "status":
            return _print_job_status(scheduler.status(args.job_id), as_json=args.json)
        if name == "logs":
            scheduler.logs(args.job_id, follow=args.follow, echo=_print_line)
            return EXIT_OK
        info = scheduler.stop(args.job_id)
        print(f"{args.job_id}: {info.status}")
        return EXIT_OK if info.terminal else EXIT_JOB_FAILED

    return command


def _detached_command(name: str, args: argparse.Namespace) -> int:
    from launcher.control import remote_runs

    if name == "status":
        return _print_job_status(remote_runs.status(args.cluster, args.job_id), as_json=args.json)
    if name == "logs":
        remote_runs.logs(args.cluster, args.job_id, follow=args.follow, rank=args.rank, echo=_print_line)
        return EXIT_OK
    info = remote_runs.stop(args.cluster, args.job_id)
    print(f"{args.job_id}: {info.status}  {info.message}".rstrip())
    return EXIT_OK if info.terminal else EXIT_JOB_FAILED


def cmd_attach(argv: Sequence[str]) -> int:
    p = _Parser(
        prog="launch attach",
        description="Follow a detached run live from its start: rank output, progress, stragglers, hangs, failures, the summary. "
        "With --cluster FILE: a run started with --cluster FILE --detach; with --address URL: a Ray job (its run id or submission id); "
        "a numeric id or --backend slurm: a Slurm job (its job id, or its run id). "
        "Exit: the run's exit code once it ends; Ctrl-C leaves it running (exit 0); launch stop RUN stops it.",
    )
    p.add_argument("run", help="the run id launch --detach printed (a Slurm job id will do)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", help="the run's cluster file (its controller host)")
    where.add_argument("--address", help="the Ray dashboard the run was submitted to, e.g. http://127.0.0.1:8265 (default: $RAY_API_SERVER_ADDRESS)")
    where.add_argument("--backend", help="the scheduler the run was submitted to (slurm), where the id alone does not say")
    p.add_argument("--out", default="runs", help="root of run directories here, where a run's directory is brought back (default: runs/)")
    p.add_argument("--quiet", action="store_true", help="no rank output on the console")
    args = p.parse_args(argv)
    from launcher.ui.console import RunUI

    ui = RunUI(quiet=args.quiet)
    if args.cluster:
        from launcher.control.remote_runs import attach

        try:
            return attach(args.cluster, args.run, ui)
        except KeyboardInterrupt:
            ui.stage_finished()
            print(f"detached from run {args.run}; it goes on (launch attach {args.run} --cluster {args.cluster}, launch stop ...)", file=sys.stderr)
            return EXIT_OK
    from launcher import backends

    address = args.address
    if args.backend:
        if args.backend not in backends.submitter_names():
            raise LauncherError(f"--backend {args.backend}: no scheduler of that name (one of: {', '.join(backends.submitter_names())})",
                                exit_code=EXIT_BAD_INPUT)  # fmt: skip
        scheduler = backends.submitter_class(args.backend)(address=address)
    else:
        scheduler = backends.submitter_for_id(args.run, address)
    result = scheduler.attach(args.run, out=Path(args.out), events=ui)
    # None: detached (Ctrl-C); the scheduler said how to attach again or stop the run
    return EXIT_OK if result is None else result.exit_code


def cmd_fetch(argv: Sequence[str]) -> int:
    p = _Parser(prog="launch fetch", description="Bring a detached run's directory from its controller host to OUT/<job>/<run-id> here.")
    p.add_argument("run", help="the run id launch --detach printed")
    p.add_argument("--cluster", required=True, help="the run's cluster file (its controller host)")
    p.add_argument("--out", default="runs", help="root of run directories here (default: runs/)")
    args = p.parse_args(argv)
    from launcher.control.remote_runs import fetch

    dest = fetch(args.cluster, args.run, args.out, say=print)
    print(f"run directory: {dest}")
    return EXIT_OK


def _print_line(source: str, text: str) -> None:
    print(f"{source} {text}" if source else text, flush=True)


def _print_job_status(info: JobInfo, *, as_json: bool) -> int:
    if as_json:
        print(json.dumps(info.to_dict(), indent=2))
        return EXIT_OK
    print(f"{info.job_id}: {info.status}  {info.message}".rstrip())
    if info.metadata:
        print("  " + ", ".join(f"{k}={v}" for k, v in sorted(info.metadata.items())))
    return EXIT_OK


def cmd_runs(argv: Sequence[str]) -> int:
    p = _Parser(prog="launch runs", description="List past runs, newest first.")
    p.add_argument("job", nargs="?", help="only this job's runs")
    p.add_argument("--out", default="runs", help="root of run directories (default: runs/)")
    p.add_argument("--limit", type=int, default=20)
    args = p.parse_args(argv)
    from launcher.ui.report import list_runs

    return list_runs(Path(args.out), args.job, args.limit)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "devices": cmd_devices,
    "validate": cmd_validate,
    "report": cmd_report,
    "resume": cmd_resume,
    "selftest": cmd_selftest,
    "runs": cmd_runs,
    "status": _job_command("status"),
    "logs": _job_command("logs"),
    "stop": _job_command("stop"),
    "attach": cmd_attach,
    "fetch": cmd_fetch,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS and not Path(argv[0]).is_file():
            return COMMANDS[argv[0]](argv[1:])
        return cmd_run(argv)
    except LauncherError as exc:
        for line in str(exc).splitlines() or ["failed"]:
            print(f"error: {line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def entry() -> None:
    """The ``launch`` command: exits without the interpreter's teardown of modules (with torch
    imported it takes a tenth of a second and more, and does nothing a finished command needs);
    atexit handlers still run and the streams are flushed."""
    from launcher.procutil import fast_exit

    fast_exit(main())
