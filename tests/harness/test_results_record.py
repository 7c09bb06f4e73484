"""results.json's one owner (moe_eval.results.RunRecord): what it reads, what it refuses, how it writes."""

from __future__ import annotations

import json
import re

import pytest

from moe_eval.results import RESULTS_SCHEMA_VERSION, RunRecord, UnreadableRecord


def test_round_trip_and_the_questions_readers_ask(tmp_path):
    path = tmp_path / "results.json"
    RunRecord(
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
    errored = RunRecord({"status": "error", "error": {"message": "server died"}})
    assert not errored.has_verdict and errored.error_message == "server died" and errored.attempt == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "cannot read a results record"),
        ("[1, 2]", "not a results record (a JSON list)"),
        (json.dumps({"schema_version": RESULTS_SCHEMA_VERSION + 1}), f"reads up to {RESULTS_SCHEMA_VERSION}"),
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
    from moe_eval.checks import Check, verdict

    assert verdict([Check("a", True, ""), Check("b", True, "")]) == "passed"
    assert verdict([Check("a", True, ""), Check("golden_gate", False, "ratio 1.6")]) == "failed"
    # Nothing judged is no pass (issue 33): a random-weights incumbent row is judged by the `served` gate.
    assert verdict([]) == "incomplete"
