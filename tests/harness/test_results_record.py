"""results.json's and summary.json's one owner (moe_eval.core.record): what it reads, what it refuses, how it
writes, and the schema generated from its types."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest

from moe_eval.core.errors import ExitCode
from moe_eval.core.record import (
    RESULTS_SCHEMA_VERSION,
    Bookkeeping,
    RunError,
    RunRecord,
    UnreadableRecord,
    Verdict,
)
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

    assert verdict([Check.judged("a", True, ""), Check.judged("b", True, "")]) == "passed"
    assert verdict([Check.judged("a", True, ""), Check.judged("golden_gate", False, "ratio 1.6")]) == "failed"
    # Nothing judged is no pass (issue 33): a random-weights incumbent row is judged by the `served` gate.
    assert verdict([]) == "incomplete"


def test_the_committed_schemas_are_the_ones_the_types_generate(repo_root):
    """docs/results.schema.json and docs/summary.schema.json are generated (python -m
    moe_eval.report.record_schema --write): a field added to a section without regenerating them fails
    here."""
    from moe_eval.report.record_schema import rendered

    for name, text in rendered().items():
        assert (repo_root / "docs" / name).read_text() == text, f"docs/{name} is stale: regenerate it"


def test_every_status_the_runner_writes_validates_against_the_schema():
    """An incomplete record (a verdict without an error object) and an errored one (no evaluation): the
    hand-written schema refused the first."""
    import jsonschema

    from moe_eval.core.check import Check
    from moe_eval.core.record import Evaluation, RunError, RunRecord
    from moe_eval.report.record_schema import results_schema

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
    incomplete.judged["gate"] = {"skipped": "random weights"}
    incomplete.verdict.checks = [Check.not_run("golden_not_run", "no scoring texts")]
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
                [Check.judged("served", True, "8 of 8")],
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


# --- the judged sections' payloads (issue 41, item 4) ------------------------------------------------------

PAYLOADS = ("gate", "paired", "divergence", "layer_check", "golden_gate", "speed", "timing", "layer_sweep")


def _closed(schema: dict) -> dict:
    """The schema with no key beyond the typed ones: a key a record holds that no type names fails."""
    schema = copy.deepcopy(schema)
    for part in [schema, *schema["$defs"].values()]:
        if "properties" in part:
            part.setdefault("additionalProperties", False)
    return schema


def _section_schema(schema: dict, name: str) -> dict:
    return {"$defs": schema["$defs"], **schema["properties"][name]}


def _real_records(repo_root) -> list[Path]:
    """The committed records of real runs (H200, docs/data/layer_cells_h200)."""
    return sorted((repo_root / "docs/data/layer_cells_h200").rglob("results.json"))


def test_each_judged_section_and_timing_capture_lists_its_fields():
    """At 593f15d every judged section's schema was {"type": "object"}."""
    from moe_eval.report.record_schema import results_schema

    schema = results_schema()
    for name in PAYLOADS:
        branches = schema["properties"][name].get("anyOf") or [schema["properties"][name]]
        typed = [b for b in branches if "$ref" in b and not b["$ref"].endswith("/Skipped")]
        assert len(typed) == 1, name
        payload = schema["$defs"][typed[0]["$ref"].rsplit("/", 1)[1]]
        assert payload["properties"] and all("description" in p for p in payload["properties"].values()), name


def test_every_real_record_validates_and_holds_no_untyped_key(repo_root):
    import jsonschema

    from moe_eval.report.record_schema import results_schema

    schema = _closed(results_schema())
    records = _real_records(repo_root)
    assert records, "docs/data/layer_cells_h200 holds committed records"
    for path in records:
        errors = list(jsonschema.Draft202012Validator(schema).iter_errors(json.loads(path.read_text())))
        assert not errors, f"{path}: {jsonschema.exceptions.best_match(errors).message[:300]}"
    # The H200 speed runs' rows (docs/data/speed_h200): their timing capture and speed section.
    for rows in (repo_root / "docs/data/speed_h200").glob("*.json"):
        for row in json.loads(rows.read_text()):
            for name in ("timing", "speed"):
                if row[name] is not None:
                    jsonschema.validate(row[name], _section_schema(schema, name))


