"""A survivor's watch (``InPlace._watch``) with real gloo ranks: a survivor whose collective
waits on a silent peer (alive, its connections open, saying nothing: a powered-off host's ranks,
here a SIGSTOPped process) hears of the loss from no connection; once a keeper's word of the loss
is in the store, each survivor's watch shuts its own connections of the group down, and its step
fails at once with a peer's loss, from which ``live.run`` recovers. Until the word comes, the step
stays where it is (the watch acts on the keeper's word only).

Timing-proof: the survivors stay in their step for as long as rank 2 is stopped, so "still in
it" is asserted after a pause of the test's choosing; every other wait is a hang guard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from launcher.runtime.inplace import KeeperWord
from tests.integration.faultkit import child_env

GUARD_S = 120


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "gone"


def _wait_for(label: str, what: Callable[[], object], guard_s: float = GUARD_S) -> object:
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        if found := what():
            return found
        time.sleep(0.02)
    raise AssertionError(f"not within {guard_s} s: {label}")


def test_survivors_waiting_on_a_silent_peer_are_woken_by_the_keepers_word(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.integration.silent_peer", str(r), "127.0.0.1", str(store.port), str(tmp_path)],
                              env=child_env(), stderr=open(tmp_path / f"rank{r}.log", "wb")) for r in range(3)]  # noqa: SIM115
    try:
        _wait_for("the three ranks ready, rank 2 stopped", lambda: store.check([f"ready/{r}" for r in range(3)]) and _state(ranks[2].pid) == "T")
        store.set("go", "1")
        _wait_for("ranks 0 and 1 in their step", lambda: store.check(["stepping/0", "stepping/1"]))
        time.sleep(3.0)  # long enough for any answer to come: none can while rank 2 is stopped
        assert not store.check(["ended/0"]) and not store.check(["ended/1"]), "a step ended with its peer stopped"
        KeeperWord(store, 0).publish_death(1, {"ranks": [2], "pids": [ranks[2].pid], "seen_at": time.time()})
        _wait_for("ranks 0 and 1 out of their step after the keeper's word", lambda: store.check(["ended/0", "ended/1"]))
        ended = {r: json.loads(store.get(f"ended/{r}")) for r in (0, 1)}
        for r in (0, 1):
            assert ended[r]["error"] and ended[r]["peer_loss"], ended  # a peer's loss: live.run recovers from it
        # a watch shut its rank's connections on the keeper's word; the other rank's step may have
        # failed on that first (its pending call on the connection shut), before its own watch ran
        nudged = [r for r in (0, 1) if ended[r]["nudged"] == [1]]
        assert nudged, ended
        for r in nudged:
            assert "heard of generation 1's loss (ranks [2]) from the store" in (tmp_path / f"rank{r}.log").read_text()
    finally:
        for proc in ranks:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
