"""Shared fixtures: the repository, the GSM8K folder, running the real `moe-eval` CLI, the two test tiers,
and the real runs that several tests read (each started once per session).

Tiers (pytest's own `--runslow` pattern): `pytest` runs the unit tests and a few shared real runs (the
README's embedded default, a subtle and a gross kernel mutation; reports, JUnit, compare and step summary are
read from them). `pytest --runslow` adds the rest: signals at each stage, SIGKILL, retry, resume, packing,
fault injection (a server that hangs or answers garbage), the plugin's multi-rank CPU tests. `.ci/run` runs
both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run the slow tier (tests marked slow; .ci/run runs it)",
    )
    parser.addoption(
        "--runextended",
        action="store_true",
        default=False,
        help="also run the extended tier (tests marked extended: more mutation targets; not in CI)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = config.getoption("--runslow") or config.getoption("--runextended")
    skip_slow = pytest.mark.skip(reason="slow tier: run with --runslow (.ci/run does)")
    # The extended tier: real runs of more targets of the same checks than CI's 90 minutes hold on 2 cores
    # (each target is a server and 200 questions); run before a release, results in docs/logprob-gate.md.
    skip_extended = pytest.mark.skip(reason="extended tier: run with --runextended (not in CI)")
    for item in items:
        if "extended" in item.keywords and not config.getoption("--runextended"):
            item.add_marker(skip_extended)
        elif "slow" in item.keywords and not slow:
            item.add_marker(skip_slow)


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
{gate}
num_questions: {questions}
num_fewshot: 5
max_tokens: 32
max_retries: 1
max_concurrency: {concurrency}
server_args: "--enforce-eager --max-model-len 4096"
"""


def tiny_config(
    tmp_path: Path,
    name: str,
    *,
    threshold: float | None = None,
    questions: int = 8,
    concurrency: int = 16,
    extra: str = "",
) -> Path:
    """A config of the random tiny MoE in tmp_path/configs/cpu/: random_weights (its answers not gated: the
    model is not the point), or an accuracy_threshold (`threshold`) it fails (it answers nothing right)."""
    path = tmp_path / "configs" / "cpu" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    gate = "random_weights: true" if threshold is None else f"accuracy_threshold: {threshold}"
    path.write_text(TINY_CONFIG.format(gate=gate, questions=questions, concurrency=concurrency) + extra)
    return path


def run_args(
    tmp_path: Path,
    gsm8k_dir: str | None,
    *configs: Path,
    extra: tuple[str, ...] = (),
    out: Path | None = None,
) -> list[str]:
    """`moe-eval run --hw cpu` of these configs into `out` (default tmp_path/out), offline when the GSM8K
    copy is there."""
    args = ["run", "--hw", "cpu", "--output-dir", str(out or tmp_path / "out"), *extra, *map(str, configs)]
    return args + (["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else [])


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(
    args: list[str],
    *,
    cwd: Path = REPO_ROOT,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    unset: tuple[str, ...] = (),
) -> CliResult:
    """The installed entry point, as a user runs it: a real process with a real exit code. `unset`: variables
    of this environment the run must not see."""
    full_env = {k: v for k, v in os.environ.items() if k not in unset} | (env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "moe_eval", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def results_json(path: Path) -> dict:
    """A config's results.json, read through moe_eval.core.record (the one reader) and held to the file: the
    typed record gives back every key and value the file has."""
    from moe_eval.core.record import RunRecord

    raw = json.loads(path.read_text())
    typed = json.loads(json.dumps(RunRecord.read(path).to_json()))
    assert typed == raw, f"{path}: the typed record does not read the file as written"
    return typed


def summary_json(path: Path) -> dict:
    """A run's summary.json, read through moe_eval.core.record and held to the file like results_json."""
    from moe_eval.core.record import RunSummary, to_json

    raw = json.loads(path.read_text())
    typed = json.loads(json.dumps(to_json(RunSummary.read(path))))
    assert typed == raw, f"{path}: the typed summary does not read the file as written"
    return typed


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


@dataclass
class SharedRun:
    result: CliResult
    out: Path  # the --output-dir: one timestamped run folder inside
    goldens: Path  # the golden cache the run used
    junit: Path
    step_summary: Path

    @property
    def folder(self) -> Path:
        return next(p for p in self.out.iterdir() if p.is_dir())


def _gsm8k_args(gsm8k_dir: str | None) -> list[str]:
    return ["--gsm8k-dir", gsm8k_dir] if gsm8k_dir else []


@pytest.fixture(scope="session")
def embedded_default_run(tmp_path_factory, gsm8k_dir) -> SharedRun:
    """The README's main job (`moe-eval run --hw cpu`), run once for the tests that read it (minutes on 2
    cores),
    from an empty golden cache (the run makes the golden itself), with JUnit and a GitHub step summary."""
    out = tmp_path_factory.mktemp("embedded-default")
    goldens = tmp_path_factory.mktemp("goldens")
    junit, summary = out.parent / "embedded-junit.xml", out.parent / "embedded-step-summary.md"
    result = run_cli(
        [
            "run",
            "--hw",
            "cpu",
            "--output-dir",
            str(out),
            "--golden-cache",
            str(goldens),
            "--junit",
            str(junit),
        ]
        + _gsm8k_args(gsm8k_dir),
        env={"GITHUB_STEP_SUMMARY": str(summary)},
        timeout=1500,
    )
    return SharedRun(result, out, goldens, junit, summary)


SUBTLE_MUTATION = "scale_one_expert"


@pytest.fixture(scope="session")
def subtle_mutation_run(embedded_default_run, tmp_path_factory, gsm8k_dir) -> SharedRun:
    """`--mutate scale_one_expert` (global expert 0's output 5% short: no answer changes) on the canary's TP1
    row, as `--resume` of a copy of the embedded default's run: vLLM's row (never mutated) carries over, the
    golden comes from the cache, only the bundled TP1 row runs."""
    shared = embedded_default_run
    assert shared.result.returncode == 0, shared.result.stderr[-3000:]
    out = tmp_path_factory.mktemp("subtle-mutation")
    shutil.copytree(shared.folder, out / shared.folder.name)
    junit, summary = out.parent / "subtle-junit.xml", out.parent / "subtle-step-summary.md"
    config = REPO_ROOT / "configs" / "canary-tp" / "Canary-Qwen3-MoE-BF16-torch.yaml"
    result = run_cli(
        [
            "run",
            "--hw",
            "cpu",
            "--resume",
            str(out / shared.folder.name),
            "--golden-cache",
            str(shared.goldens),
            "--mutate",
            SUBTLE_MUTATION,
            "--junit",
            str(junit),
            str(config),
        ]
        + _gsm8k_args(gsm8k_dir),
        env={"GITHUB_STEP_SUMMARY": str(summary)},
        timeout=1200,
    )
    return SharedRun(result, out, shared.goldens, junit, summary)
