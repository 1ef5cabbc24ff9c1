"""pydantic's validation errors, as one line per wrong field: ``FILE:LINE: dotted.field: expected ...``.

Shared by the job spec, a workload's ``params`` and the cluster file, so that every bad input
reads the same way, with a "did you mean" for misspelt keys.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable, Mapping

from pydantic import BaseModel, ValidationError

from launcher.spec.yamlsource import SourcedData

Loc = tuple[Any, ...]


def located_problems(
    exc: ValidationError,
    sourced: SourcedData,
    model: type[BaseModel],
    prefix: Loc = (),
    *,
    skip: Callable[[Loc], bool] = lambda loc: False,
    pattern_hints: Mapping[str, str] | None = None,
) -> list[str]:
    """One line per wrong field of ``model``, which validated the data found at ``prefix`` in
    ``sourced``. ``skip``: errors reported elsewhere; ``pattern_hints``: words for a regex."""
    # A union field fails once per member; report it once, with every accepted form.
    grouped: dict[Loc, list[Any]] = {}
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not _is_union_tag(p))
        if not skip(loc):
            grouped.setdefault(loc, []).append(err)
    # a list whose items failed is also "too short after validation": say only what is wrong
    for loc in [k for k, errs in grouped.items() if errs[0]["type"] == "too_short"]:
        if any(other[: len(loc)] == loc and other != loc for other in grouped):
            del grouped[loc]
    return [_describe(loc, errs, sourced, model, prefix, pattern_hints or {}) for loc, errs in grouped.items()]


def did_you_mean(key: str, choices: Any) -> str:
    hint = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f", did you mean '{hint[0]}'?" if hint else f" (expected one of: {', '.join(sorted(choices))})"


def _describe(loc: Loc, errs: list[Any], sourced: SourcedData, model: type[BaseModel], prefix: Loc, hints: Mapping[str, str]) -> str:
    err = errs[0]
    full = (*prefix, *loc)
    where = sourced.locate(full)
    dotted = ".".join(str(p) for p in full if p != "[key]") or "(top level)"  # pydantic marks a bad key
    if err["type"] == "extra_forbidden":
        return f"{field_label(where, dotted)}: unknown key{did_you_mean(str(loc[-1]), _field_names(model, loc[:-1]))}"
    if err["type"] == "missing":
        return f"{field_label(where, dotted)}: required field is missing"
    msg = " or ".join(_expectation(e, hints) for e in errs).replace(" or expected ", " or ")
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) else " (got null)" if got is None else f" (got {got!r})"
    return f"{field_label(where, dotted)}: {msg}{shown}"


def field_label(where: Any, dotted: str) -> str:
    """``FILE:LINE: field`` or ``--set field`` (the flag already names the field)."""
    return str(where) if str(where) == f"--set {dotted}" else f"{where}: {dotted}"


def _expectation(err: Any, hints: Mapping[str, str]) -> str:
    if err["type"] == "string_pattern_mismatch":
        pattern = err["ctx"]["pattern"]
        return hints.get(pattern, f"expected text matching {pattern}")
    if err["type"] == "too_short":
        return f"expected at least {err['ctx']['min_length']} item(s)"
    if err["type"] == "model_type":
        return "expected a mapping of fields"
    msg = str(err["msg"]).replace("Value error, ", "")
    return re.sub(r"^Input should be ", "expected ", msg)


def _is_union_tag(part: Any) -> bool:
    # pydantic adds the union member's name ("int", "literal['auto']") to the error location.
    return isinstance(part, str) and (
        part in {"int", "float", "str", "bool"} or part.startswith(("literal[", "function-", "constrained-"))
    )


def _field_names(root: type[BaseModel], loc: Loc) -> list[str]:
    model: Any = root
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return []
    return list(model.model_fields)
