"""The pure judge (moe_eval.gates.judge) from synthetic measurements: each gate passing, failing and not run,
the verdict's rule, and `moe-eval list` against the run's gates for every shipped config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from moe_eval.configs.config import load_config
from moe_eval.configs.selection import read_list, with_baselines
from moe_eval.core.check import Check, verdict
from moe_eval.core.errors import ConfigError
from moe_eval.core.logprob_texts import TextLogprobs
from moe_eval.gates.judge import Answers, GoldenRecord, Measurements, judge
from moe_eval.gates.layer_gate import summarize
from moe_eval.gates.measurements import IncumbentRow
from moe_eval.gates.registry import GATES, NOT_RUN_SUFFIX, describe_plan, gate_by_name
from tests.golden.test_golden_gate import capture
from tests.harness.test_layer_gate import LIMITS, _file

REPO = Path(__file__).resolve().parents[2]
TORCH_TP1 = REPO / "configs" / "canary-tp" / "Canary-Qwen3-MoE-BF16-torch.yaml"
QUESTIONS = 20


def _texts(seed: int, noise: float, texts: int = 16, positions: int = 60) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    golden = -np.abs(rng.normal(1.0, 0.5, size=(texts, positions)))
    return golden, golden + np.random.default_rng(seed).normal(0, noise, size=golden.shape)


def _decode(shift: float) -> list[TextLogprobs]:
    """Greedy continuations (every position generated): 8 texts of 12 tokens, the top-1 and a runner-up
    whose log p moves by `shift` (the greedy token's stays at 0, as it does in vLLM's 6 decimals)."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(8):
        runner_up = -np.abs(rng.normal(4.0, 1.0, size=12)) + shift * (1 + rng.random(12))
        tops = tuple(((1, 2), (0.0, float(v))) for v in runner_up)
        out.append(
            TextLogprobs(i, (1,) * 12, (0.0,) * 12, tuple(t[0] for t in tops), tuple(t[1] for t in tops))
        )
    return out


def measured(config, *, run_noise=0.02, answers_right=QUESTIONS, **changes) -> Measurements:
    """Everything a correct bundled row measures; `changes` replace fields."""
    golden, incumbent = _texts(1, 0.02)
    _, run = _texts(2, run_noise)
    probe = golden + np.random.default_rng(3).normal(0, 0.05, size=golden.shape)
    correct = {i: i < answers_right for i in range(QUESTIONS)}
    m = Measurements(
        moe_backend_used="bundled:torch",
        answers=Answers(
            {"strict-match": {"accuracy": answers_right / QUESTIONS, "stderr": 0.0}},
            QUESTIONS,
            {"questions": QUESTIONS, "empty": 0, "truncated": 0, "invalid": 0},
            correct,
        ),
        jit={"monitored_processes": 1, "count": 0, "kernels": [], "events": []},
        kernel_calls={"processes": 1, "calls": 100, "tokens": 1000, "counted_on": ["host"]},
        layer=summarize([_file()], LIMITS, 1),
        logprobs=capture(run),
        decode=_decode(0.0),
        incumbent=IncumbentRow(
            Path("/runs/vllm/results.json"),
            dict.fromkeys(range(QUESTIONS), True),
            Path("/runs/vllm/logprobs.jsonl"),
            "vllm:CPU",
            config.layout.describe(),
            Path("/runs/vllm/decode.jsonl"),
        ),
        incumbent_logprobs=capture(incumbent),
        incumbent_decode=_decode(0.0),
        golden=GoldenRecord("d" * 24, "/goldens/d", capture(golden), _decode(0.0), capture(probe), 0.05),
    )
    return dataclasses.replace(m, **changes)


@pytest.fixture(scope="module")
def config():
    return dataclasses.replace(load_config(TORCH_TP1), num_questions=QUESTIONS, accuracy_threshold=0.9)


def _by_name(judgement) -> dict[str, Check]:
    return {c.name: c for c in judgement.checks}


def test_a_correct_row_passes_every_gate_it_calls_for(config):
    got = judge(config, measured(config))
    assert got.verdict == "passed"
    assert all(c.ran and c.passed for c in got.checks)
    names = set(_by_name(got))
    for gate in ("served", "accuracy", "paired", "golden", "kernel_calls", "layer_check"):
        assert names & set(gate_by_name()[gate].checks), gate


