"""ctx.checkpoint's save and load against what a user writes by hand, the same state, one process.

Part 1, I/O: a model + optimizer state (``nn.Sequential`` of square ``nn.Linear`` layers and its
Adam state after one step: parameters, ``exp_avg``, ``exp_avg_sq``, so ~3x the model's bytes) on
the CPU, at two sizes (``--sizes``: ``large`` ~600 MB, ~0.5-2 s a save here; ``small`` ~13 MB).
Every repetition saves and loads it once in each variant, in a rotated order, each into a fresh
directory on the same filesystem (default: a temporary directory under /tmp):

- ``plain``: ``torch.save(state, path)`` and ``torch.load(path, weights_only=True)``; no fsync;
- ``dcp``: ``torch.distributed.checkpoint`` by hand, as torch documents it for one process (no
  process group): ``dcp.save(state, checkpoint_id=dir)``, ``dcp.load(state, checkpoint_id=dir)``
  (its FileSystemWriter fsyncs every file and the metadata: ``sync_files=True`` by default);
- ``ctx``: ``Checkpoints.save(state, step=k)`` / ``Checkpoints.load()`` at world size 1 (replicated:
  ``torch.save`` to the file in ``.partial-*``, its SHA-256 read back from the page cache on a
  helper thread while the file is fsynced, manifest written and fsynced, folder fsynced, renamed to
  ``step-*``, parent fsynced; the load reads the file and ``torch.load``s it from memory while a
  helper thread checks its SHA-256 against the manifest: the state is returned once they match);
- ``ctx_sharded``: ``Checkpoints.save(state, step=k, sharded=True)`` / ``Checkpoints.load(state)``
  (DCP into ``.partial-*``, every file's SHA-256 read back, manifest, rename; the load checks every
  file's digest on rank 0, then ``dcp.load``);

and, to say where the difference goes (not baselines):

- ``plain_fsync`` (save only): ``torch.save(state, path)`` then fsync of the file: what durability
  alone costs;
- ``sha256``: SHA-256 of the saved file's bytes, already in memory: what the digest alone costs.

A variant that did not fsync is fsynced after its timed part (untimed), so its dirty pages are
not written back during the next variant's measurement. Loads read what was just written (the
page cache is warm for every variant alike). ``plain`` and ``ctx`` load into new tensors; ``dcp``
and ``ctx_sharded`` fill the given state's tensors in place. Reported: median [min..max] seconds
and GB/s (the state's tensor bytes / time), and the ratio of ``ctx`` (and ``ctx_sharded``) to the
faster of ``plain`` and ``dcp`` in the same repetition (paired: median [min..max]) and of medians.

Part 2, the step rate (``--no-steps`` leaves it out): two gloo ranks (``torch.multiprocessing``),
the DDP model of ``straggler_overhead.py``, rank 0's microseconds per step, in one process per
rank, in short blocks of steps (20), the variants' blocks interleaved (rotated), 60 blocks each:

- ``plain``: the step;
- ``should_stop``: the step, then ``ctx.should_stop`` (``StopNotice.requested``: posts an
  asynchronous gloo all-reduce of one int and waits for the previous call's, long done);
- ``saving``: as ``should_stop``, plus one ``ctx.checkpoint.save`` (replicated, world 2) in the
  middle of the block; the save is timed apart and left out: the rate of the steps between saves,
  the steps right after a save included (after a save that fsynced, nothing is left writing).

Per block also: the process's CPU time per step (all its threads, gloo's included) and, in
``should_stop``, the time spent inside the call; after the blocks, the call's parts timed one by
one in the same loop (wait, read the flag, make a flag, post the all-reduce: a copy of
``StopNotice.requested``'s steps); and ``should_stop`` alone: microseconds per call in a loop of
nothing else, against an empty loop (each call then waits for the previous call's all-reduce: a
round trip of the gloo group). The in-loop time is the robust figure on a busy machine: the blocks'
wall times vary far more than the effect.

    python benchmarks/checkpoint_io.py [--smoke] [--reps N] [--sizes large,small] [--dir DIR]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import base_parser, fmt, machine_info, ratio, rotate, summary, write_result  # noqa: E402

# (width, layers) of the model; the state is ~3x its parameters' bytes (Adam's two moments)
SIZES = {"large": (2048, 12), "small": (512, 4), "tiny": (64, 2)}
VARIANTS = ("plain", "dcp", "ctx", "ctx_sharded")
DIAGNOSTICS = ("plain_fsync", "sha256")
BASELINES = ("plain", "dcp")
STEP_VARIANTS = ("plain", "should_stop", "saving")


# --- the state ----------------------------------------------------------------------------------
def build_state(torch: Any, width: int, layers: int) -> dict[str, Any]:
    """A model and its Adam state after one step (the same values every time)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1, "note": "plain values too"}


def tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


def same(a: Any, b: Any) -> bool:
    import torch

    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


def fsync_path(path: Path) -> None:
    """fsync a file, or every file of a folder and the folder (untimed: a variant that did not)."""
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


# --- ctx.checkpoint in one process --------------------------------------------------------------
def make_checkpoints(root: Path, cls: Any = None) -> Any:
    import torch

    from launcher.checkpoint_store import job_identity
    from launcher.protocol import WorkerConfig
    from launcher.runtime.checkpoint import Checkpoints

    config = WorkerConfig(
        job="bench", stage_dir=str(root / "world1"), device_type="cpu", pg_backend="gloo", threads_per_worker=1,
        entrypoint="benchmarks.checkpoint_io:none", prepare=None, script=None, args=(), params={}, rendezvous_timeout_s=10, run_id="bench",
        checkpoint_dir=str(root / "ckpt"), checkpoint_keep=1, checkpoint_async_save=False, warm_spares=0, job_identity=job_identity("bench", "benchmarks.checkpoint_io:none"),
        collective_timeout_s=None, time_ddp=True, attempt=0, stop_grace_s=60.0, gpu_health=False, ranks_per_gpu=1,
    )  # fmt: skip
    return (cls or Checkpoints)(config, rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


# --- one save + load in each variant ------------------------------------------------------------
def run_variant(name: str, state: dict[str, Any], where: Path, step: int) -> dict[str, Any]:
    """Save then load ``state`` once in variant ``name`` under ``where`` (a fresh folder)."""
    import torch
    import torch.distributed.checkpoint as dcp

    save_s = load_s = None
    loaded: Any = None
    if name in ("plain", "plain_fsync"):
        path = where / "state.pt"
        t0 = time.perf_counter()
        torch.save(state, path)
        if name == "plain_fsync":
            fsync_path(path)
        save_s = time.perf_counter() - t0
        fsync_path(path)  # untimed for ``plain``
        written = path
        if name == "plain":
            t0 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            load_s = time.perf_counter() - t0
    elif name == "sha256":
        path = where / "state.pt"
        torch.save(state, path)
        fsync_path(path)
        payload = path.read_bytes()
        t0 = time.perf_counter()
        hashlib.sha256(payload).hexdigest()
        save_s = time.perf_counter() - t0
        written = path
    elif name == "dcp":
        target = where / "dcp"
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(target))
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=str(target))  # fills the state's tensors in place
        load_s = time.perf_counter() - t0
        written, loaded = target, state
    else:  # ctx, ctx_sharded
        sharded = name == "ctx_sharded"
        ck = make_checkpoints(where)
        t0 = time.perf_counter()
        written = ck.save(state, step=step, sharded=sharded)
        save_s = time.perf_counter() - t0
        reader = make_checkpoints(where)  # as a restarted attempt would
        t0 = time.perf_counter()
        restored = reader.load(state) if sharded else reader.load()
        load_s = time.perf_counter() - t0
        assert restored is not None and restored.step == step, (name, restored)
        loaded = restored.state
    if loaded is not None and not same(state, loaded):
        raise AssertionError(f"{name}: what was loaded differs from what was saved")
    return {"save_s": save_s, "load_s": load_s, "bytes_on_disk": folder_bytes(written)}


