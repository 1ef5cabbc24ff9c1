"""BENCHMARKS.md's GPU section, made from a `launch selftest --json` record: every GPU figure with
its limit and the fraction reached, the machine, the date and the commit, and "not measured"
for each GPU figure the record lacks (a CPU-only run lists them all).

    python benchmarks/selftest_section.py runs/selftest/<run>/selftest.json [more.json ...]
    python benchmarks/selftest_section.py --session $OUT $OUT/selftest.json $OUT/selftest-shared.json

``--session DIR`` (what ``benchmarks/gpu_session.sh`` leaves in ``$OUT``) adds the session's steps
(exit code and seconds of each: every job as shipped, the selftest, ``pytest -m gpu``, the
benchmarks), the start-up and throughput tables rendered as ``benchmarks/report.py`` renders them,
and the tests that failed; a record that is missing or cannot be read is said, never fatal.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Every figure a GPU node gives, in the order the section lists them.
GPU_FIGURES = {
    "matmul_bf16": "matmul bf16 (TFLOP/s) vs the datasheet's dense peak",
    "matmul_fp32": "matmul fp32 (TFLOP/s) vs the datasheet (TF32 off)",
    "h2d_pinned": "host->GPU pinned (GB/s) vs the PCIe link",
    "d2h_pinned": "GPU->host pinned (GB/s) vs the PCIe link",
    "h2d_pageable": "host->GPU pageable (GB/s)",
    "d2h_pageable": "GPU->host pageable (GB/s)",
    "peer_copy": "GPU0->GPU1 peer copy (GB/s) vs NVLink or PCIe",
    "allreduce_node": "NCCL all-reduce bus bandwidth in a node (GB/s) vs NVLink",
    "allreduce_all": "NCCL all-reduce bus bandwidth across nodes (GB/s)",
}
GPU_CHECKS = {
    "placement": "each rank on cuda:<local_rank>, on the GPU its grant names (UUID)",
    "gpu_health": "NVML health: ECC, retired pages, row remapping, clocks, compute mode",
    "recorder_syncs": "no host sync from ctx.metrics in a logged loop (set_sync_debug_mode error)",
    "straggler": "a rank slowed on purpose flagged (CUDA-event marks)",
}


def section(reports: list[dict[str, Any]]) -> str:
    lines = ["## GPU figures from `launch selftest`", ""]
    gpu_reports = [r for r in reports if any(m.get("gpus") for m in r["machine"].values())]
    for r in reports:
        lines.append(f"- {_where(r)}: level {r['level']}, {r['status']}, {'passed' if r['passed'] else 'FAILED'}, {r['wall_s']} s")
    lines += ["", "| figure | machine | measured | limit | of limit | verdict |", "|---|---|---|---|---|---|"]
    for check, words in GPU_FIGURES.items():
        rows = [(r, f) for r in gpu_reports for f in r["figures"] if f["check"] == check]
        if not rows:
            lines.append(f"| {words} | - | not measured | - | - | - |")
        for r, f in rows:
            limit = "-" if f["limit"] is None else f"{f['limit']:.4g} ({f['limit_source']})"
            share = "-" if f["fraction"] is None else f"{f['fraction']:.0%}"
            lines.append(f"| {words} | {_gpu(r, f)} | {f['value']:.4g} | {limit} | {share} | {f['verdict']} |")
    lines += ["", "| check | machine | result |", "|---|---|---|"]
    for check, words in GPU_CHECKS.items():
        found = [(r, c) for r in gpu_reports for c in r["checks"] if c["check"] == check]
        if not found:
            lines.append(f"| {words} | - | not measured |")
        for _, c in found:
            lines.append(f"| {words} | {c['host']} | {'passed' if c['passed'] else 'FAILED'}: {c['detail']} |")
    not_run = sorted({f"{n['check']} ({n['why']})" for r in gpu_reports for n in r["not_run"]})
    if not_run:
        lines += ["", "Not run on the GPU machine(s): " + "; ".join(not_run) + "."]
    return "\n".join(lines) + "\n"


def _where(report: dict[str, Any]) -> str:
    hosts = []
    for host, m in report["machine"].items():
        gpus = m.get("gpus") or []
        kind = f"{len(gpus)}x {gpus[0]}" if gpus else "no GPU"
        torch = (m.get("versions") or {}).get("torch")
        hosts.append(f"{host} ({kind}, driver {m.get('driver')}, torch {torch})")
    return f"{', '.join(hosts)}, {report['date']}, commit {report['launcher_commit']}"


def _gpu(report: dict[str, Any], figure: dict[str, Any]) -> str:
    machine = report["machine"].get(figure["host"]) or next(iter(report["machine"].values()))
    gpus = machine.get("gpus") or ["?"]
    return f"{gpus[0]} {figure['device']}".strip()


def session_section(out: Path) -> str:
    """The GPU session's own records: its steps, the benchmarks' tables, the failed tests."""
    lines = ["", "### The GPU session (`bash benchmarks/gpu_session.sh`)", ""]
    machine = out / "machine.txt"
    if machine.is_file():
        text = machine.read_text(errors="replace").splitlines()
        nvidia = [" ".join(ln.strip(" |").split()) for ln in text if "NVIDIA" in ln][:2]  # nvidia-smi's driver line, the first GPU
        lines.append(f"Machine: {'; '.join(text[:2] + nvidia)}")
        lines.append("")
    steps = _summary_steps(out / "summary.txt")
    if steps:
        lines += ["| step | exit | seconds | limit s | command |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {rc} | {secs} | {limit} | `{cmd}` |" for name, rc, secs, limit, cmd in steps]
    else:
        lines.append(f"(no steps recorded in {out / 'summary.txt'})")
    lines += _failed_tests(out / "pytest_gpu.xml")
    from benchmarks import report

    renders: list[tuple[str, str, Callable[[dict[str, Any]], list[str]]]] = [
        ("startup-world1.json", "Start-up against bare torchrun, world 1", report.startup),
        ("startup-shared.json", "Start-up against bare torchrun, 2 ranks sharing the GPU", report.startup),
        ("throughput.json", "The matmul and DDP jobs against hand-written code", report.throughput),
    ]
    for name, title, render in renders:
        lines += ["", f"#### {title}", ""]
        path = out / name
        if not path.is_file():
            lines.append(f"not measured: no {name} (see the step's log)")
            continue
        try:
            lines += render(json.loads(path.read_text()))
        except Exception as exc:  # noqa: BLE001  (a record of another shape: say so, render the rest)
            lines.append(f"{name}: could not be rendered ({type(exc).__name__}: {exc})")
    return "\n".join(lines) + "\n"


def _summary_steps(path: Path) -> list[tuple[str, str, str, str, str]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("#") or line.startswith("step "):
            continue
        parts = line.split(None, 4)
        if len(parts) >= 4:
            rows.append((parts[0], parts[1], parts[2], parts[3], parts[4].replace("|", "\\|") if len(parts) > 4 else ""))
    return rows


def _failed_tests(path: Path) -> list[str]:
    if not path.is_file():
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return ["", f"pytest -m gpu: its report could not be read ({exc})"]
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    out = ["", f"`pytest -m gpu`: {counts['tests']} tests, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"]
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            why = (bad.get("message") or "").splitlines()[0][:160] if bad.get("message") else ""
            out.append(f"- FAILED {case.get('classname')}::{case.get('name')}: {why}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="*", type=Path, help="selftest.json records (launch selftest --json)")
    p.add_argument("--session", type=Path, default=None, help="a gpu_session.sh output folder ($OUT): its steps and benchmarks too")
    args = p.parse_args(argv)
    if not args.reports and args.session is None:
        p.error("give selftest.json records, --session DIR, or both")
    reports, unreadable = [], []
    for path in args.reports:
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            unreadable.append(f"{path}: {exc}")
    text = section(reports)
    if unreadable:
        text += "\nSelftest records that could not be read: " + "; ".join(unreadable) + "\n"
    if args.session is not None:
        text += session_section(args.session)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
