"""Watching a `moe-eval run` that was started in the background: its server logs, its records, and
whatever of its processes is still alive. Shared by the fault, CI-step and --jobs tests, which all
signal or kill a run at a chosen moment. Every path is under tmp_path/out (conftest.run_args)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO_ROOT, processes_with_env, results_json


def start_run(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moe_eval", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition: Callable[[], object], proc: subprocess.Popen, timeout: float, what: str) -> object:
    """condition()'s first true value; fails if the run ends first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"moe-eval ended (code {proc.returncode}) before {what}:\n{err[-3000:]}")
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def server_log(tmp_path: Path, name: str) -> Path | None:
    """The server log of config `name`'s current attempt, once it exists."""
    logs = [
        p
        for p in (tmp_path / "out").rglob("server.log")
        if p.parent.name == name and "attempts" not in p.parts
    ]
    return logs[0] if logs else None


def evaluating(tmp_path: Path, name: str, requests: int = 4) -> Callable[[], Path | None]:
    """True once the config's server has answered `requests` evaluation requests (after the warm-up one)."""

    def check() -> Path | None:
        log = server_log(tmp_path, name)
        if log is not None and log.read_text(errors="replace").count("POST /v1/completions") >= requests + 1:
            return log
        return None

    return check


def result_record(tmp_path: Path, name: str) -> dict | None:
    """Config `name`'s results.json (its last attempt), or None."""
    for path in (tmp_path / "out").rglob("results.json"):
        if path.parent.name == name and "attempts" not in path.parts:
            return results_json(path)
    return None


def left_running(tmp_path: Path) -> list[str]:
    """Processes of the run still alive (every worker and server carries MOE_EVAL_RUN_DIR)."""
    return processes_with_env("MOE_EVAL_RUN_DIR", str(tmp_path / "out"))


def run_root(tmp_path: Path) -> Path:
    """The run's timestamped folder."""
    return next((tmp_path / "out").iterdir())
