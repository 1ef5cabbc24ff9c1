"""The preflight's network check without a network (fast): the hosts' TCP protocol on loopback,
between threads and between two host helpers (``hostagent serve``) talking JSON as the launcher
does; the ring's rounds and timing; and the verdict, a pure function of the measured links."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import pytest

from launcher.backends.ssh.netcheck import NOT_MEASURED, judge, network_check, plan_timing, ring_rounds
from launcher.protocol import HOST_ANSWER_TAG
from launcher.records import LinkMeasure
from launcher.runtime.linkprobe import LinkTiming, Listener, Peer, _bulk, measure_link, measure_ring
from tests.cluster.conftest import REPO

QUICK = LinkTiming(connect_s=0.5, ping_s=0.1, send_s=0.3, drain_s=0.5, max_bytes=10**10)


@pytest.fixture
def listener() -> Iterator[Listener]:
    opened = Listener("127.0.0.1", for_s=30)
    yield opened
    opened.close()
    assert not opened.thread.is_alive()


@contextlib.contextmanager
def _closed_port() -> Iterator[int]:
    """A port that refuses connections: bound by this process, never listened on, and held until
    the block ends (a port freed at once could be taken by another test's process before the connect)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


# ------------------------------------------------------------------------ the protocol, threads


def test_a_link_on_loopback_has_a_throughput_and_a_latency(listener):
    figure = measure_link(Peer("lo", "127.0.0.1", listener.port), QUICK)
    assert figure.error is None and figure.acknowledged
    assert figure.gbit_s is not None and figure.gbit_s > 0.1
    assert figure.latency_ms is not None and 0 < figure.latency_ms < 50
    assert figure.bytes > 0 and QUICK.send_s <= figure.seconds < QUICK.send_s + 0.5


def test_the_bulk_send_stops_at_max_bytes(listener):
    figure = measure_link(Peer("lo", "127.0.0.1", listener.port), LinkTiming(0.5, 0.1, 5.0, 0.5, max_bytes=3_000_000))
    assert figure.bytes == 3_000_000 and figure.seconds < 1.0  # the receiver counted every byte, no more


def test_a_ring_measures_its_peers_in_order(listener):
    other = Listener("127.0.0.1", for_s=30)
    try:
        figures = measure_ring([Peer("b", "127.0.0.1", other.port), Peer("a", "127.0.0.1", listener.port)], QUICK)
    finally:
        other.close()
    assert [f.dst for f in figures] == ["b", "a"]
    assert all(f.error is None and (f.gbit_s or 0) > 0 for f in figures)


def test_a_closed_port_is_an_error_entry_at_once():
    with _closed_port() as port:
        figure = measure_link(Peer("gone", "127.0.0.1", port), QUICK)
    assert figure.gbit_s is None and figure.latency_ms is None
    # refused at the connect: the kernel's answer, not a timeout ("no answer within ...") run out
    assert figure.error == f"connect to 127.0.0.1:{port}: Connection refused", figure.error


def test_a_peer_that_never_answers_is_an_error_within_the_timeout():
    with socket.socket() as mute:  # accepts in the kernel's backlog, never reads or answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        port = mute.getsockname()[1]
        t0 = time.monotonic()
        figure = measure_link(Peer("mute", "127.0.0.1", port), QUICK)
        elapsed = time.monotonic() - t0
    # the connect succeeds (the kernel's backlog); the first ping's answer gets connect_s, and no more
    assert figure.gbit_s is None and figure.error == f"ping to 127.0.0.1:{port}: no answer within {QUICK.connect_s:.2g} s", figure.error
    assert elapsed >= QUICK.connect_s  # it waited the timeout out


def test_a_receiver_without_its_count_gives_the_bytes_its_tcp_acknowledged():
    """A slow link would make the sender wait for its socket buffer to drain: past ``drain_s``
    the figure is what the peer's TCP acknowledged (Linux: SIOCOUTQ), not an error."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        done = threading.Event()

        def reads_but_never_counts() -> None:
            conn, _ = server.accept()
            with conn:
                buffer = bytearray(1 << 20)
                while conn.recv_into(buffer):
                    pass
                done.wait(5)  # EOF seen, no count sent

        thread = threading.Thread(target=reads_but_never_counts, daemon=True)
        thread.start()
        try:
            with socket.create_connection(server.getsockname(), timeout=1) as sock:
                received, seconds, acknowledged = _bulk(sock, LinkTiming(0.5, 0.1, 0.3, 0.3, 10**10))
        finally:
            done.set()
            thread.join(5)
    # no count: the drain_s timeout's path (the acknowledged bytes), after the whole send_s and drain_s
    assert acknowledged is False and received > 0 and seconds >= 0.6


def test_the_listener_is_gone_after_its_deadline():
    opened = Listener("127.0.0.1", for_s=30)  # open for as long as a loaded machine's measurement needs
    assert measure_link(Peer("lo", "127.0.0.1", opened.port), LinkTiming(0.5, 0.1, 0.05, 0.5, 10**9)).error is None
    opened.deadline = time.monotonic()  # its deadline comes (the test does not wait out its for_s)
    opened.thread.join(60)  # a hang guard: the accept loop notices within ACCEPT_POLL_S
    assert not opened.thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", opened.port), timeout=1).close()


# ---------------------------------------------------------------- the protocol, two host helpers


class _Helper:
    """``hostagent serve`` as a child process, spoken to as the launcher's link does."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.runtime.hostagent", "serve", "--silence-s", "30"],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._next = 0

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._next += 1
        self.proc.stdin.write(json.dumps({"id": self._next, "cmd": cmd, "args": args}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(HOST_ANSWER_TAG):
                answer: dict[str, Any] = json.loads(line[len(HOST_ANSWER_TAG) :])
                assert answer.pop("id") == self._next
                return answer
        raise AssertionError(f"the helper exited ({self.proc.wait()})")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def test_two_host_helpers_measure_each_other_over_json_requests():
    a, b = _Helper(), _Helper()
    try:
        ports = [h.call("net-listen", bind="127.0.0.1", for_s=20)["port"] for h in (a, b)]
        timing = {"send_s": 0.3, "max_mb": 10_000, "connect_s": 0.5, "ping_s": 0.1, "drain_s": 0.5}
        with _closed_port() as closed:
            answers = [a.call("net-ring", peers=[["b", "127.0.0.1", ports[1]]], **timing),
                       b.call("net-ring", peers=[["a", "127.0.0.1", ports[0]], ["gone", "127.0.0.1", closed]], **timing)]  # fmt: skip
    finally:
        a.close()
        b.close()
    (ab,), (ba, gone) = answers[0]["links"], answers[1]["links"]
    assert ab["dst"] == "b" and ba["dst"] == "a" and ab["gbit_s"] > 0 and ba["gbit_s"] > 0 and ab["error"] is None
    assert gone["gbit_s"] is None and "refused" in gone["error"].lower()


def test_a_bad_request_is_an_error_answer_not_a_dead_helper():
    helper = _Helper()
    try:
        assert "error" in helper.call("net-listen", bind="10.255.255.254", for_s=5)  # not this host's address
        assert helper.call("free-port", bind="127.0.0.1")["port"] > 0
    finally:
        helper.close()


# ----------------------------------------------------------------------------- rounds and timing


def test_the_ring_is_each_way_in_two_rounds_and_2n_links():
    assert ring_rounds(1) == []
    assert ring_rounds(2) == [[(0, 1), (1, 0)]]
    assert ring_rounds(3) == [[(0, 1), (1, 2), (2, 0)], [(0, 2), (1, 0), (2, 1)]]
    for n in (4, 8, 13):
        rounds = ring_rounds(n)
        links = [pair for pairs in rounds for pair in pairs]
        assert len(rounds) == 2 and len(set(links)) == 2 * n
        assert all(sorted(src for src, _ in pairs) == list(range(n)) for pairs in rounds)  # each host sends once a round
        assert all(sorted(dst for _, dst in pairs) == list(range(n)) for pairs in rounds)  # ... and receives once


def test_both_rounds_fit_the_budget():
    for budget_s in (2.0, 3.0, 10.0):
        timing = plan_timing(budget_s)
        assert 2 * (timing.ping_s + timing.send_s + timing.drain_s) <= budget_s  # connects: ~0 s on a working network


def test_fewer_than_two_hosts_is_an_empty_ok_check():
    check = network_check([], links=None)
    assert check.ok and check.links == () and check.median_gbit_s is None and check.bad_hosts == ()


# ---------------------------------------------------------------------------------- the verdict


def _ring_each_way(names: list[str], gbit_s: dict[tuple[str, str], float | None], default: float = 9.6) -> list[LinkMeasure]:
    n = len(names)
    pairs = [(names[i], names[(i + 1) % n]) for i in range(n)] + ([(names[i], names[(i - 1) % n]) for i in range(n)] if n > 2 else [])
    out = []
    for src, dst in pairs:
        figure = gbit_s.get((src, dst), default)
        out.append(LinkMeasure(src, dst, figure, 0.05 if figure is not None else None, None if figure is not None else "connect to x: timed out"))
    return out


def test_one_slow_host_among_four_is_blamed():
    hosts = ["node-a", "node-b", "node-c", "node-d"]
    links = _ring_each_way(hosts, {("node-c", "node-d"): 0.9, ("node-c", "node-b"): 1.1})  # node-c sends slowly
    check = judge(links, 0.5, 1.5, "eth0")
    assert check.bad_hosts == ("node-c",)
    assert check.median_gbit_s == pytest.approx(9.6)
    assert sorted(check.slow) == ["slow link node-c <-> node-b: 1.1 Gbit/s vs 9.6 median", "slow link node-c <-> node-d: 0.9 Gbit/s vs 9.6 median"]
    assert not check.unreachable and not check.ok


def test_a_host_slow_both_ways_among_three_is_blamed():
    """On 4 of the 6 links: a plain median of the links would be its own figure, and nothing slow."""
    slow = {pair: 0.1 for pair in [("h1", "h2"), ("h2", "h3"), ("h2", "h1"), ("h3", "h2")]}
    check = judge(_ring_each_way(["h1", "h2", "h3"], slow), 0.5, 1.5, "eth0")
    assert check.bad_hosts == ("h2",)
    assert sorted(check.slow) == ["slow link h2 <-> h1: 0.1 Gbit/s vs 4.85 median", "slow link h2 <-> h3: 0.1 Gbit/s vs 4.85 median"]


def test_a_slow_link_between_two_hosts_blames_neither():
    check = judge(_ring_each_way(["node-a", "node-c"], {("node-a", "node-c"): 0.9}), 0.5, 1.0, "eth0")
    assert check.bad_hosts == ()
    assert check.slow == ("slow link node-a <-> node-c: 0.9 Gbit/s vs 5.25 median (either host)",)


def test_a_host_that_answers_nobody_is_unreachable_and_blamed():
    hosts = ["h1", "h2", "h3", "h4"]
    down = {pair: None for pair in [("h1", "h2"), ("h3", "h2"), ("h2", "h3"), ("h2", "h1")]}
    check = judge(_ring_each_way(hosts, down), 0.5, 2.0, "eth0")
    assert check.bad_hosts == ("h2",)  # on 4 bad links; h1 and h3 on 2 each, both shared with h2
    assert "h2: no answer on eth0 from h1 (connect to x: timed out)" in check.unreachable
    assert "h2: could not reach h3 on eth0 (connect to x: timed out)" in check.unreachable
    assert not check.slow and check.median_gbit_s == pytest.approx(9.6)


def test_a_sender_whose_helper_failed_is_not_blamed_on_its_peer():
    links = [
        LinkMeasure("h1", "h2", None, None, f"{NOT_MEASURED}no answer over SSH within 7s"),
        *_ring_each_way(["h1", "h2", "h3"], {})[1:],
    ]
    check = judge(links, 0.5, 2.0, None)
    assert check.unreachable == ("h1: could not measure its link to h2 (no answer over SSH within 7s)",)
    assert check.bad_hosts == ()


def test_all_fine():
    check = judge(_ring_each_way(["h1", "h2", "h3"], {("h1", "h2"): 8.0, ("h3", "h1"): 11.0}), 0.5, 1.2, "eth0")
    assert check.ok and check.slow == () and check.unreachable == () and check.bad_hosts == ()
    assert check.median_gbit_s == pytest.approx(9.6) and len(check.links) == 6 and check.seconds == 1.2
    assert json.loads(json.dumps(check.to_dict()))["links"][0]["src"] == "h1"


class _ScriptedLink:
    """A host's helper answering the check's requests from a script: each link's figures, in the
    order the link is measured (first look, second look)."""

    def __init__(self, name: str, figures: dict[tuple[str, str], list[float]]) -> None:
        self.name, self.figures = name, figures

    def call(self, cmd: str, **args):  # noqa: ANN003, ANN201
        if cmd == "net-listen":
            return {"port": 4000}
        (dst, _, _), = args["peers"]
        gbit_s = self.figures[(self.name, dst)].pop(0)
        return {"links": [{"dst": dst, "gbit_s": gbit_s, "latency_ms": 0.05, "error": None}]}


class _ScriptedLinks:
    def __init__(self, figures: dict[tuple[str, str], list[float]]) -> None:
        self.figures = figures

    def get(self, host):  # noqa: ANN001, ANN201
        return _ScriptedLink(host.name, self.figures)


def _scripted_check(slow_second_look: float) -> tuple:
    from launcher.spec.cluster import HostConfig

    hosts = [HostConfig(name=f"h{i}", address=f"10.0.0.{i}") for i in (1, 2, 3)]
    fast = {(s, d): [9.0] for s in ("h1", "h2", "h3") for d in ("h1", "h2", "h3") if s != d}
    figures = {**fast, ("h2", "h3"): [0.05, slow_second_look], ("h2", "h1"): [0.05, slow_second_look]}
    check = network_check(hosts, links=_ScriptedLinks(figures), budget_s=1.0)  # type: ignore[arg-type]
    return check, figures


def test_a_dip_the_second_look_does_not_see_is_not_a_slow_link():
    check, figures = _scripted_check(slow_second_look=8.5)  # h2 lost the CPU for its first send window
    assert check.ok and check.bad_hosts == () and check.slow == ()
    assert figures[("h2", "h3")] == [] and figures[("h2", "h1")] == []  # both suspects were looked at again
    assert {(link.src, link.dst): link.gbit_s for link in check.links}[("h2", "h3")] == 8.5


def test_a_link_slow_at_both_looks_is_slow_and_its_host_blamed():
    check, figures = _scripted_check(slow_second_look=0.04)
    assert check.bad_hosts == ("h2",) and len(check.slow) == 2
    assert figures[("h1", "h2")] == []  # a link that looked fine was measured once
