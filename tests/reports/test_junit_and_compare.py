"""JUnit XML against a schema and a real consumer (junitparser); compare's tables and refusals."""

import json
from pathlib import Path

import pytest
from lxml import etree

from moe_eval.checks import Check
from moe_eval.compare import group_runs, markdown
from moe_eval.config import parse_config
from moe_eval.errors import ConfigError
from moe_eval.gate import GateResult
from moe_eval.junit import junit_xml
from moe_eval.runner import ConfigOutcome

XSD = Path(__file__).with_name("junit.xsd")
CONFIG = "model_name: m\naccuracy_threshold: 0.8\nnum_questions: 10\nnum_fewshot: 5\n"


def _outcome(tmp_path: Path, name: str, status: str) -> ConfigOutcome:
    config = parse_config(tmp_path / "fam" / f"{name}.yaml", CONFIG)
    run_dir = tmp_path / "run" / name
    run_dir.mkdir(parents=True)
    (run_dir / "server.log").write_text("INFO line 1\nERROR: engine died\n")
    outcome = ConfigOutcome(config=config, run_dir=run_dir, status=status, moe_backend_used="bundled:torch",
                            timings={"total_seconds": 12.5})
    if status == "error":
        outcome.error = "vLLM server exited with code 1 before it was ready"
        return outcome
    acc = 0.9 if status == "passed" else 0.5
    outcome.gate = GateResult(accuracy=acc, stderr=0.05, threshold=0.8, tolerance=0.08)
    outcome.checks = [Check("accuracy_gate", outcome.gate.passed, outcome.gate.describe())]
    return outcome


def test_junit_validates_and_a_real_consumer_reads_it(tmp_path):
    from junitparser import Error, Failure, JUnitXml

    outcomes = [_outcome(tmp_path, "Good-BF16-torch", "passed"), _outcome(tmp_path, "Bad-BF16-torch", "failed"),
                _outcome(tmp_path, "Broken-BF16-torch", "error")]
    text = junit_xml(outcomes, "cpu", [])
    schema = etree.XMLSchema(etree.parse(str(XSD)))
    doc = etree.fromstring(text.encode())
    assert schema.validate(doc), schema.error_log
    path = tmp_path / "junit.xml"
    path.write_text(text)
    parsed = JUnitXml.fromfile(str(path))
    cases = {case.name: case for suite in parsed for case in suite}
    assert set(cases) == {"Good-BF16-torch", "Bad-BF16-torch", "Broken-BF16-torch"}  # the config stems
    assert cases["Good-BF16-torch"].is_passed
    failure = cases["Bad-BF16-torch"].result[0]
    assert isinstance(failure, Failure) and "accuracy 0.5000 vs floor 0.7200" in failure.message
    assert "margin -0.2200" in failure.message
    error = cases["Broken-BF16-torch"].result[0]
    assert isinstance(error, Error) and "ERROR: engine died" in error.text  # the server log's last lines
    suites = {suite.name: suite for suite in parsed}
    props = {p.name: p.value for p in suites["fam/Good-BF16-torch"].properties()}
    assert props["moe_backend_used"] == "bundled:torch" and props["layout"] == "TP (TP1)" and props["version.lm-eval"]
    assert doc.get("tests") == "3" and doc.get("failures") == "1" and doc.get("errors") == "1"


