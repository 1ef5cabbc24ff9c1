"""A run submitted to a cluster: its result comes back through the job's log without the large
files (they stay on the cluster, listed), and a cluster Python that lacks what the launcher needs
says so in one line before anything starts."""

from __future__ import annotations

import json

from launcher.backends.ray_jobs.bundle import LEFT_FILE, BundleLines, emit_bundle, unpack_bundle
from launcher.control import submitted


def test_large_files_stay_on_the_cluster_and_are_listed(tmp_path):
    run_dir = tmp_path / "cluster" / "job" / "20261123-000000-abcdef"
    (run_dir / "world2").mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps({"status": "succeeded"}))
    (run_dir / "world2" / "checkpoint.pt").write_bytes(b"\0" * 2_000_000)
    lines: list[str] = []
    left = emit_bundle(run_dir, write=lines.append, max_file=1_000_000)
    assert left == [str(run_dir / "world2" / "checkpoint.pt")]
    assert sum(len(line) for line in lines) < 20_000  # not 2.7 MB of base64 in the job's log
    back = unpack_bundle("\n".join(["some rank output", *lines]), tmp_path / "client")
    assert back is not None and json.loads((back / "result.json").read_text())["status"] == "succeeded"
    assert not (back / "world2" / "checkpoint.pt").exists()
    listing = json.loads((back / LEFT_FILE).read_text())
    assert [f["path"] for f in listing["files"]] == left and listing["files"][0]["bytes"] == 2_000_000
    assert [line for line in ["a", *lines, "b"] if not BundleLines().take(line)] == ["a", "b"]  # what `launch logs` shows


def test_the_runs_record_always_travels_however_large(tmp_path):
    """A result.json or a rank's report over the limit (a few thousand logged steps) still comes
    back: only artifacts stay on the cluster."""
    run_dir = tmp_path / "cluster" / "job" / "20261123-000000-abcdef"
    (run_dir / "world2" / "reports").mkdir(parents=True)
    big = {"status": "succeeded", "stages": [], "series": list(range(300_000))}
    (run_dir / "result.json").write_text(json.dumps(big))
    (run_dir / "world2" / "reports" / "rank0.json").write_text(json.dumps(big))
    assert (run_dir / "result.json").stat().st_size > 1_000_000
    lines: list[str] = []
    assert emit_bundle(run_dir, write=lines.append, max_file=1_000_000) == []
    back = unpack_bundle("\n".join(lines), tmp_path / "client")
    assert back is not None and json.loads((back / "result.json").read_text()) == big
    assert json.loads((back / "world2" / "reports" / "rank0.json").read_text()) == big


def test_a_cluster_python_without_the_dependencies_says_what_it_lacks(capsys, monkeypatch):
    monkeypatch.setattr(submitted, "NEEDED", ("yaml", "gl_no_such_module_here"))
    assert submitted.missing_dependencies() == ["gl_no_such_module_here"]
    assert submitted.main(["ray", "spec.yaml"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: the cluster's Python (") and "lacks gl_no_such_module_here" in line
