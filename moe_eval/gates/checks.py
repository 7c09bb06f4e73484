"""Checks beyond the accuracy gate, computed from lm-eval's per-question samples.

- Garbage: empty answers, answers that ran to max_tokens, answers with no number at all. A
  broken kernel often produces these while a lenient accuracy gate still passes.
- Paired: per-question flips against a baseline run of the same model and questions, with an
  exact McNemar test (moe_eval.gates.stats).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_eval.core.check import Check
from moe_eval.core.errors import ConfigError
from moe_eval.core.logprob_texts import DECODE_FILE, LOGPROBS_FILE
from moe_eval.core.moe_timing import TimingSummary
from moe_eval.core.record import RunRecord, UnreadableRecord, result_files
from moe_eval.gates.stats import PairedResult, paired_compare
from moe_eval.plan.config import EvalConfig

INVALID = "[invalid]"  # what lm-eval's regex filters leave when they find nothing


def first_response(sample: dict) -> str:
    resps = sample.get("resps") or [[""]]
    first = resps[0]
    return first[0] if isinstance(first, list) and first else str(first)


def _filtered(sample: dict) -> str:
    filtered = sample.get("filtered_resps") or [""]
    return filtered[0] if isinstance(filtered, list) else str(filtered)


def per_question(samples: list[dict], filter_name: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in samples if s.get("filter") == filter_name}


def correctness(samples: list[dict], filter_name: str = "strict-match") -> dict[int, bool]:
    return {qid: bool(s.get("exact_match")) for qid, s in per_question(samples, filter_name).items()}


def answer_stats(samples: list[dict], token_counts: dict[int, int] | None, max_tokens: int) -> dict[str, Any]:
    strict = per_question(samples, "strict-match")
    flexible = per_question(samples, "flexible-extract")
    n = len(strict)
    empty = sum(1 for s in strict.values() if not first_response(s).strip())
    invalid = sum(1 for qid in strict if qid in flexible and _filtered(flexible[qid]) == INVALID)
    no_strict = sum(1 for s in strict.values() if _filtered(s) == INVALID)
    truncated = None if token_counts is None else sum(1 for c in token_counts.values() if c >= max_tokens)
    return {
        "questions": n,
        "empty": empty,
        "invalid": invalid,
        "no_strict_answer": no_strict,
        "truncated": truncated,
        "max_tokens": max_tokens,
    }


def garbage_checks(config: EvalConfig, stats: dict[str, Any]) -> list[Check]:
    n = max(stats["questions"], 1)
    checks = []
    for key, count_key, what in (
        ("max_empty_rate", "empty", "empty answers"),
        ("max_truncated_rate", "truncated", "answers cut at max_tokens"),
        ("max_invalid_rate", "invalid", "answers with no number"),
    ):
        limit = getattr(config, key)
        if limit is None:
            continue
        count = stats[count_key]
        if count is None:
            checks.append(
                Check.not_run(key, f"not run: {what}: could not be counted (token counts unavailable)")
            )
            continue
        rate = count / n
        checks.append(Check.judged(key, rate <= limit, f"{what}: {count}/{n} = {rate:.3f} (limit {limit:g})"))
    return checks


@dataclass(frozen=True)
class Baseline:
    """A finished run of the same model and questions: its per-question correctness (the paired gate)
    and, where it scored them, its log-probabilities (the divergence gate)."""

    results_path: Path
    correctness: dict[int, bool]
    logprobs_path: Path | None = None
    moe_backend_used: str | None = None  # what its server's log said served ("bundled:torch", "vllm:CPU")
    layout: str | None = None  # Layout.describe() of its config
    decode_path: Path | None = None  # its greedy continuations (DECODE_FILE), where it made them
    speed: TimingSummary | None = None  # its MoE calls' time per range (captures.timing), where timed
    machine: str | None = None  # the GPUs (or CPU) it ran on: a speed reference holds on that machine only
    workload: str | None = None  # what its timed sweep computed (workload_identity): must match the row's
    speed_warnings: tuple[str, ...] = ()  # its server's (serving.speed_warnings_logged)
    world_size: int = 1  # the ranks of its layout: the processes its timing must come from


def find_baseline(baseline_root: Path, config: EvalConfig) -> Baseline:
    """The results.json under baseline_root for the same model, question count and few-shot count;
    the same family folder and config name win a tie, then the same name. Refused (ConfigError) when
    there is none or it is ambiguous."""
    candidates = []
    paths = [baseline_root] if baseline_root.is_file() else result_files(baseline_root)
    for path in paths:
        record = RunRecord.read_if_any(path)
        if record is None:
            continue
        cfg = record.config
        if (
            record.has_verdict
            and cfg.get("model_name") == config.model_name
            and record.evaluation.num_questions_evaluated == config.num_questions
            and cfg.get("num_fewshot") == config.num_fewshot
        ):
            # The same family folder and file name first (canary-tp/X and canary-tep/X share a name), then
            # the name.
            same_folder = Path(record.identity.config_path).parent.name == config.path.parent.name
            candidates.append((record.identity.config_name == config.name, same_folder, path))
    if not candidates:
        raise ConfigError(
            f"--baseline: value '{baseline_root}' holds no finished result for model "
            f"{config.model_name} with {config.num_questions} questions, {config.num_fewshot}-shot "
            f"(needed by {config.path})"
        )
    same_file = [p for same_name, same_folder, p in candidates if same_name and same_folder]
    same_name_only = [p for same_name, _, p in candidates if same_name]
    pool = same_file or same_name_only or [p for _, _, p in candidates]
    if len(pool) > 1:
        raise ConfigError(
            f"--baseline: value '{baseline_root}' holds {len(pool)} results that fit {config.path}: "
            f"{', '.join(map(str, pool[:4]))}; point --baseline at one run folder or results.json"
        )
    return load_baseline(pool[0], "--baseline")


def load_baseline(results_path: Path, what: str, record: RunRecord | None = None) -> Baseline:
    """The baseline a finished results.json holds (ConfigError, naming `what`, when its samples are
    unreadable); `record`: that file, when the caller has read it already."""
    samples_path = results_path.parent / "samples.jsonl"
    try:
        samples = [json.loads(line) for line in samples_path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{what}: {samples_path}: cannot read per-question samples ({exc})") from None
    logprobs = results_path.parent / LOGPROBS_FILE
    try:
        record = record or RunRecord.read(results_path)
    except UnreadableRecord as exc:
        raise ConfigError(f"{what}: {exc}") from None
    decode = results_path.parent / DECODE_FILE
    timing = record.captures.timing or {}
    speed = timing.get("moe")
    return Baseline(
        results_path,
        correctness(samples),
        logprobs if logprobs.is_file() else None,
        record.serving.moe_backend_used,
        record.layout,
        decode if decode.is_file() else None,
        TimingSummary.from_dict(speed) if speed else None,
        *timed_where(record),
        tuple(record.serving.speed_warnings_logged or ()),
        record.identity.layout.world_size,
    )


def timed_where(record: RunRecord) -> tuple[str, str | None]:
    """(machine, workload): where a record's MoE calls were timed and on which requests. Two rows' times
    compare only where both match (gates/speed.times_differ_by); the speed gate's reference and `moe-eval
    compare`'s columns are read by this one function."""
    timing = record.captures.timing or {}
    return machine_of(record.environment.hardware), workload_identity(timing.get("workload"))


def workload_identity(workload: dict[str, Any] | None) -> str | None:
    """What a row's timed sweep computed, for the speed gate to compare: the fingerprint of its requests
    (layer_sweep.sweep), and the prompt tokens the server's prefix cache served instead, where any did (those
    calls were shorter than sent). None: not recorded (a run before moe-eval recorded it)."""
    fingerprint = (workload or {}).get("fingerprint")
    if fingerprint is None:
        return None
    cached = (workload or {}).get("prefix_cache_hit_tokens")
    return f"{fingerprint} with {cached} prompt tokens from the prefix cache" if cached else fingerprint


def machine_of(hardware: Any) -> str:
    """What a timing depends on: the GPUs' names, or the CPU's model where no GPU served."""
    return ", ".join(hardware.gpus) if hardware.gpus else f"cpu: {hardware.cpu}"


def paired_check(baseline: Baseline, correct: dict[int, bool], alpha: float) -> tuple[Check, PairedResult]:
    """The paired gate: this run's per-question strict-match correctness against the baseline's."""
    result = paired_compare(baseline.correctness, correct, alpha)
    return Check.judged(
        "paired_gate", result.passed, result.describe() + f" [baseline {baseline.results_path}]"
    ), result
