"""The light CLI paths answer at once: ``launch --help``, ``launch validate``, ``launch --dry-run``
and ``launch devices``, timed from spawn to exit (median of several runs), and checked with
``python -X importtime`` that neither torch nor ray is imported on those paths.

    python benchmarks/cli_latency.py            # 15 runs of each, interleaved
    python benchmarks/cli_latency.py --smoke    # 1 run of each
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO, base_parser, bench_env, fmt, machine_info, rotate, run_timed, summary, launch_cli, write_result,
)

JOB = str(REPO / "jobs" / "matmul_scaling.yaml")
COMMANDS = {
    "--help": ["--help"],
    "validate": ["validate", JOB],
    "--dry-run": [JOB, "--dry-run"],
    "--dry-run --json": [JOB, "--dry-run", "--json"],
    "devices": ["devices"],
}
HEAVY = ("torch", "ray", "numpy", "matplotlib")
TARGET_S = 1.0


def imported_modules(args: list[str], cwd: str) -> tuple[list[str], int]:
    """Top-level packages imported by ``python -X importtime -m launcher ARGS`` and the exit code."""
    done = run_timed([sys.executable, "-X", "importtime", "-m", "launcher", *args], env=bench_env(), cwd=cwd, timeout_s=60)
    mods = set()
    for line in done.output.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name and name != "imported package":
                mods.add(name.split(".")[0])
    return sorted(mods), done.rc


def main(argv: list[str] | None = None) -> int:
    args = base_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    reps = args.reps or (1 if args.smoke else 15)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    rcs: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="glb-cli-") as cwd:  # --dry-run must create nothing here
        python_floor = [run_timed([sys.executable, "-c", "pass"], cwd=cwd).wall_s for _ in range(reps)]
        for k in range(reps + 1):  # k == 0 is an untimed warm-up
            for name in rotate(list(COMMANDS), k):
                done = run_timed([*launch_cli(), *COMMANDS[name]], env=bench_env(), cwd=cwd, timeout_s=60)
                rcs[name] = done.rc
                if k:
                    times[name].append(done.wall_s)
        imports = {}
        for name, cmd in COMMANDS.items():
            mods, _ = imported_modules(cmd, cwd)
            imports[name] = {"heavy_imported": [m for m in HEAVY if m in mods], "module_count": len(mods)}
        left_behind = sorted(p.name for p in Path(cwd).iterdir())
    rows = {}
    print(f"CLI latency, {reps} runs each; median [min..max] seconds (python -c pass: {fmt(summary(python_floor)['median'])}s)")
    for name in COMMANDS:
        s = summary(times[name])
        ok = rcs[name] == 0 and not imports[name]["heavy_imported"] and s["median"] is not None and s["median"] < TARGET_S
        rows[name] = {"wall_s": s, "exit_code": rcs[name], **imports[name], "meets_target": ok}
        print(f"  launch {name:18s} {fmt(s['median'])} [{fmt(s['min'])}..{fmt(s['max'])}]  exit {rcs[name]}  "
              f"heavy imports: {imports[name]['heavy_imported'] or 'none'}")
    if left_behind:
        print(f"  note: the working directory was left with {left_behind}")
    write_result("cli_latency", {
        "benchmark": "cli_latency", "mode": "smoke" if args.smoke else "full" if args.full else "default",
        "reps": reps, "target_s": TARGET_S, "machine": machine_info(), "python_startup_s": summary(python_floor),
        "commands": rows, "files_left_in_cwd": left_behind,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
