"""The preflight's network check between the hosts of a multi-host job: each host's links to its
neighbours in a ring, each way, measured over plain TCP on the job's network by the hosts' own
helpers (``launcher.runtime.linkprobe``; no torch there), then the verdict.

Two requests to every host over the run's connections (``link``), each sent to all hosts at once:
``net-listen`` opens a listener on the host's address (the cluster file's ``address``), gone by
itself after the check; ``net-ring`` has the host send to one neighbour, once per round. Round 1:
host i to i+1; round 2 (3 hosts or more): host i to i-1; every host sends (and receives) at the
same time in a round. 2N links for N hosts in two rounds, whatever N: the check's time does not
grow with the hosts, only its traffic does, one link per host per round. A link that looks slow
or unreachable is measured once more (half the send window) and judged by the better look: on a
busy machine a host may lose the CPU for a whole send window, which is not a slow link.

The verdict (``judge``, a pure function): the median of the hosts' median links (not of all
links: with 3 hosts, one whose NIC is slow both ways is on 4 of the 6 links and would pull a plain
median down to its own level); a link under ``min_fraction`` of it is slow; a link with no figure
is unreachable; a host is to blame when it is on two bad links or more and on more of them than
any host at their other ends (a slow NIC shows on both of its host's outgoing links, or both
incoming, or all four). With 2 hosts nothing can tell the two ends apart: nobody is blamed and
the slow line says ``(either host)``.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import TYPE_CHECKING, Sequence

from launcher.backends.ssh.command import REQUEST_TIMEOUT_S, SshError
from launcher.backends.ssh.link import HostLink, HostLinks, _parallel, current_links
from launcher.records import LinkMeasure, NetworkCheck
from launcher.runtime.linkprobe import LinkTiming

if TYPE_CHECKING:
    from launcher.spec.cluster import HostConfig

SSH_MARGIN_S = 5.0  # a net-ring request's way over SSH, on top of what the host itself may take
LISTEN_EXTRA_S = 10.0  # a listener outlives the check's budget by this much, then closes itself
MAX_MB_PER_LINK = 4000.0  # no link sends more, however fast (a 32 Gbit/s link in one second)
NOT_MEASURED = "not measured: "  # an error of the sending host's helper, not of the link
ROUNDS_IN_BUDGET = 2  # each round gets this share of the budget: 2 hosts (one round) take half of it
CONNECT_S = 1.5  # a connect (or a first ping) that loses a packet waits for the kernel's retry at 1 s


def ring_rounds(count: int) -> list[list[tuple[int, int]]]:
    """The (sender, receiver) host indices of each round: i to i+1, then (3+ hosts) i to i-1."""
    if count < 2:
        return []
    forward = [(i, (i + 1) % count) for i in range(count)]
    if count == 2:
        return [forward]  # 0 -> 1 and 1 -> 0 already: a second round would measure them again
    return [forward, [(i, (i - 1) % count) for i in range(count)]]


def plan_timing(budget_s: float) -> LinkTiming:
    """One round's share of the budget (``1 / ROUNDS_IN_BUDGET``): half of it sending, a quarter
    for the receiver's count (a slow link drains its socket buffer), a tenth for the pings. The
    same for any number of hosts, so the figures of 2 and of 8 hosts compare. Connects take no
    time on a working network; ``CONNECT_S`` on top of the budget is for a congested or lossy
    one (a throttled host's queue drops a SYN-ACK), which must come out slow, not unreachable."""
    round_s = budget_s / ROUNDS_IN_BUDGET
    return LinkTiming(
        connect_s=CONNECT_S,
        ping_s=0.1 * round_s,
        send_s=0.5 * round_s,
        drain_s=0.25 * round_s,
        max_bytes=int(MAX_MB_PER_LINK * 1e6),
    )


def network_check(
    hosts: Sequence[HostConfig],
    links: HostLinks | None = None,
    *,
    budget_s: float = 3.0,
    min_fraction: float = 0.5,
) -> NetworkCheck:
    """Every host's link to its ring neighbours, each way, in about ``budget_s`` seconds (plus
    the requests' way over SSH), over the run's connections (``links``, else ``current_links()``);
    judged by ``judge``. Fewer than 2 hosts: nothing to measure, an empty, ok check."""
    started = time.monotonic()
    hosts = list(hosts)
    ifname = _common_ifname(hosts)
    rounds = ring_rounds(len(hosts))
    if not rounds:
        return judge([], min_fraction, 0.0, ifname)
    pool = links if links is not None else current_links()
    host_links = _parallel(pool.get, hosts)  # every login under way at once, each from its own thread
    timing = plan_timing(budget_s)

    def listen(index: int) -> int | str:
        return _open_listener(hosts[index], host_links[index], budget_s + LISTEN_EXTRA_S)

    ports: list[int | str] = _parallel(listen, range(len(hosts)))

    def send(pair: tuple[int, int], how: LinkTiming = timing) -> LinkMeasure:
        src, dst = pair
        return _measure(hosts[src], host_links[src], hosts[dst], ports[dst], how)

    measured: list[LinkMeasure] = []
    for pairs in rounds:
        measured += _parallel(send, pairs)
    # A second look at each suspect link (the listeners are still up), on half the send window: a
    # link is slow or unreachable only when both looks say so. On a busy machine a host can lose
    # the CPU for its whole send window, and one dip must not cost a job its host.
    index = {host.name: i for i, host in enumerate(hosts)}
    suspects = [i for i, link in enumerate(measured) if _is_bad(link, _typical_gbit_s(measured), min_fraction)]
    if suspects:
        second_timing = plan_timing(budget_s / 2)
        again = _parallel(lambda i: send((index[measured[i].src], index[measured[i].dst]), second_timing), suspects)
        for i, link in zip(suspects, again):
            measured[i] = _better(measured[i], link)
    return judge(measured, min_fraction, time.monotonic() - started, ifname)


def _is_bad(link: LinkMeasure, median: float | None, min_fraction: float) -> bool:
    """No figure, or under ``min_fraction`` of the typical link."""
    return link.gbit_s is None or (median is not None and link.gbit_s < min_fraction * median)


def _better(first: LinkMeasure, second: LinkMeasure) -> LinkMeasure:
    """The better of two looks at one link: a figure beats none, the faster figure the slower."""
    if second.gbit_s is None:
        return first
    return second if first.gbit_s is None or second.gbit_s > first.gbit_s else first


def _common_ifname(hosts: list[HostConfig]) -> str | None:
    names = {host.ifname for host in hosts}
    return names.pop() if len(names) == 1 else None


def _open_listener(host: HostConfig, link: HostLink, for_s: float) -> int | str:
    """The port of the host's listener, or why it has none."""
    try:
        return int(link.call("net-listen", timeout_s=REQUEST_TIMEOUT_S, bind=host.address, for_s=for_s)["port"])
    except (SshError, KeyError, TypeError, ValueError) as exc:
        return f"{host.name} could not listen on {host.address}: {exc}"


def _measure(src: HostConfig, link: HostLink, dst: HostConfig, port: int | str, timing: LinkTiming) -> LinkMeasure:
    """One directed link, measured by its sender's helper; an error entry, never an exception."""
    if isinstance(port, str):
        return LinkMeasure(src.name, dst.name, None, None, port)
    longest_s = 3 * timing.connect_s + timing.ping_s + timing.send_s + timing.drain_s
    try:
        data = link.call(
            "net-ring", timeout_s=longest_s + SSH_MARGIN_S, peers=[[dst.name, dst.address, port]],
            send_s=timing.send_s, max_mb=timing.max_bytes / 1e6, connect_s=timing.connect_s, ping_s=timing.ping_s, drain_s=timing.drain_s,
        )  # fmt: skip
        (figure,) = data["links"]
    except (SshError, KeyError, TypeError, ValueError) as exc:
        return LinkMeasure(src.name, dst.name, None, None, f"{NOT_MEASURED}{exc}")
    return LinkMeasure(src.name, dst.name, figure.get("gbit_s"), figure.get("latency_ms"), figure.get("error"))


# ------------------------------------------------------------------------------------ the verdict


def judge(links: list[LinkMeasure], min_fraction: float, seconds: float, ifname: str | None) -> NetworkCheck:
    """The verdict on measured links: slow (under ``min_fraction`` x the median of the hosts'
    median links), unreachable (no figure), and the hosts to blame (see the module's doc)."""
    median = _typical_gbit_s(links)
    failed = [link for link in links if link.gbit_s is None]
    slow = [link for link in links if link.gbit_s is not None and _is_bad(link, median, min_fraction)]
    blamed = _blame([*slow, *failed])
    return NetworkCheck(
        links=tuple(links),
        median_gbit_s=median,
        min_fraction=min_fraction,
        slow=_slow_lines(slow, median, blamed),
        unreachable=_unreachable_lines(failed, ifname, blamed),
        bad_hosts=blamed,
        seconds=seconds,
    )


def _typical_gbit_s(links: list[LinkMeasure]) -> float | None:
    """The median over the hosts of each host's median link (the links with a figure): a host
    with a bad NIC moves its own median and its neighbours' halfway, the others' not at all."""
    per_host: dict[str, list[float]] = {}
    for link in links:
        if link.gbit_s is not None:
            for host in (link.src, link.dst):
                per_host.setdefault(host, []).append(link.gbit_s)
    return statistics.median(statistics.median(figures) for figures in per_host.values()) if per_host else None


def _blame(bad: list[LinkMeasure]) -> tuple[str, ...]:
    """Hosts on two bad links or more, and on more of them than every host at their other ends.
    A host whose NIC is slow one way is on 2 bad links, its neighbours on 1 each; a host that is
    down is on 4, its neighbours on 2. Two hosts on the same bad links (2 hosts in all, or one
    pair that is slow both ways) tie: nothing tells them apart, so neither is blamed."""
    counts = Counter(name for link in bad for name in (link.src, link.dst))
    blamed = []
    for host, count in counts.items():
        others = [link.dst if link.src == host else link.src for link in bad if host in (link.src, link.dst)]
        if count >= 2 and all(counts[other] < count for other in others):
            blamed.append(host)
    return tuple(blamed)


def _slow_lines(slow: list[LinkMeasure], median: float | None, blamed: tuple[str, ...]) -> tuple[str, ...]:
    """One line per pair of hosts (its slower direction), the blamed host first."""
    pairs: dict[frozenset[str], list[LinkMeasure]] = {}
    for link in slow:
        pairs.setdefault(frozenset((link.src, link.dst)), []).append(link)
    lines = []
    for measured in pairs.values():
        worst = min(measured, key=lambda link: link.gbit_s or 0.0)
        first, second = (worst.dst, worst.src) if worst.dst in blamed and worst.src not in blamed else (worst.src, worst.dst)
        either = "" if {first, second} & set(blamed) else " (either host)"
        lines.append(f"slow link {first} <-> {second}: {worst.gbit_s or 0.0:.3g} Gbit/s vs {median or 0.0:.3g} median{either}")
    return tuple(lines)


def _unreachable_lines(failed: list[LinkMeasure], ifname: str | None, blamed: tuple[str, ...]) -> tuple[str, ...]:
    """One line per link with no figure, naming the host to look at first."""
    on = f" on {ifname}" if ifname else ""
    lines = []
    for link in failed:
        why = link.error or "no figure"
        if why.startswith(NOT_MEASURED):
            lines.append(f"{link.src}: could not measure its link to {link.dst} ({why[len(NOT_MEASURED) :]})")
        elif link.src in blamed and link.dst not in blamed:
            lines.append(f"{link.src}: could not reach {link.dst}{on} ({why})")
        else:
            lines.append(f"{link.dst}: no answer{on} from {link.src} ({why})")
    return tuple(lines)
