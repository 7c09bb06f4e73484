"""Measuring a row is a loop of steps: each says whether the config wants it, runs against the served model
(or, after the server is down, against the row's files), and adds its typed capture to the row.

moe_eval.runner serves the row and loops over SERVING (while the server runs), then AFTER (once it is down);
`Row.measurements` is what the judge reads. A step measures and records; it never judges (moe_eval.gates
does, from the Measurements alone). A step whose measurement fails on the infrastructure or on its own bug
loses only its gate (`measured_or_why`): the row's other verdicts stand.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import requests

from moe_eval.configs.config import EvalConfig
from moe_eval.core import layer_cells, moe_timing
from moe_eval.core.errors import ConfigError, MoeEvalError
from moe_eval.core.flushes import wait_for_flushes
from moe_eval.core.logprob_texts import TextLogprobs, read_logprobs
from moe_eval.core.plugin_protocol import LAYER_CHECK_DIR, STATS_DIR
from moe_eval.core.record import RunRecord
from moe_eval.core.repeated_scoring import RepeatSection, compare_scorings
from moe_eval.evaluate.gpu_clocks import ClockSampler
from moe_eval.evaluate.gsm8k import Gsm8kData, Gsm8kOutcome, run_gsm8k
from moe_eval.evaluate.layer_sweep import SweepTarget, reach_every_range, sweep_target
from moe_eval.evaluate.moe_speed import end_to_end, timed_sweep
from moe_eval.evaluate.serving import Scoring, capture_prefill, score_texts
from moe_eval.gates.answers import answer_stats, correctness, first_response, per_question
from moe_eval.gates.layer_gate import layer_check_limits
from moe_eval.gates.layer_summary import MIN_ROWS, LayerSummary, reachable_ranges, summarize
from moe_eval.gates.measurements import Answers, IncumbentRow, Measurements
from moe_eval.gates.repeat import RepeatKeys
from moe_eval.gates.speed import SpeedKeys, cards_of, machine_of, workload_identity
from moe_eval.serve import cancel
from moe_eval.serve.server_log import kernel_call_counts


class Server(Protocol):
    base_url: str

    def check_alive(self, when: str) -> None: ...


@dataclass
class Row:
    """One row's run: what every step reads (the config, where it runs, the served model) and the captures
    the steps add, in the order they run."""

    config: EvalConfig
    options: Any  # moe_eval.runner.RunOptions
    data: Gsm8kData
    run_dir: Path
    model: str
    record: RunRecord
    server: Server | None = None
    result: Gsm8kOutcome | None = None
    token_counts: dict[int, int] | None = None
    scoring: Scoring | None = None
    target: SweepTarget | None = None
    swept: dict[str, Any] | None = None
    speed: moe_timing.TimingSummary | None = None
    layer: LayerSummary | None = None
    repeat: RepeatSection | None = None
    not_measured: dict[str, str] = field(default_factory=dict)  # gate name -> why its measurement failed

    @property
    def timings(self) -> dict[str, float]:
        return self.record.bookkeeping.timings

    def stage(self, name: str) -> None:
        if self.options.status is not None:
            self.options.status.stage(name)

    def measurements(self, incumbent: IncumbentRow | None) -> Measurements:
        """What the judge reads of this row (the evaluation must have run)."""
        assert self.result is not None
        stats = answer_stats(self.result.samples, self.token_counts, self.config.max_tokens)
        asked = len(self.data.test_rows())
        scoring = self.scoring
        return Measurements(
            moe_backend_used=self.record.serving.moe_backend_used,
            answers=Answers(
                self.result.scores,
                self.result.num_questions,
                stats,
                correctness(self.result.samples),
                min(self.config.num_questions, asked) if asked else None,
            ),  # fmt: skip
            jit=self.record.serving.jit_while_serving,
            speed_warnings=self.record.serving.speed_warnings_logged or [],
            kernel_calls=self.record.serving.bundled_kernel_calls,
            layer=self.layer,
            logprobs=scoring.prefill if scoring else None,
            decode=scoring.decode if scoring else None,
            logprobs_skipped=(self.record.captures.logprobs or {}).get("skipped"),
            incumbent=incumbent,
            incumbent_logprobs=_read_if(incumbent and incumbent.logprobs_path),
            incumbent_decode=_read_if(incumbent and incumbent.decode_path),
            speed=self.speed,
            repeat=self.repeat,
            machine=machine_of(self.record.environment.hardware),
            cards=cards_of(self.record.environment.hardware),
            workload=workload_identity(self.swept),
            not_measured=dict(self.not_measured),
        )


class Step(Protocol):
    stage: str  # what the progress line says while it runs

    def wanted(self, config: EvalConfig) -> bool: ...

    def run(self, row: Row) -> None: ...


class Evaluate:
    """GSM8K through lm-eval against the server (the questions' scores and samples)."""

    stage = "evaluating"

    def wanted(self, config: EvalConfig) -> bool:
        return True

    def run(self, row: Row) -> None:
        assert row.server is not None
        started = time.monotonic()
        listener = row.options.status.answered if row.options.status is not None else None
        try:
            url = row.server.base_url
            row.result = run_gsm8k(row.config, url, row.model, row.data, row.run_dir, listener)
        except MoeEvalError:
            row.server.check_alive("during the evaluation")  # a dead server explains the failure better
            raise
        row.server.check_alive("during the evaluation")
        row.timings["eval_seconds"] = time.monotonic() - started


class CountAnswerTokens:
    """Each answer's tokens by the server's own tokenizer (/tokenize): the truncated answers' count."""

    stage = "counting answer tokens"

    def wanted(self, config: EvalConfig) -> bool:
        return True

    def run(self, row: Row) -> None:
        assert row.server is not None and row.result is not None
        row.token_counts = count_answer_tokens(row.server.base_url, row.model, row.result.samples)


class ScoreTexts:
    """The fixed texts' log-probabilities and greedy continuations (divergence and golden gates)."""

    stage = "scoring log-probabilities"

    def wanted(self, config: EvalConfig) -> bool:
        return True  # score_texts says itself what the config asks for (logprob_texts 0: {skipped})

    def run(self, row: Row) -> None:
        assert row.server is not None
        scoring = score_texts(row.config, row.data, row.server.base_url, row.model, row.run_dir, lambda: None)
        row.scoring = scoring
        row.record.captures.logprobs, row.record.captures.decode = scoring.logprobs, scoring.decode_info
        row.timings.update(scoring.seconds)


class RepeatScores:
    """The scored texts once more, the same way, on the same server: do their log-probabilities repeat bit
    for bit (gates/repeat.py compares them, in memory: the files round log p)."""

    stage = "scoring log-probabilities again"

    def wanted(self, config: EvalConfig) -> bool:
        return config.keys(RepeatKeys).repeat_texts and config.logprob_texts > 0

    def run(self, row: Row) -> None:
        assert row.server is not None
        scoring = row.scoring
        if scoring is None or scoring.prefill is None:
            return  # nothing was scored (no test questions): results.json's logprobs says why
        first = scoring.prefill
        started = time.monotonic()
        server, config = row.server, row.config
        row.repeat, why = measured_or_why(
            lambda: compare_scorings(
                first, capture_prefill(config, server.base_url, row.model, scoring.texts)
            ),
            "the texts' second scoring failed",
        )
        if why is not None:
            server.check_alive("while scoring the texts again")  # a dead server ends the row, as elsewhere
            row.not_measured["repeat"] = why
        row.timings["repeat_seconds"] = time.monotonic() - started


def _target(row: Row) -> SweepTarget:
    """The sweeps' target, made once per row (its token pool is read from the server once)."""
    if row.target is None:
        assert row.server is not None
        per_call = _max_tokens_per_call(row.run_dir)
        row.target = sweep_target(row.config, row.data, row.server.base_url, row.model, per_call)
    return row.target


def aimed_eager_margin(config: EvalConfig) -> float | None:
    """The eager margin the timed workload's top-up aims at (gates/speed.py EAGER_AIM) on GPUs; None on the
    CPU, where the comparison is reported only and a 2-core machine's spread would ask every range for the
    cap."""
    return config.keys(SpeedKeys).speed_margin_eager if config.on_gpu else None


class TimeMoeCalls:
    """The timed workload: the MoE calls' time per call size (the speed gate's input), the client's and the
    engine's views, the GSM8K eval's output tokens per second."""

    stage = "timing the MoE calls"

    def wanted(self, config: EvalConfig) -> bool:
        return config.moe_timing

    def run(self, row: Row) -> None:
        started = time.monotonic()
        paused = row.config.layer_checked
        # the SM clock beside the timed requests, on GPUs only (report only; see evaluate/gpu_clocks.py)
        clocks = ClockSampler(row.options.devices) if row.options.hw != "cpu" else None
        with clocks if clocks is not None else nullcontext():
            row.swept, row.speed = timed_sweep(
                _target(row),
                row.run_dir,
                pause_layer_check=paused,
                eager_margin=aimed_eager_margin(row.config),
            )
        row.timings["speed_seconds"] = time.monotonic() - started
        row.record.captures.timing = {
            "moe": row.speed.as_dict(),
            "end_to_end": end_to_end(row.swept),
            "eval_output_tokens_per_s": _tokens_per_second(
                row.token_counts, row.timings.get("eval_seconds", 0.0)
            ),
            "workload": row.swept,
            "gpu_clocks": clocks.summary() if clocks is not None else None,
        }


class ReachEveryRange:
    """The layer check's own sweep, until its cells are judged or its time is spent; on the prompts after the
    timed ones (prompts sent before are in the prefix cache and would make smaller calls)."""

    stage = "layer check: reaching every dispatch range"

    def wanted(self, config: EvalConfig) -> bool:
        return config.layer_checked

    def run(self, row: Row) -> None:
        started = time.monotonic()
        first = row.swept["requests"] if row.swept else 0

        unflushed: set[str] = set()

        def owed() -> dict[str, int]:
            # The requests before, in the tables (a table whose flusher lagged past the bound: read as it
            # stands, and named in the capture).
            unflushed.update(_unflushed(row.run_dir, {LAYER_CHECK_DIR: "*.npz"}))
            return owed_cells(row.config, row.run_dir)

        swept = reach_every_range(row.config, _target(row), owed, first_index=first)
        if unflushed:
            swept["read_unflushed"] = sorted(unflushed)
        row.record.captures.layer_sweep = swept
        row.timings["layer_sweep_seconds"] = time.monotonic() - started


def _unflushed(run_dir: Path, folders: dict[str, str]) -> list[str]:
    """Wait until every live server process has copied its files of `folders` (a run-dir folder: the glob
    of its files) after now (core/flushes.py); the files whose process had not after the bound, relative to
    the run dir."""
    behind = wait_for_flushes({run_dir / name: pattern for name, pattern in folders.items()})
    return [str(path.relative_to(run_dir)) for path in behind]


class ReadCounters:
    """The in-server counters, read while the server still runs: the kernel's calls, the layer check's
    tables (summarized: a summary that fails is the layer check not run)."""

    stage = "reading the kernel's counters"

    def wanted(self, config: EvalConfig) -> bool:
        return True

    def run(self, row: Row) -> None:
        # Every process's counters and tables copied after the last request returned (at once for a row the
        # plugin stayed out of).
        started = time.monotonic()
        unflushed = _unflushed(row.run_dir, {STATS_DIR: "*.json", LAYER_CHECK_DIR: "*.npz"})
        row.timings["counters_wait_seconds"] = time.monotonic() - started
        row.record.serving.bundled_kernel_calls = kernel_call_counts(row.run_dir)
        if unflushed:
            row.record.serving.bundled_kernel_calls["read_unflushed"] = unflushed
        if not row.config.layer_checked:
            return
        files, problems = layer_cells.read_folder(row.run_dir)
        config = row.config
        row.layer, why = measured_or_why(
            lambda: summarize(files, layer_check_limits(config), config.layout.world_size, problems),
            "the layer check's tables could not be summarized",
        )
        if why is not None:
            row.not_measured["layer_check"] = why


class MakeGolden:
    """The golden reference (the cache's, or made now on this row's GPUs or cores once its server is down),
    where the judge can compare with it: both this row and its incumbent scored texts."""

    stage = "comparing with the golden reference"

    def wanted(self, config: EvalConfig) -> bool:
        return config.golden_gated

    def run(self, row: Row, measured: Measurements) -> None:
        if measured.logprobs is None or measured.incumbent_logprobs is None:
            return
        from moe_eval.evaluate.golden_for_row import measure_golden

        cancel.raise_if_cancelled()  # a signal during the teardown: no golden server starts after it
        # A golden that cannot be made is the golden gate not run: what the row measured is still judged (an
        # accuracy regression stays a failure, never an infrastructure error).
        made, why = measured_or_why(
            lambda: measure_golden(row.config, row.options, row.data, row.model, row.run_dir, row.timings),
            "the golden reference could not be made",
        )
        if why is None:
            measured.golden, row.record.captures.golden = made
        else:
            measured.not_measured["golden"] = why
            row.record.captures.golden = {"not_made": why}


SERVING: tuple[Step, ...] = (Evaluate(), CountAnswerTokens(), ScoreTexts(), RepeatScores(), TimeMoeCalls(),
                             ReachEveryRange(), ReadCounters())  # fmt: skip
AFTER = (MakeGolden(),)


def measured_or_why(measure: Any, what: str) -> tuple[Any, str | None]:
    """(measure(), None), or (None, why) where it failed on the infrastructure or on its own bug: one
    measurement lost is its gate not run, never the row's other verdicts. A signal (Cancelled, Ctrl-C) and a
    bad config still end the row."""
    try:
        return measure(), None
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001  named in the gate's not-run check
        return None, f"{what}: {type(exc).__name__}: {exc}"


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


def _tokens_per_second(token_counts: dict[int, int] | None, seconds: float) -> float | None:
    """The GSM8K eval's generated tokens per wall second (None where the answers' tokens were not counted)."""
    if not token_counts or seconds <= 0:
        return None
    return round(sum(token_counts.values()) / seconds, 1)


def _read_if(path: Path | None) -> list[TextLogprobs] | None:
    return read_logprobs(path) if path else None
