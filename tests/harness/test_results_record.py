"""results.json's and summary.json's one owner (moe_eval.core.record): what it reads, what it refuses, how it
writes, and the schema generated from its types."""

from __future__ import annotations

import json
import re

import pytest

from moe_eval.core.errors import ExitCode
from moe_eval.core.record import RESULTS_SCHEMA_VERSION, RunRecord, UnreadableRecord
from moe_eval.core.results import _json_safe


def test_round_trip_and_the_questions_readers_ask(tmp_path):
    path = tmp_path / "results.json"
    RunRecord.from_json(
        {
            "schema_version": RESULTS_SCHEMA_VERSION,
            "status": "failed",
            "layout": {"describe": "TP (TP1)"},
            "mutation": "swap_gate_up",
            "attempt": 2,
            "config": {"model_name": "m"},
        },
        path,
    ).write()
    record = RunRecord.read(path)
    assert record.has_verdict and record.status == "failed" and record.layout == "TP (TP1)"
    assert (record.mutation, record.attempt, record.config["model_name"], record.path) == (
        "swap_gate_up",
        2,
        "m",
        path,
    )
    assert not [p for p in tmp_path.iterdir() if p.name != "results.json"], "no temporary file left"
    errored = RunRecord.from_json({"status": "error", "error": {"message": "server died"}})
    assert not errored.has_verdict and errored.error_message == "server died" and errored.attempt == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "cannot read a results record"),
        ("[1, 2]", "not a results record (a JSON list)"),
        (json.dumps({"schema_version": RESULTS_SCHEMA_VERSION + 1}), f"reads up to {RESULTS_SCHEMA_VERSION}"),
        # A typed section of another JSON shape is refused where it is read, not where a reader meets it.
        (json.dumps({"status": "passed", "layout": "TP"}), "an object expected for LayoutInfo, got str"),
        (json.dumps({"status": "passed", "checks": {"name": "served"}}), "a list expected, got dict"),
    ],
)
def test_a_bad_file_is_refused_naming_it(tmp_path, text, message):
    path = tmp_path / "results.json"
    path.write_text(text)
    with pytest.raises(UnreadableRecord, match=re.escape(message)) as caught:
        RunRecord.read(path)
    assert str(path) in str(caught.value)
    assert RunRecord.read_if_any(path) is None and RunRecord.read_if_any(tmp_path / "missing.json") is None


def test_the_verdict_is_a_function_of_the_checks_alone():
    from moe_eval.core.check import Check, verdict

    assert verdict([Check("a", True, ""), Check("b", True, "")]) == "passed"
    assert verdict([Check("a", True, ""), Check("golden_gate", False, "ratio 1.6")]) == "failed"
    # Nothing judged is no pass (issue 33): a random-weights incumbent row is judged by the `served` gate.
    assert verdict([]) == "incomplete"


def test_the_committed_schemas_are_the_ones_the_types_generate(repo_root):
    """docs/results.schema.json and docs/summary.schema.json are generated (python -m
    moe_eval.core.record_schema --write): a field added to a section without regenerating them fails here."""
    from moe_eval.core.record_schema import rendered

    for name, text in rendered().items():
        assert (repo_root / "docs" / name).read_text() == text, f"docs/{name} is stale: regenerate it"


def test_every_status_the_runner_writes_validates_against_the_schema():
    """An incomplete record (a verdict without an error object) and an errored one (no evaluation): the
    hand-written schema refused the first."""
    import jsonschema

    from moe_eval.core.check import Check
    from moe_eval.core.record import Evaluation, RunError, RunRecord
    from moe_eval.core.record_schema import results_schema

    schema = results_schema()
    incomplete = RunRecord(
        evaluation=Evaluation(
            scores={"strict-match": {"accuracy": 1.0, "stderr": float("nan")}},
            num_questions_evaluated=8,
            answers={"questions": 8},
            samples="samples.jsonl",
        )
    )
    incomplete.identity.config_sha256 = "0" * 64
    incomplete.judged.gate = {"skipped": "random weights"}
    incomplete.verdict.checks = [Check("golden_not_run", False, "no scoring texts", ran=False)]
    incomplete.verdict.status = "incomplete"
    errored = RunRecord()
    errored.identity.config_sha256 = "1" * 64
    errored.bookkeeping.error = RunError("InfraError", "vLLM exited", int(ExitCode.INFRA))
    for record in (incomplete, errored):
        jsonschema.validate(_json(record), schema)
    errored.bookkeeping.error = None
    with pytest.raises(jsonschema.ValidationError, match="'error' is a required property"):
        jsonschema.validate(_json(errored), schema)


def _json(record) -> dict:
    """As the file holds it (NaN written as null)."""
    path_text = json.dumps(_json_safe(record.to_json()))
    return json.loads(path_text)


def test_keys_of_a_newer_writer_survive_a_rewrite(tmp_path):
    """The scheduler rewrites a record to add its attempts: a key this moe-eval does not know stays."""
    from moe_eval.core.record import Attempt

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema_version": RESULTS_SCHEMA_VERSION, "status": "passed", "future": [1]}))
    record = RunRecord.read(path)
    record.bookkeeping.attempts = [Attempt(1, "error", "server died", "attempts/1")]
    record.write()
    again = json.loads(path.read_text())
    assert again["future"] == [1] and again["attempts"][0]["folder"] == "attempts/1"
    assert RunRecord.read(path).bookkeeping.attempts[0].error == "server died"


def test_the_summary_round_trips(tmp_path):
    from moe_eval.core.check import Check
    from moe_eval.core.record import RunSummary, SummaryEntry, to_json

    summary = RunSummary(
        hw="cpu",
        source="config-cpu.txt",
        run_root=str(tmp_path),
        complete=False,
        configs=[
            SummaryEntry(
                "a.yaml",
                "passed",
                str(tmp_path / "a"),
                None,
                None,
                [Check("served", True, "8 of 8")],
                "bundled:torch",
                1,
                False,
            ),
            SummaryEntry("b.yaml"),
        ],
    )
    summary.write(tmp_path)
    back = RunSummary.read(tmp_path / "summary.json")
    assert back == summary and to_json(back)["configs"][1]["status"] == "not_started"