def test_one_registry_each_gate_carries_its_rule_and_the_judge_follows_it(config, monkeypatch):
    """Issue 41: at 593f15d the judge looked each gate's function up by name in a second table
    (judge._JUDGES). Now the gate is one object; replacing a gate's rule in the registry changes what the
    judge does, and every gate has one."""
    import dataclasses as dc

    from moe_eval.gates.registry import gate_names

    assert tuple(g.name for g in GATES) == gate_names() and all(callable(g.rule) for g in GATES)

    def broken_layer_rule(config, m, out):
        return "a rule replaced in the registry"

    from moe_eval.gates import registry

    gates = [dc.replace(g, rule=broken_layer_rule) if g.name == "layer_check" else g for g in GATES]
    monkeypatch.setattr(registry, "GATES", gates)
    got = judge(config, measured(config))
    assert got.verdict == "incomplete"
    assert "a rule replaced in the registry" in _by_name(got)["layer_check" + NOT_RUN_SUFFIX].detail


@pytest.mark.parametrize(
    ("change", "failing"),
    [
        ({"answers_right": 10}, {"accuracy_gate", "paired_gate"}),
        ({"run_noise": 0.2}, {"golden_gate", "logprob_mean_abs"}),
        (
            {"kernel_calls": {"processes": 0, "calls": 0, "tokens": 0, "counted_on": []}},
            {"bundled_kernel_calls"},
        ),
        ({"layer": summarize([_file(ratio=1.6)], LIMITS, 1)}, {"layer_check_ranges"}),  # over 1 + 0.5
        ({"decode": _decode(0.3)}, {"golden_gate_decode"}),
        ({"answers": "garbage"}, {"max_empty_rate"}),
    ],
)
def test_each_gate_fails_on_its_own_measurement(config, change, failing):
    if change.get("answers") == "garbage":  # 5 of 20 answers empty, over the canary's max_empty_rate
        right = measured(config).answers
        change = {"answers": dataclasses.replace(right, stats=right.stats | {"empty": 5})}
    got = judge(config, measured(config, **change))
    failed = {c.name for c in got.checks if not c.passed}
    assert failing <= failed, failed
    assert got.verdict == "failed"


def test_the_jit_gate_fails_on_a_compile_and_on_an_unwatched_server(config):
    config = config.with_keys(max_jit_while_serving=0)
    jit = {"monitored_processes": 1, "count": 1, "kernels": ["k"], "events": []}
    assert not _by_name(judge(config, measured(config, jit=jit)))["jit_while_serving"].passed
    unwatched = {"monitored_processes": 0, "count": 0, "kernels": [], "events": []}
    got = judge(config, measured(config, jit=unwatched))
    # Issue 41: a monitor that never started could not measure: not run (incomplete, exit 6), not a
    # regression (at 593f15d: failed, exit 1).
    assert _by_name(got)["jit_while_serving"].status == "not_run" and got.verdict == "incomplete"
    assert _by_name(judge(config, measured(config)))["jit_while_serving"].passed


def _decode_from(first_token: int, matching: int) -> list[TextLogprobs]:
    """8 continuations of which `matching` start with `first_token` as the golden's do (the rest differ)."""
    return [
        dataclasses.replace(t, token_ids=(first_token if i < matching else 99,) + t.token_ids[1:])
        for i, t in enumerate(_decode(0.0))
    ]


def test_decode_that_shares_fewer_first_tokens_than_the_incumbent_fails_and_too_few_is_not_run(config):
    """Issue 41: when fewer than 2 continuations share a first token with the golden's the decode rule has
    nothing to compare, and at 593f15d the row passed with only `decode.skipped` said. A kernel that breaks
    decoding produces exactly that: fewer shared first tokens than the incumbent is a failure."""
    broken = judge(config, measured(config, decode=_decode_from(1, 1)))
    check = _by_name(broken)["golden_gate_decode"]
    assert check.status == "failed" and "1 of 8" in check.detail and broken.verdict == "failed"
    decode_record = broken.sections["golden_gate"]["decode"]  # a failure, never "skipped" beside it
    assert "skipped" not in decode_record and "fewer than the incumbent" in decode_record["failed"]
    both = judge(config, measured(config, decode=_decode_from(1, 1), incumbent_decode=_decode_from(1, 1)))
    assert _by_name(both)["golden_gate_decode"].status == "not_run" and both.verdict == "incomplete"
    none = judge(config, measured(config, decode=None))
    assert _by_name(none)["golden_gate_decode"].status == "not_run" and none.verdict == "incomplete"