def test_the_sections_the_judge_writes_validate(config_for_judge):
    """Every payload form the current judge writes: each gate passing, and the {skipped} and partial forms."""
    import jsonschema

    from moe_eval.gates.judge import judge
    from moe_eval.report.record_schema import results_schema
    from tests.harness.test_judge import _decode_from, _timed, measured

    config, gpu = config_for_judge
    schema = _closed(results_schema())
    timed = _timed({"M=1": 10.0, "M=2-16": 11.0, "M=17-64": 12.0})
    right = measured(config)
    incumbent = dataclasses.replace(right.incumbent, speed=timed, machine="NVIDIA H200")
    cases = [
        (gpu, measured(config, speed=_timed({"M=1": 10.0, "M=2-16": 14.0}), incumbent=incumbent)),
        (gpu, measured(config, speed=_timed({"M=1": 10.0}, calls=3), incumbent=incumbent)),  # none judged
        (config, measured(config, logprobs=None)),  # divergence and golden gate {skipped}
        (config, measured(config, decode=None)),  # decode {skipped}
        (config, measured(config, decode=_decode_from(1, 1))),  # decode failed
        (config, measured(config, decode=_decode_from(1, 1), incumbent_decode=_decode_from(1, 1))),
        (config, measured(config, incumbent_logprobs=right.incumbent_logprobs[:3])),  # golden gate partial
        (dataclasses.replace(config, random_weights=True), right),  # the accuracy gate {skipped}
    ]
    seen = set()
    for kind, m in cases:
        sections = _json(RunRecord(judged=judge(kind, m).sections))
        for name in PAYLOADS[:6]:
            if name in sections:
                jsonschema.validate(sections[name], _section_schema(schema, name))
                seen.add(name)
    assert seen == set(PAYLOADS[:6])


@pytest.fixture(scope="module")
def config_for_judge():
    from moe_eval.configs.config import effective_config
    from tests.harness.test_judge import QUESTIONS, TORCH_TP1, load_config

    config = dataclasses.replace(load_config(TORCH_TP1), num_questions=QUESTIONS, accuracy_threshold=0.9)
    return config, effective_config(config, None, None, "h200")[0]


def test_a_speed_section_with_a_ratio_of_another_type_is_refused():
    import jsonschema

    from moe_eval.report.record_schema import results_schema

    speed = {
        "reference": "runs/vllm/results.json",
        "margin": 0.15,
        "min_calls": 12,
        "z": 3.0,
        "timed_on": ["device"],
        "ranges": [
            {
                "range": "M=1",
                "us": 12.9,
                "reference_us": 12.1,
                "ratio": 1.06,
                "calls": 48,
                "reference_calls": 48,
                "passed": True,
                "why_not": None,
                "z": -20.1,
            },
        ],  # fmt: skip
        "worst_ratio": 1.06,
    }
    record = _json(RunRecord(verdict=Verdict(status="error"), bookkeeping=Bookkeeping(error=RunError("E"))))
    record["config_sha256"] = "0" * 64
    schema = results_schema()
    jsonschema.validate(record | {"speed": speed}, schema)
    speed["ranges"][0]["ratio"] = "x1.06"
    with pytest.raises(jsonschema.ValidationError, match="'x1.06' is not of type 'number', 'null'"):
        jsonschema.validate(record | {"speed": speed}, schema)


def test_the_payload_types_are_the_dataclasses_that_write_them():
    """e49cc3c kept a TypedDict beside each dataclass a gate writes (DivergenceLimits, LayerCheckLimits, the
    layer check's rows and cells, GoldenErrors, DecodeErrors, RangeTiming), held in step by a test. Now the
    schema is generated from the dataclasses themselves: no second list to keep."""
    from dataclasses import fields

    from moe_eval.core import moe_timing
    from moe_eval.gates import divergence, golden_errors, layer_gate
    from moe_eval.report.record_schema import results_schema

    defs = results_schema()["$defs"]
    for written in (
        divergence.DivergenceLimits, layer_gate.LayerCheckLimits, layer_gate.RangeRow, layer_gate.ExpertCell,
        layer_gate.PowerRow, golden_errors.GoldenErrors, golden_errors.DecodeErrors, moe_timing.RangeTiming,
        moe_timing.SizeTiming,
    ):  # fmt: skip
        made = defs[written.__name__]["properties"]
        assert set(made) == {f.name for f in fields(written)}, written.__name__
        assert all(p.get("description") for p in made.values()), written.__name__
