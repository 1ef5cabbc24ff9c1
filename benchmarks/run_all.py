"""Run every benchmark in turn and collect their results in one file.

    python benchmarks/run_all.py --smoke     # CI: each script in its smoke mode (well under a minute)
    python benchmarks/run_all.py             # the CPU figures of BENCHMARKS.md (tens of minutes)
    python benchmarks/run_all.py --full      # on a GPU machine: the GPU paths as well

Each script also runs alone (``python benchmarks/startup.py --help``). Results go to
``benchmarks/results/<name>.json`` (or under ``--out-dir``) and ``all.json`` lists them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, machine_info, write_result  # noqa: E402

SCRIPTS = ("cli_latency", "recorder_overhead", "startup", "throughput", "scaling", "event_path")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true")
    mode.add_argument("--full", action="store_true")
    p.add_argument("--out-dir", default=None, help=f"where the JSON files go (default {RESULTS}; --smoke: its smoke/ folder)")
    p.add_argument("--only", action="append", default=[], choices=SCRIPTS)
    args = p.parse_args(argv)
    # a smoke run's figures mean nothing: keep them out of the published results
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS / "smoke" if args.smoke else RESULTS
    flags = ["--smoke"] if args.smoke else ["--full"] if args.full else []
    import importlib

    done, failed = {}, {}
    for name in args.only or SCRIPTS:
        t0 = time.perf_counter()
        print(f"== {name} {' '.join(flags)}", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        out = out_dir / f"{name}.json"
        try:
            rc = module.main([*flags, "--out", str(out)])
        except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
            rc = f"{type(exc).__name__}: {exc}"
        entry = {"file": str(out), "seconds": round(time.perf_counter() - t0, 1), "rc": rc}
        if rc != 0 and out.is_file():  # keep the why next to the what (a run's error text)
            entry["errors"] = json.loads(out.read_text()).get("errors")
        (done if rc == 0 else failed)[name] = entry
    write_result("all", {"mode": "smoke" if args.smoke else "full" if args.full else "default", "machine": machine_info(),
                         "ran": done, "failed": failed}, str(out_dir / "all.json"))
    for name, info in failed.items():
        print(f"FAILED {name}: {info['rc']} {info.get('errors') or ''}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
