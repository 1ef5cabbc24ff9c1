"""A survivor's left process group outlives the recovery (``launcher.runtime.inplace.Retired``):
freeing a gloo group while its collectives are still failing deadlocks the rank (the gloo worker
frees a finished collective holding the group's mutex and waits for the GIL, the main thread
holds the GIL and waits for that mutex). A real gloo group of one rank, in this process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launcher.runtime.inplace import GroupSeam, InPlace


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_left_group_is_kept_until_its_collectives_have_surely_ended(tmp_path: Path, one_rank_group: None) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seam = GroupSeam(stage_dir=tmp_path, attempt=0, restart="0", store=None, form=lambda gen: None, collective_timeout_s=0.2)
    live = InPlace(model, optimizer, torch.nn.parallel.DistributedDataParallel, step=0, wait_s=1.0,
                   rank=0, world_size=1, seam=seam, metrics=None, gen=0)  # fmt: skip
    group = dist.distributed_c10d._get_default_group()
    live.model(torch.ones(3, 4)).sum().backward()  # a collective of the group's, done

    live._leave_group()

    assert not dist.is_initialized() and live.model is None
    (kept,) = live.retired
    assert kept.group is group and isinstance(kept.model, torch.nn.parallel.DistributedDataParallel)
    work = group.allreduce([torch.ones(2)])  # still a working group: its threads and sockets live
    assert work.wait() and work.result()[0].tolist() == [1.0, 1.0]
    assert live._release_retired() is None and live.retired, "let go before two collective timeouts had passed"
    time.sleep(2 * 0.2 + 0.05)
    dropping = live._release_retired()  # off the rank's thread: a worker that never ends blocks only it
    assert dropping is not None and dropping.name == "gpulaunch-retire" and live.retired == []
    dropping.join(30)  # a hang guard: an idle group's workers end at once
    assert not dropping.is_alive() and kept.group is None and kept.model is None


def test_the_keepers_take_one_generation_at_a_time_through_the_stages_store() -> None:
    """Two hosts' keepers (two clients of one real TCPStore): one recovery at a time in the
    stage, each generation taken once, and a survivor on any host reads the word."""
    from datetime import timedelta

    from launcher.runtime.inplace import KeeperWord

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    first, second = (KeeperWord(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10)), 0) for _ in range(2))
    assert first.begun() == 0
    assert first.claim("h1:10") == 1
    assert second.claim("h2:20") is None  # h1's recovery is under way: h2 leaves its loss to the restart path
    second.release("h2:20")  # not its claim: changes nothing
    assert second.claim("h2:20") is None
    first.publish_death(1, {"ranks": [3], "pids": [123]})
    assert second.death(1) == {"ranks": [3], "pids": [123]} and second.outcome(1) is None
    second.settle(1, "recovered", {"gen": 1})
    assert first.outcome(1) == {"gen": 1, "outcome": "recovered"}
    first.release("h1:10")
    assert second.claim("h2:20") == 2 and first.begun() == 2
    assert KeeperWord(server, 1).begun() == 0  # another attempt's keys are its own


def test_the_ray_drivers_keeper_replaces_only_the_process_that_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """``store_keeper`` (the moves Ray's driver makes through rank 0's actor) on a real TCPStore:
    a rank whose current process never armed (or an older process of it armed) is declined,
    which the survivors read as no replacement coming; an armed one gets the next generation,
    its death published for the survivors, and the recovery's outcome and release go through."""
    from datetime import timedelta

    from launcher.runtime import store_keeper
    from launcher.runtime.inplace import KeeperWord

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setattr(store_keeper, "_words", {})
    survivor = KeeperWord(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10)), 3)

    declined = KeeperWord(survivor.store, 4)  # an attempt whose loss is declined (the restart path has it from then on)
    assert store_keeper.claim(4, rank=1, joined=0, seen_at=1.0, token="driver") == {"declined": "rank 1 ended, not opted in"}
    assert (declined.outcome(1) or {}).get("outcome") == "declined"  # the survivors stop waiting
    KeeperWord(survivor.store, 5).arm(2, {"pid": 4242, "wait_s": 7.0, "gen": 0})
    # rank 2's process of the first start armed; its replacement (generation 1) died before it did
    assert "declined" in store_keeper.claim(5, rank=2, joined=1, seen_at=1.0, token="driver")
    survivor.arm(2, {"pid": 4242, "wait_s": 7.0, "gen": 0})
    answer = store_keeper.claim(3, rank=2, joined=0, seen_at=1.0, token="driver", steps_at_death=12)
    assert answer["gen"] == 1 and answer["wait_s"] == 7.0, answer
    death = survivor.death(1)
    assert death is not None and death["ranks"] == [2] and death["pids"] == [4242] and death["steps_at_death"] == 12, death
    assert survivor.claim("a-host-keeper") is None  # one recovery at a time in the stage
    survivor.settle(1, "recovered", {"gen": 1})
    assert store_keeper.outcome(3, 1) == {"gen": 1, "outcome": "recovered"}
    store_keeper.release(3, "driver")
    assert survivor.claim("a-host-keeper") == 2


