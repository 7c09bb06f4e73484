"""One config in a process of its own: `python -m moe_eval.worker JOB.json` (started by the scheduler).

A process per config keeps configs apart: lm-eval's global state (seeds, logging, environment),
a crash, or a cancel in one config cannot reach another running beside it (`run --jobs`), and
lm-eval's own output goes to the config's `worker.log` instead of the terminal. The worker asks
for SIGTERM when its parent dies, so a killed harness still tears the server down; it writes
`results.json` (moe_eval.runner) and `status.json` (moe_eval.core.status) in the config's run folder.
Exit code: 0 when results.json holds a verdict or an infrastructure error, 130 when cancelled,
4 on a config error, 3 on an internal error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from moe_eval.core.errors import ConfigError, ExitCode
from moe_eval.serve import cancel
from moe_eval.serve.process_tree import ask_for_parent_death_signal

JOB_FILE = "job.json"
LOG_FILE = "worker.log"


@dataclass(frozen=True)
class Job:
    """Everything a worker needs, as JSON (written by the scheduler into the config's run folder)."""

    config_path: str
    run_root: str
    hw: str
    parent_pid: int
    limit: int | None = None
    gsm8k_dir: str | None = None
    mutation: str | None = None
    baseline: str | None = None  # --baseline: a run folder or results.json
    port: int | None = None
    devices: list[int] | None = None
    gpus: list[str] = dataclasses.field(default_factory=list)
    attempt: int = 1
    golden_cache: str | None = None  # --golden-cache (moe_eval.evaluate.golden); None: the default folder
    optional_gates: list[str] = dataclasses.field(default_factory=list)  # run --optional-gate
    config_text: str = ""  # the config file's text as the run parsed it (EvalConfig.text)

    def write(self, path: Path) -> None:
        from moe_eval.core.results import atomic_write_json

        atomic_write_json(path, dataclasses.asdict(self))

    @classmethod
    def read(cls, path: Path) -> Job:
        return cls(**json.loads(path.read_text()))


def run_job(job: Job) -> int:
    from moe_eval.core.status import STATUS_FILE, StatusWriter, reference_answers
    from moe_eval.evaluate.gsm8k import gsm8k_data
    from moe_eval.evaluate.incumbent import find_incumbent
    from moe_eval.runner import config_run_dir, run_config, task_data

    config, mutation = job_config(job)
    data = gsm8k_data(job.gsm8k_dir)
    run_root = Path(job.run_root)
    run_dir = config_run_dir(run_root, config)
    references = reference_answers(task_data(config, data).test_rows())
    status = StatusWriter(
        run_dir / STATUS_FILE,
        config=str(config.path),
        total=config.num_questions,
        devices=job.devices,
        attempt=job.attempt,
        references=references,
    )
    incumbents, baseline_error = {}, None
    if job.baseline:
        incumbents[config.path] = find_incumbent(Path(job.baseline), config)
    elif config.baseline_config_path is not None:
        found = _baseline_config(config, job, run_root)
        if isinstance(found, str):
            baseline_error = found
        else:
            incumbents[config.path] = found
    options = dataclasses.replace(
        _options(job, run_root, data),
        incumbents=incumbents,
        status=status,
        baseline_error=baseline_error,
        mutation=mutation,
    )
    try:
        run_config(config, options)
    except KeyboardInterrupt:
        return cancel.EXIT_CANCELLED
    except ConfigError as exc:
        print(f"moe-eval worker: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    return 0


def job_config(job: Job):
    """The config as the run parsed it, and the mutation it runs under: its text travels in the job (the
    scheduler writes it), and the run's --limit and --mutate apply as they did in the parent (the one
    function, moe_eval.configs.config.effective_config)."""
    from moe_eval.configs.config import effective_config, parse_config

    config = parse_config(Path(job.config_path), job.config_text)
    return effective_config(config, job.limit, job.mutation, job.hw)


def _baseline_config(config, job: Job, run_root: Path):
    """The IncumbentRow that config's baseline_config left in this run's folder, or why there is none."""
    from moe_eval.core.record import RESULTS_FILE, RunRecord
    from moe_eval.evaluate.incumbent import load_incumbent
    from moe_eval.runner import run_dir_of

    baseline = config.baseline_config_path  # its folder in the run is named by its path alone
    results = run_dir_of(run_root, baseline) / RESULTS_FILE
    record = RunRecord.read_if_any(results)
    if record is None:
        return f"baseline_config {baseline} left no results ({results}); nothing to compare against"
    if not record.has_verdict:
        why, status = record.error_message, record.status
        return f"baseline_config {baseline} ended {status} ({why}); nothing to compare against"
    return load_incumbent(results, f"{config.path}: baseline_config", record)


def _options(job: Job, run_root: Path, data: object):
    from moe_eval.core.status import progress_line
    from moe_eval.runner import RunOptions

    def progress(message: str) -> None:
        print(progress_line(message), file=sys.stderr, flush=True)

    return RunOptions(
        hw=job.hw,
        run_root=run_root,
        data=data,
        port=job.port,
        progress=progress,
        gpus=tuple(job.gpus),
        devices=tuple(job.devices) if job.devices is not None else None,
        attempt=job.attempt,
        golden_cache=Path(job.golden_cache) if job.golden_cache else None,
        optional_gates=tuple(job.optional_gates),
    )


def main(argv: list[str]) -> int:
    job = Job.read(Path(argv[0]))
    ask_for_parent_death_signal(signal.SIGTERM)  # the harness died: cancel, which tears the server down
    cancel.install()
    if os.getppid() != job.parent_pid:  # it died before the request took effect
        return cancel.EXIT_CANCELLED
    try:
        return run_job(job)
    except KeyboardInterrupt:
        return cancel.EXIT_CANCELLED
    except Exception:  # noqa: BLE001  the scheduler reads results.json; the traceback goes to worker.log
        import traceback

        traceback.print_exc()
        return ExitCode.INFRA


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
