"""The incumbent a row is compared with, read from a finished run: its baseline_config's row of this run,
or with `run --baseline RUN` the same config's row of an earlier run (the file I/O of the comparing gates:
the gates read the `IncumbentRow` this returns, never a file)."""

from __future__ import annotations

import json
from pathlib import Path

from moe_eval.configs.config import EvalConfig
from moe_eval.core.errors import ConfigError
from moe_eval.core.logprob_texts import DECODE_FILE, LOGPROBS_FILE
from moe_eval.core.moe_timing import TimingSummary
from moe_eval.core.record import RunRecord, UnreadableRecord, result_files
from moe_eval.gates.answers import correctness
from moe_eval.gates.measurements import IncumbentRow
from moe_eval.gates.speed import cards_of, timed_where


def find_incumbent(baseline_root: Path, config: EvalConfig) -> IncumbentRow:
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
    return load_incumbent(pool[0], "--baseline")


def load_incumbent(results_path: Path, what: str, record: RunRecord | None = None) -> IncumbentRow:
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
    return IncumbentRow(
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
        cards_of(record.environment.hardware),
    )
