"""Start-up benchmark: a 2-worker job that only joins the process group and does one all-reduce.

Variants, run side by side and interleaved (the order rotates every repetition):

  torchrun          bare ``torchrun --standalone --nproc-per-node=2 benchmarks/bare_allreduce.py``
  launch            ``launch benchmarks/jobs/allreduce.yaml --backend torchrun`` (ranks forked from
                    a forkserver that has imported torch: the default ``start_method``)
  launch_spawn      the same with ``--set start_method=spawn``: each rank a fresh interpreter, as
                    under plain torchrun
  launch_script     ``launch benchmarks/jobs/allreduce_script.yaml``: the unchanged torchrun script
                    (``script: bare_allreduce.py``, the one bare torchrun runs), each rank a fresh
                    interpreter; its first step is the script's own timestamp, as for torchrun
  launch_ray        ``launch ... --backend ray`` (Ray started inside the launcher)
  launch_ray_cluster ``launch ... --backend ray`` on an already running local Ray cluster
                    (``ray start --head`` before the repetitions): the launcher connects to it
                    (RAY_ADDRESS + GPULAUNCH_RAY_CONNECT=1, as it does inside a Ray job)
  launch_ray_jobs   ``launch ... --backend ray --address http://127.0.0.1:<dashboard>``: the same
                    running cluster through the Ray Jobs API
  launch[NAME]      with ``--variant NAME=DIR``: ``launch`` with another checkout's ``launcher``
                    package in front on PYTHONPATH (to measure a proposed change side by side);
                    ``launch_script[NAME]`` the same for the script job

Every variant runs in a fresh temporary working directory (the repository reaches the workers
through PYTHONPATH), so a ``--variant`` checkout is not shadowed by the current directory.

For each run: wall clock from spawning the command to its exit, and time to first step (from the
spawn to the first rank's first step: ``phases.first_step`` in result.json, or the timestamp the
bare script writes right after its all-reduce). For ``launch`` also the per-phase breakdown from
result.json. Ray variants are skipped, with the reason printed, when the Ray backend is missing
or fails its first run.

    python benchmarks/startup.py            # 7 repetitions
    python benchmarks/startup.py --smoke    # 1 repetition of torchrun and launch
    python benchmarks/startup.py --full --reps 15
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO, base_parser, bench_env, fmt, kill_group, kill_matching, machine_info, ratio, rotate, run_timed, summary,
    launch_cli, tool, write_result,
)

JOB = REPO / "benchmarks" / "jobs" / "allreduce.yaml"
JOB_SCRIPT = REPO / "benchmarks" / "jobs" / "allreduce_script.yaml"
BARE = REPO / "benchmarks" / "bare_allreduce.py"
TIMEOUT_S = 180


class Skip(Exception):
    pass


def _launch_result(out_dir: Path) -> dict[str, Any] | None:
    found = sorted(out_dir.glob("*/*/result.json"))
    return json.loads(found[-1].read_text()) if found else None


def _launch_record(argv: list[str], env: dict[str, str], work: Path, stamps: Path | None = None) -> dict[str, Any]:
    out_dir = work / "runs"
    done = run_timed([*argv, "--out", str(out_dir)], env=env, timeout_s=TIMEOUT_S, cwd=work)
    if done.rc != 0:
        raise RuntimeError(f"exit {done.rc}{' (timeout)' if done.timed_out else ''}: {done.output[-1500:]}")
    result = _launch_result(out_dir)
    if result is None:  # e.g. a job submitted to a cluster that keeps its run directory there
        return {"wall_s": done.wall_s, "first_step_s": None, "note": f"no result.json under {out_dir}"}
    ranks = result.get("ranks", [])
    firsts = [r["phases"]["first_step"] for r in ranks if "first_step" in r.get("phases", {})]
    if stamps is not None:  # a script counts no steps: its own timestamp after the all-reduce, as under torchrun
        firsts = [json.loads(p.read_text())["first_step"] for p in stamps.glob("rank*.json")]
    finished = [r["phases"]["finished"] for r in ranks if "finished" in r.get("phases", {})]
    stage = (result.get("stages") or [{}])[0]
    # the stage's clock starts after the backend's session (e.g. ray.init) is up: recover it from a rank
    stage_start = next((r["phases"]["first_step"] - r["timeline_s"]["first_step"] for r in ranks
                        if "first_step" in r.get("phases", {}) and "first_step" in (r.get("timeline_s") or {})), None)
    return {
        "session_setup_s": None if stage_start is None else stage_start - result["started_at"],
        "wall_s": done.wall_s,
        "first_step_s": min(firsts) - done.t_start if firsts else None,
        "launcher_before_stage_s": result["started_at"] - done.t_start,
        "after_last_rank_finished_s": done.t_end - max(finished) if finished else None,
        "stage_phases": stage.get("phases"),
        "launcher_cpu_s": (result.get("phases") or {}).get("launcher_cpu_s"),  # the launcher's own CPU by phase
        "rank_timeline_s": {str(r["rank"]): r.get("timeline_s") for r in ranks},
    }


def _bench_env(device: str, ranks_per_gpu: int, stamps: Path | None = None) -> dict[str, str]:
    """What bare_allreduce.py reads: where to stamp, the device, and how many ranks share a GPU."""
    env = {"BENCH_DEVICE": device, "BENCH_RANKS_PER_GPU": str(ranks_per_gpu)}
    if stamps is not None:
        env["BENCH_STAMP_DIR"] = str(stamps)
    return env


def run_torchrun(work: Path, device: str, world: int, ranks_per_gpu: int = 1) -> dict[str, Any]:
    stamps = work / "stamps"
    stamps.mkdir()
    env = bench_env(_bench_env(device, ranks_per_gpu, stamps))
    done = run_timed([tool("torchrun"), "--standalone", f"--nproc-per-node={world}", str(BARE)], env=env, timeout_s=TIMEOUT_S, cwd=work)
    if done.rc != 0:
        raise RuntimeError(f"exit {done.rc}: {done.output[-1500:]}")
    firsts = [json.loads(p.read_text())["first_step"] for p in stamps.glob("rank*.json")]
    return {"wall_s": done.wall_s, "first_step_s": min(firsts) - done.t_start if firsts else None}


def _job_args(device: str, world: int, ranks_per_gpu: int = 1) -> list[str]:
    """The job's world on the command line: ``world`` CPU workers, or ``world`` ranks on
    ``world / ranks_per_gpu`` GPUs (``resources.ranks_per_gpu``: ranks sharing one GPU, gloo)."""
    if device == "cuda":
        gpus = -(-world // ranks_per_gpu)
        args = ["--set", "resources.device=cuda", "--set", f"resources.gpus_per_node={gpus}"]
        return args + (["--set", f"resources.ranks_per_gpu={ranks_per_gpu}"] if ranks_per_gpu > 1 else [])
    return ["--set", f"resources.cpu_workers={world}"] if world != 2 else []


def make_launch(backend: str, device: str, extra_env: dict[str, str] | None = None,
                pythonpath: str | None = None, extra_args: tuple[str, ...] = (), *, world: int = 2,
                ranks_per_gpu: int = 1, job: Path = JOB) -> Callable[[Path], dict[str, Any]]:
    def run(work: Path) -> dict[str, Any]:
        stamps = None
        extra = dict(extra_env or {})
        if job == JOB_SCRIPT:  # the bare script's own stamps, device and GPU sharing, as under torchrun
            stamps = work / "stamps"
            stamps.mkdir()
            extra.update(_bench_env(device, ranks_per_gpu, stamps))
        env = bench_env(extra, pythonpath=pythonpath)
        # a variant's checkout may lay the package out differently: run its own CLI (`python -m launcher`)
        cli = [sys.executable, "-m", "launcher"] if pythonpath else launch_cli()
        argv = [*cli, str(job), "--backend", backend, "--quiet", *_job_args(device, world, ranks_per_gpu), *extra_args]
        return _launch_record(argv, env, work, stamps)

    return run


class RayCluster:
    """A local Ray head for the 'running cluster' variant: own temp dir, own ports, started as
    our child and stopped by pid (never ``ray stop``, which would stop other people's Ray)."""

    def __init__(self) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="glb-ray-", dir="/tmp"))
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.dashboard = ""
        # token auth on, with a throw-away token of our own (never the user's ~/.ray/auth_token)
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}

    def start(self, timeout_s: float = 90) -> None:
        port, dash = _free_port(), _free_port()
        argv = [
            tool("ray"), "start", "--head", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
            f"--port={port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={self.temp}",
            "--num-cpus=2",
        ]
        log = open(self.temp / "ray-start.log", "w")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=bench_env(self.env))
        self.address = f"127.0.0.1:{port}"
        self.dashboard = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Skip(f"ray start exited with {self.proc.returncode}: {(self.temp / 'ray-start.log').read_text()[-800:]}")
            if any(self.temp.glob("session_latest/logs/raylet.out")) and _port_open(port) and _port_open(dash):
                time.sleep(1.0)  # let the raylet register with the GCS
                return
            time.sleep(0.2)
        self.stop()
        raise Skip("ray start did not come up within %ds" % timeout_s)

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid)
            self.proc.wait()
        kill_matching(str(self.temp))  # raylet, gcs_server, workers: all name our temp dir
        shutil.rmtree(self.temp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def ray_available() -> str | None:
    """None when the Ray variants can run, else the reason they cannot."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'gpulaunch[ray]')"
    if importlib.util.find_spec("launcher.backends.ray") is None:
        return "launcher/backends/ray.py does not exist yet"
    return None


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--no-ray", action="store_true", help="skip the Ray variants")
    p.add_argument("--only", action="append", default=[], help="run only these variants (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                   help="also run `launch` with DIR (a checkout holding a modified launcher/) first on PYTHONPATH")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo) by default; cuda: one GPU per rank with nccl (--world 2 needs 2 GPUs), "
                        "or --ranks-per-gpu ranks sharing each GPU with gloo")
    p.add_argument("--world", type=int, default=None,
                   help="ranks (default 2; with --device cuda, 1 unless --ranks-per-gpu says more)")
    p.add_argument("--ranks-per-gpu", type=int, default=1,
                   help="with --device cuda: ranks sharing each GPU (resources.ranks_per_gpu; both sides use gloo "
                        "on cuda:<local_rank // k>), so one GPU runs a 2-rank start-up")
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.smoke else 7)
    if args.ranks_per_gpu < 1 or (args.ranks_per_gpu > 1 and args.device != "cuda"):
        p.error("--ranks-per-gpu is for --device cuda (a positive count)")
    world = args.world or (args.ranks_per_gpu if args.device == "cuda" else 2)
    shape = {"world": world, "ranks_per_gpu": args.ranks_per_gpu}

    variants: dict[str, Callable[[Path], dict[str, Any]]] = {
        "torchrun": lambda work: run_torchrun(work, args.device, world, args.ranks_per_gpu),
        "launch": make_launch("torchrun", args.device, **shape),
        "launch_script": make_launch("torchrun", args.device, job=JOB_SCRIPT, **shape),
        "launch_spawn": make_launch("torchrun", args.device, extra_args=("--set", "start_method=spawn"), **shape),
    }
    for spec in args.variant:
        name, _, path = spec.partition("=")
        variants[f"launch[{name}]"] = make_launch("torchrun", args.device, pythonpath=str(Path(path).resolve()), **shape)
        variants[f"launch_script[{name}]"] = make_launch("torchrun", args.device, pythonpath=str(Path(path).resolve()), job=JOB_SCRIPT, **shape)
    skipped: dict[str, str] = {}
    if args.smoke:  # the smoke run checks the script, not the figures: one launch variant is enough
        del variants["launch_spawn"], variants["launch_script"]
        skipped["launch_spawn"] = "smoke mode (launch's code path with --set start_method=spawn)"
        skipped["launch_script"] = "smoke mode (launch's code path with a script: job)"
    cluster: RayCluster | None = None
    ray_tmp = Path(tempfile.mkdtemp(prefix="glb-rt-", dir="/tmp"))  # the embedded Ray's temp dir
    why = "smoke mode (Ray start-up takes longer than the smoke budget)" if args.smoke else (
        "--no-ray" if args.no_ray else ray_available())
    if why:
        skipped["launch_ray"] = skipped["launch_ray_cluster"] = skipped["launch_ray_jobs"] = why
    else:

        def on_cluster(work: Path) -> dict[str, Any]:
            assert cluster is not None
            # what the backend does inside a Ray job: connect to the running cluster, never embed
            env = {**cluster.env, "RAY_ADDRESS": cluster.address, "GPULAUNCH_RAY_CONNECT": "1"}
            return make_launch("ray", args.device, env, **shape)(work)

        def on_cluster_jobs(work: Path) -> dict[str, Any]:
            assert cluster is not None
            return make_launch("ray", args.device, cluster.env, extra_args=("--address", cluster.dashboard), **shape)(work)

        variants["launch_ray"] = make_launch("ray", args.device, {"RAY_TMPDIR": str(ray_tmp)}, **shape)
        variants["launch_ray_cluster"] = on_cluster
        if importlib.util.find_spec("launcher.backends.ray_jobs") is not None:
            variants["launch_ray_jobs"] = on_cluster_jobs
        else:
            skipped["launch_ray_jobs"] = "launcher/backends/ray_jobs.py (the Ray Jobs API client behind --address) does not exist yet"

    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only}

    records: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    errors: dict[str, str] = {}
    try:
        if "launch_ray_cluster" in variants or "launch_ray_jobs" in variants:
            cluster = RayCluster()
            try:
                t0 = time.perf_counter()
                cluster.start()
                print(f"ray cluster up at {cluster.address} in {time.perf_counter() - t0:.1f}s")
            except Skip as exc:
                for name in ("launch_ray_cluster", "launch_ray_jobs"):
                    if name in variants:
                        skipped[name] = str(exc)
                        del variants[name], records[name]
        # one untimed warm-up of each variant (page cache, .pyc files); a failing variant is dropped
        for name in [] if args.smoke else list(variants):  # smoke: no warm-up, the one rep is the check
            with tempfile.TemporaryDirectory(prefix="glb-") as work:
                try:
                    variants[name](Path(work))
                except Exception as exc:  # noqa: BLE001
                    reason = f"first run failed: {exc}"[:2000]
                    if name.startswith("launch_ray"):
                        skipped[name] = reason
                    else:
                        errors[name] = reason
                    print(f"skip {name}: {reason}", file=sys.stderr)
                    del variants[name], records[name]
            kill_matching(str(ray_tmp))
        for k in range(reps):
            for name in rotate(list(variants), k):
                with tempfile.TemporaryDirectory(prefix="glb-") as work:
                    try:
                        rec = variants[name](Path(work))
                    except Exception as exc:  # noqa: BLE001
                        errors.setdefault(name, str(exc)[:2000])
                        continue
                    finally:
                        kill_matching(str(ray_tmp))
                records[name].append(rec)
                print(f"rep {k + 1}/{reps} {name:22s} wall {rec['wall_s']:.3f}s  first step {fmt(rec['first_step_s'])}s", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        kill_matching(str(ray_tmp))
        shutil.rmtree(ray_tmp, ignore_errors=True)

    table = {}
    for name, recs in records.items():
        row: dict[str, Any] = {
            "wall_s": summary([r["wall_s"] for r in recs]),
            "first_step_s": summary([r["first_step_s"] for r in recs]),
        }
        with_phases = [r for r in recs if "stage_phases" in r]
        if with_phases:
            row["launcher_before_stage_s"] = summary([r["launcher_before_stage_s"] for r in with_phases])
            row["session_setup_s"] = summary([r.get("session_setup_s") for r in with_phases])
            row["after_last_rank_finished_s"] = summary([r["after_last_rank_finished_s"] for r in with_phases])
            for phase in ("spawn", "import", "rendezvous", "pg_init", "run", "to_first_step"):
                row[f"phase_{phase}_s"] = summary([(r["stage_phases"] or {}).get(phase) for r in with_phases])
        with_cpu = [r["launcher_cpu_s"] for r in recs if r.get("launcher_cpu_s")]
        if with_cpu:  # the launcher's own CPU seconds: the two totals, then by phase
            cpu_row = {k: summary([c.get(k) for c in with_cpu]) for k in ("before_spawn", "after_exit", "total")}
            for phase in dict.fromkeys(p for c in with_cpu for p in c.get("by_phase") or {}):
                cpu_row[phase] = summary([(c.get("by_phase") or {}).get(phase) for c in with_cpu])
            row["launcher_cpu_s"] = cpu_row
        table[name] = row
    base = table.get("torchrun", {})
    base_recs = records.get("torchrun", [])
    for name, row in table.items():
        recs = records[name]
        if base_recs and len(recs) == len(base_recs):  # paired: the same repetition, minutes apart at most
            row["wall_ratio_per_rep"] = summary([ratio(a["wall_s"], b["wall_s"]) for a, b in zip(recs, base_recs)])
            row["first_step_ratio_per_rep"] = summary(
                [ratio(a["first_step_s"], b["first_step_s"]) for a, b in zip(recs, base_recs)])
        row["wall_ratio_vs_torchrun"] = ratio(row["wall_s"]["median"], base.get("wall_s", {}).get("median"))
        row["first_step_ratio_vs_torchrun"] = ratio(row["first_step_s"]["median"], base.get("first_step_s", {}).get("median"))

    sharing = f", {args.ranks_per_gpu} ranks per GPU" if args.ranks_per_gpu > 1 else ""
    print(f"\nstart-up, {world} workers, one all-reduce ({args.device}{sharing}), {reps} repetitions; median [min..max], ratio vs torchrun")
    print(f"{'variant':24s} {'wall s':>24s} {'ratio':>6s} {'first step s':>24s} {'ratio':>6s}")
    for name, row in table.items():
        w, f = row["wall_s"], row["first_step_s"]
        print(f"{name:24s} {fmt(w['median']):>8s} [{fmt(w['min'])}..{fmt(w['max'])}] {fmt(row['wall_ratio_vs_torchrun'], 2):>6s}"
              f" {fmt(f['median']):>8s} [{fmt(f['min'])}..{fmt(f['max'])}] {fmt(row['first_step_ratio_vs_torchrun'], 2):>6s}")
    for name, row in table.items():
        if "launcher_cpu_s" in row:
            cpu = row["launcher_cpu_s"]
            print(f"{name:24s} launcher CPU s (median): " + ", ".join(f"{k} {fmt(v['median'])}" for k, v in cpu.items()))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    for name, err in errors.items():
        print(f"error {name}: {err}", file=sys.stderr)
    write_result("startup", {
        "benchmark": "startup", "mode": "smoke" if args.smoke else "full" if args.full else "default",
        "device": args.device, "world": world, "ranks_per_gpu": args.ranks_per_gpu, "reps": reps, "machine": machine_info(), "variants": table,
        "skipped": skipped, "errors": errors, "raw": records,
    }, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