def part_io(sizes: list[str], reps: int, base: Path) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
    variants = [*VARIANTS, *DIAGNOSTICS]
    out: dict[str, Any] = {}
    for size in sizes:
        width, layers = SIZES[size]
        state = build_state(torch, width, layers)
        nbytes = state_bytes(state)
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        loads: list[float] = []
        print(f"{size}: {len(tensors(state))} tensors, {nbytes / 1e6:.1f} MB (width {width}, {layers} layers, Adam)", flush=True)
        for rep in range(reps + 1):  # repetition 0: untimed warm-up
            for name in rotate(variants, rep):
                where = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
                try:
                    record = run_variant(name, state, where, rep + 1)
                finally:
                    shutil.rmtree(where, ignore_errors=True)
                if rep:
                    runs[name].append(record)
            if rep:
                loads.append(round(os.getloadavg()[0], 2))
                line = ", ".join(f"{v} {fmt(runs[v][-1]['save_s'])}/{fmt(runs[v][-1]['load_s'])}" for v in variants)
                print(f"  rep {rep}/{reps} (save/load s): {line}; load average {loads[-1]}", flush=True)
        out[size] = summarize_io(runs, nbytes, loads, width, layers)
    return out


def summarize_io(runs: dict[str, list[dict[str, Any]]], nbytes: int, loads: list[float], width: int, layers: int) -> dict[str, Any]:
    res: dict[str, Any] = {"width": width, "layers": layers, "state_bytes": nbytes, "loadavg_1min_per_rep": loads, "variants": {}}
    for name, records in runs.items():
        entry: dict[str, Any] = {"bytes_on_disk": records[0]["bytes_on_disk"] if records else None}
        for op in ("save", "load"):
            values = [r[f"{op}_s"] for r in records]
            if any(v is None for v in values):
                continue
            s = summary(values)
            entry[f"{op}_s"] = s
            speed = {"median": s["median"], "min": s["max"], "max": s["min"]}  # the slowest time is the lowest GB/s
            entry[f"{op}_gbps"] = {k: round(nbytes / 1e9 / t, 3) if t else None for k, t in speed.items()}
        res["variants"][name] = entry
    ratios: dict[str, Any] = {}
    for name in (n for n in ("ctx", "ctx_sharded") if n in runs):
        for op in ("save", "load"):
            best = [min(runs[b][i][f"{op}_s"] for b in BASELINES) for i in range(len(runs[name]))]
            paired = [ratio(r[f"{op}_s"], b) for r, b in zip(runs[name], best)]
            medians = res["variants"]
            best_median = min(medians[b][f"{op}_s"]["median"] for b in BASELINES)
            ratios[f"{name}_{op}"] = {"paired": summary(paired), "of_medians": ratio(medians[name][f"{op}_s"]["median"], best_median),
                                      "faster_baseline": min(BASELINES, key=lambda b: medians[b][f"{op}_s"]["median"])}  # fmt: skip
    res["ctx_over_best_baseline"] = ratios
    return res