def _write_run(root: Path, run: str, config: str, model: str, backend: str, layout: str, correct: list[bool],
               fewshot: int = 5, status: str = "passed") -> None:
    d = root / run / "fam" / config
    d.mkdir(parents=True)
    acc = sum(correct) / len(correct)
    record = {"status": status, "config": {"model_name": model, "num_fewshot": fewshot},
              "layout": {"describe": layout}, "moe_backend_used": backend, "samples": "samples.jsonl",
              "scores": {"strict-match": {"accuracy": acc, "stderr": 0.01},
                         "flexible-extract": {"accuracy": acc, "stderr": 0.01}}}
    (d / "results.json").write_text(json.dumps(record))
    lines = [{"doc_id": i, "filter": f, "exact_match": float(c)} for i, c in enumerate(correct)
             for f in ("strict-match", "flexible-extract")]
    (d / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_compare_puts_backends_side_by_side_with_flips(tmp_path):
    _write_run(tmp_path, "r1", "Q-BF16-triton", "Qwen", "bundled:triton", "TP (TP2)", [True] * 8 + [False] * 2)
    _write_run(tmp_path, "r2", "Q-BF16-fi-cutlass", "Qwen", "bundled:flashinfer_cutlass", "TEP (TP2 EP2)",
               [True] * 7 + [False] * 2 + [True])
    table = markdown(group_runs([tmp_path / "r1", tmp_path / "r2"]))
    assert "### Qwen: GSM8K, 10 questions, 5-shot" in table
    assert "|Filter|n-shot|Metric|bundled:triton TP (TP2)|bundled:flashinfer_cutlass TEP (TP2 EP2)|" in table
    assert "|strict-match|5|exact_match|0.8000 ± 0.0100|0.8000 ± 0.0100|" in table
    assert "1 right->wrong, 1 wrong->right" in table


@pytest.mark.parametrize("second, message", [
    ({"fewshot": 3}, "few-shot counts differ"),
    ({"correct": [True] * 9}, "question sets differ"),
    ({"model": "Mixtral"}, "has one result"),
])
def test_compare_refuses_mismatches(tmp_path, second, message):
    _write_run(tmp_path, "r1", "Q-BF16-triton", "Qwen", "bundled:triton", "TP (TP2)", [True] * 10)
    kwargs = {"model": "Qwen", "correct": [True] * 10, "fewshot": 5} | second
    _write_run(tmp_path, "r2", "Q-BF16-fi-cutlass", kwargs["model"], "bundled:flashinfer_cutlass", "TEP",
               kwargs["correct"], fewshot=kwargs["fewshot"])
    with pytest.raises(ConfigError, match=message):
        group_runs([tmp_path / "r1", tmp_path / "r2"])


def test_compare_refuses_missing_inputs_and_errored_only(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        group_runs([tmp_path / "nope"])
    _write_run(tmp_path, "r1", "Q", "Qwen", "x", "TP", [True], status="error")
    with pytest.raises(ConfigError, match="no finished results"):
        group_runs([tmp_path / "r1"])


def test_compare_shows_the_log_probability_divergence_against_the_first_run(tmp_path):
    from moe_eval.logprobs import TextLogprobs, write_logprobs

    def texts(shift: float) -> list[TextLogprobs]:
        # Two texts of 3 positions; position 0 has no log-probability. `shift` moves every reference token.
        return [TextLogprobs(i, (5, 6, 7), (None, -1.0 - shift, -2.0 - shift), (None, (6, 9), (7, 9)),
                             (None, (-1.0 - shift, -3.0), (-2.0 - shift, -3.0))) for i in range(2)]

    for run, shift in (("r1", 0.0), ("r2", 0.25)):
        _write_run(tmp_path, run, "Q-BF16-triton", "Qwen", "bundled:triton", "TP (TP1)", [True] * 4)
        write_logprobs(tmp_path / run / "fam" / "Q-BF16-triton" / "logprobs.jsonl", texts(shift))
    _write_run(tmp_path, "r3", "Q-BF16-triton", "Qwen", "bundled:triton", "TP (TP1)", [True] * 4)  # scored nothing
    table = markdown(group_runs([tmp_path / "r1", tmp_path / "r2", tmp_path / "r3"]))
    row = next(line for line in table.splitlines() if line.startswith("|Δ log p vs first|"))
    assert row == "|Δ log p vs first||mean, top-1 changed|-|0.2500 mean, 0.00% top-1|-|"