def test_the_launchers_keeper_of_a_lost_host_claims_for_all_its_ranks_once_each_opted_in() -> None:
    """``HostKeeper`` (the launcher's side of a lost host's recovery) on a real TCPStore: a host
    one of whose ranks never opted in is declined (the survivors stop waiting); a host whose ranks
    opted in, one of them since replaced by its node's keeper (a newer record), gets the next
    generation with both ranks published dead; the outcome settles it, and the ranks' next loss is
    checked against the generation they joined on the spare."""
    from datetime import timedelta

    from launcher.backends.host_inplace import HostKeeper, HostRecovery
    from launcher.runtime.inplace import KeeperWord

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    survivor = KeeperWord(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10)), 0)

    unarmed = HostKeeper(7, ("127.0.0.1", server.port))
    KeeperWord(survivor.store, 7).arm(2, {"pid": 10, "wait_s": 5.0, "gen": 0})
    assert unarmed.claim(1, "h2", "h3", (2, 3)) == "rank(s) [3] of h2 had not opted in" and unarmed.given_up
    assert (KeeperWord(survivor.store, 7).outcome(1) or {}).get("outcome") == "declined"

    keeper = HostKeeper(0, ("127.0.0.1", server.port))
    survivor.arm(2, {"pid": 20, "wait_s": 5.0, "gen": 0})
    survivor.arm(3, {"pid": 31, "wait_s": 9.0, "gen": 1})  # rank 3 replaced by h2's keeper in generation 1
    assert survivor.claim("h2-keeper") == 1
    survivor.settle(1, "recovered", {"gen": 1})
    survivor.release("h2-keeper")
    recovery = keeper.claim(1, "h2", "h3", (2, 3))
    assert isinstance(recovery, HostRecovery) and (recovery.gen, recovery.wait_s, recovery.ranks) == (2, 9.0, (2, 3)), recovery
    death = survivor.death(2)
    assert death is not None and death["ranks"] == [2, 3] and death["pids"] == [20, 31] and death["lost_host"] == "h2", death
    assert keeper.settled() is None  # under way
    survivor.settle(2, "recovered", {"gen": 2})
    recovery.next_ask = 0.0
    assert keeper.settled() is True and keeper.recovery is None and keeper.joined == {2: 2, 3: 2}
    assert survivor.claim("h1-keeper") == 3  # released: the next loss may be recovered
    survivor.release("h1-keeper")
    assert keeper.claim(1, "h3", "h4", (2, 3)) == "rank(s) [2, 3] of h3 had not opted in"  # the spare's ranks never armed
    late = HostKeeper(0, ("127.0.0.1", server.port))
    late.joined = {2: 2, 3: 2}
    survivor.arm(2, {"pid": 40, "wait_s": 1.0, "gen": 2})
    survivor.arm(3, {"pid": 41, "wait_s": 1.0, "gen": 2})
    assert isinstance(late.claim(1, "h3", "h4", (2, 3)), HostRecovery)
    # wait_s (1 s) counts from the loss until the spare's ranks begin to join, then from their arrival
    from launcher.backends.host_inplace import SPARE_RESTART
    from launcher.runtime.inplace import arrived_key

    late.recovery.seen_at -= 0.8  # type: ignore[union-attr]
    for rank in (2, 3):
        survivor.store.set(arrived_key(SPARE_RESTART, 4, rank), "1")
    late.recovery.next_ask = 0.0  # type: ignore[union-attr]
    assert late.settled() is None and late.recovery is not None and late.recovery.arrived_at is not None
    late.recovery.seen_at -= 5.0  # long past the loss: the spare's ranks arrived, their clock runs
    late.recovery.next_ask = 0.0
    assert late.settled() is None
    late.recovery.arrived_at -= 1.5
    late.recovery.next_ask = 0.0
    assert late.settled() is False
    record = late.give_up("no recovery within wait_s=1s")  # the spare's ranks never stepped
    assert record is not None and record["dead_ranks"] == [2, 3] and late.given_up
    assert (survivor.outcome(4) or {}).get("outcome") == "fallback"  # the survivors stop waiting: the restart path
    assert survivor.claim("h1-keeper") == 5  # released


def test_a_left_groups_sockets_are_shut_down_not_closed_and_never_its_listener_or_a_reused_descriptor() -> None:
    """``shut_down`` on real sockets: a connection is shut (its peer reads the end at once) and its
    descriptor stays open (gloo closes it); a listener is left alone (gloo's accept loop would
    abort); a descriptor closed since, or reused by another socket, is skipped."""
    import os
    import socket

    from launcher.runtime.inplace import opened_between, shut_down, socket_fds

    before = socket_fds()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    gone = socket.socket()
    group = opened_between(before, socket_fds())
    gone.close()
    reused = socket.create_connection(listener.getsockname())  # the lowest free descriptor: the closed one's, as a rule
    peer, _ = listener.accept()
    try:
        assert shut_down(group) == 2  # client and server, not the listener, not the reused descriptor
        assert server.recv(1) == b"" and client.recv(1) == b""  # each end saw the other shut
        assert os.readlink(f"/proc/self/fd/{client.fileno()}").startswith("socket:")  # still open: its owner closes it
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        peer.sendall(b"x")
        assert reused.recv(1) == b"x"  # the socket now on that descriptor still works
    finally:
        for sock in (listener, client, server, reused, peer):
            sock.close()


def test_the_state_comes_from_the_lowest_rank_with_the_most_steps_to_every_rank_behind_it() -> None:
    """``state_transfer``: replacements (-1) take the state; where a peer died during a step's
    all-reduce and it completed on some survivors only (they stepped), the survivors behind take
    it too, from the lowest of those ahead: every rank goes on from the same step."""
    from launcher.runtime.inplace import state_transfer

    assert state_transfer([17, -1, 17, 17]) == (0, [1])  # a lost rank's replacement, survivors agreeing
    assert state_transfer([-1, 17, -1, 17]) == (1, [0, 2])  # rank 0 and rank 2 lost: the lowest survivor sends
    assert state_transfer([17, 18, -1, 18]) == (1, [0, 2])  # ranks 1 and 3 had stepped: rank 0 catches up with them
    assert state_transfer([5, 5]) == (0, [])  # nobody behind: nothing moves
