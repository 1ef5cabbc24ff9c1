"""pydantic field types for what people type in YAML, shared by the job spec and a workload's
``params`` (which the ranks import too, so this module needs nothing but pydantic)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator


def _number(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a valid number")  # `run_s: yes` is a mistake, not 1 s
    return value


# A float field as YAML users write one: 60, 1.5 and 1e-3 (which YAML 1.1 reads as text); never a boolean.
Real = Annotated[float, BeforeValidator(_number)]
