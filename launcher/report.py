"""``launch report RUN_DIR``: re-render a past run's table and plots from its result.json."""

from __future__ import annotations

from pathlib import Path

from launcher.errors import EXIT_BAD_INPUT, EXIT_OK, LauncherError
from launcher.results import RESULT_FILE, attach_plots, load_result, write_result


def rerender(run_dir: Path) -> int:
    result = load_result(run_dir)
    if result is None:
        raise LauncherError(f"{run_dir / RESULT_FILE}: missing or unreadable; expected a run directory", exit_code=EXIT_BAD_INPUT)
    from launcher.console import RunUI

    spec = result.get("spec") or {}
    attach_plots(result, run_dir, spec.get("entrypoint"), (spec.get("env") or {}).get("PYTHONPATH", ""))
    write_result(run_dir, result)
    RunUI().finished(result, str(run_dir))
    for plot in result["plots"]:
        print(f"plot: {run_dir / plot}")
    return EXIT_OK