# --- part 2: the step rate ------------------------------------------------------------------------
def _step_rank(rank: int, store_path: str, reps: int, steps: int, calls: int, ckpt_root: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.straggler_overhead import mlp
    from launcher.checkpoint_store import job_identity
    from launcher.protocol import WorkerConfig
    from launcher.runtime.checkpoint import Checkpoints, StopNotice

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    config = WorkerConfig(
        job="bench", stage_dir=str(Path(ckpt_root) / "world2"), device_type="cpu", pg_backend="gloo", threads_per_worker=1,
        entrypoint="benchmarks.checkpoint_io:none", prepare=None, script=None, args=(), params={}, rendezvous_timeout_s=30, run_id="bench",
        checkpoint_dir=str(Path(ckpt_root) / "ckpt"), checkpoint_keep=2, checkpoint_async_save=False, warm_spares=0, job_identity=job_identity("bench", "benchmarks.checkpoint_io:none"),
        collective_timeout_s=None, time_ddp=True, attempt=0, stop_grace_s=60.0, gpu_health=False, ranks_per_gpu=1,
    )  # fmt: skip
    ck = Checkpoints(config, rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    model = DDP(mlp(torch), bucket_cap_mb=0.25)
    x = torch.randn(32, 256)
    saved = [0]
    save_at = max(1, steps // 2)  # one save a `saving` block, in its middle: the steps after it are timed too

    def loop(variant: str, n: int, notice: Any) -> tuple[float, float, float]:
        """Per step, in microseconds, the save's own time left out: wall time; CPU time of this
        process (all its threads: gloo's included); time inside ``should_stop`` (in the loop)."""
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        dist.barrier()
        save_s = save_cpu = in_call = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(1, n + 1):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            if variant != "plain":
                q0 = time.perf_counter()
                stop = notice.requested  # as a job reads ctx.should_stop (never true here)
                in_call += time.perf_counter() - q0
                if stop:
                    break
            if variant == "saving" and i == save_at:
                s0, sc = time.perf_counter(), time.process_time()
                saved[0] += 1
                ck.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": saved[0]}, step=saved[0])
                save_s += time.perf_counter() - s0
                save_cpu += time.process_time() - sc
        wall, cpu = time.perf_counter() - t0 - save_s, time.process_time() - c0 - save_cpu
        return wall / n * 1e6, cpu / n * 1e6, in_call / n * 1e6

    def calls_us(n: int, notice: Any | None) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if notice is not None and notice.requested:
                break
        return (time.perf_counter() - t0) / n * 1e6

    times: dict[str, list[float]] = {v: [] for v in STEP_VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in STEP_VARIANTS}
    in_call: list[float] = []
    call_us: dict[str, list[float]] = {"should_stop": [], "empty": []}
    with StopNotice(60.0, world_size=2) as notice:
        loop("saving", steps, notice)  # warm-up: every variant's path once (the first save sets up the layout)
        for rep in range(reps):
            for variant in rotate(STEP_VARIANTS, rep):
                wall_us, cpu_us, call_in_loop_us = loop(variant, steps, notice)
                times[variant].append(wall_us)
                cpu[variant].append(cpu_us)
                if variant == "should_stop":
                    in_call.append(call_in_loop_us)
            call_us["empty"].append(calls_us(calls, None))
            call_us["should_stop"].append(calls_us(calls, notice))
        anatomy = should_stop_anatomy(torch, dist, model, x, reps * 2)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"step_us": times, "cpu_us": cpu, "in_loop_call_us": in_call, "call_us": call_us, "saves": saved[0],
                                              "anatomy_us": anatomy}))  # fmt: skip
    dist.destroy_process_group()
    os._exit(0)  # as the rank runtime leaves (fast_exit): gloo's threads can abort an interpreter's teardown


