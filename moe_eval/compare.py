"""`moe-eval compare`: side-by-side accuracy of several runs, one table per model.

Columns are the runs (MoE kernel and layout, e.g. Triton TP vs FlashInfer CUTLASS TEP), cells
are accuracy ± stderr for both filters; further rows give the per-question flips against the
first column with the exact McNemar p-value, and, where both runs scored the same texts, the
log-probability divergence against the first column (moe_eval.logprobs). Runs that did not answer the same questions with
the same few-shot count are refused, not compared. Usage:

    moe-eval compare moe-eval-results/20261129-120000 moe-eval-results/20261129-130000
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from moe_eval.checks import LOGPROBS_FILE, correctness
from moe_eval.errors import ConfigError
from moe_eval.gsm8k import FILTERS
from moe_eval.logprobs import TextLogprobs, divergence, read_logprobs
from moe_eval.report import divergence_cell, markdown_table, rich_table
from moe_eval.results import result_files
from moe_eval.stats import paired_compare


@dataclass(frozen=True)
class RunResult:
    path: Path
    model: str
    label: str
    num_fewshot: int
    scores: dict[str, dict[str, float]]
    verdict: str
    correct: dict[int, bool]
    logprobs: Path | None = None  # logprobs.jsonl beside results.json, when the run scored texts

    @property
    def questions(self) -> frozenset[int]:
        return frozenset(self.correct)


def _result_files(inputs: list[Path]) -> list[Path]:
    files = []
    for item in inputs:
        if item.is_file():
            files.append(item)
        elif item.is_dir():
            found = result_files(item)
            if not found:
                raise ConfigError(f"compare: '{item}' holds no results.json")
            files.extend(found)
        else:
            raise ConfigError(f"compare: '{item}' does not exist")
    return files


def load_run(path: Path) -> RunResult | None:
    """None for a config that errored (nothing to compare); ConfigError for an unreadable file."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"compare: {path}: not a moe-eval results.json ({exc})") from None
    if record.get("status") not in ("passed", "failed"):
        return None
    samples_path = path.parent / record.get("samples", "samples.jsonl")
    try:
        samples = [json.loads(line) for line in samples_path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise ConfigError(f"compare: {samples_path}: per-question samples missing ({exc})") from None
    backend = record.get("moe_backend_used") or record.get("moe_backend_requested") or "vllm"
    correct = correctness(samples)
    logprobs = path.parent / LOGPROBS_FILE
    return RunResult(path=path, model=record["config"]["model_name"],
                     label=f"{backend} {record['layout']['describe']}", num_fewshot=record["config"]["num_fewshot"],
                     scores=record["scores"], verdict=record["status"].upper(), correct=correct,
                     logprobs=logprobs if logprobs.is_file() else None)


def group_runs(inputs: list[Path]) -> dict[str, list[RunResult]]:
    runs = [r for r in (load_run(p) for p in _result_files(inputs)) if r is not None]
    groups: dict[str, list[RunResult]] = defaultdict(list)
    for run in runs:
        groups[run.model].append(run)
    if not groups:
        raise ConfigError("compare: no finished results among the inputs (errored configs have no scores)")
    for model, members in groups.items():
        if len(members) < 2:
            raise ConfigError(f"compare: model {model} has one result ({members[0].path}); nothing to compare it "
                              "with (results of different models are never compared)")
        first = members[0]
        for other in members[1:]:
            if other.num_fewshot != first.num_fewshot:
                raise ConfigError(f"compare: {model}: few-shot counts differ ({first.num_fewshot} in {first.path}, "
                                  f"{other.num_fewshot} in {other.path})")
            if other.questions != first.questions:
                raise ConfigError(f"compare: {model}: question sets differ ({len(first.questions)} questions in "
                                  f"{first.path}, {len(other.questions)} in {other.path}, "
                                  f"{len(first.questions ^ other.questions)} not in both)")
        labels = [m.label for m in members]
        if len(set(labels)) < len(labels):  # same kernel and layout twice: tell the runs apart
            groups[model] = [dataclasses.replace(m, label=f"{m.label} [{m.path.parents[2].name}]")
                             for m in members]
    return dict(groups)


def _cell(score: dict[str, float]) -> str:
    stderr = score.get("stderr")
    return f"{score['accuracy']:.4f} ± {stderr:.4f}" if stderr is not None else f"{score['accuracy']:.4f}"


def table_rows(members: list[RunResult]) -> tuple[list[str], list[list[str]]]:
    header = ["Filter", "n-shot", "Metric", *[m.label for m in members]]
    rows = [[f, str(members[0].num_fewshot), "exact_match", *[_cell(m.scores[f]) for m in members]] for f in FILTERS]
    flips = ["flips vs first", "", "strict-match", "-"]
    for m in members[1:]:
        p = paired_compare(members[0].correct, m.correct, alpha=0.05)
        flips.append(f"{p.baseline_only} right->wrong, {p.new_only} wrong->right (McNemar p={p.p_two_sided:.3g})")
    rows.append(flips)
    first_logprobs = read_logprobs(members[0].logprobs) if members[0].logprobs is not None else None  # read once
    rows.append(["Δ log p vs first", "", "mean, top-1 changed", "-",
                 *[_divergence(first_logprobs, m) for m in members[1:]]])
    rows.append(["verdict", "", "", *[m.verdict for m in members]])
    return header, rows


def _divergence(first: list[TextLogprobs] | None, other: RunResult) -> str:
    """The divergence cell: '-' where either run scored no texts or they scored different ones."""
    if first is None or other.logprobs is None:
        return "-"
    try:
        div = divergence(first, read_logprobs(other.logprobs))
    except ValueError:  # other texts or tokens: not comparable
        return "not comparable"
    return divergence_cell(div.as_dict())


def _title(model: str, members: list[RunResult]) -> str:
    return f"{model}: GSM8K, {len(members[0].questions)} questions, {members[0].num_fewshot}-shot"


def markdown(groups: dict[str, list[RunResult]]) -> str:
    # Labels are never empty, so every separator cell is "---".
    return "\n".join(f"### {_title(model, members)}\n\n{markdown_table(*table_rows(members))}"
                     for model, members in groups.items())


def print_rich(groups: dict[str, list[RunResult]]) -> None:
    from rich.console import Console

    console = Console()
    for model, members in groups.items():
        console.print(rich_table(_title(model, members), *table_rows(members)))
