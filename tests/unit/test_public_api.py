"""Pin the public API and keep the CLI's light paths light."""

from __future__ import annotations

import subprocess
import sys

import launcher


def test_public_names_are_pinned():
    assert launcher.__all__ == sorted(
        [
            "DryRun", "JobSpec", "LauncherError", "MetricsRecorder", "NodeInventory", "PlainEvents", "PlanError",
            "RunEvents", "RunResult", "SpecError", "StopRequest", "WorkerContext", "cpu", "discover", "dry_run", "gpu",
            "load_job", "load_result", "num_gpus", "run_job", "try_all_gpus", "try_gpu",
        ]
    )
    for name in launcher.__all__:
        assert getattr(launcher, name) is not None


def test_help_validate_and_dry_run_import_neither_torch_nor_ray():
    code = (
        "import sys\n"
        "from launcher.ui.cli import main\n"
        "for argv in (['validate', 'jobs/matmul_scaling.yaml'], ['jobs/matmul_scaling.yaml', '--dry-run', '--json']):\n"
        "    assert main(argv) == 0\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray'))\n"
        "print('HEAVY', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in done.stdout


def test_cli_main_maps_errors_to_exit_codes(capsys, tmp_path):
    from launcher.ui.cli import main

    assert main(["no/such/job.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "error: no/such/job.yaml: no such job spec"
    assert main(["jobs/matmul_scaling.yaml", "--backend", "pbs"]) == 2
    assert "unknown backend 'pbs' (expected one of: torchrun, ray, slurm)" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "result.json: missing" in capsys.readouterr().err
