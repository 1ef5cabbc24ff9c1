"""A workload's ``params``: the base model and the field types the workloads share.

The launcher checks a spec's ``params`` against a workload's ``Params`` before it spawns anything
(unknown keys and wrong types exit 2 with the spec's file and line); the ranks read them with their
defaults.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from launcher.fieldtypes import Real


class WorkloadParams(BaseModel):
    """A workload's ``params``, checked by the launcher before anything is spawned (unknown keys
    and wrong types exit 2 with the spec's file and line) and read by the ranks with defaults;
    ``null`` means the default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # `--set params.steps=null`, or a spec unsetting what the file it extends set
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, Mapping) else data


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _distinct(values: tuple[Any, ...]) -> tuple[Any, ...]:
    if len(set(values)) != len(values):
        raise ValueError("expected each size once")  # a repeated size would be timed, and counted, twice
    return values


Count = Annotated[StrictInt, Field(ge=1)]


NonNegative = Annotated[StrictInt, Field(ge=0)]


Positive = Annotated[Real, Field(gt=0)]


# `sizes: 64` means `sizes: [64]`
Sizes = Annotated[tuple[Count, ...], BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)]


PositiveSizes = Annotated[tuple[Positive, ...], BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)]


DtypeName = Literal["float16", "bfloat16", "float32", "float64"]


# torch threads per rank: a count, or "share" (the launcher's share of the node's cores, which
# shrinks as the world size grows); null: 1 on the CPU (the same at every world size), the
# launcher's share on a GPU (where each rank computes on a device of its own)
ThreadsPerRank = Count | Literal["share"] | None
