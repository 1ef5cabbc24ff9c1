"""Everything the terminal shows, rendered with rich: devices, plans, live progress, summaries.

``RunUI`` is what ``run_job`` talks to while a job runs. It prints rank output prefixed
``host:rank`` and, on a terminal only, a live status line; it is quiet when not a terminal.
"""

from __future__ import annotations

import os
import re
import shlex
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
from rich.live import Live
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from launcher.masking import mask_env
from launcher.results.series import timer_summary
from launcher.results.store import RunResult
from launcher.hardware.devices import NodeInventory
from launcher.stage.engine import LaunchRequest
from launcher.stage.plan import StagePlan
from launcher.stage.watch import RunEvents, StageProgress

_RANK_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")


def devices_table(inv: NodeInventory, cpu_workers: int) -> list[Any]:
    """A compact ``nvidia-smi``: one row per visible GPU, or a plain word that there is none."""
    out: list[Any] = []
    if inv.gpus:
        rows = []
        for g in inv.gpus:
            used = "?" if g.memory_used_mib is None else str(g.memory_used_mib)
            util = "?" if g.utilization_pct is None else f"{g.utilization_pct}%"
            if g.physical_index < 0:
                shown = f"{g.index} (MIG)"
            else:
                shown = f"{g.index}" if g.index == g.physical_index else f"{g.index} (phys {g.physical_index})"
            rows.append((shown, g.name, f"{used} / {g.memory_total_mib}", util, g.uuid))
        columns = [
            _Col("idx", justify="left"),
            _Col("name", justify="left", whole=False),
            _Col("memory used / total (MiB)", justify="left"),
            _Col("util", justify="left"),
            _Col("uuid", justify="left", whole=False),
        ]
        out.append(_FittedTable(f"{inv.hostname}: {inv.gpu_count} GPU(s), {inv.cpu_count} CPU core(s)", columns, rows))
    else:
        out.append(
            Text(
                f"{inv.hostname}: no GPU visible; jobs run on the CPU with {cpu_workers} worker process(es) "
                f"sharing {inv.cpu_count} core(s) (resources.cpu_workers)."
            )
        )
    out.extend(Text(f"note: {n}", style="dim") for n in inv.notes)
    return out


def runs_table(title: str, rows: Sequence[Sequence[str]]) -> Any:
    """``launch runs``: job, run id (when it started), status, world sizes, backend, headline."""
    names = ("job", "run", "status", "world sizes", "backend", "headline")
    columns = [_Col(name, justify="left", whole=name not in ("headline", "job")) for name in names]
    return _FittedTable(title, columns, rows)


def plan_renderables(plans: Sequence[StagePlan], requests: Sequence[LaunchRequest]) -> list[Any]:
    """Per stage: the rank table, each node's env, and the backend's own launch request."""
    out: list[Any] = []
    # host names may wrap: they are what is long, the rest is short and must stay whole
    names = ("rank", "node", "host", "local", "device", "pg")
    columns = [_Col(name, justify="left", whole=name != "host") for name in names]
    for plan, request in zip(plans, requests):
        rows = [(str(r.rank), str(r.node_rank), r.host, str(r.local_rank), r.device, plan.pg_backend) for r in plan.ranks]
        title = f"{plan.job}: world size {plan.world_size}, rendezvous {plan.rendezvous}"
        out.append(_FittedTable(title, columns, rows))
        # each log path under the table, whole on its own line (a table column would fold it at 80
        # columns): printed as a Text, it is never wrapped, so it can be copied as it is
        width = len(str(max((r.rank for r in plan.ranks), default=0)))
        out.append(Text("\n".join(f"rank {r.rank:<{width}} log: {plan.paths.log(r.rank)}" for r in plan.ranks), style="dim"))
        for node in plan.nodes:
            env = " ".join(f"{k}={v}" for k, v in mask_env(node.env).items())
            out.append(Text(f"[{node.host}] env: {env}", style="dim"))
        out.extend(Text(line) for line in request.lines())
    return out