def test_answers_that_could_not_be_counted_are_not_run_not_a_regression(config):
    """Issue 41: truncated answers with no token counts: at 593f15d the check failed (exit 1)."""
    right = measured(config).answers
    m = measured(config, answers=dataclasses.replace(right, stats=right.stats | {"truncated": None}))
    got = judge(config, m)
    assert _by_name(got)["max_truncated_rate"].status == "not_run" and got.verdict == "incomplete"


def test_the_judge_never_raises_a_gate_it_cannot_compute_is_not_run(config):
    """Issue 41: the paired check's ValueError (answers of other questions than the incumbent's) ended the
    row as an internal error at 593f15d, the other gates' verdicts lost."""
    other = dataclasses.replace(measured(config).incumbent, correctness={100 + i: True for i in range(5)})
    got = judge(config, measured(config, incumbent=other))
    assert _by_name(got)["paired_not_run"].status == "not_run"
    assert "could not be judged" in _by_name(got)["paired_not_run"].detail
    assert "paired_gate" not in _by_name(got) and _by_name(got)["golden_gate"].passed
    assert got.verdict == "incomplete"
    # Log-probabilities of other texts than the golden's: the golden gate not run, not an infra error.
    short = measured(config).logprobs[:3]
    got = judge(config, measured(config, logprobs=short))
    assert _by_name(got)["golden_not_run"].status == "not_run" and got.verdict == "incomplete"


def test_an_optional_gate_that_could_not_run_is_skipped_in_the_table_and_junit(config, tmp_path):
    """Issue 41: at 593f15d an optional gate not run printed a plain PASS and JUnit said skipped="0"."""
    from moe_eval.report.junit import junit_xml
    from moe_eval.report.table import _verdict
    from moe_eval.runner import ConfigOutcome

    got = judge(config, measured(config, golden=None), frozenset({"golden"}))
    assert got.verdict == "passed" and _by_name(got)["golden_not_run"].status == "skipped"
    outcome = ConfigOutcome(config, tmp_path, status=got.verdict, checks=got.checks)
    assert _verdict(outcome) == "PASS (skipped: golden_not_run)"
    xml = junit_xml([outcome], "cpu", [])
    assert 'skipped="1"' in xml and 'tests="2"' in xml and '<skipped message="not run (optional here)' in xml


@pytest.mark.parametrize(
    ("change", "not_run"),
    [
        (
            {"logprobs": None, "logprobs_skipped": "no scoring texts: hub unreachable"},
            {"golden", "divergence"},
        ),
        ({"incumbent_logprobs": None}, {"golden", "divergence"}),
        ({"golden": None}, {"golden"}),
        ({"layer": None}, {"layer_check"}),
        ({"kernel_calls": None}, {"kernel_calls"}),
        # No incumbent at all: the paired and divergence gates exist to compare with one and are not called
        # for; the golden gate is (the kernel asks for it) and cannot run.
        ({"incumbent": None, "incumbent_logprobs": None}, {"golden"}),
    ],
)
def test_a_gate_that_could_not_run_makes_the_verdict_incomplete_unless_optional(config, change, not_run):
    m = measured(config, **change)
    got = judge(config, m)
    skipped = {c.name for c in got.checks if not c.ran}
    assert skipped == {f"{gate}{NOT_RUN_SUFFIX}" for gate in not_run}, skipped
    assert all(not c.passed and c.detail.startswith("not run: ") for c in got.checks if not c.ran)
    assert got.verdict == "incomplete"
    optional = judge(config, m, frozenset(not_run))
    assert optional.verdict == "passed"
    assert all(c.passed and "optional" in c.detail for c in optional.checks if not c.ran)
    declared = dataclasses.replace(config, optional_gates=tuple(not_run))  # the config key, same effect
    assert judge(declared, m, frozenset(declared.optional_gates)).verdict == "passed"


def test_a_failure_outranks_a_gate_not_run(config):
    got = judge(config, measured(config, answers_right=10, golden=None))
    assert got.verdict == "failed"


