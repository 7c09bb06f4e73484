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
    retokenized[1] = dataclasses.replace(retokenized[1], token_ids=(9,) * 30)
    got = compare_scorings(_scoring(), retokenized)
    assert got["differing_positions"] == 29 and got["first_difference"]["text"] == 1


def test_by_default_the_repeat_is_reported_never_a_verdict(config):
    differing = compare_scorings(_scoring(), _changed(_scoring(), 0, 1, logprobs=-50.0))
    got = judge(config, measured(config, repeat=differing))
    assert got.verdict == "passed" and not any(c.name.startswith("repeat") for c in got.checks)
    assert got.sections["repeat"]["gated"] is False and not got.sections["repeat"]["identical"]
    assert "repeat" not in describe_plan(config, True)


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
    assert repeat_cell(differing, None).startswith("no: 1 of 116 positions differ (max |Δ log p| ")
    assert repeat_cell(None, None) == "-" and repeat_cell({"skipped": "why"}, None) == "-"
    assert repeat_junit(differing) == {
        "repeat.identical": False,
        "repeat.differing_positions": 1,
        "repeat.positions": 116,
    }
