"""Whether a scaling comparison is fair: the machine's load during each stage (other work than
this job's own ranks), and the torch threads each rank ran with at each world size. The words
the summary and the plots' notes carry."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def stage_load(stage: Mapping[str, Any]) -> dict[str, Any] | None:
    """The stage's load average at start and end: the run loop's ``load_avg`` where it records one,
    else what the first rank saw at the start and end of its work."""
    if stage.get("load_avg"):
        return dict(stage["load_avg"])
    for r in sorted(stage.get("ranks", []), key=lambda r: r.get("rank", 0)):
        res = r.get("result") or {}
        start, end = (res.get("machine_start") or {}).get("load_avg"), (res.get("machine_end") or {}).get("load_avg")
        if start or end:
            return {"start": start, "end": end}
    return None


def stage_cores(stage: Mapping[str, Any]) -> int | None:
    for r in stage.get("ranks", []):
        cores = ((r.get("result") or {}).get("machine_start") or {}).get("cores")
        if cores:
            return int(cores)
    return None


def busy_stages(stages: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """The stages (by world size) during which other work than this job's own ranks kept more than
    half the cores busy, with the note their rows carry ("busy: load 3.24 on 2 cores"). The job's
    own threads are taken out of each 1-minute load reading: at a stage's end its own ranks', at
    its start the previous stage's, which the average still remembers."""
    out, previous = {}, 0
    for stage in stages:
        load, own, cores = stage_load(stage), _own_threads(stage), stage_cores(stage)
        if load and cores:
            start, end = (load.get("start") or [None])[0], (load.get("end") or [None])[0]
            readings = [(x, x - mine) for x, mine in ((start, previous), (end, own)) if x is not None]
            worst = max(readings, key=lambda r: r[1], default=None)
            if worst and worst[1] > cores / 2:
                out[stage["world_size"]] = f"busy: load {worst[0]:.2f} on {cores} cores"
        previous = own
    return out


def load_words(stages: Sequence[Mapping[str, Any]]) -> tuple[str | None, bool]:
    """"load average (1 min) at start->end of each stage: 1 worker(s) 0.4->1.1, ..." and whether the
    machine was busy during any stage (see ``busy_stages``)."""
    parts = []
    for stage in stages:
        load = stage_load(stage)
        if load:
            start, end = (load.get("start") or [None])[0], (load.get("end") or [None])[0]
            parts.append(f"{stage['world_size']} worker(s) " + "->".join("?" if x is None else f"{x:.2f}" for x in (start, end)))
    if not parts:
        return None, False
    return "load average (1 min) at start->end of each stage: " + ", ".join(parts), bool(busy_stages(stages))


def _own_threads(stage: Mapping[str, Any]) -> int:
    """The torch threads this stage's ranks ran on the first rank's host (the host whose load is read)."""
    ranks = sorted(stage.get("ranks", []), key=lambda r: r.get("rank", 0))
    host = ranks[0].get("host") if ranks else None
    return sum(int((r.get("result") or {}).get("threads") or 1) for r in ranks if r.get("host") == host)


def threads_words(threads: Mapping[int, Any], policy: set[str], cores: int | None, device: str) -> tuple[str, bool]:
    """The fairness sentence for the threads ranks ran with at each world size, and whether it is
    like for like (the same threads per rank at every world size)."""
    counts = {ws: t for ws, t in threads.items() if t is not None}
    same = len(set(counts.values())) <= 1
    if device != "cpu":
        return "each rank computes on a GPU of its own at every world size", True
    if not counts:
        return "threads per rank not recorded", False
    if same:
        t = next(iter(counts.values()))
        how = {"fair": "threads_per_rank default", "set": "threads_per_rank", "share": "the launcher's share"}
        why = ", ".join(how.get(p, p) for p in sorted(policy))
        most = max(counts)
        over = f"; {most} worker(s) x {t} thread(s) is more than the {cores} cores" if cores and most * t > cores else ""
        where = f" of this machine's {cores}" if cores else ""
        return (f"like for like: every rank ran {t} torch thread(s) at every world size ({why}), so N workers "
                f"use N x {t} core(s){where}{over}"), not over
    each = ", ".join(f"{ws} worker(s): {t}" for ws, t in sorted(counts.items()))
    return (f"NOT like for like: threads per rank differ by world size ({each}), so the efficiency mixes "
            "scaling with thread count (set params.threads_per_rank to compare like for like)"), False
