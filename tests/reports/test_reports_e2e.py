"""Reports of real runs, read from the session's shared runs (tests/conftest.py): the embedded default (three
configs passing: vLLM's CPU kernel, bundled torch at TP1 and TEP) and the subtle mutation of its TP1 row
(failing by the golden gate). JUnit with its passes and its failure, the GitHub step summary, summary.md,
results.json against the schema, `moe-eval compare` of the two, and the paired gate against the baseline."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from junitparser import Failure, JUnitXml

from tests.conftest import REPO_ROOT, SUBTLE_MUTATION, run_cli

pytestmark = pytest.mark.server


def _cases(junit) -> dict:
    """Test cases by '<classname>/<name>' (the TP and TEP rows share a config name; the family tells them
    apart)."""
    return {
        f"{case.classname}/{case.name}": case for suite in JUnitXml.fromfile(str(junit)) for case in suite
    }


def test_junit_and_step_summary_of_a_passing_and_a_failing_run(embedded_default_run, subtle_mutation_run):
    passing = _cases(embedded_default_run.junit)
    assert len(passing) == 3 and all(case.is_passed for case in passing.values()), passing
    summary = embedded_default_run.step_summary.read_text()
    assert summary.count("|canary-t") >= 3 and "PASS" in summary and "Error vs golden (incumbent)" in summary

    failing = _cases(subtle_mutation_run.junit)
    assert failing["moe-eval.canary-tp/Canary-Qwen3-MoE-BF16-vllm"].is_passed  # resumed: its verdict stands
    failure = failing["moe-eval.canary-tp/Canary-Qwen3-MoE-BF16-torch"].result[0]
    assert isinstance(failure, Failure) and "golden_gate" in failure.type, failure.type
    # scale_one_expert (5% in one expert, every call): the golden gate (prefill and decode) and the layer
    # check all fail it; the verdict cell names each.
    failed = {"layer_check_ranges", "layer_check_experts", "golden_gate", "golden_gate_decode"}
    for text in (
        subtle_mutation_run.step_summary.read_text(),
        (subtle_mutation_run.folder / "summary.md").read_text(),
    ):
        cell = re.search(r"\|FAIL \(([^)]*)\)\|", text)
        assert cell and set(cell.group(1).split(", ")) == failed, text


def test_results_files_follow_the_schema_and_carry_the_paired_gate(embedded_default_run, subtle_mutation_run):
    schema = json.loads((REPO_ROOT / "docs" / "results.schema.json").read_text())
    for run in (embedded_default_run, subtle_mutation_run):
        for path in run.folder.rglob("results.json"):
            if "attempts" in path.parts:
                continue
            record = json.loads(path.read_text())
            jsonschema.validate(record, schema)
            if record["moe_backend_requested"] is not None:  # compared with vLLM's row of the same run
                paired = record["paired"]
                assert paired["n"] == 200 and paired["baseline"].endswith(
                    "Canary-Qwen3-MoE-BF16-vllm/results.json"
                )
                assert paired["passed"], paired  # a 5% expert bug flips no canary answer


def test_compare_puts_the_runs_side_by_side_with_the_mutation_marked(
    embedded_default_run, subtle_mutation_run
):
    tp = "canary-tp/Canary-Qwen3-MoE-BF16-torch/results.json"
    compared = run_cli(
        [
            "compare",
            "--format",
            "markdown",
            str(embedded_default_run.folder / tp),
            str(subtle_mutation_run.folder / tp),
            str(embedded_default_run.folder / "canary-tp/Canary-Qwen3-MoE-BF16-vllm/results.json"),
        ]
    )
    assert compared.returncode == 0, compared.stderr
    out = compared.stdout
    assert "### builtin:canary-qwen3-moe" in out and "200 questions" in out
    assert f"bundled:torch TP (TP1) [mutated: {SUBTLE_MUTATION}]" in out and "vllm:CPU TP (TP1)" in out
    golden_row = next(line for line in out.splitlines() if line.startswith("|error vs golden"))
    assert "(reference)" in golden_row and golden_row.count("(x") == 2, golden_row
