"""Everything the terminal shows, rendered with rich: devices, plans, live progress, summaries.

``RunUI`` is what ``run_job`` talks to while a job runs. It prints rank output prefixed
``host:rank`` and, on a terminal only, a live status line; it is quiet when not a terminal.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from launcher.devices import NodeInventory
from launcher.plan import LaunchPlan
from launcher.spec import mask_env

_RANK_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")


def devices_table(inv: NodeInventory, cpu_workers: int) -> list[Any]:
    """A compact ``nvidia-smi``: one row per visible GPU, or a plain word that there is none."""
    out: list[Any] = []
    if inv.gpus:
        table = Table(title=f"{inv.hostname}: {inv.gpu_count} GPU(s), {inv.cpu_count} CPU core(s)")
        for col in ("idx", "name", "memory used / total (MiB)", "util", "uuid"):
            table.add_column(col)
        for g in inv.gpus:
            used = "?" if g.memory_used_mib is None else str(g.memory_used_mib)
            util = "?" if g.utilization_pct is None else f"{g.utilization_pct}%"
            if g.physical_index < 0:
                shown = f"{g.index} (MIG)"
            else:
                shown = f"{g.index}" if g.index == g.physical_index else f"{g.index} (phys {g.physical_index})"
            table.add_row(shown, g.name, f"{used} / {g.memory_total_mib}", util, g.uuid)
        out.append(table)
    else:
        out.append(
            Text(
                f"{inv.hostname}: no GPU visible; jobs run on the CPU with {cpu_workers} worker process(es) "
                f"sharing {inv.cpu_count} core(s) (resources.cpu_workers)."
            )
        )
    out.extend(Text(f"note: {n}", style="dim") for n in inv.notes)
    return out


def plan_renderables(plans: Sequence[LaunchPlan], commands: Sequence[Sequence[str]]) -> list[Any]:
    """Per stage: the rank table, each node's env, and what the backend would run (its own lines)."""
    out: list[Any] = []
    for plan, cmds in zip(plans, commands):
        table = Table(title=f"{plan.job}: world size {plan.world_size}, rendezvous {plan.master_addr}:{plan.master_port}")
        for col in ("rank", "node", "host", "local", "device", "pg", "log"):
            table.add_column(col)
        for r in plan.ranks:
            table.add_row(str(r.rank), str(r.node_rank), r.host, str(r.local_rank), r.device, r.pg_backend, r.log_path)
        out.append(table)
        for node in plan.nodes:
            env = " ".join(f"{k}={v}" for k, v in mask_env(node.env).items())
            out.append(Text(f"[{node.host}] env: {env}", style="dim"))
        out.extend(Text(line) for line in cmds)
    return out


def summary_renderables(result: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    stages = Table(title=f"{result['job']} [{result['backend']}]: {result['status']}")
    for col in ("world", "status", "restarts", "wall s", "spawn", "import", "rendezvous", "run", "to 1st step"):
        stages.add_column(col, justify="right")
    for s in result["stages"]:
        p = s["phases"]
        stages.add_row(
            str(s["world_size"]),
            s["status"],
            str(s["restarts"]),
            f"{s['wall_s']:.2f}",
            *(_seconds(p.get(k)) for k in ("spawn", "import", "rendezvous", "run", "to_first_step")),
        )
    out.append(stages)
    summary = result.get("summary") or {}
    if summary.get("rows"):
        table = Table(title=summary.get("title", "summary"))
        columns = summary.get("columns") or list(summary["rows"][0])
        for col in columns:
            table.add_column(col, justify="right")
        for row in summary["rows"]:
            table.add_row(*(_cell(row.get(c)) for c in columns))
        out.append(table)
    for line in summary.get("conclusions", ()):
        out.append(Text(f"• {line}"))
    if summary.get("error"):
        out.append(Text(f"the job's summary failed: {summary['error']}", style="yellow"))
    if result.get("plot_error"):
        out.append(Text(f"the job's plots failed: {result['plot_error']}", style="yellow"))
    if result.get("failure"):
        out.extend(failure_renderables(result["failure"]))
    return out


def failure_renderables(failure: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = [Text(f"FAILED: {failure['summary']}", style="bold red")]
    root = failure.get("root_cause")
    if root:
        out.append(Text(f"root cause: host {root['host']}, rank {root['rank']}, local rank {root['local_rank']}, device {root['device']}"))
        if root.get("traceback"):
            out.append(Text(root["traceback"].rstrip(), style="red"))
        if root.get("log_tail"):
            out.append(Text(f"last lines of rank {root['rank']}'s log:", style="dim"))
            out.append(Text("\n".join(root["log_tail"]), style="dim"))
    if failure.get("collateral_ranks"):
        out.append(Text(f"stopped as collateral: ranks {failure['collateral_ranks']}", style="yellow"))
    if failure.get("stuck_ranks"):
        out.append(Text(f"stuck ranks (stacks dumped to their logs): {failure['stuck_ranks']}", style="yellow"))
    return out


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


class RunUI:
    """Console side of a run. ``quiet`` keeps only rank output off; errors are always shown."""

    def __init__(self, console: Console | None = None, *, quiet: bool = False, echo_ranks: bool = True) -> None:
        self.console = console or Console(stderr=False)
        self.quiet = quiet
        self.echo_ranks = echo_ranks and not quiet
        self._live: Live | None = None
        self._lock = threading.Lock()

    def print(self, *things: Any) -> None:
        if not self.quiet:
            self.console.print(*things)

    def echo(self, source: str, text: str) -> None:
        if not self.echo_ranks:
            return
        rank = source.rpartition(":")[2]
        style = _RANK_STYLES[int(rank) % len(_RANK_STYLES)] if rank.isdigit() else "dim"
        with self._lock:
            self.console.print(Text.assemble((f"{source} ", style), text), highlight=False, markup=False, soft_wrap=True)

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self.print(Text(f"▶ {job}: world size {world_size} on {device_type} ({backend})", style="bold"))
        if self.console.is_terminal and not self.quiet:
            self._live = Live(Text(""), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def progress(self, plan: LaunchPlan, snap: Mapping[str, Any]) -> None:
        if self._live is None:
            return
        phases = ", ".join(f"{n} {p}" for p, n in sorted(snap["phases"].items()))
        steps = snap["steps_max"] if snap["steps_min"] == snap["steps_max"] else f"{snap['steps_min']}-{snap['steps_max']}"
        self._live.update(Text(f"  world {plan.world_size} · {phases} · steps {steps} · {snap['elapsed_s']:.1f}s", style="dim"))

    def stage_finished(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def finished(self, result: Mapping[str, Any], run_dir: str) -> None:
        for thing in summary_renderables(result):
            self.console.print(thing)
        self.console.print(Text(f"run directory: {run_dir}", style="bold"))
