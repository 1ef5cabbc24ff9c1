"""gpulaunch: one YAML spec, one DDP worker per GPU, on one box, several servers or Ray.

The public API, importable without importing torch or Ray::

    from launcher import run_job, load_job, try_all_gpus
    result = run_job("jobs/matmul_scaling.yaml", overrides=["params.iters=5"])
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "run_job": "launcher.api",
    "dry_run": "launcher.api",
    "DryRun": "launcher.api",
    "load_job": "launcher.spec",
    "JobSpec": "launcher.spec",
    "RunResult": "launcher.results",
    "load_result": "launcher.results",
    "discover": "launcher.devices",
    "NodeInventory": "launcher.devices",
    "cpu": "launcher.devices",
    "gpu": "launcher.devices",
    "num_gpus": "launcher.devices",
    "try_gpu": "launcher.devices",
    "try_all_gpus": "launcher.devices",
    "MetricsRecorder": "launcher.metrics",
    "WorkerContext": "launcher.context",
    "LauncherError": "launcher.errors",
    "SpecError": "launcher.errors",
    "PlanError": "launcher.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy: `import launcher` stays instant; torch loads only when a helper needs it.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'launcher' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
