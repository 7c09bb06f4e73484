"""`moe-eval compare`: side-by-side accuracy of several runs, one table per model.

Columns are the runs (MoE kernel and layout, e.g. Triton TP vs FlashInfer CUTLASS TEP), in input
order; a run made with a deliberately broken kernel (`run --mutation`) is marked
`<label> [mutated: <name>]`. Cells are accuracy ± stderr for both filters; further rows give:
  - the per-question flips against the reference column, with the exact McNemar p-value;
  - where both runs scored the same texts, the log-probability divergence against the reference
    column (moe_eval.evaluate.logprobs);
  - every run's error against the golden reference (mean |Δ log p| of the reference tokens,
    moe_eval.gates.golden_errors) and its ratio to the reference column's. The golden record is the one the
    runs' results.json name; all runs of one model and texts share it, so a run that names none is
    measured too. The golden used is the reference column's, else the first named; a run that names
    another shows "other golden", and a golden folder not readable here "golden missing".
The reference column is `--reference`: `vllm` (default: the first column whose backend is vLLM's own
kernel, else the first column), `first`, a 1-based column number, or a (case-sensitive) substring of
exactly one column's label. Runs that did not answer the same questions with the same few-shot count
are refused, not compared. Usage:

    moe-eval compare moe-eval-results/20261129-120000 moe-eval-results/20261129-130000
    moe-eval compare --reference 'bundled:triton TP' moe-eval-results/20261129-120000
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from moe_eval.core.errors import ConfigError
from moe_eval.core.logprob_texts import LOGPROBS_FILE, TextLogprobs, read_logprobs
from moe_eval.core.plugin_protocol import layer_range_names
from moe_eval.core.record import RunRecord, UnreadableRecord, result_files
from moe_eval.evaluate.gsm8k import FILTERS
from moe_eval.gates import registry
from moe_eval.gates.answers import correctness
from moe_eval.gates.divergence import divergence, divergence_cell
from moe_eval.gates.speed import timed_where, times_differ_by
from moe_eval.gates.stats import paired_compare
from moe_eval.report.table import evidence_cell, markdown_table, rich_table

DEFAULT_REFERENCE = "vllm"
GOLDEN_PREFILL = (
    "prefill.jsonl"  # moe_eval.evaluate.golden.FILES: the prefill records, a logprobs.jsonl's format
)


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
    backend: str = ""  # moe_backend_used, e.g. "vllm:TRITON", "bundled:triton"
    mutation: str | None = None  # the deliberate kernel bug the run was made with, if any
    golden_digest: str | None = None  # the golden record the run was gated against (results.json "golden")
    golden_path: Path | None = None
    judged: dict = dataclasses.field(default_factory=dict)  # results.json's gate sections, by key
    checks: tuple = ()  # its checks (core/check.Check)
    moe_timing: dict | None = None  # results.json captures "speed.moe" (core/moe_timing.py), every timed row
    machine: str | None = None  # where it ran (checks.machine_of): times compare on one machine only
    workload: str | None = None  # what its timed sweep computed (checks.workload_identity)

    @property
    def questions(self) -> frozenset[int]:
        return frozenset(self.correct)

    def section(self, key: str) -> dict | None:
        value = self.judged.get(key)
        return value if isinstance(value, dict) and "skipped" not in value else None


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
        record = RunRecord.read(path)
    except UnreadableRecord as exc:
        raise ConfigError(f"compare: not a moe-eval results.json: {exc}") from None
    if not record.has_verdict:
        return None
    samples_path = path.parent / (record.evaluation.samples or "samples.jsonl")
    try:
        samples = [json.loads(line) for line in samples_path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise ConfigError(f"compare: {samples_path}: per-question samples missing ({exc})") from None
    backend = record.serving.moe_backend_used or record.serving.moe_backend_requested or "vllm"
    mutation = record.mutation
    label = f"{backend} {record.layout}"
    if mutation:  # a broken kernel on purpose: its column must never pass for a real one
        label += f" [mutated: {mutation}]"
    golden = record.captures.golden if isinstance(record.captures.golden, dict) else {}
    correct = correctness(samples)
    logprobs = path.parent / LOGPROBS_FILE
    machine, workload = timed_where(record)
    return RunResult(
        path=path,
        model=record.config["model_name"],
        label=label,
        num_fewshot=record.config["num_fewshot"],
        scores=record.evaluation.scores or {},
        verdict=record.status.upper(),
        correct=correct,
        logprobs=logprobs if logprobs.is_file() else None,
        backend=backend,
        mutation=mutation or None,
        golden_digest=golden.get("digest"),
        golden_path=Path(golden["path"]) if golden.get("path") else None,
        judged=dict(record.judged),
        checks=tuple(record.verdict.checks),
        moe_timing=(record.captures.timing or {}).get("moe"),
        machine=machine,
        workload=workload,
    )


def group_runs(inputs: list[Path]) -> dict[str, list[RunResult]]:
    runs = [r for r in (load_run(p) for p in _result_files(inputs)) if r is not None]
    groups: dict[str, list[RunResult]] = defaultdict(list)
    for run in runs:
        groups[run.model].append(run)
    if not groups:
        raise ConfigError("compare: no finished results among the inputs (errored configs have no scores)")
    for model, members in groups.items():
        if len(members) < 2:
            raise ConfigError(
                f"compare: model {model} has one result ({members[0].path}); nothing to "
                "compare it with (results of different models are never compared)"
            )
        first = members[0]
        for other in members[1:]:
            if other.num_fewshot != first.num_fewshot:
                raise ConfigError(
                    f"compare: {model}: few-shot counts differ ({first.num_fewshot} in "
                    f"{first.path}, {other.num_fewshot} in {other.path})"
                )
            if other.questions != first.questions:
                raise ConfigError(
                    f"compare: {model}: question sets differ ({len(first.questions)} "
                    f"questions in {first.path}, {len(other.questions)} in {other.path}, "
                    f"{len(first.questions ^ other.questions)} not in both)"
                )
        labels = [m.label for m in members]
        if len(set(labels)) < len(labels):  # same kernel and layout twice: tell the runs apart
            groups[model] = [
                dataclasses.replace(m, label=f"{m.label} [{m.path.parents[2].name}]") for m in members
            ]
    return dict(groups)


def reference_index(model: str, members: list[RunResult], reference: str = DEFAULT_REFERENCE) -> int:
    """The 0-based column the flips, Δ log p and golden ratios are against (`--reference`, see above)."""
    if reference == "vllm":
        # vLLM's own kernel is the incumbent a bundled kernel must match; without one, the old behaviour.
        return next((i for i, m in enumerate(members) if m.backend.startswith("vllm:")), 0)
    if reference == "first":
        return 0
    if reference.isdigit():
        number = int(reference)
        if not 1 <= number <= len(members):
            raise ConfigError(f"compare: --reference {reference}: {model} has columns 1 to {len(members)}")
        return number - 1
    found = [i for i, m in enumerate(members) if reference in m.label]
    if len(found) != 1:
        how = "matches no column" if not found else f"matches {len(found)} columns"
        labels = ", ".join(repr(m.label) for m in members)
        raise ConfigError(
            f"compare: --reference '{reference}' {how} of {model} ({labels}); give a longer "
            "part of one label, a column number, 'first' or 'vllm'"
        )
    return found[0]


def reference_indices(
    groups: dict[str, list[RunResult]], reference: str = DEFAULT_REFERENCE
) -> dict[str, int]:
    """Every group's reference column, resolved before any table is printed (a bad value prints nothing)."""
    return {model: reference_index(model, members, reference) for model, members in groups.items()}


