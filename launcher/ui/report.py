"""``launch report RUN_DIR``: re-render a past run's table and plots from its result.json.

``RUN_DIR`` may also be a job's directory (``runs/<job>``): its latest run is rendered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.errors import EXIT_BAD_INPUT, EXIT_OK, LauncherError
from launcher.results.hooks import make_plots, workload_module
from launcher.results.store import RESULT_FILE, load_result, write_result


def latest_run(path: Path) -> Path:
    """``path`` itself when it holds a result, else its newest run directory that does."""
    if (path / RESULT_FILE).is_file():
        return path
    runs = sorted((p.parent for p in path.glob(f"*/{RESULT_FILE}")), key=lambda p: p.name)
    if not runs:
        raise LauncherError(
            f"{path / RESULT_FILE}: missing or unreadable; expected a run directory (runs/<job>/<run-id>) or a job's directory",
            exit_code=EXIT_BAD_INPUT,
        )
    return runs[-1]  # run ids start with the time they started: the last one is the newest


def rerender(path: Path) -> int:
    run_dir = latest_run(path)
    result = load_result(run_dir)
    if result is None:
        raise LauncherError(f"{run_dir / RESULT_FILE}: unreadable; expected a run's result.json", exit_code=EXIT_BAD_INPUT)
    from launcher.ui.console import RunUI

    spec = result.get("spec") or {}
    module, error = None, None
    try:
        module = workload_module(spec.get("entrypoint"), (spec.get("env") or {}).get("PYTHONPATH", ""))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the workload's own import: results stay
        error = f"importing the workload: {type(exc).__name__}: {exc}"
    plots, plot_error = make_plots(result, run_dir, module)
    result = {k: v for k, v in result.items() if k != "plot_error"}
    result.update(plots=list(plots), **({"plot_error": error or plot_error} if error or plot_error else {}))
    write_result(run_dir, result)
    RunUI().show_result(result, run_dir)
    return EXIT_OK


def _headline(result: dict[str, Any]) -> str:
    """The run's one figure worth a glance: the job's own ``summary.headline`` when it gives one,
    else its wall time, its steps per rank where it counted any (a ``script:`` job, or one that
    never calls ``ctx.metrics.step()``, counts none: its 0 is no measurement) and, where no steps
    say what it did, how its ranks ended; a failure's summary line for a failed run."""
    summary = result.get("summary") or {}
    failure = result.get("failure") or {}
    if failure:
        from launcher.ui.console import resume_hint

        said, command = resume_hint(str(failure.get("summary", "")))  # a command is never cut: the run's row says where
        return said[:120] + ("; launch resume goes on with it" if command else "")
    if summary.get("headline"):
        return str(summary["headline"])
    parts = [f"{result['wall_s']:.1f} s"] if isinstance(result.get("wall_s"), (int, float)) else []
    steps = summary.get("steps_per_rank")
    if isinstance(steps, (int, float)) and not isinstance(steps, bool) and steps > 0:
        parts.append(f"{steps:g} steps/rank")
    else:
        parts.extend(_exits(result))
    return ", ".join(parts)


def _exits(result: dict[str, Any]) -> list[str]:
    """How the ranks ended: "2/2 ranks exit 0" where they all returned (a script's exit status 0,
    an entrypoint's return); nothing where the result lists no rank."""
    ranks = [r for r in result.get("ranks") or () if isinstance(r, dict)]
    if not ranks:
        return []
    ok = sum(1 for r in ranks if r.get("status") == "ok")
    return [f"{ok}/{len(ranks)} rank{'s' if len(ranks) > 1 else ''} exit 0"]


def list_runs(root: Path, job: str | None = None, limit: int = 20) -> int:
    """``launch runs [JOB] [--out DIR]``: the latest runs under ``root``, newest first."""
    from rich.console import Console

    from launcher.ui.console import runs_table

    pattern = f"{job}/*/{RESULT_FILE}" if job else f"*/*/{RESULT_FILE}"
    found = sorted(root.glob(pattern), key=lambda p: p.parent.name, reverse=True)[:limit]
    rows = []
    for path in found:
        result = load_result(path.parent) or {}
        rows.append((
            str(result.get("job", path.parent.parent.name)),
            path.parent.name,
            str(result.get("status", "?")),
            ",".join(map(str, result.get("world_sizes") or [])) or "-",
            str(result.get("backend", "?")),
            _headline(result),
        ))
    console = Console()
    if not rows:
        console.print(f"no runs under {root}" + (f" for job {job}" if job else ""))
        return EXIT_OK
    console.print(runs_table(f"runs under {root}", rows))
    return EXIT_OK
