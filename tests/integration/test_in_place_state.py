"""The state a survivor sends a replacement in place (``launcher.runtime.peerstate``): two real
gloo ranks (spawned processes, a file store), a model with Adam trained a few steps on the
sender, a fresh one on the receiver; after the transfer both hold the same bits (parameters,
every optimizer state tensor and value, hyperparameters), and one more identical step keeps
them equal. A receiver whose model differs is refused with the tensor named."""

from __future__ import annotations

import multiprocessing
import tempfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

HANG_GUARD_S = 240  # two processes on a file store: a hang guard, not a figure


def _model(width: int = 8) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 2))


def _step(model: Any, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(8, 4, generator=g)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _snapshot(model: Any, opt: Any) -> dict[str, Any]:
    state = opt.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for i, s in state["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
    }


def _rank(rank: int, store_path: str, out: str, width: int) -> None:
    import torch.distributed as dist

    from launcher.runtime.peerstate import receive_state, send_state

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    model = _model(width if rank == 1 else 8)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    try:
        if rank == 0:
            for seed in range(3):
                _step(model, opt, seed)
            opt.param_groups[0]["lr"] = 0.005  # a schedule moved it: the receiver gets it too
            sent = send_state(model, opt, 3, dst=1, extra={"metrics_steps": 3})
            result: dict[str, Any] = {"sent": sent}
        else:
            header = receive_state(model, opt, src=0)
            result = {"step": header.step, "extra": dict(header.extra)}
        result["after"] = _snapshot(model, opt)
        _step(model, opt, 99)
        result["next"] = {k: v.clone() for k, v in model.state_dict().items()}
    except RuntimeError as exc:
        result = {"error": str(exc)}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _transfer(width: int = 8) -> tuple[dict[str, Any], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        # spawned, not forked: a child forked from a process that has run torch's intra-op pool
        # (this pytest worker, after other tests) hangs in its first parallel op (GNU OpenMP is
        # not fork-safe): seen as a rank killed by the hang guard in a fresh-clone run
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, str(Path(tmp) / "store"), tmp, width)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(HANG_GUARD_S)
            if p.is_alive():
                p.kill()
                p.join()
        assert [p.exitcode for p in procs] == [0, 0]  # each rank's outcome, an error included, is in its file
        return torch.load(Path(tmp) / "rank0.pt", weights_only=False), torch.load(Path(tmp) / "rank1.pt", weights_only=False)


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_the_replacement_gets_every_bit_of_the_model_and_optimizer() -> None:
    sender, receiver = _transfer()
    assert receiver["step"] == 3 and receiver["extra"] == {"metrics_steps": 3}
    assert sender["sent"] > 0
    assert _same(sender["after"], receiver["after"])  # parameters, BatchNorm's buffers, Adam's state and step, lr and betas
    assert _same(sender["next"], receiver["next"])  # and the next step is the same step


def test_a_receiver_whose_model_differs_is_refused_with_the_tensor_named() -> None:
    _, receiver = _transfer(width=6)
    assert "differs from its peer's" in receiver["error"] and "0.weight" in receiver["error"], receiver
