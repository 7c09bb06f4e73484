"""benchmarks/device/served_earlier.sh: the earlier kernel's tiles in place for its run, today's back after.

The script moves package files on the lent machine, so what it serves as "the earlier kernel" and what it
leaves behind are checked here with stand-ins for the GPU's tools (nvidia-smi, the GPU's name, the kit's
launcher, which records the tile files a run would have read and writes a run folder): today's H100 file set
aside and the earlier revision's files (none for an H100) in place during the run; every file back, byte for
byte, after it, and after a SIGTERM mid-run; the later stage given the earlier run as its --baseline.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H100 = "E=128,F=768,D=2048,device=NVIDIA_H100_80GB_HBM3.json"
H200 = "E=128,F=768,D=2048,device=NVIDIA_H200.json"

LAUNCHER = """#!/usr/bin/env bash
# Stand-in for the kit's launcher: the tile files a server would read now, the arguments, a run folder.
ls moe_eval/kernels/tuned_configs > "$STAND_IN_LOG.tiles"
echo "$@" > "$STAND_IN_LOG.args"
while [ $# -gt 0 ]; do [ "$1" = --output-dir ] && out="$2"; shift; done
mkdir -p "$out/20261207-200000/twins-cuda-graph"
[ -n "${STAND_IN_SLEEP:-}" ] && exec sleep "$STAND_IN_SLEEP"  # a signal to the launcher ends the sleep
exit "${STAND_IN_EXIT:-0}"
"""


def _checkout(tmp_path: Path) -> tuple[Path, dict]:
    repo = tmp_path / "repo"
    tiles = repo / "moe_eval/kernels/tuned_configs"
    tiles.mkdir(parents=True)
    (tiles / H100).write_text('{"today": "h100"}\n')
    (tiles / H200).write_text('{"today": "h200"}\n')
    (repo / ".earlier-tiles").mkdir()
    (repo / ".earlier-tiles" / H200).write_text('{"earlier": "h200"}\n')  # e49cc3c had no H100 file
    (repo / "benchmarks/device").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks/device/served_earlier.sh", repo / "benchmarks/device/")
    (repo / ".vgpu").mkdir()
    (repo / ".vgpu/device_env.sh").write_text(LAUNCHER)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("nvidia-smi", "echo 'NVIDIA H100 80GB HBM3, GPU-x'"),
        ("python3", "echo NVIDIA_H100_80GB_HBM3"),
    ):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "STAND_IN_LOG": str(tmp_path / "launcher"), "EARLIER_TILES": ".earlier-tiles"}  # fmt: skip
    return repo, env


def _files(repo: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in (repo / "moe_eval/kernels/tuned_configs").iterdir()}


def _run(repo: Path, env: dict, stage: str) -> subprocess.CompletedProcess:
    script = ["bash", "benchmarks/device/served_earlier.sh"]
    return subprocess.run(script, cwd=repo, env={**env, "STAGE": stage}, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def test_earlier_serves_the_earlier_tiles_and_puts_todays_back(tmp_path):
    repo, env = _checkout(tmp_path)
    today = _files(repo)
    run = _run(repo, env, "earlier")
    assert run.returncode == 0, run.stdout + run.stderr
    # During the run: no H100 file (e49cc3c had none: the heuristic), today's H200 file as it was.
    assert (tmp_path / "launcher.tiles").read_text().split() == [H200]
    assert _files(repo) == today
    assert "set aside: 1" in run.stdout and "in their place: 0" in run.stdout
    now = _run(repo, env, "now")
    assert now.returncode == 0, now.stdout + now.stderr
    args = (tmp_path / "launcher.args").read_text()
    assert f"--baseline {repo}/.limit-run/served/earlier/20261207-200000/" in args
    assert (tmp_path / "launcher.tiles").read_text().split() == sorted([H100, H200])
    assert (tmp_path / "out/served-now.tar.xz").is_file() and (
        tmp_path / "out/served-earlier.tar.xz"
    ).is_file()


def test_an_earlier_file_for_this_gpu_stands_in_and_is_removed_after(tmp_path):
    repo, env = _checkout(tmp_path)
    (repo / ".earlier-tiles" / H100).write_text('{"earlier": "h100"}\n')
    today = _files(repo)
    run = _run(repo, env, "earlier")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "launcher.tiles").read_text().split() == sorted([H100, H200])
    assert _files(repo) == today  # today's H100 file, not the earlier one


def test_sigterm_mid_run_puts_todays_files_back(tmp_path):
    repo, env = _checkout(tmp_path)
    today = _files(repo)
    proc = subprocess.Popen(["bash", "benchmarks/device/served_earlier.sh"], cwd=repo,
                            env={**env, "STAGE": "earlier", "STAND_IN_SLEEP": "30"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 20
    while not (tmp_path / "launcher.tiles").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert H100 not in _files(repo)  # set aside while the run is on
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert _files(repo) == today


def test_now_without_an_earlier_run_and_earlier_without_its_tiles_are_refused(tmp_path):
    repo, env = _checkout(tmp_path)
    now = _run(repo, env, "now")
    assert now.returncode == 2 and "no earlier run" in now.stdout
    run = _run(repo, {k: v for k, v in env.items() if k != "EARLIER_TILES"}, "earlier")
    assert run.returncode != 0 and "EARLIER_TILES" in run.stderr
    assert not (tmp_path / "launcher.tiles").exists()


def test_files_left_moved_by_a_hard_kill_are_put_back_before_the_next_run(tmp_path):
    """SIGKILL (or the device's time limit) gives the script no chance to restore: the next call does it
    first, so `now` never serves the earlier tiles."""
    repo, env = _checkout(tmp_path)
    today = _files(repo)
    proc = subprocess.Popen(["bash", "benchmarks/device/served_earlier.sh"], cwd=repo,
                            env={**env, "STAGE": "earlier", "STAND_IN_SLEEP": "3"})  # fmt: skip
    deadline = time.monotonic() + 20
    while not (tmp_path / "launcher.tiles").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.kill()  # the script only: its launcher (a 3 s sleep) ends on its own
    proc.wait(timeout=10)
    assert H100 not in _files(repo)  # left moved
    (repo / ".limit-run/served/earlier/20261207-200000").mkdir(parents=True, exist_ok=True)
    now = _run(repo, env, "now")
    assert now.returncode == 0, now.stdout + now.stderr
    assert (tmp_path / "launcher.tiles").read_text().split() == sorted([H100, H200])
    assert _files(repo) == today


def test_the_runs_exit_status_is_the_scripts(tmp_path):
    repo, env = _checkout(tmp_path)
    run = _run(repo, {**env, "STAND_IN_EXIT": "1"}, "earlier")
    assert run.returncode == 1 and "served earlier: exit 1" in run.stdout
    assert (tmp_path / "out/served-earlier.tar.xz").is_file()  # packed all the same
