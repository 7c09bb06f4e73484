"""Shared fixtures: the repository, the GSM8K folder, and running the real `moe-eval` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def gsm8k_dir() -> str | None:
    """MOE_EVAL_GSM8K_DIR, else the shared copy beside the checkout, else None (the hub)."""
    configured = os.environ.get("MOE_EVAL_GSM8K_DIR")
    if configured:
        return configured
    shared = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
    return str(shared) if (shared / "test.jsonl").exists() else None


TINY_CONFIG = """model_name: "builtin:tiny-qwen3-moe"
accuracy_threshold: {threshold}
num_questions: {questions}
num_fewshot: 5
max_tokens: 32
max_retries: 1
max_concurrency: {concurrency}
server_args: "--enforce-eager --max-model-len 4096"
"""


def tiny_config(tmp_path: Path, name: str, *, threshold: float = 0.0, questions: int = 8, concurrency: int = 16,
                extra: str = "") -> Path:
    """A config of the random tiny MoE (accuracy 0: the model is not the point) in tmp_path/configs/cpu/."""
    path = tmp_path / "configs" / "cpu" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TINY_CONFIG.format(threshold=threshold, questions=questions, concurrency=concurrency) + extra)
    return path


def run_args(tmp_path: Path, gsm8k_dir: str | None, *configs: Path, extra: tuple[str, ...] = (),
             out: Path | None = None) -> list[str]:
    """`moe-eval run --hw cpu` of these configs into `out` (default tmp_path/out), offline when the GSM8K
    copy is there."""
    args = ["run", "--hw", "cpu", "--output-dir", str(out or tmp_path / "out"), *extra, *map(str, configs)]
    return args + (["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else [])


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(args: list[str], *, cwd: Path = REPO_ROOT, env: dict[str, str] | None = None,
            timeout: float = 900) -> CliResult:
    """The installed entry point, as a user runs it: a real process with a real exit code."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "moe_eval", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def processes_with_env(marker_key: str, marker_prefix: str) -> list[str]:
    """Live processes whose environment has marker_key=<value starting with marker_prefix>."""
    found = []
    needle = f"{marker_key}={marker_prefix}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            continue
        if any(var.startswith(needle) for var in environ.split(b"\0")):
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
            found.append(f"{entry}: {cmdline!r}")
    return found
