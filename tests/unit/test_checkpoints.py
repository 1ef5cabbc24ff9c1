"""ctx.checkpoint in one process (world size 1), on a real disk: what is saved comes back, a
checkpoint cut short is never loaded, and what must not be trusted is a one-line error naming
its path (never a silent fresh start). The multi-rank paths run under torchrun in
tests/integration/test_resume.py."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from launcher.checkpoint_store import PARTIAL_PREFIX, CheckpointError, Manifest, check_writable, complete_steps, job_identity
from launcher.protocol import WorkerConfig
from launcher.runtime import checkpoint as checkpoint_module
from launcher.runtime.checkpoint import Checkpoints, StopNotice
from tests.fake_time import FakeTime


def config(tmp_path: Path, **overrides: object) -> WorkerConfig:
    base = dict(
        job="j", stage_dir=str(tmp_path / "world1"), device_type="cpu", pg_backend="gloo", threads_per_worker=1,
        entrypoint="m:f", prepare=None, script=None, args=(), params={}, rendezvous_timeout_s=10, run_id="r1",
        checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_keep=2, checkpoint_async_save=False, warm_spares=0, job_identity=job_identity("j", "m:f"),
        collective_timeout_s=None, time_ddp=True, attempt=0, stop_grace_s=60.0, gpu_health=False, ranks_per_gpu=1,
    )  # fmt: skip
    return WorkerConfig(**{**base, **overrides})  # type: ignore[arg-type]


def checkpoints(tmp_path: Path, **overrides: object) -> Checkpoints:
    return Checkpoints(config(tmp_path, **overrides), rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 4), value)}, "step": int(value), "rng": torch.get_rng_state(), "note": "plain values too"}


def test_what_is_saved_comes_back_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    saved: list[int] = []
    ck = Checkpoints(config(tmp_path), rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), on_saved=lambda step, at: saved.append(step))
    assert ck.load() is None  # a fresh start
    for step in (10, 20, 30):
        folder = ck.save(state(step), step=step)
        assert folder == tmp_path / "ckpt" / f"step-{step:09d}"
    assert saved == [10, 20, 30] and [s for s, _ in complete_steps(tmp_path / "ckpt")] == [20, 30]  # keep: 2
    manifest = Manifest.read(tmp_path / "ckpt" / "step-000000030")
    assert (manifest.step, manifest.job, manifest.format, manifest.run_id) == (30, "j", "torch", "r1")
    assert manifest.files["state.pt"].bytes == (tmp_path / "ckpt" / "step-000000030" / "state.pt").stat().st_size

    again = checkpoints(tmp_path)  # a restarted attempt
    restored = again.load()
    assert restored is not None and restored.step == 30 and again.resumed_step == 30
    assert torch.equal(restored.state["model"]["w"], torch.full((4, 4), 30.0)) and restored.state["note"] == "plain values too"
    assert torch.equal(restored.state["rng"], state(30)["rng"])


def test_a_checkpoint_cut_short_is_never_loaded(tmp_path: Path) -> None:
    ck = checkpoints(tmp_path)
    ck.save(state(5), step=5)
    # a writer killed mid-write leaves its temporary folder, half a file in it, and no manifest
    partial = tmp_path / "ckpt" / f"{PARTIAL_PREFIX}step-000000009-host-123"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"PK\x03\x04 half a zip")
    restored = checkpoints(tmp_path).load()
    assert restored is not None and restored.step == 5
    assert not partial.exists()  # cleared at the load: nobody writes then


def test_a_killed_save_leaves_no_step_folder(tmp_path: Path) -> None:
    """The save itself killed (SIGKILL mid-write, in a child): the previous checkpoint is the latest."""
    checkpoints(tmp_path).save(state(1), step=1)
    pid = os.fork()
    if pid == 0:  # the child: a save whose torch.save is killed after its first write
        import signal

        # forked from a pytest worker that may have run torch's intra-op pool: GNU OpenMP is not
        # fork-safe (a parallel op would hang here), so the child runs every op on its own thread
        torch.set_num_threads(1)
        ck = checkpoints(tmp_path)
        original = torch.save
        torch.save = lambda obj, f, *a, **k: (Path(f).write_bytes(b"PK\x03\x04"), os.kill(os.getpid(), signal.SIGKILL))  # type: ignore[assignment]
        try:
            ck.save(state(2), step=2)
        finally:
            torch.save = original
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    assert [s for s, _ in complete_steps(tmp_path / "ckpt")] == [1]
    restored = checkpoints(tmp_path).load()
    assert restored is not None and restored.step == 1


def test_a_corrupted_manifest_is_an_error_naming_it(tmp_path: Path) -> None:
    checkpoints(tmp_path).save(state(3), step=3)
    manifest = tmp_path / "ckpt" / "step-000000003" / "manifest.json"
    manifest.write_text('{"step": 3, "job": ')
    with pytest.raises(CheckpointError) as info:
        checkpoints(tmp_path).load()
    message = str(info.value)
    assert message.startswith(f"checkpoint {manifest}: corrupted manifest") and "\n" not in message


def test_a_changed_state_file_is_an_error_naming_it(tmp_path: Path) -> None:
    checkpoints(tmp_path).save(state(3), step=3)
    path = tmp_path / "ckpt" / "step-000000003" / "state.pt"
    data = bytearray(path.read_bytes())
    data[-30] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"^checkpoint {path}: its contents differ from its manifest"):
        checkpoints(tmp_path).load()


def test_another_jobs_checkpoint_is_refused(tmp_path: Path) -> None:
    checkpoints(tmp_path, job="other", job_identity=job_identity("other", "m:g")).save(state(3), step=3)
    with pytest.raises(CheckpointError, match=r"written by another job \('other'"):
        checkpoints(tmp_path).load()


def test_a_directory_that_is_not_writable_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=rf"^checkpoint.dir {blocker / 'ckpt'}: not writable"):
        check_writable(blocker / "ckpt")


def test_load_from_a_given_step_folder_and_onto_another_device_type(tmp_path: Path) -> None:
    checkpoints(tmp_path).save(state(7), step=7)
    other = checkpoints(tmp_path / "elsewhere")
    restored = other.load(source=tmp_path / "ckpt" / "step-000000007", map_location="meta")
    assert restored is not None and restored.step == 7 and restored.state["model"]["w"].device.type == "meta"


def test_step_must_be_a_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        checkpoints(tmp_path).save(state(1), step=-1)


def test_the_stop_notice_is_the_jobs_once_it_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeTime.install(monkeypatch, checkpoint_module)
    notice = StopNotice(grace_s=30)
    called: list[str] = []
    with notice:
        assert notice.requested is False and notice.seconds_left is None
        notice.on_stop(lambda: called.append(notice.reason))
        notice.notify("SIGTERM")
        assert notice.requested is True and called == ["SIGTERM"]
        assert notice.seconds_left == 30  # the whole grace, from the notice on
        clock.advance(12.5)
        assert notice.seconds_left == 17.5
        clock.advance(20)
        assert notice.seconds_left == 0.0  # past the grace: none left, never negative


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signal handlers live in the main thread")
def test_a_host_sigterm_is_a_notice_for_a_watching_job_and_the_handler_goes_with_it() -> None:
    before = signal.getsignal(signal.SIGTERM)
    notice = StopNotice(grace_s=30)
    with notice:
        assert notice.requested is False  # the job watches from now on
        os.kill(os.getpid(), signal.SIGTERM)  # a spot VM's shutdown, say: this process lives on
        assert notice.requested is True and notice.reason == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_background_save_blocks_for_a_copy_and_publishes_what_was_saved(tmp_path: Path) -> None:
    """checkpoint.async_save: the job changes its tensors in place right after save() returns,
    while the file is still being written: the checkpoint holds the values at the save, it counts
    as saved (on_saved, with the step count at the save) only once published, and the next save,
    a load and wait() each wait for it."""
    gate = threading.Event()
    saved: list[tuple[int, int]] = []
    done = [0]
    ck = Checkpoints(config(tmp_path, checkpoint_async_save=True), rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                     on_saved=lambda step, at: saved.append((step, at)), steps_done=lambda: done[0])  # fmt: skip
    write = ck._write_stream

    def held_write(*args: object, **kwargs: object) -> Path:
        assert gate.wait(30)
        return write(*args, **kwargs)  # type: ignore[arg-type]

    ck._write_stream = held_write  # type: ignore[method-assign]
    model = {"w": torch.full((4, 4), 1.0)}
    done[0] = 7
    folder = ck.save({"model": model, "step": 1}, step=1)
    assert folder == tmp_path / "ckpt" / "step-000000001"
    model["w"].add_(100.0)  # the job steps on: its tensors change in place under the write
    done[0] = 9
    assert saved == [] and not folder.exists() and ck.last_step is None  # not published yet: not saved
    gate.set()
    ck.wait()
    assert saved == [(1, 7)] and ck.last_step == 1 and ck.write_s > 0  # at: the count when the job saved
    restored = checkpoints(tmp_path).load()
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.state["model"]["w"], torch.full((4, 4), 1.0))  # the values at the save
    ck.save({"model": model, "step": 2}, step=2)
    ck.save({"model": model, "step": 3}, step=3)  # waits for step 2's write first: one in flight
    assert [s for s, _ in saved] == [1, 2]
    assert ck.load() is not None and ck.last_step == 3  # load waits for the write in flight: the newest is 3
    assert [s for s, _ in complete_steps(tmp_path / "ckpt")] == [2, 3]


def test_a_failed_background_write_fails_the_next_save_naming_it(tmp_path: Path) -> None:
    ck = checkpoints(tmp_path, checkpoint_async_save=True)

    def broken(*_args: object, **_kwargs: object) -> Path:
        raise OSError(28, "No space left on device")

    ck._write_stream = broken  # type: ignore[method-assign]
    ck.save(state(1), step=1)
    with pytest.raises(CheckpointError, match="background write of a checkpoint failed: OSError: .*No space left on device"):
        ck.save(state(2), step=2)
    assert ck.last_step is None and complete_steps(tmp_path / "ckpt") == []
    ck.wait()  # the error was told once


def test_a_host_copy_keeps_a_state_dicts_shape_and_versions() -> None:
    """What load_state_dict reads back: the module's OrderedDict with its _metadata (versions),
    an optimizer's nested groups, tuples and named tuples, each tensor a detached copy."""
    from collections import namedtuple

    model = torch.nn.BatchNorm1d(3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    Pair = namedtuple("Pair", "a b")
    original = {"model": model.state_dict(), "opt": opt.state_dict(), "pair": Pair(torch.ones(1), 2), "t": (torch.zeros(1), "x")}
    copied = checkpoint_module.host_copy(original)
    assert type(copied["model"]) is type(original["model"]) and copied["model"]._metadata == original["model"]._metadata
    assert isinstance(copied["pair"], Pair) and copied["pair"].b == 2 and isinstance(copied["t"], tuple)
    for name, tensor in original["model"].items():
        assert torch.equal(copied["model"][name], tensor) and copied["model"][name].data_ptr() != tensor.data_ptr()
    assert copied["opt"]["param_groups"] == original["opt"]["param_groups"]
    fresh = torch.nn.BatchNorm1d(3)
    fresh.load_state_dict(copied["model"])
    assert torch.equal(fresh.running_mean, model.running_mean)



def test_a_host_copy_reuses_an_earlier_copys_memory_where_the_layout_matches() -> None:
    """The next save's copy goes into the last one's host tensors (no new memory to fault in),
    tensor by tensor where shape, dtype and strides match; anything else gets a new tensor."""
    model = torch.nn.Linear(4, 3)
    first = checkpoint_module.host_copy({"model": model.state_dict(), "extra": [torch.ones(2)]})
    with torch.no_grad():
        model.weight.add_(1.0)
    second = checkpoint_module.host_copy({"model": model.state_dict(), "extra": [torch.ones(5)]}, reuse=first)
    assert second["model"]["weight"].data_ptr() == first["model"]["weight"].data_ptr()  # the same memory, the new values
    assert torch.equal(second["model"]["weight"], model.weight) and second["model"]["weight"].data_ptr() != model.weight.data_ptr()
    assert second["extra"][0].shape == (5,) and second["extra"][0].data_ptr() != first["extra"][0].data_ptr()  # a new shape: new memory
    assert second["model"]._metadata == model.state_dict()._metadata


def test_background_saves_reuse_the_last_writes_copy_and_each_file_keeps_its_own_values(tmp_path: Path) -> None:
    ck = checkpoints(tmp_path, checkpoint_async_save=True)
    model = torch.nn.Linear(8, 8)
    ck.save({"model": model.state_dict()}, step=1)
    staged, initial = ck._staged["model"]["weight"].data_ptr(), model.weight.detach().clone()
    with torch.no_grad():
        model.weight.fill_(7.0)
    ck.save({"model": model.state_dict()}, step=2)  # waits for step 1's write, then copies into its buffers
    assert ck._staged["model"]["weight"].data_ptr() == staged
    ck.wait()
    older = torch.load(tmp_path / "ckpt" / "step-000000001" / "state.pt", weights_only=False)
    assert torch.equal(older["model"]["weight"], initial)  # written before its buffers were reused
    assert torch.equal(ck.load().state["model"]["weight"], torch.full((8, 8), 7.0))


def test_a_regroup_on_one_host_keeps_the_layout_and_the_replacement_takes_it_with_the_state(tmp_path: Path) -> None:
    """After a recovery in place no save asks the group for its layout again (every rank holds
    it: nothing is left to ask): a collective there is outside the job's ``live.run``, and a peer
    lost during it failed the survivor."""
    survivor = Checkpoints(config(tmp_path), rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    survivor._leaders, survivor._shared = [0], True  # what its first save learned (one host: rank 0 writes for both)
    replacement = Checkpoints(config(tmp_path), rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    survivor._regrouped()
    replacement._regrouped()
    replacement.take_layout(survivor.carried_layout())
    assert (survivor._leaders, survivor._shared) == (replacement._leaders, replacement._shared) == ([0], True)
    # a layout never asked is not made up: every rank asks at its first save, the replacement too
    fresh = Checkpoints(config(tmp_path), rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    fresh.take_layout(Checkpoints(config(tmp_path), rank=0, world_size=2, local_rank=0, device=torch.device("cpu")).carried_layout())
    assert fresh._leaders is None