def summary_renderables(result: Mapping[str, Any], *, traceback_shown: bool = False) -> list[Any]:
    """The end-of-run summary: one row per stage, the workload's own table and conclusions, any failure."""
    out: list[Any] = []
    stage_rows = [
        (
            str(s["world_size"]),
            s["status"],
            str(s["restarts"]),
            f"{s['wall_s']:.2f}",
            *(_seconds(s["phases"].get(k)) for k in ("spawn", "import", "rendezvous", "pg_init", "run", "to_first_step")),
        )
        for s in result["stages"]
    ]
    out.append(_FittedTable(f"{result['job']} [{result['backend']}]: {result['status']}", _STAGE_COLUMNS, stage_rows))
    out.extend(history_renderables(result))
    out.extend(timer_renderables(result))
    summary = result.get("summary") or {}
    if summary.get("rows"):
        names = summary.get("columns") or list(summary["rows"][0])
        rows = [[_cell(row.get(c)) for c in names] for row in summary["rows"]]
        # a column of words (transfer's "host memcpy (no device)") may wrap; numbers and single tokens stay whole
        columns = [_Col(c, whole=not any(" " in row[i] for row in rows)) for i, c in enumerate(names)]
        out.append(_FittedTable(str(summary.get("title") or "summary"), columns, rows))
    for line in summary.get("conclusions", ()):
        out.append(Text(f"• {line}"))
    out.extend(_straggler_lines(result["stages"]))
    out.extend(_recovery_lines(result["stages"]))
    if summary.get("error"):
        out.append(Text(f"the job's summary failed: {summary['error']}", style="yellow"))
    if result.get("plot_error"):
        out.append(Text(f"the job's plots failed: {result['plot_error']}", style="yellow"))
    if result.get("failure"):
        out.extend(failure_renderables(result["failure"], traceback_shown=traceback_shown))
    return out


def history_renderables(result: Mapping[str, Any]) -> list[Any]:
    """A run restarted or resumed: every attempt of every stage (how it ended, its steps, the
    checkpoint step it resumed from, the steps lost), and the launches the wall time sums."""
    stages = result.get("stages") or ()
    parts = result.get("parts") or ()
    if not parts and all(len(s.get("attempts") or ()) <= 1 for s in stages):
        return []
    rows = [
        (str(s["world_size"]), str(a.get("attempt", 0) + 1), str(a.get("status")), str(a.get("failure_class") or "-"), str(a.get("steps", 0)),
         _cell(a.get("resumed_step")), _cell(a.get("lost_steps")),
         _seconds(a["ended_at"] - a["started_at"]) if isinstance(a.get("ended_at"), (int, float)) and isinstance(a.get("started_at"), (int, float)) else "-")
        for s in stages for a in s.get("attempts") or ()
    ]  # fmt: skip
    columns = (_Col("world"), _Col("attempt"), _Col("status"), _Col("class"), _Col("steps"), _Col("from step"), _Col("lost steps"), _Col("wall s"))
    out: list[Any] = [_FittedTable("attempts (result.json: stages[].attempts)", columns, rows)] if rows else []
    if parts:
        gaps = sum(float(p.get("gap_s") or 0.0) for p in parts)
        out.append(Text(
            f"{len(parts)} launches (launch resume {len(parts) - 1} time(s)): wall time {float(result.get('wall_s') or 0.0):.1f} s, "
            f"theirs summed; {gaps:.1f} s between them, when nothing ran, not counted", style="dim",
        ))  # fmt: skip
    return out


MAX_TIMER_ROWS = 24  # timers shown in the summary; the rest are named as a count (all are in result.json)


def timer_renderables(result: Mapping[str, Any]) -> list[Any]:
    """What the job timed with ``ctx.metrics.timer``: per stage and timer, the median block and
    how many blocks, over every rank that timed it (nothing when the job timed nothing)."""
    rows = timer_summary(result)
    if not rows:
        return []
    cells = [(str(r.world_size), r.timer, _duration(r.median_ms), str(r.count), str(r.ranks)) for r in rows[:MAX_TIMER_ROWS]]
    columns = (_Col("world"), _Col("timer", justify="left"), _Col("median"), _Col("count"), _Col("ranks"))
    out: list[Any] = [_FittedTable("timers (ctx.metrics.timer): median of every rank's blocks", columns, cells)]
    if len(rows) > MAX_TIMER_ROWS:
        more = len(rows) - MAX_TIMER_ROWS
        out.append(Text(f"{more} more timer row(s) not shown: result.json has them all (ranks[].metrics.times_ms)", style="dim"))
    return out


def _duration(ms: float | None) -> str:
    """A duration in the unit that suits it: 812 µs, 12.3 ms, 4.56 s, 1,234 s."""
    if ms is None:
        return "-"
    if ms < 1:
        return f"{ms * 1e3:.3g} µs"
    if ms < 1e3:
        return f"{ms:.3g} ms"
    return f"{ms / 1e3:.3g} s" if ms < 1e6 else f"{ms / 1e3:,.0f} s"


