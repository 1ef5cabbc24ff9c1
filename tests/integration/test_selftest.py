"""`launch selftest` on this CPU-only machine: real ranks started by torchrun, the CPU parts
measured, every GPU part listed as not run with its reason, the straggler made on purpose
flagged by the launcher, and `selftest.json` written where the run's files are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def selftest(*args: str, out: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "selftest", *args, "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("selftest")
    done = selftest("--quick", "--json", out=out)
    return done, out


def test_quick_selftest_passes_on_the_cpu_with_every_cpu_figure(quick):
    done, out = quick
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["passed"] is True and report["status"] == "succeeded" and report["level"] == "quick"
    figures = {(f["check"], f["rank"]) for f in report["figures"]}
    assert {("matmul_fp32", 0), ("matmul_fp32", 1), ("host_memcpy", 0), ("host_memcpy", 1), ("allreduce_node", 0)} <= figures
    assert all(f["value"] > 0 and f["limit"] is None for f in report["figures"])  # no datasheet for a CPU
    (allreduce,) = [f for f in report["figures"] if f["check"] == "allreduce_node"]
    assert "gloo busbw over 2 ranks" in allreduce["detail"]
    saved = json.loads(next((out / "selftest").glob("*/selftest.json")).read_text())
    assert saved == report


def test_the_launchers_own_promises_are_checked(quick):
    done, out = quick
    report = json.loads(done.stdout)
    checks = {(c["check"], c["passed"]) for c in report["checks"]}
    assert checks == {("placement", True), ("recorder_syncs", True), ("straggler", True)}
    syncs = [c["detail"] for c in report["checks"] if c["check"] == "recorder_syncs"]
    assert len(syncs) == 2 and all("0 host read(s) in 50 logged steps" in d for d in syncs)
    (straggler,) = [c["detail"] for c in report["checks"] if c["check"] == "straggler"]
    assert straggler.startswith("rank 1 (+20 ms own work per step, host clock) flagged")
    result = json.loads(next((out / "selftest").glob("*/result.json")).read_text())
    assert [s["rank"] for s in result["stages"][0]["stragglers"]] == [1]  # flagged live, by the run loop


def test_every_gpu_part_is_listed_as_not_run_with_its_reason(quick):
    done, _ = quick
    report = json.loads(done.stdout)
    not_run = {(n["check"], n["why"]) for n in report["not_run"]}
    for part in ("matmul bf16 and fp32 vs the datasheet", "host<->GPU copies vs PCIe", "GPU->GPU peer copy", "NCCL all-reduce (gloo measured)",
                 "device syncs under set_sync_debug_mode (host reads counted)", "straggler marks on CUDA events (host clock used)"):
        assert (part, "no GPU") in not_run
    assert ("GPU inventory and health (NVML)", "no NVIDIA driver") in not_run
    assert "not run (no GPU):" in done.stderr and "SELFTEST PASSED" in done.stderr  # with --json the table goes to stderr
    machine = next(iter(report["machine"].values()))
    assert machine["gpus"] == [] and machine["versions"]["torch"].startswith("2.")


def test_a_straggler_the_launcher_misses_fails_the_selftest(tmp_path):
    done = selftest("--quick", "--set", "params.slow_ms=0", out=tmp_path)  # nobody slower: nothing to flag
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    said = " ".join(done.stdout.split())  # the console folds lines at 80 columns
    assert "straggler on" in said and "nothing flagged" in said and "SELFTEST FAILED" in said
    report = json.loads(next((tmp_path / "selftest").glob("*/selftest.json")).read_text())
    assert report["passed"] is False and report["status"] == "succeeded"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--set", "params.level=fast"), "params.level"),
        (("--cluster", "/nonexistent/cluster.yaml"), "/nonexistent/cluster.yaml"),
        (("--quick", "--full"), "not allowed with argument"),
    ],
)
def test_bad_input_is_one_line_and_starts_nothing(tmp_path, args, words):
    done = selftest(*args, out=tmp_path, timeout=30)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "selftest").exists()
