"""The sink a Ray stage's relays send their answers to (``launcher.backends.ray_sink``), and its way
back to Ray's stream where a relay cannot reach it.

With real sockets: a peer that says the stage's token has its frames taken (ranks back as numbers);
a peer with a wrong token, or a hello too long to be one, is closed unread (what it sends after is
never delivered, and it reads the close). With a real Ray head: a real ``NodeRelay`` given a wrong
token is refused and its ``serve`` returns, the connection broken; a stage whose sink the relay
cannot reach takes Ray's stream for the node and still brings every beacon, line and report."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.backends.ray import RayStage
from launcher.backends.ray_sink import RelaySink, Taken
from launcher.runtime.relay_wire import HEADER, SinkAddress, connect, frame
from tests.ray.conftest import RayHead, assert_ray_run_left_nothing
from tests.ray.test_ray_node_relay import Tap, _check_lines, _run

HANG_GUARD_S = 60.0  # a bound on a wait that ends as soon as its condition holds


def _take_until(sink: RelaySink, done: Any, timeout_s: float = HANG_GUARD_S) -> Taken:
    """What the sink takes until ``done(taken)`` holds (a hang guard, not a timing)."""
    got = Taken()
    deadline = time.monotonic() + timeout_s
    while not done(got) and time.monotonic() < deadline:
        more = sink.take(0.05)
        got.answers += more.answers
        got.closed += more.closed
    return got


def _closed_by_peer(sock: socket.socket) -> bool:
    """The other end closed: a read gives end of file (or a reset) within the hang guard."""
    sock.settimeout(HANG_GUARD_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_sink_takes_a_relay_that_says_the_token_and_closes_a_stranger_unread() -> None:
    sink = RelaySink("127.0.0.1")
    try:
        good = connect(sink.address_for("node-a"), 10.0)
        good.sendall(frame({"seq": 1, "lines": {"3": ["hello"]}, "beacons": {"3": {"phase": "running", "steps": 5}}, "dirs": {"3": "/tmp/x"}}))
        good.sendall(frame({"seq": 2, "lines": {}, "beacons": {"4": {"phase": "running", "steps": 7}}, "dirs": {}}))
        # a stranger: the right address, a wrong token, then a well-formed answer it hopes is read
        wrong = connect(SinkAddress(sink.host, sink.port, "0" * 64, "node-b"), 10.0)
        wrong.sendall(frame({"seq": 1, "lines": {"0": ["not yours"]}, "beacons": {}, "dirs": {}}))
        # another: a "hello" far longer than one (closed before its bytes are read)
        long_hello = socket.create_connection((sink.host, sink.port), timeout=10.0)
        long_hello.sendall(HEADER.pack(10**6) + b"x" * 4096)
        got = _take_until(sink, lambda g: len(g.answers) >= 2 and sink.refused >= 2)
        assert [node for node, _ in got.answers] == ["node-a", "node-a"]
        first, second = (answer for _, answer in got.answers)
        assert first["lines"] == {3: ["hello"]} and first["beacons"] == {3: {"phase": "running", "steps": 5}} and first["dirs"] == {3: "/tmp/x"}
        assert second["seq"] == 2 and second["beacons"] == {4: {"phase": "running", "steps": 7}}
        assert sink.seq == {"node-a": 2}
        assert sink.refused == 2
        assert _closed_by_peer(wrong) and _closed_by_peer(long_hello)
        # nothing of theirs was ever delivered, and the good peer's close is reported once
        good.close()
        after = _take_until(sink, lambda g: bool(g.closed))
        assert after.answers == [] and after.closed == ["node-a"]
        wrong.close()
        long_hello.close()
    finally:
        sink.close()


def test_wait_for_reads_until_a_relays_numbered_answer_arrived() -> None:
    """What the final answer relies on: everything a relay sent before it is taken first."""
    sink = RelaySink("127.0.0.1")
    try:
        peer = connect(sink.address_for("node-a"), 10.0)

        def send() -> None:
            for k in range(1, 51):
                peer.sendall(frame({"seq": k, "lines": {"0": [f"line {k}"]}}))
                time.sleep(0.01)

        sender = threading.Thread(target=send)
        sender.start()
        got = sink.wait_for({"node-a": 50}, HANG_GUARD_S)
        sender.join()
        # every line once, in order
        assert [answer["lines"][0] for _, answer in got.answers] == [[f"line {k}"] for k in range(1, 51)]
        peer.close()
    finally:
        sink.close()


def test_a_relay_on_ray_with_a_wrong_token_is_refused(ray_driver: RayHead) -> None:
    import ray

    from launcher.runtime.ray_actor import NodeRelay

    sink = RelaySink("127.0.0.1")
    relay = ray.remote(NodeRelay).options(num_cpus=0, max_concurrency=2).remote({}, SinkAddress(sink.host, sink.port, "f" * 64, "node-x"))
    try:
        served = relay.serve.remote(0.2, 0.1)
        # the relay keeps answering (empty answers every 0.2 s) until its writes fail on the closed connection
        got = _take_until(sink, lambda g: sink.refused >= 1 and bool(ray.wait([served], timeout=0)[0]))
        assert sink.refused == 1 and got.answers == [] and got.closed == []
        result = ray.get(served, timeout=HANG_GUARD_S)
        assert result["connected"] is True and "broke" in result["detail"], result
    finally:
        ray.kill(relay, no_restart=True)
        sink.close()


def _refused_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then closed: a connect there is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_relay_that_cannot_reach_the_sink_answers_over_rays_stream(ray_driver: RayHead, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tap = Tap(monkeypatch)
    streams: list[str] = []
    port = _refused_port()
    address_for, start_stream = RelaySink.address_for, RayStage._start_stream

    def unreachable(sink: RelaySink, node: str) -> SinkAddress:
        real = address_for(sink, node)
        return SinkAddress(real.host, port, real.token, real.node)

    def start_stream_tapped(stage: RayStage, node_id: str) -> None:
        streams.append(node_id)
        start_stream(stage, node_id)

    monkeypatch.setattr(RelaySink, "address_for", unreachable)
    monkeypatch.setattr(RayStage, "_start_stream", start_stream_tapped)
    run, result = _run(tmp_path)
    assert run.status == "succeeded" and run.exit_code == 0, run.data.get("failure")
    assert tap.shape == (1, 0, 0), "the relay's serve first"
    assert len(streams) == 1, "the relay could not connect: its node's answers over Ray's stream"
    assert tap.sink_answers == 0
    gaps = tap.gaps()
    assert all(gap <= 0.6 for gap in gaps.values()), gaps  # every beacon of 2 a second, over the stream
    _check_lines(result)  # nothing lost: the relay had drained nothing before it gave up on the sink
    assert_ray_run_left_nothing(ray_driver, "relay", [r["pid"] for r in result["ranks"]])
