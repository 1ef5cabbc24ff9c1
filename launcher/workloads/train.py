"""d2l "GPUs", "Neural Networks and GPUs" and exercise 2: a small model trained with DDP.

Every rank puts its replica of an MLP on ``ctx.device`` (``cuda:<local_rank>`` or the CPU), wraps
it in ``DistributedDataParallel`` and trains on its shard of a generated classification task
(labels from a fixed random "teacher" network: learnable, nothing downloaded). Batches move to the
device as they are used (pinned, ``non_blocking`` on a GPU). Loss, correct answers and sample
counts are summed in a tensor on the device, never read inside the loop, and reduced across ranks
once at the end. Rank 0 then writes a checkpoint (model + optimizer + epoch), reads the file back
and sends its bytes to every rank, which loads them with ``map_location=ctx.device`` and checks
they equal its own replica. ``params.resume`` continues from such a checkpoint up to
``params.epochs`` in all: rank 0 reads it and every rank loads the same bytes (model, optimizer
state, epoch). DDP gets its final gradient buckets before its first step
(``ctx.checkpoint.fix_buckets``), so that a resumed run ends with the uninterrupted run's model,
bit for bit, at every world size on the CPU. No shared filesystem is assumed: a rank on another
host (SSH without shared storage, a Ray actor on another node) never opens a checkpoint path,
which exists on rank 0's host.

Throughput is measured per epoch (CUDA events on a GPU, read once at the end; the host clock on
the CPU): the first epoch of a run is its warm-up (allocations, DDP's bucket set-up) and the
epochs after it are the trials, reported as the median samples/s with their min-max. On the CPU
every rank runs ``threads_per_rank`` torch threads (default 1) at every world size, so that the
scaling efficiency compares like with like; an efficiency above 1.05 or a noisy figure is
flagged and not stated as a result.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Mapping

from pydantic import Field, StrictInt

from launcher.workloads.fairness import busy_stages, load_words, threads_words
from launcher.workloads.measure import machine_state, set_threads
from launcher.workloads.params import Count, NonNegative, Positive, ThreadsPerRank, WorkloadParams
from launcher.workloads.plotting import devices_label, integer_ticks, legend_below, save_figure, values, yerr
from launcher.workloads.stats import Stat, doubts_in_words, flags_for, pct, rnd, span, stat


class Params(WorkloadParams):
    n_train: Count = 32768  # generated samples: nothing is downloaded
    n_test: Count = 4096
    features: Count = 64
    classes: Annotated[StrictInt, Field(ge=2)] = 10
    hidden: Count = 512
    batch_size: Count = 256  # per rank
    epochs: Count = 4  # in all, counting the epochs of a resumed checkpoint; the first of a run is its warm-up
    lr: Positive = 0.002
    threads_per_rank: ThreadsPerRank = None  # null: 1 on the CPU at every world size; "share": the launcher's share
    seed: NonNegative = 0
    checkpoint_every: NonNegative = 1  # epochs between checkpoints (ctx.checkpoint); 0: only the last
    resume: str | None = None  # a fresh run starts from this checkpoint (a step-* folder or a checkpoint dir, on rank 0's host)
    in_place: bool = False  # a lost rank replaced while the others keep their processes (ctx.checkpoint.in_place)


def make_dataset(n: int, features: int, classes: int, seed: int, split: int) -> tuple[Any, Any]:
    """Inputs ~ N(0, 1); labels = argmax of a fixed random teacher MLP (the same teacher for every split)."""
    import torch

    teacher = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(features, 64, generator=teacher), torch.randn(64, classes, generator=teacher)
    data = torch.Generator().manual_seed(seed * 1000 + 1 + split)
    x = torch.randn(n, features, generator=data)
    y = (torch.tanh(x @ w1 / features**0.5) @ w2).argmax(dim=1)
    return x, y


def make_model(features: int, hidden: int, classes: int) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def run(ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    p = Params.model_validate(ctx.params)
    threads = set_threads(ctx, p.threads_per_rank)
    machine_start = machine_state()
    dev, rec, cuda = ctx.device, ctx.metrics, ctx.device.type == "cuda"
    features, classes, seed = p.features, p.classes, p.seed
    torch.manual_seed(seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = make_model(features, p.hidden, classes).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr)
    # a restart finds the stage's own latest checkpoint; a fresh run may start from params.resume
    restored = ctx.checkpoint.load() or (ctx.checkpoint.load(source=p.resume) if p.resume else None)
    if restored is not None:  # saved on cuda:0 (or wherever), on our device now
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["optimizer"])
    x, y = make_dataset(p.n_train, features, classes, seed, split=0)
    train = TensorDataset(x, y)
    sampler: DistributedSampler[Any] = DistributedSampler(train, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(train, batch_size=p.batch_size, sampler=sampler, pin_memory=cuda)
    loss_fn = nn.CrossEntropyLoss()
    per_epoch = len(loader)
    # the data position, in epochs (a checkpoint of another world size has another batches per epoch)
    start_step = round(float(restored.state["epoch"]) * per_epoch) if restored is not None else 0

    # Recovery in place (params.in_place: ctx.checkpoint.in_place): a lost rank is replaced while
    # the others keep their processes, and its state comes from a survivor's memory; live.model is
    # the DDP model, built here (and again after a recovery) with its final gradient buckets from
    # the first step on, so that a resumed or recovered run reduces as an uninterrupted one did,
    # bit for bit at any world size (ctx.checkpoint.fix_buckets); live.step: where a replacement
    # goes on from.
    def wrap(m: Any) -> Any:
        return ctx.checkpoint.fix_buckets(DDP(m, device_ids=[dev.index] if cuda else None))

    live = ctx.checkpoint.in_place(model, opt, wrap=wrap, step=start_step) if p.in_place else _Steps(wrap(model), start_step)
    start_step = step = live.step
    start_epoch, skip = divmod(start_step, per_epoch)  # the epoch, and the batch in it
    epochs = range(start_epoch, p.epochs)
    # loss sum, correct, samples per epoch of the run: one layout on every rank (a replacement in
    # place starts later), reduced once at the end
    stats = torch.zeros(max(p.epochs, 1), 3, device=dev, dtype=torch.float64)
    stopped, ran = False, 0

    def state() -> dict[str, Any]:
        arch = {"features": p.features, "hidden": p.hidden, "classes": p.classes}
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": step / per_epoch, "world_size": ctx.world_size, "arch": arch}

    def train_step(epoch: int, xb: Any, yb: Any) -> bool:
        """One step, done again by live.run should a peer be lost before its optimizer step."""
        xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
        out = live.model(xb)
        loss = loss_fn(out, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here
        opt.step()
        stats[epoch, 0] += loss.detach() * yb.shape[0]  # on the device: no .item(), no sync
        stats[epoch, 1] += (out.argmax(dim=1) == yb).sum()
        stats[epoch, 2] += yb.shape[0]
        rec.step()
        return bool(ctx.should_stop)  # the group's answer (read once per step, on every rank)

    live.model.train()
    for i, epoch in enumerate(epochs):
        sampler.set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
        ran = i + 1
        with rec.timer("train/epoch"):
            for b, (xb, yb) in enumerate(loader):
                if epoch == start_epoch and b < skip:
                    continue  # done before the checkpoint this run resumed from
                stopped = bool(live.run(train_step, epoch, xb, yb))
                step += 1
                if stopped:
                    break
        if stopped or (p.checkpoint_every and (epoch + 1) % p.checkpoint_every == 0) or epoch + 1 == p.epochs:
            ctx.checkpoint.save(state(), step=step)
        if stopped:
            break
    test = _evaluate(torch, model, dev, ctx, p)
    totals = torch.cat([stats.flatten(), test])
    dist.all_reduce(totals)  # the one reduction: every rank's sums, once, at the end
    stats, test = totals[:-3].view(-1, 3), totals[-3:]
    for epoch in epochs[:ran]:
        rec.log("train/loss", stats[epoch, 0] / stats[epoch, 2])  # still tensors: copied to the host by the runtime
        rec.log("train/acc", stats[epoch, 1] / stats[epoch, 2])
    rec.log("test/loss", test[0] / test[2])
    rec.log("test/acc", test[1] / test[2])
    if not len(epochs):
        ctx.checkpoint.save(state(), step=step)  # nothing left to train: the checkpoint it resumed from, kept as this run's
    final = ctx.checkpoint.load()  # the last checkpoint, read back on every rank onto its own device
    check = _check_checkpoint(torch, final, model, dev)
    return {
        "samples_per_epoch": len(sampler),
        "batches_per_epoch": per_epoch,
        "start_epoch": start_epoch,
        "start_step": start_step,
        "steps": step,
        "epochs_run": len(epochs),
        "first_epoch": start_epoch,
        "resumed_from": str(restored.path) if restored is not None else None,
        "stopped_early": stopped,
        "checkpoint": str(final.path) if final is not None else None,  # on rank 0's host
        "checkpoint_check": check,
        "model_sha256": _state_digest(model.state_dict()),
        **threads,
        "machine_start": machine_start,
        "machine_end": machine_state(),
    }


class _Steps:
    """``live`` without recovery in place (``params.in_place: false``): the DDP model, its steps run as they are."""

    def __init__(self, model: Any, step: int) -> None:
        self.model, self.step = model, step

    def run(self, step_fn: Any, *args: Any) -> Any:
        return step_fn(*args)


def _state_digest(state: Mapping[str, Any]) -> str:
    """The model's parameters as one SHA-256 (bitwise: two runs agree only if every bit does)."""
    digest = hashlib.sha256()
    for name, tensor in state.items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _evaluate(torch: Any, model: Any, dev: Any, ctx: Any, p: Params) -> Any:
    """This rank's share of the test set: [loss sum, correct, samples] on the device."""
    x, y = make_dataset(p.n_test, p.features, p.classes, p.seed, split=1)
    x, y = x[ctx.rank :: ctx.world_size].to(dev), y[ctx.rank :: ctx.world_size].to(dev)
    model.eval()
    with torch.no_grad():
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y, reduction="sum")
    model.train()
    return torch.stack([loss.double(), (out.argmax(dim=1) == y).sum().double(), torch.tensor(float(y.shape[0]), device=dev, dtype=torch.float64)])