def _straggler_lines(stages: list[Mapping[str, Any]]) -> list[Text]:
    """One line per rank flagged as a straggler in any stage (result.json: stages[].stragglers)."""
    out = []
    for stage in stages:
        for s in stage.get("stragglers") or ():
            held = "to the end" if s.get("cleared_after_s") is None else f"until {s['cleared_after_s']:.0f} s"
            out.append(Text(
                f"straggler (world {stage['world_size']}): rank {s['rank']} on {s['host']} ({s['device']}), own work "
                f"{s['work_s'] * 1e3:.1f} ms per step vs {s['peers_median_s'] * 1e3:.1f} ms for its peers "
                f"(up to {s['peak_ratio'] or float('inf'):.1f}x), from {s['flagged_after_s']:.0f} s {held}",
                style="yellow",
            ))  # fmt: skip
    return out


def _recovery_lines(stages: list[Mapping[str, Any]]) -> list[Text]:
    """One line per rank lost where the stage tried recovery in place (result.json:
    stages[].recoveries): recovered, in how long and at what cost, or why the restart path took it."""
    out = []
    for stage in stages:
        for r in stage.get("recoveries") or ():
            ranks = ", ".join(str(k) for k in r.get("dead_ranks") or ()) or "?"
            where = f"world {stage['world_size']}, attempt {int(r.get('attempt') or 0) + 1}: rank(s) {ranks} lost"
            if r.get("path") != "in_place":
                out.append(Text(f"{where}; not recovered in place ({r.get('why') or 'no reason recorded'}): the restart path", style="yellow"))
                out.extend(Text(f"  {line}", style="yellow") for line in r.get("stuck") or ())
                continue
            state = f", state {r['state_bytes'] / 1e6:,.1f} MB from a survivor's memory" if r.get("state_bytes") else ""
            kinds = list(dict.fromkeys(r.get("replacements") or ()))
            by = f" by a {' and a '.join(r['replacements'])}" if any(k.startswith("warm spare") for k in kinds) else ""
            by = f" on the {kinds[0]}" if len(kinds) == 1 and kinds[0].startswith("spare host") else by
            out.append(Text(
                f"{where}; recovered in place{by} in {_cell(r.get('recovery_s'))} s (seen after {_cell(r.get('detection_s'))} s{state}), "
                f"from step {_cell(r.get('resumed_step'))}, {_cell(r.get('steps_lost'))} step(s) lost, no restart",
                style="yellow",
            ))  # fmt: skip
    return out


def failure_renderables(failure: Mapping[str, Any], *, traceback_shown: bool = False) -> list[Any]:
    """The failure in a few lines: what failed where, the traceback once (the job's own frames;
    ``traceback_shown``: it already scrolled by as the rank's output), who was stopped because of it."""
    if failure.get("reason") == "interrupted":
        summary, command = resume_hint(str(failure["summary"]))
        said: list[Any] = [Text(f"INTERRUPTED: {summary}; every rank was stopped, and what had finished is kept", style="bold yellow")]
        if command:  # on a line of its own, whole: pasted as printed, it is the whole command
            said.append(WholeLine(f"continue with: {command}", style="bold"))
        return said
    if failure.get("reason") == "hung" and failure.get("hang"):
        return hang_renderables(failure["hang"])
    out: list[Any] = [Text(f"FAILED: {failure['summary']}", style="bold red")]
    root = failure.get("root_cause")
    if root:
        where = f"root cause: host {root['host']}, rank {root['rank']}, local rank {root['local_rank']}, device {root['device']}"
        if root.get("traceback") and traceback_shown:
            where += " (its traceback is above)"
        out.append(Text(where))
        if root.get("traceback") and not traceback_shown:
            out.append(Text("\n".join(job_frames(root["traceback"].rstrip().splitlines())), style="red"))
        elif root.get("log_tail") and not root.get("traceback"):
            out.append(Text(f"last lines of rank {root['rank']}'s log:", style="dim"))
            out.append(Text("\n".join(root["log_tail"][-LOG_TAIL_SHOWN:]), style="dim"))
        if root.get("hint"):
            out.append(Text(f"hint: {root['hint']}", style="yellow"))
    if failure.get("collateral_ranks"):
        out.append(Text(f"stopped as collateral: ranks {failure['collateral_ranks']}", style="yellow"))
    if failure.get("stuck_ranks"):
        out.append(Text(f"stuck ranks (stacks dumped to their logs): {failure['stuck_ranks']}", style="yellow"))
    return out


