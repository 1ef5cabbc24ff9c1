"""Test entrypoint: a state whose ranks hold parts of it (a DTensor sharded by rows over the
group), saved with ``ctx.checkpoint.save(..., sharded=True)`` (torch.distributed.checkpoint) and
loaded back, at the same world size or another one (resharded), from ``params.source`` if given."""

from __future__ import annotations

from typing import Any

ROWS, COLS = 8, 6


def run(ctx: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    template = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]), "step": -1}
    restored = ctx.checkpoint.load(template, source=ctx.param("source"))
    if restored is not None:
        w = restored.state["w"]
        return {
            "loaded_step": restored.step,
            "format": restored.manifest.format,
            "saved_world_size": restored.manifest.world_size,
            "rows_held": list(w.to_local().shape),  # this rank's part at this world size
            "equals_saved": bool(torch.equal(w.full_tensor(), full)),
            "step_value": restored.state["step"],
        }
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 7}
    folder = ctx.checkpoint.save(state, step=7, sharded=True)
    return {"saved_to": str(folder) if folder else None, "rows_held": list(state["w"].to_local().shape)}
