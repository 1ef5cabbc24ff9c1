"""What a Ray submission ships as its job's working directory, without a cluster: regular files
only (a live socket, a pipe, a broken link skipped and named), the defaults, .gitignore and
.rayignore (here, below and above within the repository), ``ray.excludes`` and the run's ``--out``
left out, and a directory over ``ray.working_dir_max_mb`` refused in one line that names its size,
its largest parts and how to narrow it (the real submission: test_ray_jobs_channels.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Iterator

import pytest

from launcher.backends.ray_jobs.submit import _working_dir, shipment
from launcher.backends.ray_jobs.workdir import materialize, select
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.spec.model import load_job

MiB = 1024**2


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[Path]:
    """A directory with a unix socket something listens on (as a running Ray's session dir has)."""
    folder = tmp_path / "sock"
    folder.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(folder / "raylet.sock"))
        sock.listen(1)
        yield folder


def _tree(root: Path, files: dict[str, bytes | int]) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, int):
            with open(path, "wb") as handle:
                handle.truncate(content)  # sparse: its size without the disk
        else:
            path.write_bytes(content)


def _names(root: Path, **kwargs) -> list[str]:  # noqa: ANN003
    return [name for name, _, _ in select(root, cap_bytes=kwargs.pop("cap_bytes", 50 * MiB), **kwargs).files]