def hang_renderables(hang: Mapping[str, Any]) -> list[Any]:
    """A hung stage: the culprits in one line, then every group of ranks by where it was."""
    out: list[Any] = [Text(f"HUNG: {hang['summary']}", style="bold red")]
    for group in hang.get("groups") or ():
        ranks = ", ".join(map(str, group["ranks"]))
        state = f" ({group['state']})" if group.get("state") else ""
        inside = f"in {group['collective']} " if group.get("collective") else ""
        out.append(Text(f"  ranks [{ranks}]{state}: {inside}at {group['where']}"))
    out.append(Text(f"stalled {hang['stalled_for_s']:.0f} s; every rank's stacks and last collectives: {hang['evidence_dir']}", style="dim"))
    return out


_RESUME_HINT = re.compile(r"[;,]? *continue with: launch resume (?P<dir>.+)$")


def resume_hint(summary: str) -> tuple[str, str | None]:
    """A stop's summary without its "continue with: launch resume DIR", and that command (the
    directory quoted for a shell where it needs it), or None where the summary has none."""
    found = _RESUME_HINT.search(summary)
    if found is None:
        return summary, None
    return summary[: found.start()].rstrip(" ;,"), f"launch resume {shlex.quote(found['dir'].strip())}"


class WholeLine(Text):
    """A line that holds a command or a path: ``RunUI`` prints it whole, never wrapped or cut,
    whatever the console's width and whether or not it is a terminal (a terminal narrower than the
    line shows it folded, but a copy of it is the line as it is)."""


LOG_TAIL_SHOWN = 6
# the launcher's own code inside a rank, and torch's elastic agent: kept in the logs, not shown
_OWN_FRAMES = (f"{os.sep}launcher{os.sep}runtime{os.sep}", f"{os.sep}torch{os.sep}distributed{os.sep}elastic{os.sep}")
# torchelastic's own chatter while the launcher tears a group down (in the agent's log, not the console)
_AGENT_NOISE = re.compile(
    r"^[IWE]\d{4} [\d:.]+ \d+ .*torch/distributed/elastic/|^gpulaunch-agent: stopped by "
    r"|^[IWE]\d{4} [\d:.]+ \d+ \S*spawn\.py:\d+\] Terminating process \d+ via signal"  # torch's own line as it stops a group
)


class TracebackFilter:
    """Drops the launcher's own frames from tracebacks in one stream of lines, line by line (a
    frame is its ``File ...`` line plus the indented lines under it)."""

    def __init__(self) -> None:
        self._in_traceback = False
        self._skipping = False

    def keep(self, line: str) -> bool:
        if line.startswith("Traceback (most recent call last):"):
            self._in_traceback, self._skipping = True, False
            return True
        if not self._in_traceback:
            return True
        if line.startswith('  File "'):
            self._skipping = any(part in line for part in _OWN_FRAMES)
            return not self._skipping
        if line.startswith("    "):
            return not self._skipping
        self._in_traceback = self._skipping = False  # the exception line ends it
        return True


def job_frames(lines: Sequence[str]) -> list[str]:
    """A traceback without the launcher's own frames."""
    kept = TracebackFilter()
    return [line for line in lines if kept.keep(line)]


@dataclass(frozen=True)
class _Col:
    """A column of a ``_FittedTable``. ``short``: its name where the full one does not fit.
    ``whole``: its cells keep one line (statuses, numbers); otherwise (paths, host names, GPU
    models) a long cell may wrap or fold, since it is these that the table narrows first."""

    name: str
    short: str | None = None
    justify: JustifyMethod = "right"
    whole: bool = True


_STAGE_COLUMNS = (
    _Col("world"),
    _Col("status"),
    _Col("restarts"),
    _Col("wall s"),
    _Col("spawn"),
    _Col("import"),
    _Col("rendezvous", short="rdzv"),  # torchrun's own word for it (--rdzv-backend)
    _Col("pg init"),
    _Col("run"),
    _Col("to 1st step"),
)