def test_the_reason_a_gate_did_not_run_is_said(config):
    got = judge(config, measured(config, logprobs=None, logprobs_skipped="no scoring texts: hub unreachable"))
    assert "hub unreachable" in _by_name(got)["golden_not_run"].detail
    assert got.sections["golden_gate"] == {
        "skipped": _by_name(got)["golden_not_run"].detail[len("not run: ") :]
    }


def test_verdict_of_nothing_judged_is_not_a_pass():
    assert verdict([]) == "incomplete"
    assert verdict([Check.judged("a", True, "")]) == "passed"
    assert verdict([Check.judged("a", True, ""), Check.not_run("b_not_run", "not run: x")]) == "incomplete"
    assert verdict([Check.judged("a", False, ""), Check.not_run("b_not_run", "not run: x")]) == "failed"
    # Issue 41: a row whose every check was skipped (optional, could not measure) proved nothing: at 593f15d
    # it passed.
    only_skipped = Check.not_run("b_not_run", "not run (optional here): x").skipped()
    assert only_skipped.status == "skipped" and verdict([only_skipped]) == "incomplete"
    assert verdict([Check.judged("a", True, ""), only_skipped]) == "passed"
    statuses = [
        Check.judged("a", True, ""),
        Check.judged("a", False, ""),
        Check.not_run("b", ""),
        only_skipped,
    ]
    assert [c.status for c in statuses] == ["passed", "failed", "not_run", "skipped"]
    assert [c.as_dict()["status"] for c in statuses] == ["passed", "failed", "not_run", "skipped"]


def test_an_incumbent_row_is_judged_by_what_it_served(config):
    incumbent = dataclasses.replace(config, moe_backend=None, baseline_config=None)
    got = judge(incumbent, measured(incumbent, incumbent=None))
    assert got.checks[0].name == "served" and got.checks[0].passed
    assert {c.name for c in got.checks} <= {"served", "accuracy_gate", *gate_by_name()["garbage"].checks}
    assert got.verdict == "passed"
    short = dataclasses.replace(measured(incumbent, incumbent=None).answers, num_questions=3)  # of 20 asked
    assert judge(incumbent, measured(incumbent, incumbent=None, answers=short)).verdict == "failed"


def _shipped_lists() -> list[Path]:
    return sorted(REPO.glob("config-*.txt"))


def _listed_gates(list_path: Path, optional: tuple[str, ...]) -> list[list[str]]:
    """`moe-eval list`'s gates column for a list, as the CLI prints it (in process)."""
    from click.testing import CliRunner

    from moe_eval.cli import cli

    args = ["list", "--list", str(list_path), "--gsm8k-dir", str(REPO.parent / "shared" / "data" / "gsm8k")]
    args += [a for gate in optional for a in ("--optional-gate", gate)]
    result = CliRunner().invoke(cli, args, env={"MOE_EVAL_GSM8K_DIR": None})
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if not line.startswith("#")][1:]
    return [line.split("\t")[-1].split(",") for line in lines]


