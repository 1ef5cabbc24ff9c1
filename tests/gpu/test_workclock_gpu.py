"""Straggler timing on a real GPU (marked ``gpu``): a DDP model's marks (its last gradient, the
optimizer's step) are CUDA events, read only once the device has passed them, and the step loop
never waits for the device."""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.gpu


def test_ddp_own_work_is_measured_with_events_and_no_host_sync(tmp_path):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from launcher.runtime.workclock import WorkClock, install_ddp_timing

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    clock = WorkClock(use_events=True)
    undo = install_ddp_timing(clock)
    try:
        model = DDP(torch.nn.Linear(256, 256).cuda(), device_ids=[0])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 256, device="cuda")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(30):
                if step == 5:
                    torch.cuda.set_sync_debug_mode("warn")  # from here on, every host sync warns
                torch.cuda._sleep(2_000_000)  # a few ms of "own work" queued on the device
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
            torch.cuda.set_sync_debug_mode("default")
        # whatever torch itself may do, the timing never made the host wait
        assert not [w for w in caught if "workclock" in w.filename], [str(w.message) for w in caught]
        torch.cuda.synchronize()
        mean = clock.recent()
        assert mean is not None and mean > 0.0005, mean
    finally:
        torch.cuda.set_sync_debug_mode("default")
        undo()
        dist.destroy_process_group()