# How a table may be drawn, roomiest first, each with whether it takes the columns' short names:
# rich's boxed table; no frame, a rule under the headers and two spaces between columns; the
# same with short names; one space.
_FRAMELESS: dict[str, Any] = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False}
_TWO_SPACES = {**_FRAMELESS, "collapse_padding": True}
_LAYOUTS: tuple[tuple[dict[str, Any], bool], ...] = (
    ({}, False),
    (_TWO_SPACES, False),
    (_TWO_SPACES, True),
    ({**_FRAMELESS, "padding": 0}, True),
)
_FLEX_MIN = 16  # a column of wrapping cells (whole=False) gets at least this many characters, or its header's width
_UNBOUNDED = 100_000  # wider than any console: measures a table's natural width


class _FittedTable:
    """A table laid out for the width it is printed at, so that no status or number is cut short.

    Left to itself, rich shortens the widest columns whatever they hold ("succe…"). Here the
    table takes the first of ``_LAYOUTS`` in which every ``whole`` cell fits on one line: its
    widest headers wrap (at spaces, after underscores) and its ``whole=False`` columns narrow
    first. A wide console gets rich's usual boxed table; an 80-column one (or a pipe, which
    rich takes as 80 columns) may get the frameless one. Where even the tightest does not fit,
    the widest columns narrow and their cells fold onto more lines rather than lose characters.
    """

    def __init__(self, title: str, columns: Sequence[_Col], rows: Iterable[Sequence[str]]) -> None:
        self.title = title
        self.columns = tuple(columns)
        self.rows = [tuple(row) for row in rows]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        floors = [max((cell_len(row[i]) for row in self.rows), default=0) for i in range(len(self.columns))]
        for style, short in _LAYOUTS:
            names = [(c.short or c.name) if short else c.name for c in self.columns]
            room = options.max_width - _chrome(console, options, style, len(self.columns))
            headers, widths = _fit(self.columns, names, floors, room)
            if sum(widths) <= room:
                break
        else:  # no layout keeps every status and number whole: fold the widest, not every column a little
            widths = _narrow(widths, [1] * len(widths), room)
        chrome = options.max_width - room
        if cell_len(self.title) > sum(widths) + chrome:
            # a title wider than its table would wrap to the table's width: it gets its own line(s)
            yield Text(self.title, style="table.title")
            yield self._table(style, headers, widths, titled=False)
        else:
            yield self._table(style, headers, widths)

    def _table(self, style: Mapping[str, Any], headers: Sequence[str], widths: Sequence[int], *, titled: bool = True) -> Table:
        # escape: "job [torchrun]: ..." is text; as rich markup the "[torchrun]" would vanish
        table = Table(title=escape(self.title) if titled else None, **style)
        for col, header, width in zip(self.columns, headers, widths):
            # the widths are ours, so rich wraps within them instead of choosing which column to cut
            table.add_column(escape(header), justify=col.justify, overflow="fold", width=width)
        for row in self.rows:
            table.add_row(*(Text(cell) for cell in row))
        return table


def _chrome(console: Console, options: ConsoleOptions, style: Mapping[str, Any], columns: int) -> int:
    """Characters a layout spends on borders and padding: the width of a table of 1-wide columns, less those."""
    probe = Table(**style)
    for _ in range(columns):
        probe.add_column(width=1)
    return Measurement.get(console, options.update_width(_UNBOUNDED), probe).maximum - columns


def _fit(columns: Sequence[_Col], names: Sequence[str], floors: Sequence[int], room: int) -> tuple[list[str], list[int]]:
    """Headers and column widths for ``room`` characters, or as near as they get: the widest
    headers wrap first, then the widest ``whole=False`` columns narrow, down to ``_FLEX_MIN``.
    ``floors``: each column's widest cell."""
    natural = sum(max(_text_width(n), f) for n, f in zip(names, floors))
    headers = _wrap_headers(names, floors, natural - room)
    widths = [max(_text_width(h), f) for h, f in zip(headers, floors)]
    least = [w if c.whole else max(_text_width(h), min(w, _FLEX_MIN)) for c, h, w in zip(columns, headers, widths)]
    return headers, _narrow(widths, least, room)


def _narrow(widths: Sequence[int], least: Sequence[int], room: int) -> list[int]:
    """Take a character at a time from the widest column still above its ``least`` until the
    widths fit ``room`` or none can give more."""
    out = list(widths)
    while sum(out) > room:
        narrower = [i for i, (w, m) in enumerate(zip(out, least)) if w > m]
        if not narrower:
            break
        out[max(narrower, key=lambda i: out[i])] -= 1
    return out