def test_only_regular_files_go_and_what_is_not_one_is_named(tmp_path: Path, listening: Path) -> None:
    root = listening
    _tree(root, {"train.py": b"x", "pkg/mod.py": b"y", "pkg/__pycache__/mod.cpython-311.pyc": b"z", ".git/HEAD": b"ref",
                 ".venv/bin/python": b"", "runs/old/result.json": b"{}"})  # fmt: skip
    os.mkfifo(root / "pipe")
    (root / "gone").symlink_to(root / "nowhere")
    (root / "alias.py").symlink_to(root / "train.py")
    (root / "pkg" / "loop").symlink_to(root)  # a link back up is not walked twice
    shipped = select(root, cap_bytes=50 * MiB)
    assert [name for name, _, _ in shipped.files] == ["alias.py", "pkg/mod.py", "train.py"]
    assert shipped.skipped == ("gone", "pipe", "raylet.sock")
    said = shipped.describe()
    assert "3 file(s)" in said and "skipped 3 that are not regular files (or cannot be read): gone, pipe, raylet.sock" in said
    dest = tmp_path / "dest"
    materialize(shipped, dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == ["alias.py", "pkg/mod.py", "train.py"]
    assert not (dest / "alias.py").is_symlink() and (dest / "alias.py").read_bytes() == b"x"


def test_gitignore_rayignore_excludes_and_the_runs_own_out_are_left_out(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    root = repo / "jobs" / "mine"
    _tree(repo, {".git/HEAD": b"ref", ".gitignore": b"*.ckpt\n", "jobs/.gitignore": b"scratch/\n"})
    _tree(root, {
        "train.py": b"x", "model.ckpt": b"c", "scratch/tmp.txt": b"t", ".gitignore": b"/data/\n*.log\n!keep.log\n",
        "data/big.bin": b"b", "sub/data/small.txt": b"s", "sub/.rayignore": b"*.txt\n", "sub/code.py": b"p",
        "notes.log": b"n", "keep.log": b"k", "results/r.json": b"{}", "out/job/run/result.json": b"{}", "cache/c.bin": b"c",
    })  # fmt: skip
    assert _names(root, excludes=["cache/", "results"], out=root / "out") == [".gitignore", "keep.log", "sub/.rayignore", "sub/code.py", "train.py"]
    # outside a repository the .gitignore files above the directory do not count (as for git)
    plain = tmp_path / "plain"
    _tree(plain, {".gitignore": b"*.ckpt\n", "job/model.ckpt": b"c", "job/train.py": b"x"})
    assert _names(plain / "job") == ["model.ckpt", "train.py"]


def test_a_directory_over_the_cap_is_refused_in_one_line(tmp_path: Path, listening: Path) -> None:
    _tree(listening, {"train.py": b"x" * 100, "big.bin": 60 * MiB, "data/a.npy": 3 * MiB, "data/b.npy": 2 * MiB})
    with pytest.raises(LauncherError) as info:
        select(listening, cap_bytes=50 * MiB, label="job.yaml")
    text = str(info.value)
    assert info.value.exit_code == EXIT_BAD_INPUT and "\n" not in text
    assert text.startswith(f"job.yaml: the Ray job's working directory {listening} is 65.0 MiB, over ray.working_dir_max_mb (50.0 MiB)")
    assert "largest: big.bin 60.0 MiB, data/ 5.0 MiB, train.py 100 B" in text
    assert 'ray.excludes (gitignore patterns, e.g. ray.excludes: ["big.bin"])' in text and "ray.working_dir" in text
    assert text.endswith("nothing was submitted")
    assert _names(listening, excludes=["big.bin"]) == ["data/a.npy", "data/b.npy", "train.py"]
    # far over the cap, counting stops (a home directory is not walked to its end)
    _tree(listening, {"huge.bin": 2000 * MiB})
    with pytest.raises(LauncherError) as info:
        select(listening, cap_bytes=1 * MiB)
    assert "or more, over ray.working_dir_max_mb (1.0 MiB)" in str(info.value)


def _spec(folder: Path, extra: str = "") -> Path:
    spec = folder / "job.yaml"
    spec.write_text(f"name: wd\nentrypoint: launcher.workloads.matmul:run\nbackend: ray\nresources: {{cpu_workers: 1}}\n{extra}")
    return spec


def test_the_specs_ray_settings_choose_what_ships(tmp_path: Path) -> None:
    _tree(tmp_path, {"src/train.py": b"print(1)", "src/big.bin": 2 * MiB, "other.txt": b"o", "venv/x": b""})
    assert [n for n, _, _ in shipment(load_job(_spec(tmp_path)), tmp_path / "runs").files] == ["job.yaml", "other.txt", "src/big.bin", "src/train.py"]
    job = load_job(_spec(tmp_path, "ray: {working_dir: src, working_dir_max_mb: 1, excludes: ['*.bin']}\n"))
    shipped = shipment(job, None)
    assert shipped.root == tmp_path / "src" and [n for n, _, _ in shipped.files] == ["train.py"]
    with pytest.raises(LauncherError) as info:  # the cap, from the spec
        shipment(load_job(_spec(tmp_path, "ray: {working_dir: src, working_dir_max_mb: 1}\n")), None)
    assert "is 2.0 MiB, over ray.working_dir_max_mb (1.0 MiB)" in str(info.value) and str(info.value).startswith(f"{tmp_path / 'job.yaml'}: ")
    with pytest.raises(LauncherError) as info:
        shipment(load_job(_spec(tmp_path, "ray: {working_dir: nowhere}\n")), None)
    assert info.value.exit_code == EXIT_BAD_INPUT and "ray.working_dir:" in str(info.value) and "is not a directory" in str(info.value)


def test_a_script_job_ships_its_script_and_finds_it_in_the_working_dir(tmp_path: Path) -> None:
    import yaml

    _tree(tmp_path, {"src/train.py": b"print(1)\n"})
    spec = tmp_path / "job.yaml"
    spec.write_text("name: wd\nscript: src/train.py\nbackend: ray\nresources: {cpu_workers: 1}\nray: {working_dir: src}\n")
    job = load_job(spec)
    work = _working_dir(job, shipment(job, None))
    try:
        assert (work / "train.py").is_file()
        assert yaml.safe_load((work / "_gpulaunch_job.yaml").read_text())["script"] == "train.py"
    finally:
        import shutil

        shutil.rmtree(work.parent)
    spec.write_text("name: wd\nscript: src/train.py\nbackend: ray\nresources: {cpu_workers: 1}\nray: {excludes: ['*.py']}\n")
    with pytest.raises(LauncherError) as info:
        shipment(load_job(spec), None)
    assert "script: src/train.py would not be in the Ray job's working directory" in str(info.value)
