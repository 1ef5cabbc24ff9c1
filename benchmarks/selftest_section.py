"""BENCHMARKS.md's GPU section, made from a `launch selftest --json` record: every GPU figure with
its limit and the fraction reached, the machine, the date and the commit, and "not measured"
for each GPU figure the record lacks (a CPU-only run lists them all).

    python benchmarks/selftest_section.py runs/selftest/<run>/selftest.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path)
    args = p.parse_args(argv)
    print(section([json.loads(path.read_text()) for path in args.reports]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
