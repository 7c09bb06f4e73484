"""Adding a gate is one module and one registry row: a gate defined in this test alone, with config keys of
its own, is found by `moe-eval list`, read from a config's YAML, judged in a run, written to results.json and
described by its schema, shown in the run table, JUnit and `moe-eval compare`, its evidence counted and its
floor applied like every gate's."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
from click.testing import CliRunner
from junitparser import JUnitXml
from pydantic import Field

from moe_eval.configs.config import parse_config
from moe_eval.core.check import Check
from moe_eval.core.errors import ConfigError
from moe_eval.core.evidence import Evidence
from moe_eval.core.payload import described
from moe_eval.core.record import RunRecord, Verdict
from moe_eval.gates.gate import Column, Floor, Gate, Show, gate_keys
from moe_eval.gates.judge import judge
from moe_eval.gates.registry import describe_plan, registered
from tests.harness.test_judge import QUESTIONS, TORCH_TP1, load_config, measured


@dataclass(frozen=True)
class ToySection:
    """The toy gate's section: how many questions it counted."""

    counted: int = described("questions counted")
    wanted: int = described("questions asked")


def toy_rule(config, m, out):
    counted = m.answers.num_questions
    out.sections["toy"] = {"counted": counted, "wanted": QUESTIONS}
    evidence = Evidence("question", counted, QUESTIONS, would_catch="a missing question")
    out.checks.append(Check.judged("toy_check", True, f"counted {counted} questions", evidence))
    return None


@gate_keys
class ToyKeys:
    toy_gate: bool = Field(True, description="count the questions answered (the toy gate)")
    toy_min_share: float = Field(1.0, gt=0.0, le=1.0, description="toy gate: share of the questions it needs")


TOY = Gate(
    "toy",
    ("toy_check",),
    lambda config, incumbent: config.keys(ToyKeys).toy_gate,
    False,
    toy_rule,
    "counts the questions answered (a gate made in a test)",
    keys=ToyKeys,
    section="toy",
    payload=ToySection,
    floors={"toy_check": Floor(share_key="toy_min_share")},  # every question by default, or no pass
    show=Show(
        columns=(Column("Toy count", lambda section, row: f"{(section or {}).get('counted', '-')} counted"),),
        junit=lambda section: {"toy.counted": (section or {}).get("counted")},
        compare=lambda sections, ref: [
            ["toy", "", "counted", *[str((s or {}).get("counted")) for s in sections]]
        ],
    ),
)