def _wrap_headers(headers: Sequence[str], floors: Sequence[int], excess: int) -> list[str]:
    """Wrap the widest headers, one at a time, until ``excess`` characters are saved or none
    can wrap any narrower. ``floors``: each column's widest cell, below which wrapping saves nothing."""
    out = list(headers)
    while excess > 0:
        widths = [max(floor, _text_width(h)) for h, floor in zip(out, floors)]
        for i in sorted(range(len(out)), key=lambda i: -widths[i]):
            wrapped = _wrap_words(headers[i], widths[i] - 1)
            saved = widths[i] - max(floors[i], _text_width(wrapped))
            if saved > 0:
                out[i], excess = wrapped, excess - saved
                break
        else:
            break
    return out


def _wrap_words(text: str, width: int) -> str:
    """``text`` on lines of at most ``width`` characters, broken after spaces and underscores
    (``gflops_per_rank``); a word longer than ``width`` keeps a line of its own."""
    lines: list[str] = []
    for part in re.split(r"(?<=[ _])", text):
        if lines and cell_len((lines[-1] + part).rstrip()) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    return "\n".join(line.rstrip() for line in lines)


def _text_width(text: str) -> int:
    return max(cell_len(line) for line in text.split("\n"))


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


class RunUI(RunEvents):
    """Console side of a run. ``quiet`` keeps only rank output off; errors are always shown."""

    def __init__(self, console: Console | None = None, *, quiet: bool = False, echo_ranks: bool = True) -> None:
        self.console = console or Console(stderr=False)
        self.quiet = quiet
        self.echo_ranks = echo_ranks and not quiet
        self._live: Live | None = None
        self._lock = threading.Lock()
        self._filters: dict[str, TracebackFilter] = {}

    def print(self, *things: Any) -> None:
        if not self.quiet:
            self.console.print(*things)

    def rank_output(self, source: str, text: str) -> None:
        if not self.echo_ranks:
            return
        if source.endswith(":agent") and _AGENT_NOISE.search(text):
            return  # torchelastic's teardown chatter: in the agent's log
        if not self._filters.setdefault(source, TracebackFilter()).keep(text):
            return  # the launcher's own frame of a rank's traceback: in the rank's log
        rank = source.rpartition(":")[2]
        style = _RANK_STYLES[int(rank) % len(_RANK_STYLES)] if rank.isdigit() else "dim"
        line = Text.assemble((f"{source} ", style), text) if source else Text(text)
        with self._lock:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def note(self, text: str) -> None:
        self.print(Text(f"note: {text}", style="yellow"))

    def message(self, text: str) -> None:
        # the launcher's own lines (where the metrics are, a restart) show even with --quiet
        self.console.print(Text(f"launcher: {text}", style="dim"), soft_wrap=True)

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self.print(Text(f"▶ {job}: world size {world_size} on {device_type} ({backend})", style="bold"))
        if self.console.is_terminal and not self.quiet:
            self._live = Live(Text(""), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def progress(self, progress: StageProgress) -> None:
        # only a terminal has a live line (stage_started starts it): piped output stays free of it
        if self._live is None:
            return
        phases = ", ".join(f"{n} {p}" for p, n in sorted(progress.phases.items()))
        low, high = progress.steps_min, progress.steps_max
        steps = high if low == high else f"{low}-{high}"
        slow = [str(r.rank) for r in progress.ranks if r.straggler]
        flagged = f" · straggler: rank {', '.join(slow)}" if slow else ""
        attempt = f" · attempt {progress.restarts + 1}" if progress.restarts else ""
        resumed = f" · from step {progress.resumed_step}" if progress.resumed_step is not None else ""
        line = f"  world {progress.world_size}{attempt}{resumed} · {phases} · steps {steps}{flagged} · {progress.elapsed_s:.1f}s"
        self._live.update(Text(line, style="dim"))

    def stage_finished(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def finished(self, result: RunResult) -> None:
        self.show_result(result.data, result.run_dir, live=True)

    def show_result(self, result: Mapping[str, Any], run_dir: Any, *, live: bool = False) -> None:
        # a root cause's traceback scrolled by as its rank's output when this run echoed the ranks
        for thing in summary_renderables(result, traceback_shown=live and self.echo_ranks):
            self.console.print(thing, soft_wrap=isinstance(thing, WholeLine))
        for plot in result.get("plots") or ():
            self.console.print(Text(f"plot: {run_dir}/{plot}"), soft_wrap=True)
        self.console.print(Text(f"run directory: {run_dir}", style="bold"), soft_wrap=True)
