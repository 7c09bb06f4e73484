"""JUnit XML against a schema and a real consumer (junitparser); compare's tables and refusals."""

import json
import re
import shutil
from pathlib import Path

import pytest
from lxml import etree

from moe_eval.configs.config import parse_config
from moe_eval.core.check import Check
from moe_eval.core.errors import ConfigError
from moe_eval.gates.accuracy import GateResult
from moe_eval.report.compare import group_runs, markdown
from moe_eval.report.junit import junit_xml
from moe_eval.runner import ConfigOutcome

XSD = Path(__file__).with_name("junit.xsd")
CONFIG = "model_name: m\naccuracy_threshold: 0.8\nnum_questions: 10\nnum_fewshot: 5\n"


def _outcome(tmp_path: Path, name: str, status: str) -> ConfigOutcome:
    config = parse_config(tmp_path / "fam" / f"{name}.yaml", CONFIG)
    run_dir = tmp_path / "run" / name
    run_dir.mkdir(parents=True)
    (run_dir / "server.log").write_text("INFO line 1\nERROR: engine died\n")
    outcome = ConfigOutcome(
        config=config,
        run_dir=run_dir,
        status=status,
        moe_backend_used="bundled:torch",
        timings={"total_seconds": 12.5},
    )
    if status == "error":
        outcome.error = "vLLM server exited with code 1 before it was ready"
        return outcome
    acc = 0.9 if status == "passed" else 0.5
    gate = GateResult(accuracy=acc, stderr=0.05, threshold=0.8, tolerance=0.08)
    outcome.judged["gate"] = gate.as_dict()
    outcome.checks = [Check.judged("accuracy_gate", gate.passed, gate.describe())]
    return outcome


def test_junit_validates_and_a_real_consumer_reads_it(tmp_path):
    from junitparser import Error, Failure, JUnitXml

    outcomes = [
        _outcome(tmp_path, "Good-BF16-torch", "passed"),
        _outcome(tmp_path, "Bad-BF16-torch", "failed"),
        _outcome(tmp_path, "Broken-BF16-torch", "error"),
    ]
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
    assert (
        props["moe_backend_used"] == "bundled:torch"
        and props["layout"] == "TP (TP1)"
        and props["version.lm-eval"]
    )
    assert doc.get("tests") == "3" and doc.get("failures") == "1" and doc.get("errors") == "1"


def test_junit_carries_the_speed_gates_worst_range_and_how_many_ranges_it_judged(tmp_path):
    from junitparser import JUnitXml

    from moe_eval.core.moe_timing import RangeTiming, SizeTiming, TimingSummary
    from moe_eval.gates.speed import Margins, speed_check

    def timing(*means: float) -> TimingSummary:
        sizes = (("M=1", 1, True), ("M=2-16", 8, True), ("M>=4096", 8192, False))
        # a mean of 0 stands for an eager range timed in too few calls to judge
        ranges = []
        for (name, m, replayed), us in zip(sizes, means, strict=True):
            n = 100 if us else 3
            size = SizeTiming(m, n, us or 5.0, 0.0, n if replayed else 0)
            ranges.append(RangeTiming(name, n, n * m, us or 5.0, 0.0, 1.0, size.replayed,
                                      0.0 if replayed else 1.0, (size,), n))  # fmt: skip
        return TimingSummary(1, ("device",), ("s",), ("triton",), tuple(ranges))

    outcome = _outcome(tmp_path, "Slow-BF16-torch", "failed")
    check, outcome.judged["speed"] = speed_check(
        timing(10.0, 30.0, 0), timing(10.0, 20.0, 0), Margins(0.01, 0.03), "vllm", "other"
    )
    outcome.checks.append(check)
    path = tmp_path / "junit.xml"
    path.write_text(junit_xml([outcome], "h200", ["NVIDIA H200"]))
    (suite,) = JUnitXml.fromfile(str(path))
    props = {p.name: p.value for p in suite.properties()}
    assert props["speed.worst_ratio"] == "1.5" and props["speed.worst_range"] == "M=2-16"
    assert props["speed.judged"] == "2/3" and props["speed.reference"] == "vllm"
    assert props["speed.reference_cards"] == "other"  # a --baseline from another machine's GPUs says so
    assert props["evidence.speed_gate"] == "2/3 dispatch ranges" and props["speed.would_catch"].startswith(
        "x1.0"
    )
    case = next(iter(suite))
    assert "speed_gate" in case.result[0].type
    assert not props.get("speed.hidden_under_lead")  # nothing hidden: empty
    # a row faster than its reference at M=1 passes there, and says a slowdown would hide under that lead
    outcome = _outcome(tmp_path, "Fast-BF16-torch", "passed")
    check, outcome.judged["speed"] = speed_check(
        timing(8.0, 20.0, 0), timing(10.0, 20.0, 0), Margins(0.01, 0.03), "vllm", "same"
    )
    outcome.checks.append(check)
    path.write_text(junit_xml([outcome], "h200", ["NVIDIA H200"]))
    (suite,) = JUnitXml.fromfile(str(path))
    props = {p.name: p.value for p in suite.properties()}
    assert props["speed.hidden_under_lead"] == "M=1"