def test_a_gate_defined_in_a_test_alone_is_found_everywhere(tmp_path):
    from moe_eval.cli import cli
    from moe_eval.report.compare import load_run, table_rows
    from moe_eval.report.junit import junit_xml
    from moe_eval.report.record_schema import results_schema
    from moe_eval.report.table import markdown
    from moe_eval.runner import ConfigOutcome

    config = dataclasses.replace(load_config(TORCH_TP1), num_questions=QUESTIONS)
    listing = tmp_path / "config-toy.txt"
    listing.write_text(f"{TORCH_TP1}\n")
    with registered(TOY):
        # list
        args = ["list", "--hw", "cpu", "--list", str(listing)]
        listed = CliRunner().invoke(cli, args, env={"HF_HUB_OFFLINE": "1"})
        assert listed.exit_code == 0 and ",toy" in listed.stdout.splitlines()[-1], listed.stdout
        # run: the judge gives its check and section, the floor applied
        got = judge(config, measured(config))
        check = next(c for c in got.checks if c.name == "toy_check")
        assert check.status == "passed" and check.evidence.required == QUESTIONS
        assert got.sections["toy"] == {"counted": QUESTIONS, "wanted": QUESTIONS}
        thin = judge(config, measured(config, answers_right=QUESTIONS))
        assert next(c for c in thin.checks if c.name == "toy_check").status == "passed"
        # results.json and its schema
        folder = tmp_path / "run" / "fam" / config.name
        folder.mkdir(parents=True)
        record = RunRecord(
            judged=got.sections, verdict=Verdict(got.checks, got.verdict), path=folder / "results.json"
        )
        record.identity.config = {"model_name": config.model_name, "num_fewshot": config.num_fewshot}
        record.evaluation.scores = {
            f: {"accuracy": 1.0, "stderr": 0.0} for f in ("strict-match", "flexible-extract")
        }
        record.write()
        assert json.loads(record.path.read_text())["toy"]["counted"] == QUESTIONS
        assert RunRecord.read(record.path).judged["toy"] == got.sections["toy"]
        schema = results_schema()
        assert schema["properties"]["toy"]["$ref"].endswith("/ToySection")
        assert schema["$defs"]["ToySection"]["properties"]["counted"]["description"] == "questions counted"
        # the run table, JUnit
        outcome = ConfigOutcome.from_record(config, folder, RunRecord.read(record.path))
        table = markdown([outcome])
        assert "|Toy count|" in table.splitlines()[0] and f"{QUESTIONS} counted" in table
        assert f"toy {QUESTIONS}/{QUESTIONS} questions, catches a missing question" in table
        path = tmp_path / "junit.xml"
        path.write_text(junit_xml([outcome], "cpu", []))
        (suite,) = JUnitXml.fromfile(str(path))
        props = {p.name: p.value for p in suite.properties()}
        assert (
            props["toy.counted"] == str(QUESTIONS)
            and props["evidence.toy_check"] == f"{QUESTIONS}/20 questions"
        )
        # compare
        (folder / "samples.jsonl").write_text(
            "".join(
                json.dumps({"doc_id": i, "filter": "strict-match", "exact_match": 1, "resps": [["4"]]}) + "\n"
                for i in range(QUESTIONS)
            )
        )
        _, rows = table_rows([load_run(record.path)])
        assert ["toy", "", "counted", str(QUESTIONS)] in rows
    # gone with the test: nothing of it stays registered
    assert all(c.name != "toy_check" for c in judge(config, measured(config)).checks)
    assert "toy" not in results_schema()["properties"]


def _thin(config, m, out):
    out.checks.append(Check.judged("toy_check", True, "x", Evidence("question", 3, QUESTIONS)))


def test_the_toy_gates_floor_makes_a_thin_pass_not_run():
    config = dataclasses.replace(load_config(TORCH_TP1), num_questions=QUESTIONS)
    with registered(dataclasses.replace(TOY, rule=_thin)):
        got = judge(config, measured(config))
    check = next(c for c in got.checks if c.name == "toy_check")
    assert check.status == "not_run" and check.detail.startswith(
        f"not run: judged 3 of {QUESTIONS} questions"
    )
    assert got.verdict == "incomplete"


def test_the_toy_gates_keys_are_read_from_the_yaml_while_it_is_registered():
    """Its keys sit flat in the YAML beside the run's, validated by its own type (file, key and value named),
    ask for the gate, set its floor's share, and are results.json's config like every key; unregistered, they
    are unknown keys."""
    base = load_config(TORCH_TP1)

    def parsed(extra: str):
        return dataclasses.replace(parse_config(base.path, base.text + extra), num_questions=QUESTIONS)

    with registered(dataclasses.replace(TOY, rule=_thin)):
        assert "toy" not in describe_plan(parsed("toy_gate: false\n"), has_incumbent=True)
        assert "toy" in describe_plan(parsed(""), has_incumbent=True)
        lenient = parsed("toy_min_share: 0.1\n")  # 3 of 20 questions is enough now
        assert lenient.keys(ToyKeys).toy_min_share == 0.1 and lenient.resolved()["toy_min_share"] == 0.1
        check = next(c for c in judge(lenient, measured(lenient)).checks if c.name == "toy_check")
        assert check.status == "passed"
        with pytest.raises(ConfigError) as err:
            parsed("toy_min_share: 2\n")
        assert f"{base.path}: key 'toy_min_share': value 2 must be above 0.0 and at most 1.0" in str(
            err.value
        )
    with pytest.raises(ConfigError, match="unknown key 'toy_gate'"):
        parsed("toy_gate: true\n")