@pytest.mark.parametrize("optional", [(), ("golden", "divergence", "paired")], ids=["strict", "optional"])
@pytest.mark.parametrize("list_path", _shipped_lists(), ids=lambda p: p.name)
def test_list_and_run_name_the_same_gates_for_every_shipped_config(list_path, optional):
    """`moe-eval list` prints the plan from the table; the run's checks come from the judge over the same
    table: for every config of every shipped list, under the same options, the gates `list` names as
    running, not run or skipped are the ones the judge's checks say ran, were not run or were skipped."""
    if not (REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl").exists():
        pytest.skip("no local GSM8K copy for --gsm8k-dir")
    selected, dependencies, _ = with_baselines([load_config(p) for p in read_list(list_path)])
    check_to_gate = {name: gate.name for gate in GATES for name in gate.checks}
    for i, (config, listed) in enumerate(zip(selected, _listed_gates(list_path, optional), strict=True)):
        has_incumbent = i in dependencies
        # An incumbent with nothing scored (what the "not run" rows of a run with --baseline look like too).
        m = measured(config) if has_incumbent else measured(config, incumbent=None, incumbent_logprobs=None)
        got = judge(config, m, frozenset(optional) | frozenset(config.optional_gates))
        status = {"ran": set(), "not run": set(), "skipped": set()}
        for c in got.checks:
            key = "ran" if c.ran else "skipped" if c.status == "skipped" else "not run"
            status[key].add(check_to_gate.get(c.name) or c.name.removesuffix(NOT_RUN_SUFFIX))
        expected = {
            "ran": {name for name in listed if "(" not in name},
            "not run": {name.split("(")[0] for name in listed if "(not run:" in name},
            "skipped": {name.split("(")[0] for name in listed if "(skipped:" in name},
        }
        # A gate listed as running shows at least one check (garbage: one per limit set; divergence: one per
        # limit in force), and no gate the list leaves out appears.
        assert status == expected, (config.path, listed, got.checks)


@pytest.mark.parametrize("optional", [frozenset(), frozenset({"golden"})], ids=["strict", "optional"])
def test_with_a_baseline_every_config_plans_and_judges_its_incumbent_gates(optional):
    """`run --baseline` / `list --baseline`: every config has an incumbent; the plan and the judge agree."""
    for list_path in _shipped_lists():
        for config in [load_config(p) for p in read_list(list_path)]:
            listed = describe_plan(config, True, optional)
            got = judge(config, measured(config, golden=None), optional)
            golden_status = next((c.status for c in got.checks if c.name == "golden_not_run"), None)
            if "golden" in listed:
                assert golden_status == ("skipped" if optional else "not_run"), config.path
            assert all("(" not in name for name in listed), listed


def _timed(means_us: dict[str, float], calls: int = 100):
    """Graph-replayed ranges of one call size each (the range's lowest), `calls` calls of 1 % spread."""
    from moe_eval.core.moe_timing import RangeTiming, SizeTiming, TimingSummary
    from moe_eval.core.plugin_protocol import LAYER_RANGE_EDGES, layer_range_names

    low = dict(zip(layer_range_names(), LAYER_RANGE_EDGES, strict=True))
    ranges = tuple(
        RangeTiming(name, calls, calls, us, 0.01 * us, us, calls, 0.0,
                    (SizeTiming(low[name], calls, us, 0.01 * us, calls),), calls)
        for name, us in means_us.items()
    )  # fmt: skip
    return TimingSummary(1, ("device",), ("s",), ("triton",), ranges)


def test_the_speed_gate_is_a_gpus_and_judges_each_range_against_the_incumbents(config):
    from moe_eval.configs.config import effective_config
    from moe_eval.gates.speed import speed_gated

    assert not speed_gated(effective_config(config, None, None, "cpu")[0], True)  # the CPU: reported only
    gpu, _ = effective_config(config, None, None, "h200")
    assert speed_gated(gpu, True) and not speed_gated(config, True)  # absent: resolved from the hardware
    timed = _timed({"M=1": 10.0, "M=2-16": 11.0})
    incumbent = dataclasses.replace(measured(config).incumbent, speed=timed, machine="NVIDIA H200")
    m = measured(config, speed=timed, machine="NVIDIA H200", incumbent=incumbent)
    assert _by_name(judge(gpu, m))["speed_gate"].passed
    slower = dataclasses.replace(m, speed=_timed({"M=1": 10.0, "M=2-16": 14.0}))
    got = judge(gpu, slower)
    assert (
        got.verdict == "failed"
        and "M=2-16 x1.273 (graph-replayed, 1/1 sizes" in _by_name(got)["speed_gate"].detail
    )
    assert got.sections["speed"]["ranges"][1]["passed"] is False
    # What could not be compared is not run, never a pass: an untimed reference, another machine.
    for change, why in (
        ({"incumbent": dataclasses.replace(incumbent, speed=None)}, "holds no MoE timing"),
        ({"machine": "NVIDIA B200"}, "ran on NVIDIA H200, this row on NVIDIA B200"),
        ({"speed": None}, "were not timed"),
        # other requests (a reference from before the sweep's prompts changed): other routing, other means
        (
            {"workload": "0f3a"},
            "timed requests differ from this row's (workload not recorded there, 0f3a here",
        ),
    ):
        got = judge(gpu, dataclasses.replace(m, **change))
        assert got.verdict == "incomplete" and why in _by_name(got)["speed_not_run"].detail
    # A server that served FlashInfer untuned is named in the message (a setup problem that reads as a slow
    # kernel), whichever row it was; the verdict stays the times' own.
    untuned = "No FlashInfer autotune cache entries found.Falling back to default tactics. (1x)"
    for change, whose in (
        ({"speed_warnings": [untuned]}, "this row's"),
        ({"incumbent": dataclasses.replace(incumbent, speed_warnings=(untuned,))}, "the reference's"),
    ):
        for row, expected in ((m, "passed"), (slower, "failed")):
            got = judge(gpu, dataclasses.replace(row, **change))
            assert got.verdict == expected
            assert _by_name(got)["speed_gate"].detail.endswith(f"; {whose} server logged: {untuned}")
    assert "server logged" not in _by_name(judge(gpu, m))["speed_gate"].detail
    # No range judged: the not-run reason names each range's own why
    few = dataclasses.replace(m, speed=_timed({"M=1": 10.0, "M=2-16": 11.0}, calls=3))
    detail = _by_name(judge(gpu, few))["speed_not_run"].detail
    assert "no dispatch range could be judged: M=1: fewer than 12 calls per rank at sizes both rows" in detail


def test_a_sweep_the_prefix_cache_shortened_is_another_workload():
    """Two rows' times compare where their sweeps sent the same requests and the server computed them as
    sent: prompt tokens served from the prefix cache make shorter calls, so they are part of the identity."""
    from moe_eval.gates.speed import workload_identity

    assert workload_identity(None) is None and workload_identity({"requests": 3}) is None  # not recorded
    assert workload_identity({"fingerprint": "ab", "prefix_cache_hit_tokens": 0}) == "ab"
    assert workload_identity({"fingerprint": "ab", "prefix_cache_hit_tokens": None}) == "ab"  # stats off
    assert workload_identity({"fingerprint": "ab", "prefix_cache_hit_tokens": 32}) == (
        "ab with 32 prompt tokens from the prefix cache"
    )


def test_a_rule_that_breaks_is_its_gate_not_run_and_every_other_verdict_stands(config, monkeypatch):
    """The judge caught five exception types (e49cc3c): an AttributeError or IndexError in one rule lost every
    check of the row. Now any exception of a rule is that gate not run, with its type and message."""

    def broken(config, m, out):
        return [][1]  # IndexError

    from moe_eval.gates import registry

    gates = [dataclasses.replace(g, rule=broken) if g.name == "golden" else g for g in GATES]
    monkeypatch.setattr(registry, "GATES", gates)
    got = judge(config, measured(config, answers_right=QUESTIONS // 2))
    checks = _by_name(got)
    assert "IndexError" in checks["golden_not_run"].detail and checks["golden_not_run"].status == "not_run"
    assert checks["accuracy_gate"].status == "failed" and got.verdict == "failed"


def test_a_golden_that_could_not_be_made_leaves_a_measured_accuracy_regression_failed(config):
    """The golden server failed to start after the row's own evaluation (e49cc3c: the row ended "error",
    exit 3, its accuracy regression lost): the measurement's failure is the golden gate not run, and the
    row's verdict is its accuracy's."""
    from moe_eval.core.errors import InfraError
    from moe_eval.steps import measured_or_why

    def golden_server():
        raise InfraError("vLLM server exited with code 1 during startup")

    made, why = measured_or_why(golden_server, "the golden reference could not be made")
    assert made is None and why == (
        "the golden reference could not be made: InfraError: vLLM server exited with code 1 during startup"
    )
    m = measured(config, answers_right=QUESTIONS // 2, golden=None, not_measured={"golden": why})
    got = judge(config, m)
    assert got.verdict == "failed" and _by_name(got)["golden_not_run"].detail == f"not run: {why}"
    assert _by_name(got)["accuracy_gate"].status == "failed"
    with pytest.raises(ConfigError):  # a bad config still ends the row, as does a signal
        measured_or_why(lambda: (_ for _ in ()).throw(ConfigError("x")), "y")


def test_served_fails_where_fewer_questions_were_answered_than_asked(config):
    """e49cc3c compared two counts of the same samples (it could not fail): now the questions lm-eval scored
    against those asked of it."""
    m = measured(config)
    short = dataclasses.replace(m.answers, num_questions=QUESTIONS - 3, asked=QUESTIONS)
    check = _by_name(judge(config, dataclasses.replace(m, answers=short)))["served"]
    assert (
        not check.passed
        and check.detail == f"{QUESTIONS - 3} of {QUESTIONS} questions asked answered by the server"
    )
    full = dataclasses.replace(m.answers, asked=QUESTIONS)
    assert _by_name(judge(config, dataclasses.replace(m, answers=full)))["served"].passed