def _cell(score: dict[str, float]) -> str:
    stderr = score.get("stderr")
    return f"{score['accuracy']:.4f} ± {stderr:.4f}" if stderr is not None else f"{score['accuracy']:.4f}"


def table_rows(members: list[RunResult], ref: int = 0) -> tuple[list[str], list[list[str]]]:
    header = ["Filter", "n-shot", "Metric", *[m.label for m in members]]
    rows = [
        [f, str(members[0].num_fewshot), "exact_match", *[_cell(m.scores[f]) for m in members]]
        for f in FILTERS
    ]
    base = members[ref]
    flips = [f"flips vs {base.label}", "", "strict-match"]
    for i, m in enumerate(members):
        if i == ref:
            flips.append("reference")
            continue
        p = paired_compare(base.correct, m.correct, alpha=0.05)
        flips.append(
            f"{p.baseline_only} right->wrong, {p.new_only} wrong->right (McNemar p={p.p_two_sided:.3g})"
        )
    rows.append(flips)
    # Each file is read once: the divergence and the golden rows both use every run's records.
    records = [read_logprobs(m.logprobs) if m.logprobs is not None else None for m in members]
    divergences = [
        "reference" if i == ref else _divergence(records[ref], recs) for i, recs in enumerate(records)
    ]
    rows.append([f"Δ log p vs {base.label}", "", "mean, top-1 changed", *divergences])
    rows.append(["error vs golden", "", "mean |Δ log p|, x reference", *_golden_cells(members, records, ref)])
    for gate in registry.GATES:  # each gate's own rows, from each run's section (its Show)
        if gate.show.compare is not None and gate.section:
            rows += gate.show.compare([m.section(gate.section) for m in members], ref)
    rows += _speed_rows(members, ref)
    rows.append(["evidence", "", "judged/total (would catch)", *[evidence_cell(m.checks) for m in members]])
    rows.append(["verdict", "", "", *[m.verdict for m in members]])
    return header, rows


