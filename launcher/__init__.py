"""gpulaunch: one YAML spec, one DDP worker per GPU, on one box, several servers or Ray.

The public API, importable without importing torch or Ray::

    from launcher import run_job, load_job, try_all_gpus
    result = run_job("jobs/matmul_scaling.yaml", overrides=["params.iters=5"])
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "run_job": "launcher.control.api",
    "dry_run": "launcher.control.api",
    "DryRun": "launcher.control.api",
    "load_job": "launcher.spec.model",
    "JobSpec": "launcher.spec.model",
    "RunResult": "launcher.results.store",
    "load_result": "launcher.results.store",
    "RunEvents": "launcher.stage.watch",
    "PlainEvents": "launcher.stage.watch",
    "StopRequest": "launcher.control.runloop",
    "discover": "launcher.hardware.devices",
    "NodeInventory": "launcher.hardware.devices",
    "cpu": "launcher.hardware.devices",
    "gpu": "launcher.hardware.devices",
    "num_gpus": "launcher.hardware.devices",
    "try_gpu": "launcher.hardware.devices",
    "try_all_gpus": "launcher.hardware.devices",
    "MetricsRecorder": "launcher.runtime.metrics",
    "WorkerContext": "launcher.runtime.context",
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