def _write_run(
    root: Path,
    run: str,
    config: str,
    model: str,
    backend: str,
    layout: str,
    correct: list[bool],
    fewshot: int = 5,
    status: str = "passed",
    **extra,
) -> Path:
    """A finished run's folder; `extra` goes into results.json as is (mutation, golden, ...)."""
    d = root / run / "fam" / config
    d.mkdir(parents=True)
    acc = sum(correct) / len(correct)
    record = {
        "status": status,
        "config": {"model_name": model, "num_fewshot": fewshot},
        "layout": {"describe": layout},
        "moe_backend_used": backend,
        "samples": "samples.jsonl",
        "scores": {
            "strict-match": {"accuracy": acc, "stderr": 0.01},
            "flexible-extract": {"accuracy": acc, "stderr": 0.01},
        },
    } | extra
    (d / "results.json").write_text(json.dumps(record))
    lines = [
        {"doc_id": i, "filter": f, "exact_match": float(c)}
        for i, c in enumerate(correct)
        for f in ("strict-match", "flexible-extract")
    ]
    (d / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def _row(table: str, title: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"|{title}|"))


def _cells(table: str, title: str) -> list[str]:
    """The run columns' cells of one row (a pipe inside a cell is escaped as \\|)."""
    return re.split(r"(?<!\\)\|", _row(table, title))[4:-1]


def test_compare_puts_backends_side_by_side_with_flips(tmp_path):
    _write_run(
        tmp_path, "r1", "Q-BF16-triton", "Qwen", "bundled:triton", "TP (TP2)", [True] * 8 + [False] * 2
    )
    _write_run(
        tmp_path,
        "r2",
        "Q-BF16-fi-cutlass",
        "Qwen",
        "bundled:flashinfer_cutlass",
        "TEP (TP2 EP2)",
        [True] * 7 + [False] * 2 + [True],
    )
    table = markdown(group_runs([tmp_path / "r1", tmp_path / "r2"]))
    assert "### Qwen: GSM8K, 10 questions, 5-shot" in table
    assert "|Filter|n-shot|Metric|bundled:triton TP (TP2)|bundled:flashinfer_cutlass TEP (TP2 EP2)|" in table
    assert "|strict-match|5|exact_match|0.8000 ± 0.0100|0.8000 ± 0.0100|" in table
    assert "|flips vs bundled:triton TP (TP2)||strict-match|reference|1 right->wrong, 1 wrong->right" in table


@pytest.mark.parametrize(
    "second, message",
    [
        ({"fewshot": 3}, "few-shot counts differ"),
        ({"correct": [True] * 9}, "question sets differ"),
        ({"model": "Mixtral"}, "has one result"),
    ],
)
def test_compare_refuses_mismatches(tmp_path, second, message):
    _write_run(tmp_path, "r1", "Q-BF16-triton", "Qwen", "bundled:triton", "TP (TP2)", [True] * 10)
    kwargs = {"model": "Qwen", "correct": [True] * 10, "fewshot": 5} | second
    _write_run(
        tmp_path,
        "r2",
        "Q-BF16-fi-cutlass",
        kwargs["model"],
        "bundled:flashinfer_cutlass",
        "TEP",
        kwargs["correct"],
        fewshot=kwargs["fewshot"],
    )
    with pytest.raises(ConfigError, match=message):
        group_runs([tmp_path / "r1", tmp_path / "r2"])