def should_stop_anatomy(torch: Any, dist: Any, model: Any, x: Any, n: int) -> dict[str, list[float]]:
    """Where a ``should_stop`` call's time goes inside a step loop: the same operations as
    ``StopNotice.requested`` (a copy, timed one by one; the job's group is gloo, as here): wait
    for the previous call's all-reduce, read its flag, make this call's flag, post its all-reduce."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    parts: dict[str, list[float]] = {"wait": [], "item": [], "new_flag": [], "post": [], "done_before_wait": []}
    pending = None
    dist.barrier()
    for _ in range(n):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if pending is not None:
            work, flag = pending
            parts["done_before_wait"].append(1.0 if work.is_completed() else 0.0)
            t = time.perf_counter()
            work.wait()
            parts["wait"].append(time.perf_counter() - t)
            t = time.perf_counter()
            bool(flag.item())
            parts["item"].append(time.perf_counter() - t)
        t = time.perf_counter()
        flag = torch.tensor([0], dtype=torch.int32)
        parts["new_flag"].append(time.perf_counter() - t)
        t = time.perf_counter()
        pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        parts["post"].append(time.perf_counter() - t)
    if pending is not None:
        pending[0].wait()
    return {k: [v * 1e6 for v in vs] if k != "done_before_wait" else vs for k, vs in parts.items()}


def part_steps(reps: int, steps: int, calls: int, base: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(dir=base) as tmp:
        out = Path(tmp) / "steps.json"
        mp.spawn(_step_rank, args=(str(Path(tmp) / "store"), reps, steps, calls, tmp, str(out)), nprocs=2)
        raw = json.loads(out.read_text())
    times, call_us = raw["step_us"], raw["call_us"]
    res: dict[str, Any] = {"blocks": reps, "steps_per_block": steps, "saves": raw["saves"], "calls_per_block": calls,
                           "step_us": {v: summary(times[v]) for v in STEP_VARIANTS}}  # fmt: skip
    res["steps_per_s"] = {v: round(1e6 / res["step_us"][v]["median"], 1) for v in STEP_VARIANTS}
    res["over_plain"] = {v: summary([ratio(a, b) for a, b in zip(times[v], times["plain"])]) for v in STEP_VARIANTS if v != "plain"}
    cpu = raw["cpu_us"]
    res["cpu_us"] = {v: summary(cpu[v]) for v in STEP_VARIANTS}
    res["cpu_over_plain"] = {v: summary([ratio(a, b) for a, b in zip(cpu[v], cpu["plain"])]) for v in STEP_VARIANTS if v != "plain"}
    res["should_stop_in_loop_us"] = summary(raw["in_loop_call_us"])  # the time a step spends inside the call
    res["should_stop_in_loop_share"] = ratio(res["should_stop_in_loop_us"]["median"], res["step_us"]["plain"]["median"])
    res["call_us"] = {k: summary(v) for k, v in call_us.items()}
    anatomy = raw["anatomy_us"]
    res["should_stop_anatomy_us"] = {k: summary(v) for k, v in anatomy.items() if k != "done_before_wait"}
    res["should_stop_anatomy_us"]["p90"] = {k: round(sorted(v)[int(0.9 * (len(v) - 1))], 1) for k, v in anatomy.items() if v and k != "done_before_wait"}
    res["previous_allreduce_done_before_wait"] = round(sum(anatomy["done_before_wait"]) / max(1, len(anatomy["done_before_wait"])), 3)
    res["should_stop_net_us"] = summary([a - b for a, b in zip(call_us["should_stop"], call_us["empty"])])
    return res


# --- report -------------------------------------------------------------------------------------
def _spread(s: dict[str, Any], digits: int = 3) -> str:
    return f"{fmt(s['median'], digits)} [{fmt(s['min'], digits)}..{fmt(s['max'], digits)}]"


def io_table(size: str, res: dict[str, Any]) -> list[str]:
    lines = [f"{size}: {res['state_bytes'] / 1e6:.1f} MB of tensors; load average (1 min) per repetition {res['loadavg_1min_per_rep']}", "",
             "| variant | save s | save GB/s | load s | load GB/s | on disk MB |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, v in res["variants"].items():
        save = _spread(v["save_s"]) if "save_s" in v else "-"
        load = _spread(v["load_s"]) if "load_s" in v else "-"
        gs = _spread(v["save_gbps"], 2) if "save_gbps" in v else "-"
        gl = _spread(v["load_gbps"], 2) if "load_gbps" in v else "-"
        lines.append(f"| {name} | {save} | {gs} | {load} | {gl} | {v['bytes_on_disk'] / 1e6:.1f} |")
    lines += ["", "| ratio to the faster baseline | paired: median [min..max] | of medians | faster baseline (medians) |", "|---|---|---|---|"]
    for key, r in res["ctx_over_best_baseline"].items():
        lines.append(f"| {key} | {_spread(r['paired'])} | {fmt(r['of_medians'])} | {r['faster_baseline']} |")
    return lines


def steps_table(res: dict[str, Any]) -> list[str]:
    lines = [f"2 gloo ranks, {res['blocks']} blocks of {res['steps_per_block']} steps per variant (interleaved), one save in the middle of each `saving` block "
             f"({res['saves']} saves); rank 0's time per step, saves left out", "",
             "| variant | wall us per step (per block) | steps/s (median) | wall / plain (paired per block) | CPU us per step (all threads) | CPU / plain (paired) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for v in STEP_VARIANTS:
        over = _spread(res["over_plain"][v]) if v in res["over_plain"] else "1"
        cpu_over = _spread(res["cpu_over_plain"][v]) if v in res["cpu_over_plain"] else "1"
        lines.append(f"| {v} | {_spread(res['step_us'][v], 1)} | {res['steps_per_s'][v]} | {over} | {_spread(res['cpu_us'][v], 1)} | {cpu_over} |")
    c, q = res["call_us"], res["should_stop_in_loop_us"]
    lines += ["", f"`ctx.should_stop` inside the step loop: {_spread(q, 1)} us per call ({fmt((res['should_stop_in_loop_share'] or 0) * 100, 2)}% of a plain step); "
                  f"alone, back to back (each call waits for the previous call's all-reduce): {_spread(c['should_stop'], 1)} us per call, "
                  f"an empty loop {_spread(c['empty'], 2)} us"]  # fmt: skip
    a = res["should_stop_anatomy_us"]
    lines += ["its parts inside the loop (us, median [min..max]; p90): " + "; ".join(f"{k} {_spread(a[k], 1)}; {a['p90'][k]}" for k in ("wait", "item", "new_flag", "post"))
              + f"; the previous call's all-reduce was done before the wait in {fmt(res['previous_allreduce_done_before_wait'] * 100, 0)}% of the calls"]  # fmt: skip
    return lines


def verdicts(data: dict[str, Any]) -> list[str]:
    out = []
    for size, res in data.get("io", {}).items():
        for key in ("ctx_save", "ctx_load", "ctx_sharded_save", "ctx_sharded_load"):
            r = res["ctx_over_best_baseline"].get(key)
            if r:
                med = r["paired"]["median"]
                out.append(f"{size} {key}: {fmt(med)}x the faster baseline ({r['faster_baseline']}): "
                           + ("within 5%" if med is not None and med <= 1.05 else f"over the 5% goal by {fmt((med - 1.05) * 100, 0)} points"))  # fmt: skip
    st = data.get("steps")
    if st:
        for v, r in st["over_plain"].items():
            c = st["cpu_over_plain"][v]
            out.append(
                f"steps with {v}: wall {fmt(r['median'])}x a plain step [{fmt(r['min'])}..{fmt(r['max'])}], CPU {fmt(c['median'])}x [{fmt(c['min'])}..{fmt(c['max'])}]"
            )
        out.append(
            f"should_stop inside the loop: {fmt(st['should_stop_in_loop_us']['median'], 1)} us per call, {fmt((st['should_stop_in_loop_share'] or 0) * 100, 2)}% of a step"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="comma-separated, of " + ", ".join(f"{k} ({w}x{w}, {n} layers)" for k, (w, n) in SIZES.items()))
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder under /tmp)")
    p.add_argument("--no-steps", action="store_true", help="part 1 only")
    p.add_argument("--no-io", action="store_true", help="part 2 only")
    p.add_argument("--steps", type=int, default=None, help="steps a block in part 2 (blocks: max(reps, 60))")
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.smoke else 9)
    sizes = (args.sizes or ("tiny" if args.smoke else "large,small")).split(",")
    steps = args.steps or (10 if args.smoke else 20)  # ~0.2 s a block here: short blocks, many, pair well on a busy machine
    step_reps = 1 if args.smoke else max(reps, 60)
    calls = 50 if args.smoke else 200
    base = Path(tempfile.mkdtemp(prefix="glb-ckpt-", dir=args.dir or "/tmp"))
    data: dict[str, Any] = {"mode": "smoke" if args.smoke else "full", "machine": machine_info(),
                            "config": {"reps": reps, "step_reps": step_reps, "sizes": sizes, "dir": str(base), "torch_threads": 1}}  # fmt: skip
    try:
        if not args.no_io:
            data["io"] = part_io(sizes, reps, base)
        if not args.no_steps:
            data["steps"] = part_steps(step_reps, steps, calls, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    data["verdicts"] = verdicts(data)
    for size, res in data.get("io", {}).items():
        print("\n".join(["", *io_table(size, res)]))
    if "steps" in data:
        print("\n".join(["", *steps_table(data["steps"])]))
    print("\n".join(["", *data["verdicts"]]))
    write_result("checkpoint_io-smoke" if args.smoke and not args.out else "checkpoint_io", data, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
