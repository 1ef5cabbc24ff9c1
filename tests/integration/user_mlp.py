"""A user's own DDP job with no summarize/plot hooks: it logs its loss through ctx.metrics."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def run(ctx):
    torch.manual_seed(ctx.rank)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(60):
        x = torch.randn(32, 16, device=ctx.device)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.metrics.log("loss", loss.detach())
        ctx.metrics.log("lr", 0.05)
        ctx.metrics.step()
    return {"final_loss_logged": True}
