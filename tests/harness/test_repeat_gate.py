"""The repeat check (gates/repeat.py): two scorings of the same texts compared bit for bit, reported for every
row, a verdict only where the config asks (repeat_gate: true)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from moe_eval.core.logprob_texts import TextLogprobs
from moe_eval.core.repeated_scoring import compare_scorings
from moe_eval.gates.judge import judge
from moe_eval.gates.registry import describe_plan, gate_by_name
from moe_eval.gates.repeat import repeat_cell, repeat_junit
from tests.harness.test_judge import config as config  # noqa: F401  the fixture
from tests.harness.test_judge import measured


def _scoring(seed: int = 0, texts: int = 4, positions: int = 30) -> list[TextLogprobs]:
    rng = np.random.default_rng(seed)
    out = []
    for index in range(texts):
        own = [None] + [float(-abs(v)) for v in rng.normal(1.0, 0.5, positions - 1)]
        tops = [None] + [(1, 2, 3) for _ in range(positions - 1)]
        top_lps = [None] + [
            tuple(float(-abs(v)) for v in rng.normal(2.0, 0.5, 3)) for _ in range(positions - 1)
        ]
        out.append(TextLogprobs(index, tuple(range(positions)), tuple(own), tuple(tops), tuple(top_lps)))
    return out


def _changed(scoring: list[TextLogprobs], text: int, position: int, **fields) -> list[TextLogprobs]:
    out = list(scoring)
    record = out[text]
    changes = {}
    for name, value in fields.items():
        values = list(getattr(record, name))
        values[position] = value
        changes[name] = tuple(values)
    out[text] = dataclasses.replace(record, **changes)
    return out


def test_the_same_bits_are_identical_and_every_position_is_counted():
    got = compare_scorings(_scoring(), _scoring())
    assert got["identical"] and got["texts"] == 4 and got["positions"] == 4 * 29
    assert got["differing_positions"] == 0 and got["max_abs_difference"] == 0.0
    assert "first_difference" not in got


def test_one_ulp_in_one_position_is_a_difference_named_where():
    first = _scoring()
    value = first[2].logprobs[7]
    again = _changed(first, 2, 7, logprobs=math.nextafter(value, 0.0))
    got = compare_scorings(first, again)
    assert not got["identical"] and got["differing_positions"] == 1 and got["differing_texts"] == 1
    assert got["first_difference"] == {
        "text": 2,
        "position": 7,
        "first": value,
        "again": again[2].logprobs[7],
    }
    assert 0 < got["max_abs_difference"] < 1e-15


def test_a_runner_up_alone_that_moves_or_swaps_is_a_difference():
    first = _scoring()
    moved = _changed(
        first, 0, 3, top_logprobs=(first[0].top_logprobs[3][0], -9.0, first[0].top_logprobs[3][2])
    )
    swapped = _changed(first, 1, 4, top_ids=(2, 1, 3))
    for again in (moved, swapped):
        got = compare_scorings(first, again)
        assert not got["identical"] and got["differing_positions"] == 1
        assert got["max_abs_difference"] == 0.0  # the text's own token's log p did not move


def test_scorings_of_other_texts_do_not_compare():
    with pytest.raises(ValueError, match="4 texts scored first, 3 the second time"):
        compare_scorings(_scoring(), _scoring()[:3])
    retokenized = _scoring()
    tokens = list(retokenized[1].token_ids)
    tokens[10] = 99  # tokenized otherwise from position 10 on
    retokenized[1] = dataclasses.replace(retokenized[1], token_ids=tuple(tokens))
    got = compare_scorings(_scoring(), retokenized)
    assert not got["identical"] and got["differing_texts"] == 1 and got["differing_positions"] == 20
    assert got["first_difference"] == {"text": 1, "position": 10, "first": None, "again": None}
    # One token: no position to compare, yet tokenized otherwise is not identical.
    one = [TextLogprobs(0, (5,), (None,), (None,), (None,))]
    other = [TextLogprobs(0, (6,), (None,), (None,), (None,))]
    assert compare_scorings(one, one)["identical"] and not compare_scorings(one, other)["identical"]


def test_infinite_and_nan_log_p_are_differences_without_an_infinite_size():
    """-inf against a number, NaN against a number, a value against None: each differs; the largest
    difference stays finite (results.json writes no infinity) and the table shows it."""
    first = _scoring()
    for changed in (float("-inf"), float("nan"), None):
        again = _changed(first, 0, 5, logprobs=changed)
        got = compare_scorings(first, again)
        assert not got["identical"] and got["differing_positions"] == 1
        assert got["max_abs_difference"] == 0.0 and math.isfinite(got["max_abs_difference"])
    nan_both = _changed(first, 0, 5, logprobs=float("nan"))
    assert compare_scorings(nan_both, nan_both)["identical"]  # alike: the divergence gate names NaNs
    no_size = got | {"max_abs_difference": None, "gated": True}  # a record's null read back
    assert repeat_cell(no_size, None) == "no: 1 of 116 positions differ"


def test_by_default_the_repeat_is_reported_never_a_verdict(config):
    differing = compare_scorings(_scoring(), _changed(_scoring(), 0, 1, logprobs=-50.0))
    got = judge(config, measured(config, repeat=differing))
    assert got.verdict == "passed" and not any(c.name.startswith("repeat") for c in got.checks)
    assert got.sections["repeat"]["gated"] is False and not got.sections["repeat"]["identical"]
    assert repeat_cell(got.sections["repeat"], None).startswith("report only: no: 1 of 116 positions differ")
    assert "repeat" not in describe_plan(config, True)


def test_a_second_scoring_that_failed_is_said_where_the_repeat_is_reported(config):
    why = "the texts' second scoring failed: ConnectionError: refused"
    got = judge(config, measured(config, not_measured={"repeat": why}))
    assert got.verdict == "passed"
    assert got.sections["repeat"] == {"skipped": f"the texts were not scored a second time: {why}"}
    assert repeat_cell(got.sections["repeat"], None).startswith("not measured: the texts were not scored")
    silent = config.with_keys(repeat_texts=False)  # not asked for: nothing to report
    assert "repeat" not in judge(silent, measured(silent)).sections


def test_repeat_gate_fails_a_row_whose_scores_differ_and_passes_one_whose_do_not(config):
    gated = config.with_keys(repeat_gate=True)
    assert "repeat" in describe_plan(gated, True)
    same = judge(gated, measured(gated, repeat=compare_scorings(_scoring(), _scoring())))
    check = {c.name: c for c in same.checks}["repeat_bit_identical"]
    assert same.verdict == "passed" and check.passed and check.evidence.judged == 4 * 29
    assert same.sections["repeat"]["gated"] is True
    differing = compare_scorings(_scoring(), _changed(_scoring(), 3, 9, logprobs=-50.0))
    failed = judge(gated, measured(gated, repeat=differing))
    check = {c.name: c for c in failed.checks}["repeat_bit_identical"]
    assert failed.verdict == "failed" and not check.passed
    assert "1 positions in 1 texts differ" in check.detail and "text 3 position 9" in check.detail


def test_repeat_gate_without_a_second_scoring_is_not_run_and_listed_so(config):
    gated = config.with_keys(repeat_gate=True)
    got = judge(gated, measured(gated))  # nothing scored twice
    assert got.verdict == "incomplete"
    assert {c.name: c.status for c in got.checks}["repeat_not_run"] == "not_run"
    unscored = gated.with_keys(repeat_texts=False)
    assert "repeat(not run: repeat_texts false)" in describe_plan(unscored, True)
    none = dataclasses.replace(gated, logprob_texts=0)
    assert "repeat(not run: logprob_texts 0)" in describe_plan(none, True)
    assert gate_by_name()["repeat"].checks == ("repeat_bit_identical",)


def test_the_table_and_junit_say_whether_it_repeated():
    same = compare_scorings(_scoring(), _scoring())
    differing = compare_scorings(_scoring(), _changed(_scoring(), 0, 1, logprobs=-50.0))
    assert repeat_cell(same, None) == "yes, 116 positions"
    assert repeat_cell(differing | {"gated": True}, None).startswith(
        "no: 1 of 116 positions differ (max |Δ log p| "
    )
    assert repeat_cell(None, None) == "-" and repeat_cell({"skipped": "why"}, None) == "not measured: why"
    assert repeat_junit(differing) == {
        "repeat.identical": False,
        "repeat.differing_positions": 1,
        "repeat.positions": 116,
        "repeat.gated": False,
    }
