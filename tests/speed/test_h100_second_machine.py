"""A second H100 (another machine than the first gated runs', 2026-12-06 13:12-13:24 UTC, code at ddbb264):
one more STAGE=power run of the twin and of the canary (docs/data/speed_h100/power-gated-{twin,canary}-2.json,
docs/perf.md "The speed gate on a second H100"), re-judged by the rule as it is now, alone and against the
first machine's runs (power-gated-{twin,canary}.json): the false alarms across machines, and the canary's
third run."""

from __future__ import annotations

import itertools

import pytest

from moe_eval.gates.speed import speed_check
from tests.speed import stored_power as stored
from tests.speed.stored_power import DECODE, EAGER, MARGINS, SLOWED, timing

ALL_RANGES = DECODE + EAGER


def _second(repo_root, model: str) -> list[dict]:
    return stored.stored_rows(repo_root, f"power-gated-{model}-2")


def _first(repo_root, model: str) -> list[dict]:
    return stored.stored_rows(repo_root, f"power-gated-{model}")


def test_the_top_up_has_every_range_of_the_twin_judged_in_every_comparison(repo_root):
    """Before the top-up counted a range by its most-called size (7f16df6), M>=4096 went unjudged in 2 of the
    first machine's 3 twin runs and M=1024-4095 in 1: too few matched calls."""
    rows = _second(repo_root, "twin")
    (bundled, repeat), (vllm,) = stored.correct(rows), stored.correct(rows, vllm=True)
    slowed = next(r for r in rows if r["mutation"] == SLOWED)
    for row, reference in ((bundled, vllm), (repeat, bundled), (slowed, bundled), (slowed, vllm)):
        judged = stored.ranges_judged(row, reference)
        assert all(judged[r].passed is not None for r in ALL_RANGES), (row["run"], reference["run"])


@pytest.mark.parametrize("model", ["twin", "canary"])
def test_the_slowdown_fails_every_range_and_a_repeat_passes_on_the_second_machine(repo_root, model):
    rows = _second(repo_root, model)
    slowed = next(r for r in rows if r["mutation"] == SLOWED)
    judged = stored.ranges_judged(slowed, stored.baseline(rows, slowed))
    assert all(judged[r].passed is False for r in ALL_RANGES), {r: j.ratio for r, j in judged.items()}
    assert all(1.09 <= judged[r].ratio <= 1.11 for r in EAGER)  # 10 % read as 10 %, the canary's too
    first, repeat = stored.correct(rows)
    check, _ = speed_check(timing(repeat), timing(first), MARGINS, first["run"])
    assert check is not None and check.passed


@pytest.mark.parametrize("model", ["twin", "canary"])
def test_correct_rows_pass_against_every_run_of_the_other_machine(repo_root, model):
    """The fresh-machine false-alarm runs: each correct bundled row of the second H100 against each of the
    first's (10 pairs on the twin, 6 on the canary). The twin's decode calls ran 1-3 % slower there (x1.013-
    1.028 against thresholds of x1.036-1.039), the canary's eager calls 2-5 % faster: the machines
    differ by more than one machine's servers do, and a baseline from another machine spends part of the
    gate's reach (docs/perf.md)."""
    offsets = []
    here, there = stored.correct(_second(repo_root, model)), stored.correct(_first(repo_root, model))
    for later, earlier in itertools.product(here, there):
        check, _ = speed_check(timing(later), timing(earlier), MARGINS, earlier["run"])
        assert check is not None and check.passed, (later["run"], earlier["run"])
        judged = stored.ranges_judged(later, earlier)
        offsets += [judged[r].ratio for r in DECODE]
    count = {"twin": 10, "canary": 6}[model]
    assert len(offsets) == count * len(DECODE)
    if model == "twin":
        assert 1.01 <= min(offsets) and max(offsets) <= 1.03
    else:
        assert 0.98 <= min(offsets) and max(offsets) <= 1.03


def test_over_three_canary_runs_decode_is_caught_in_11_of_12_ranges_and_eager_in_1_of_3_runs(repo_root):
    """The canary's 24-55 us eager calls: 10 % read x1.067-1.074 in the first machine's two runs (not caught)
    and x1.096-1.107 in the second's (caught). The spin itself reads x1.100-1.101 at 30 us calls whether the
    GPU idles before each call or not (benchmarks/device/slowdown_probe.py on the second H100): what the first
    runs lacked was their servers' calls running 2-3 % faster than their baselines'."""
    runs = [
        (row, rows)
        for rows in (_first(repo_root, "canary"), _second(repo_root, "canary"))
        for row in rows
        if row["mutation"] == SLOWED
    ]
    decode_caught, eager_caught = 0, []
    for row, rows in runs:
        judged = stored.ranges_judged(row, stored.baseline(rows, row))
        decode_caught += sum(judged[r].passed is False for r in DECODE)
        eager = [judged[r] for r in EAGER if judged[r].passed is not None]
        eager_caught.append(all(j.passed is False for j in eager))
    assert (len(runs), decode_caught, eager_caught) == (3, 11, [False, False, True])


def test_judged_as_other_cards_correct_rows_pass_and_a_5_percent_decode_slowdown_is_out_of_reach(repo_root):
    """What BETWEEN_CARDS costs, on these records: judged as a reference from other cards (as the gate now
    judges a --baseline whose results.json names other GPU UUIDs), the 16 cross-machine pairs of correct rows
    pass with decode thresholds of x1.078-1.081; the twin's 5 % decode slowdown on the second H100 reads
    x1.065-1.074 against the first H100's rows: not caught. Its 10 % eager slowdown, x1.11-1.135, fails in
    every comparison. For the gate's full reach the reference runs on the same cards."""
    from moe_eval.gates.speed import compare

    for model in ("twin", "canary"):
        here, there = stored.correct(_second(repo_root, model)), stored.correct(_first(repo_root, model))
        for later, earlier in itertools.product(here, there):
            check, section = speed_check(timing(later), timing(earlier), MARGINS, "first H100", "other")
            assert check is not None and check.passed and section["reference_cards"] == "other"
            judged = {r["range"]: r for r in section["ranges"]}
            assert all(1.077 <= judged[r]["fails_above"] <= 1.082 for r in DECODE)
    slowed = next(r for r in _second(repo_root, "twin") if r["mutation"] == SLOWED)
    for earlier in stored.correct(_first(repo_root, "twin")):
        judged = {r.range: r for r in compare(timing(slowed), timing(earlier), MARGINS, other_cards=True)}
        assert all(judged[r].passed and 1.06 <= judged[r].ratio <= 1.075 for r in DECODE)
        assert any(j.passed is False for r, j in judged.items() if r in EAGER)