def _speed_rows(members: list[RunResult], ref: int) -> list[list[str]]:
    """Per dispatch range, each run's served MoE call (us) and its ratio to the reference column's, so
    "correct and not slower" reads per range. A ratio only where the two timed the same requests on the same
    machine (what the speed gate asks too); elsewhere the time stands alone, saying why."""
    timed = [{r["range"]: r for r in (m.moe_timing or {}).get("ranges", [])} for m in members]
    if not any(timed):
        return []
    reference = members[ref]
    apart = [times_differ_by(m.machine, m.workload, reference.machine, reference.workload) for m in members]
    rows = []
    for name in layer_range_names():
        if not any(name in t for t in timed):
            continue
        base = timed[ref].get(name)
        cells = []
        for i, t in enumerate(timed):
            row = t.get(name)
            if row is None:
                cells.append("-")
            elif apart[i]:
                cells.append(f"{row['mean_us']:.1f} us (other {apart[i]})")
            elif i == ref or base is None or not base["mean_us"]:
                cells.append(f"{row['mean_us']:.1f} us")
            else:
                cells.append(f"{row['mean_us']:.1f} us (x{row['mean_us'] / base['mean_us']:.2f})")
        rows.append([f"MoE time {name}", "", "us per call (x reference)", *cells])
    return rows


def _divergence(base: list[TextLogprobs] | None, other: list[TextLogprobs] | None) -> str:
    """The divergence cell: '-' where either run scored no texts or they scored different ones."""
    if base is None or other is None:
        return "-"
    try:
        div = divergence(base, other)
    except ValueError:  # other texts or tokens: not comparable
        return "not comparable"
    return divergence_cell(div.as_dict())


def _golden_of(members: list[RunResult], ref: int) -> tuple[str | None, list[Path]]:
    """The group's golden: the reference column's, else the first named; with every folder named for
    that digest, since results copied from other machines may name a cache folder not present here."""
    named = [m for m in members if m.golden_path is not None]
    if not named:
        return None, []
    chosen = members[ref] if members[ref].golden_path is not None else named[0]
    paths: list[Path] = []
    for m in [chosen, *named]:
        same = m.golden_digest == chosen.golden_digest
        if same and m.golden_path is not None and m.golden_path not in paths:
            paths.append(m.golden_path)
    return chosen.golden_digest, paths


def _read_golden(paths: list[Path]) -> list[TextLogprobs] | None:
    for folder in paths:
        try:
            return read_logprobs(folder / GOLDEN_PREFILL)
        except ConfigError:  # missing, unreadable or corrupt here: try the next folder named for it
            continue
    return None


def _golden_cells(members: list[RunResult], records: list[list[TextLogprobs] | None], ref: int) -> list[str]:
    """'0.0169 (x0.98)' per run: its error vs the golden and the ratio to the reference column's error."""
    from moe_eval.gates.golden_errors import errors_vs_golden  # noqa: I001

    digest, paths = _golden_of(members, ref)
    if not paths:
        return ["-"] * len(members)
    golden = _read_golden(paths)
    errors: list[float | str] = []
    for m, recs in zip(members, records):
        if recs is None:
            errors.append("-")
        elif m.golden_digest is not None and digest is not None and m.golden_digest != digest:
            errors.append("other golden")  # a ratio between errors against different references means nothing
        elif golden is None:
            errors.append("golden missing")
        else:
            try:
                errors.append(errors_vs_golden(golden, recs).mean_abs)
            except ValueError:  # other texts or tokens than the golden's
                errors.append("not comparable")
    base = errors[ref]
    cells = []
    for i, err in enumerate(errors):
        if isinstance(err, str):
            cells.append(err)
        elif i == ref:
            cells.append(f"{err:.4f} (reference)")
        elif isinstance(base, float) and base > 0:
            cells.append(f"{err:.4f} (x{err / base:.2f})")
        else:  # the reference has no error to divide by
            cells.append(f"{err:.4f}")
    return cells


def _title(model: str, members: list[RunResult]) -> str:
    return f"{model}: GSM8K, {len(members[0].questions)} questions, {members[0].num_fewshot}-shot"


def _md_escape(cell: str) -> str:
    # markdown_table joins cells with "|": a pipe inside a cell ("mean |Δ log p|") would split it.
    return cell.replace("|", "\\|")


def markdown(groups: dict[str, list[RunResult]], reference: str = DEFAULT_REFERENCE) -> str:
    refs = reference_indices(groups, reference)
    parts = []
    for model, members in groups.items():
        header, rows = table_rows(members, refs[model])
        # Labels are never empty, so every separator cell is "---".
        table = markdown_table([_md_escape(c) for c in header], [[_md_escape(c) for c in r] for r in rows])
        parts.append(f"### {_title(model, members)}\n\n{table}")
    return "\n".join(parts)


def print_rich(groups: dict[str, list[RunResult]], reference: str = DEFAULT_REFERENCE) -> None:
    from rich.console import Console
    from rich.markup import escape

    refs = reference_indices(groups, reference)
    console = Console()
    for model, members in groups.items():
        header, rows = table_rows(members, refs[model])
        # Rich reads "[...]" as markup and drops it: the "[mutated: ...]" and "[<run>]" marks must show.
        console.print(
            rich_table(
                escape(_title(model, members)),
                [escape(c) for c in header],
                [[escape(c) for c in r] for r in rows],
            )
        )