def test_compare_refuses_missing_inputs_and_errored_only(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        group_runs([tmp_path / "nope"])
    _write_run(tmp_path, "r1", "Q", "Qwen", "x", "TP", [True], status="error")
    with pytest.raises(ConfigError, match="no finished results"):
        group_runs([tmp_path / "r1"])


def test_compare_shows_the_log_probability_divergence_against_the_first_run(tmp_path):
    from moe_eval.core.logprob_texts import TextLogprobs, write_logprobs

    def texts(shift: float) -> list[TextLogprobs]:
        # Two texts of 3 positions; position 0 has no log-probability. `shift` moves every reference token.
        return [
            TextLogprobs(
                i,
                (5, 6, 7),
                (None, -1.0 - shift, -2.0 - shift),
                (None, (6, 9), (7, 9)),
                (None, (-1.0 - shift, -3.0), (-2.0 - shift, -3.0)),
            )
            for i in range(2)
        ]

    for run, shift in (("r1", 0.0), ("r2", 0.25)):
        _write_run(tmp_path, run, "Q-BF16-triton", "Qwen", "bundled:triton", "TP (TP1)", [True] * 4)
        write_logprobs(tmp_path / run / "fam" / "Q-BF16-triton" / "logprobs.jsonl", texts(shift))
    _write_run(
        tmp_path, "r3", "Q-BF16-triton", "Qwen", "bundled:triton", "TP (TP1)", [True] * 4
    )  # scored nothing
    table = markdown(group_runs([tmp_path / "r1", tmp_path / "r2", tmp_path / "r3"]))
    # No vLLM column: the first is the reference (the same kernel and layout thrice: told apart by run).
    row = _row(table, "Δ log p vs bundled:triton TP (TP1) [r1]")
    assert row == (
        "|Δ log p vs bundled:triton TP (TP1) [r1]||mean, top-1 changed|reference|0.2500 mean, 0.00% top-1|-|"
    )


def _texts(shift: float, first_token: int = 5):
    from moe_eval.core.logprob_texts import TextLogprobs

    # Two texts of 3 positions; position 0 has no log-probability. `shift` moves every reference token, so a
    # run's mean |Δ log p| against the unshifted golden is |shift|.
    return [
        TextLogprobs(
            i,
            (first_token, 6, 7),
            (None, -1.0 - shift, -2.0 - shift),
            (None, (6, 9), (7, 9)),
            (None, (-1.0 - shift, -3.0), (-2.0 - shift, -3.0)),
        )
        for i in range(2)
    ]


def _golden(root: Path, digest: str, shift: float = 0.0) -> dict:
    from moe_eval.core.logprob_texts import write_logprobs

    folder = root / "goldens" / digest
    folder.mkdir(parents=True)
    write_logprobs(folder / "prefill.jsonl", _texts(shift))
    return {"digest": digest, "path": str(folder), "made_now": False}


def _scored_run(
    root: Path, run: str, backend: str, layout: str, shift: float | None, correct=None, **extra
) -> None:
    from moe_eval.core.logprob_texts import write_logprobs

    d = _write_run(root, run, "Q-BF16", "Qwen", backend, layout, correct or [True] * 4, **extra)
    if shift is not None:  # None: the run scored no texts
        write_logprobs(d / "logprobs.jsonl", _texts(shift))


def test_compare_reference_defaults_to_the_vllm_column_wherever_it_stands(tmp_path):
    golden = _golden(tmp_path, "a" * 24)
    _scored_run(tmp_path, "r1", "bundled:triton", "TP (TP1)", 0.03, [True, True, False, False], golden=golden)
    _scored_run(tmp_path, "r2", "vllm:TRITON", "TP (TP1)", 0.02, [True, True, True, False], golden=golden)
    # r3 names no golden: all runs of one model and texts share it, so it is measured with the group's.
    _scored_run(tmp_path, "r3", "bundled:torch", "TP (TP1)", 0.01)
    table = markdown(group_runs([tmp_path / "r1", tmp_path / "r2", tmp_path / "r3"]))
    # Columns stay in input order; only the reference moves.
    assert "|Metric|bundled:triton TP (TP1)|vllm:TRITON TP (TP1)|bundled:torch TP (TP1)|" in table
    flips = _cells(table, "flips vs vllm:TRITON TP (TP1)")
    assert flips[1] == "reference"  # and the others' flips are counted from the reference's side
    assert flips[0].startswith("1 right->wrong, 0 wrong->right") and flips[2].startswith("0 right->wrong, 1 ")
    assert _row(table, "Δ log p vs vllm:TRITON TP (TP1)") == (
        "|Δ log p vs vllm:TRITON TP (TP1)||mean, top-1 changed|0.0100 mean, 0.00% top-1|reference|"
        "0.0100 mean, 0.00% top-1|"
    )
    assert _row(table, "error vs golden") == (
        "|error vs golden||mean \\|Δ log p\\|, x reference|0.0300 (x1.50)|0.0200 (reference)|0.0100 (x0.50)|"
    )


@pytest.mark.parametrize(
    "reference, title, ref_column",
    [
        ("first", "bundled:triton TP (TP1)", 0),
        ("3", "bundled:torch TEP (TP2 EP2)", 2),
        ("torch", "bundled:torch TEP (TP2 EP2)", 2),
        ("vllm", "vllm:TRITON TP (TP1)", 1),
    ],
)
def test_compare_reference_can_be_first_a_number_or_part_of_a_label(tmp_path, reference, title, ref_column):
    golden = _golden(tmp_path, "a" * 24)
    _scored_run(tmp_path, "r1", "bundled:triton", "TP (TP1)", 0.04, golden=golden)
    _scored_run(tmp_path, "r2", "vllm:TRITON", "TP (TP1)", 0.02, golden=golden)
    _scored_run(tmp_path, "r3", "bundled:torch", "TEP (TP2 EP2)", 0.01, golden=golden)
    table = markdown(group_runs([tmp_path / "r1", tmp_path / "r2", tmp_path / "r3"]), reference)
    flips = _cells(table, f"flips vs {title}")
    assert [i for i, cell in enumerate(flips) if cell == "reference"] == [ref_column]
    assert _cells(table, f"Δ log p vs {title}")[ref_column] == "reference"
    errors = _cells(table, "error vs golden")
    base = (0.04, 0.02, 0.01)[ref_column]
    assert errors == [
        f"{e:.4f} (reference)" if i == ref_column else f"{e:.4f} (x{e / base:.2f})"
        for i, e in enumerate((0.04, 0.02, 0.01))
    ]


@pytest.mark.parametrize(
    "reference, message",
    [
        ("cutlass", "--reference 'cutlass' matches no column of Qwen"),
        ("bundled", "--reference 'bundled' matches 2 columns of Qwen"),
        ("4", "--reference 4: Qwen has columns 1 to 3"),
        ("0", "--reference 0: Qwen has columns 1 to 3"),
    ],
)
def test_compare_refuses_a_reference_that_names_no_single_column(tmp_path, reference, message):
    for run, backend in (("r1", "bundled:triton"), ("r2", "vllm:TRITON"), ("r3", "bundled:torch")):
        _scored_run(tmp_path, run, backend, "TP (TP1)", None)
    groups = group_runs([tmp_path / "r1", tmp_path / "r2", tmp_path / "r3"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        markdown(groups, reference)


def test_compare_cli_takes_reference_and_exits_4_naming_a_bad_one(tmp_path):
    from tests.conftest import run_cli

    _scored_run(tmp_path, "r1", "bundled:triton", "TP (TP1)", None)
    _scored_run(tmp_path, "r2", "vllm:TRITON", "TP (TP1)", None)
    runs = [str(tmp_path / "r1"), str(tmp_path / "r2")]
    good = run_cli(["compare", "--format", "markdown", "--reference", "1", *runs])
    assert good.returncode == 0, good.stderr
    assert "|flips vs bundled:triton TP (TP1)||strict-match|reference|" in good.stdout
    bad = run_cli(["compare", "--format", "markdown", "--reference", "cutlass", *runs])
    assert bad.returncode == 4 and "--reference 'cutlass' matches no column" in bad.stderr and not bad.stdout


def test_compare_marks_mutated_runs_in_their_labels(tmp_path):
    _write_run(tmp_path, "r1", "Q", "Qwen", "bundled:triton", "TP (TP1)", [True] * 4)
    _write_run(
        tmp_path, "r2", "Q", "Qwen", "bundled:triton", "TP (TP1)", [True] * 4, mutation="scale_one_expert"
    )
    _write_run(tmp_path, "r3", "Q", "Qwen", "bundled:triton", "TP (TP1)", [True] * 4, mutation=None)
    table = markdown(group_runs([tmp_path / "r1", tmp_path / "r2"]))
    assert "|bundled:triton TP (TP1)|bundled:triton TP (TP1) [mutated: scale_one_expert]|" in table
    # The same kernel and layout twice still gets the run to tell the columns apart, after the mark.
    _write_run(
        tmp_path, "r4", "Q", "Qwen", "bundled:triton", "TP (TP1)", [True] * 4, mutation="scale_one_expert"
    )
    table = markdown(group_runs([tmp_path / "r2", tmp_path / "r4", tmp_path / "r3"]))
    assert (
        "|bundled:triton TP (TP1) [mutated: scale_one_expert] [r2]|bundled:triton TP (TP1) [mutated: "
        "scale_one_expert] [r4]|bundled:triton TP (TP1) [r3]|"
    ) in table


def test_compare_golden_row_other_golden_missing_and_unscored(tmp_path):
    golden, other = _golden(tmp_path, "a" * 24), _golden(tmp_path, "b" * 24)
    _scored_run(tmp_path, "r1", "vllm:TRITON", "TP (TP1)", 0.02, golden=golden)
    _scored_run(tmp_path, "r2", "bundled:triton", "TP (TP1)", 0.03, golden=other)  # another golden's run
    _scored_run(tmp_path, "r3", "bundled:torch", "TP (TP1)", None, golden=golden)  # scored no texts
    _scored_run(tmp_path, "r4", "bundled:fi", "TP (TP1)", 0.01)
    d = _write_run(tmp_path, "r5", "Q-BF16", "Qwen", "bundled:x", "TP (TP1)", [True] * 4)
    from moe_eval.core.logprob_texts import write_logprobs

    write_logprobs(d / "logprobs.jsonl", _texts(0.0, first_token=8))  # other tokens than the golden's
    runs = [tmp_path / r for r in ("r1", "r2", "r3", "r4", "r5")]
    row = _cells(markdown(group_runs(runs)), "error vs golden")
    assert row == ["0.0200 (reference)", "other golden", "-", "0.0100 (x0.50)", "not comparable"]
    # The reference names the other golden: its digest is the one measured against, the first's is "other".
    row = _cells(markdown(group_runs(runs), "2"), "error vs golden")
    assert row == ["other golden", "0.0300 (reference)", "-", "0.0100 (x0.33)", "not comparable"]
    # The golden folder is gone (results copied from another machine): said so, not a crash.
    shutil.rmtree(golden["path"])
    row = _cells(markdown(group_runs(runs)), "error vs golden")
    assert row == ["golden missing", "other golden", "-", "golden missing", "golden missing"]


def test_compare_golden_row_is_dashes_without_any_golden(tmp_path):
    _scored_run(tmp_path, "r1", "vllm:TRITON", "TP (TP1)", 0.02)
    _scored_run(tmp_path, "r2", "bundled:triton", "TP (TP1)", 0.03)
    assert _cells(markdown(group_runs([tmp_path / "r1", tmp_path / "r2"])), "error vs golden") == ["-", "-"]


def test_compare_rich_table_keeps_the_bracketed_marks(tmp_path, capsys, monkeypatch):
    from moe_eval.report.compare import print_rich

    monkeypatch.setenv("COLUMNS", "300")  # one line per row, so the marks are not wrapped apart
    _write_run(tmp_path, "r1", "Q", "Qwen", "bundled:triton", "TP (TP1)", [True] * 4, mutation="zero_expert")
    _write_run(tmp_path, "r2", "Q", "Qwen", "vllm:TRITON", "TP (TP1)", [True] * 4)
    print_rich(group_runs([tmp_path / "r1", tmp_path / "r2"]))
    out = capsys.readouterr().out
    assert "bundled:triton TP (TP1) [mutated: zero_expert]" in out and "flips vs vllm:TRITON TP (TP1)" in out


def test_a_random_weights_row_reads_n_a_never_a_passing_zero(tmp_path):
    from moe_eval.report.table import markdown as run_table

    config = parse_config(
        tmp_path / "twins" / "Twin-BF16-triton.yaml",
        "model_name: builtin:twin-qwen3-30b-a3b\nrandom_weights: true\nnum_questions: 8\n"
        "num_fewshot: 5\nmoe_backend: triton\n",
    )
    outcome = ConfigOutcome(
        config=config,
        run_dir=tmp_path,
        status="passed",
        moe_backend_used="bundled:triton",
        scores={
            "strict-match": {"accuracy": 0.0, "stderr": 0.0},
            "flexible-extract": {"accuracy": 0.0, "stderr": 0.0},
        },
        checks=[Check.judged("golden_gate", True, "ratio 0.99")],
    )
    strict = next(line for line in run_table([outcome]).splitlines() if "strict-match" in line).split("|")
    assert strict[7:10] == ["n/a", "±", "n/a"] and "0.0000" not in "|".join(strict) and strict[-2] == "PASS"


def test_compare_shows_a_layer_range_whose_ratio_is_null_as_infinite(tmp_path):
    """results.json writes an infinite ratio (an error against an exact incumbent) as null: compare read it
    with :.2f and raised TypeError (e49cc3c)."""
    from moe_eval.gates.layer_gate import compare_rows
    from moe_eval.report.compare import RunResult  # noqa: F401

    null = {"range": "M=1", "error": 2e-3, "incumbent_error": 0.0, "ratio": None}
    check = {"processes": 1, "ranges": [null]}
    run = RunResult(tmp_path, "m", "triton", 5, {}, "FAILED", {}, judged={"layer_check": check})
    rows = compare_rows([run.section("layer_check")], 0)
    assert rows[0] == ["layer error M=1", "", "RMS vs exact (x incumbent)", "2.00e-03 (xinf)"]


def test_the_evidence_cell_shows_each_gates_weakest_check_and_names_one_short_of_its_floor():
    from moe_eval.core.check import Check
    from moe_eval.core.evidence import Evidence
    from moe_eval.report.table import evidence_cell

    checks = [
        Check.judged(
            "accuracy_gate", True, "", Evidence("question", 200, 200, would_catch="a drop of 0.013")
        ),
        Check.judged("layer_check_ranges", True, "", Evidence("(range, rank) pool", 14, 14)),
        Check.judged(
            "layer_check_experts", True, "", Evidence("(range, expert) cell", 50, 56, 54, "a 1% error")
        ),
        Check.not_run("speed_gate", "not run: x", Evidence("dispatch range", 2, 6, 6, "x1.04")),
        Check.judged("served", True, ""),  # no evidence: not shown
    ]
    cell = evidence_cell(checks)
    assert cell == (
        "accuracy 200/200 questions, catches a drop of 0.013; "
        "layer_check 50/56 (range, expert) cells (layer_check_experts: 54 needed), catches a 1% error; "
        "speed 2/6 dispatch ranges (speed_gate: 6 needed), catches x1.04"
    )


def test_junit_properties_spell_booleans_as_ci_systems_read_them():
    import xml.etree.ElementTree as ET

    from moe_eval.report.junit import _properties

    root = ET.Element("testsuite")
    _properties(root, {"gated": True, "passed": False, "ratio": 1.05, "reason": None})
    values = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert values == {"gated": "true", "passed": "false", "ratio": "1.05", "reason": ""}