def _check_checkpoint(torch: Any, final: Any, model: Any, dev: Any) -> dict[str, Any]:
    """The last checkpoint as ``ctx.checkpoint.load`` gave it to this rank: on this rank's device,
    equal to this rank's replica."""
    if final is None:
        return {"map_location": str(dev), "all_on_device": False, "equals_replica": False, "epoch": None, "tensors": 0, "sha256": None}
    tensors = list(final.state["model"].values())
    mine = model.state_dict()
    return {
        "map_location": str(dev),
        "all_on_device": all(t.device == dev for t in tensors),
        "equals_replica": all(torch.equal(final.state["model"][k], mine[k]) for k in mine),
        "epoch": final.state["epoch"],
        "step": final.step,
        "tensors": len(tensors),
        # what rank 0 wrote, by its manifest (a rank on another host got the same, verified, bytes)
        "sha256": final.manifest.files["state.pt"].sha256,
    }


def _epoch_trials(ranks: list[dict[str, Any]]) -> tuple[Stat | None, Stat | None, list[Stat], float | None]:
    """Samples/s in total per timed epoch (every rank's samples over the slowest rank's time: DDP
    keeps them in step), its median rank's own samples/s, and the warm-up epoch's total."""
    times = [r.get("metrics", {}).get("times_ms", {}).get("train/epoch") or [] for r in ranks]
    samples = [(r.get("result") or {}).get("samples_per_epoch", 0) for r in ranks]
    epochs = min((len(t) for t in times), default=0)
    if not epochs or not all(samples):
        return None, None, [], None
    warm = 1 if epochs >= 2 else 0  # the run's first epoch pays for allocations and DDP's set-up
    totals = [sum(samples) / (max(t[e] for t in times) / 1e3) for e in range(epochs)]
    per_rank = [s for t, n in zip(times, samples) if (s := stat(n / (ms / 1e3) for ms in t[warm:] if ms > 0)) is not None]
    medians = sorted(x.median for x in per_rank)
    rank_med = stat([medians[len(medians) // 2]]) if medians else None
    return stat(totals[warm:]), rank_med, per_rank, (totals[0] if warm else None)


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    """Samples/s per rank and in total per world size (median of the timed epochs, min-max), scaling
    efficiency with its range and flags, the reduced loss/accuracy, the checkpoint checks."""
    rows, curves, totals = [], {}, {}
    cores, device = None, "?"
    threads: dict[int, int | None] = {}
    policy: set[str] = set()
    done = []
    for stage in stages:
        ranks = sorted((r for r in stage["ranks"] if r.get("status") == "ok"), key=lambda r: r["rank"])
        if stage["status"] != "succeeded" or not ranks:
            continue
        done.append(stage)
        ws = stage["world_size"]
        total, rank_med, per_rank, first_sps = _epoch_trials(ranks)
        totals[ws] = total
        res0 = ranks[0]
        values_ = res0.get("metrics", {}).get("values", {})
        result0 = res0.get("result") or {}
        for r in ranks:
            res = r.get("result") or {}
            device = str(r.get("device", device)).split(":")[0]
            threads.setdefault(ws, res.get("threads"))
            if res.get("threads_policy"):
                policy.add(res["threads_policy"])
            cores = cores or (res.get("machine_start") or {}).get("cores")
        first = result0.get("first_epoch", 0)
        curves[ws] = {
            "epochs": list(range(first + 1, first + 1 + len(values_.get("train/loss", [])))),
            "train_loss": [rnd(v) for v in values_.get("train/loss", [])],
            "train_acc": [rnd(v) for v in values_.get("train/acc", [])],
        }
        checks = [(r.get("result") or {}).get("checkpoint_check") or {} for r in ranks]
        rows.append(
            {
                "workers": ws,
                "epochs": f"{first}->{first + result0.get('epochs_run', 0)}",
                "timed_epochs": total.n if total else 0,
                "rank_sps": rnd(rank_med and rank_med.median, 1),
                "rank_sps_by_rank": [rnd(x.median, 1) for x in per_rank],
                "total_sps": rnd(total and total.median, 1),
                "total_sps_min": rnd(total and total.min, 1),
                "total_sps_max": rnd(total and total.max, 1),
                "total_sps_range": span(total.min, total.max) if total else None,
                "rank_sps_min": rnd(min((x.min for x in per_rank), default=None), 1),
                "rank_sps_max": rnd(max((x.max for x in per_rank), default=None), 1),
                "warmup_epoch_sps": rnd(first_sps, 1),
                "spread": rnd(total and total.spread, 3),
                "train_loss": rnd((values_.get("train/loss") or [None])[-1]),
                "train_acc": rnd((values_.get("train/acc") or [None])[-1]),
                "test_acc": rnd((values_.get("test/acc") or [None])[-1]),
                "ckpt_ok": all(c.get("all_on_device") and c.get("equals_replica") for c in checks),
                "checkpoint": result0.get("checkpoint"),
                "resumed_from": result0.get("resumed_from"),
                "devices": sorted({r["device"] for r in ranks}),
                "threads_per_worker": threads.get(ws),
            }
        )
    base = rows[0] if rows else None
    base_total = totals.get(base["workers"]) if base else None
    busy = busy_stages(done)
    for row in rows:
        total = totals.get(row["workers"])
        eff = lo = hi = None
        if base and base_total and total:
            scale = row["workers"] / base["workers"]
            eff = total.median / (scale * base_total.median)
            if row is not base:
                lo, hi = total.min / (scale * base_total.max), total.max / (scale * base_total.min)
        row["efficiency"], row["efficiency_min"], row["efficiency_max"] = rnd(eff, 3), rnd(lo, 3), rnd(hi, 3)
        row["flags"], row["note"] = flags_for(row["spread"], eff if row is not base else None,
                                              trials=row["timed_epochs"] or None, busy=busy.get(row["workers"]))
    fair_words, fair = threads_words(threads, policy, cores, device)
    load, was_busy = load_words(done)
    return {
        "title": "DDP training: samples/s (sps) per rank and in total (median of timed epochs); metrics reduced at the end",
        "columns": ["workers", "rank_sps", "total_sps", "total_sps_range", "efficiency", "test_acc", "ckpt_ok", "note"],
        "rows": rows,
        "curves": {str(k): v for k, v in curves.items()},
        "checkpoints_ok": bool(rows) and all(r["ckpt_ok"] for r in rows),
        "like_for_like": fair,
        "threads_per_rank": {str(ws): t for ws, t in sorted(threads.items())},
        "conclusions": _conclusions(rows, fair_words, fair, load, was_busy),
    }


def _conclusions(rows: list[dict[str, Any]], fair_words: str, fair: bool, load: str | None, busy: bool) -> list[str]:
    if not rows:
        return ["no stage finished: nothing to report"]
    out = []
    for row in rows:
        where = ", ".join(row["devices"])
        rate = ("-" if row["total_sps"] is None else
                f"{row['total_sps']:,.0f} samples/s in total (epochs {row['total_sps_range']}; {row['rank_sps']:,.0f} per rank)")
        out.append(f"{row['workers']} worker(s) on {where}: {rate}; epochs {row['epochs']}, test accuracy {row['test_acc']:.1%}")
    base, last = rows[0], rows[-1]
    if len(rows) > 1 and last["efficiency"] is not None:
        doubts = [*doubts_in_words(last["flags"], last["workers"]), *doubts_in_words(base["flags"], base["workers"], baseline=True)]
        if not fair:
            doubts.append("not like for like")
        eff = f"{pct(last['efficiency'])} (range {pct(last['efficiency_min'])}-{pct(last['efficiency_max'])})"
        if doubts:
            out.append(f"{last['workers']} workers: the measured {eff} of linear scaling in samples/s cannot be trusted: "
                       f"{', '.join(doubts)}; rerun on a quieter machine or with more epochs")
        else:
            out.append(f"{last['workers']} workers reach {eff} of linear scaling in samples/s")
    if any(r["timed_epochs"] for r in rows):
        out.append("the first epoch of each run is its warm-up: the samples/s are the median of the epochs after it")
    out.append(fair_words)
    if load:
        out.append(load + (": the machine was busy, other work than this job's ranks competed for the cores" if busy else ""))
    resumed = [r for r in rows if r["resumed_from"]]
    if resumed:
        out.append(f"resumed from {resumed[0]['resumed_from']} at epoch {resumed[0]['epochs'].split('->')[0]}")
    out.append(
        "rank 0's checkpoint, read back on every rank with map_location=<its device>, equals every replica"
        if all(r["ckpt_ok"] for r in rows)
        else "WARNING: a rank's checkpoint read-back differs from its replica or landed on the wrong device"
    )
    return out


def plot(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    summary = result.get("summary") or {}
    rows, curves = summary.get("rows") or [], summary.get("curves") or {}
    if not rows:
        return []
    fig, (ax_l, ax_a, ax_t) = plt.subplots(1, 3, figsize=(14, 4.8))
    for i, (ws, c) in enumerate(curves.items()):
        if c["epochs"]:
            ax_l.plot(c["epochs"], c["train_loss"], marker="o", color=f"C{i}", label=f"{ws} worker(s)")
            ax_a.plot(c["epochs"], c["train_acc"], marker="s", color=f"C{i}", label=f"{ws} worker(s)")
    ax_l.set(xlabel="epoch", ylabel="train loss (all ranks)", title="training loss (reduced at the end)")
    ax_a.set(xlabel="epoch", ylabel="train accuracy (all ranks)", title="training accuracy", ylim=(0, 1))
    for ax in (ax_l, ax_a):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # throughput: total and per rank side by side (never one bar over the other), min-max error bars
    shown = [r for r in rows if r.get("total_sps") is not None]
    xs = [r["workers"] for r in shown]
    width = 0.35
    ax_t.bar([x - width / 2 for x in xs], values(shown, "total_sps"), width, yerr=yerr(shown, "total_sps"), capsize=4,
             color="C0", label="total (median, min-max)")
    ax_t.bar([x + width / 2 for x in xs], values(shown, "rank_sps"), width, yerr=yerr(shown, "rank_sps"), capsize=4,
             color="C1", label="per rank (median rank; min-max of all ranks)")
    base = shown[0] if shown else None
    ideal = [base["total_sps"] * x / base["workers"] for x in xs] if base and base["total_sps"] else []
    if ideal:
        ax_t.hlines(ideal, [x - width for x in xs], xs, colors="black", linestyles="--", linewidths=1.5, zorder=4,
                    label="ideal linear total (N x one worker)")
    for r in shown:
        top = r.get("total_sps_max") or r["total_sps"]
        ax_t.annotate(f"{r['total_sps']:,.0f}", (r["workers"] - width / 2, top), xytext=(0, 3), textcoords="offset points",
                      ha="center", va="bottom", fontsize=8)
    bad = [r for r in shown if r.get("flags")]
    if bad:
        ax_t.scatter([r["workers"] - width / 2 for r in bad], values(bad, "total_sps"), s=160, facecolors="none",
                     edgecolors="red", linewidths=1.5, zorder=5, label="flagged (see note)")
    tops = [r.get("total_sps_max") or r["total_sps"] for r in shown] + [r.get("rank_sps_max") or 0 for r in shown] + ideal
    ax_t.set_ylim(0, max(tops, default=1) * 1.2)  # every bar, error bar and reference inside: nothing clipped
    ax_t.set(xlabel="workers", ylabel="samples/s (timed epochs)", title="training throughput")
    integer_ticks(ax_t, xs or [1])
    for ax in (ax_l, ax_a, ax_t):
        ax.grid(alpha=0.3)
        legend_below(ax, ncol=1 if ax is ax_t else 2)
    fig.suptitle(f"{result['job']} on {devices_label(result)}; torch threads per rank by world size: "
                 + (", ".join(f"{k}: {v}" for k, v in (summary.get("threads_per_rank") or {}).items()) or "?"))
    notes = [f"{r['workers']} worker(s): {r['note']}" for r in rows if r.get("note")]
    notes.append("the first epoch of each run is its warm-up and is not in the samples/s")
    return [save_figure(fig, run_dir, "ddp_train.png", notes)]
