"""Test entrypoint: ``matmul_scaling`` with one more param, ``note``: free text that every rank
hands back as it received it, so a test can check that spec values reach remote ranks as data."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from launcher.workloads import matmul
from launcher.workloads.matmul import plot  # noqa: F401 - the job's own plots


class Params(matmul.Params):
    note: str = ""


def _matmul_params(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k != "note"}


def run(ctx: Any) -> dict[str, Any]:
    note = Params.model_validate(ctx.params).note
    result = matmul.run(dataclasses.replace(ctx, params=_matmul_params(ctx.params)))
    return {**result, "note": note}


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    return matmul.summarize(stages, _matmul_params(params))
