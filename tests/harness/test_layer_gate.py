"""The layer check's verdict from the processes' sums (gates/layer_gate.py): a table of cases, each check
passing, failing and not judged; plus the report's and compare's cells."""

from __future__ import annotations

import math

import pytest

from moe_eval.core.plugin_protocol import LAYER_RANGE_EDGES
from moe_eval.gates.layer_gate import (
    MIN_ROWS,
    LayerCheckLimits,
    layer_checks,
    reachable_ranges,
    summarize,
    summary_record,
)
from moe_eval.report.table import layer_cell

LIMITS = LayerCheckLimits(margin=0.25, scale_bound=0.005, z=5.0)
NR = len(LAYER_RANGE_EDGES)


def _record(rank=None, max_tokens=2048, rows=40, ratio=0.85, experts=None, skip=(), nonfinite=0):
    """One process's file: every range up to max_tokens sampled with `rows` rows, errors in `ratio`; experts
    {(range index, expert): (slots, scale, stderr[, incumbent's scale])} as the sums that give them (the
    difference's standard error taken equal to the scale's)."""
    range_sums, seen = [], []
    for i, low in enumerate(LAYER_RANGE_EDGES):
        if low > max_tokens or i in skip:
            range_sums.append([0.0] * 6)
            seen.append(0)
            continue
        sq_exact = 100.0
        sq_ref = sq_exact * 1e-5
        range_sums.append([rows / 4, rows, sq_ref * ratio**2, sq_exact, sq_ref, nonfinite])
        seen.append(rows)
    expert_sums = [{} for _ in range(NR)]
    for (i, expert), (slots, scale, stderr, *incumbent) in (experts or {}).items():
        b = 10.0
        inc = incumbent[0] if incumbent else 0.0
        expert_sums[i][str(expert)] = [slots, scale * b, b, (stderr * b) ** 2, inc * b, (stderr * b) ** 2]
    return {
        "rank": rank or {"tp_rank": 0, "tp_size": 1},
        "max_tokens": max_tokens,
        "counted_on": "host",
        "seen": seen,
        "range_sums": range_sums,
        "expert_sums": expert_sums,
    }


def _verdicts(records):
    return {c.name: c.passed for c in layer_checks(summarize(records), LIMITS)}


ALL_PASS = {"layer_check_coverage": True, "layer_check_ranges": True, "layer_check_experts": True}


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([_record()], ALL_PASS),  # a correct kernel: every range sampled, ratio 0.85, no expert off
        ([_record(ratio=1.24)], ALL_PASS),  # just under the margin
        ([_record(ratio=1.30)], ALL_PASS | {"layer_check_ranges": False}),  # over it
        (
            [_record(skip={5})],
            ALL_PASS | {"layer_check_coverage": False},
        ),  # M=1024-4095 reachable, not sampled
        ([_record(max_tokens=512)], ALL_PASS),  # a server whose calls stop at 512: nothing above is owed
        (
            [_record(rows=MIN_ROWS - 1, ratio=3.0)],
            ALL_PASS | {"layer_check_coverage": False},
        ),  # too few to judge
        ([_record(experts={(1, 0): (40, -0.0100, 0.0005)})], ALL_PASS | {"layer_check_experts": False}),
        ([_record(experts={(1, 0): (40, -0.0100, 0.0030)})], ALL_PASS),  # 3.3 standard errors: noise
        ([_record(experts={(1, 0): (40, -0.0040, 0.0001)})], ALL_PASS),  # significant but within the bound
        ([_record(experts={(1, 0): (19, -0.0500, 0.0001)})], ALL_PASS),  # 19 slots: not judged
        # Off by 32% but so is the incumbent's arithmetic on the same slots (rounding of a tiny share): pass.
        ([_record(experts={(0, 5): (40, -0.3175, 0.0709, -0.3175)})], ALL_PASS),
        # Off by 1% where the incumbent is off by 0.1%: the difference is 18 standard errors.
        (
            [_record(experts={(0, 5): (40, -0.0100, 0.0005, -0.0010)})],
            ALL_PASS | {"layer_check_experts": False},
        ),
        # Served values NaN where the exact MoE is finite: the range fails whatever its error ratio.
        ([_record(nonfinite=3)], ALL_PASS | {"layer_check_ranges": False}),
        ([], {"layer_check_coverage": False}),  # no process wrote sums: never a pass
    ],
)
def test_layer_checks_table(records, expected):
    assert _verdicts(records) == expected


def test_one_rank_off_fails_on_that_rank_even_when_the_pool_dilutes_it():
    """TP2 without EP: rank 1 holds half of the expert; its own cell shows the 1% while the pooled estimate
    (both ranks' sums) is near half of it."""
    rank0 = _record(rank={"tp_rank": 0, "tp_size": 2}, experts={(2, 7): (40, 0.0, 0.0003)})
    rank1 = _record(rank={"tp_rank": 1, "tp_size": 2}, experts={(2, 7): (40, -0.0100, 0.0003)})
    summary = summarize([rank0, rank1])
    cells = {(c.rank, c.expert): c for c in summary.experts}
    assert cells[("TP1/2", 7)].scale == pytest.approx(-0.01)
    assert cells[("all", 7)].scale == pytest.approx(-0.005)
    assert not {c.name: c.passed for c in layer_checks(summary, LIMITS)}["layer_check_experts"]


def test_reachable_ranges_follow_the_batched_token_limit():
    assert reachable_ranges(1) == ["M=1"]
    assert reachable_ranges(2048)[-1] == "M=1024-4095" and len(reachable_ranges(8192)) == NR


def test_the_record_and_the_report_cell_say_the_worst_range_and_the_largest_scale():
    summary = summarize([_record(ratio=0.9, experts={(3, 2): (20, -0.0012, 0.0002)})])
    record = summary_record(summary, LIMITS)
    assert record["processes"] == 1 and record["limits"]["scale_bound"] == 0.005
    assert {r["range"] for r in record["ranges"]} == set(reachable_ranges(2048))
    assert record["expert_cells"][0]["scale"] == pytest.approx(-0.0012)
    assert layer_cell(record) == "x0.90 worst (M=1); |s| <= 0.0012"
    assert layer_cell(None) == "-"


def test_infinite_stderr_is_written_as_null():
    record = _record()
    record["expert_sums"][0]["3"] = [40, 0.0, 0.0, 0.0, 0.0, 0.0]  # b = 0: its slots all had weight 0
    out = summary_record(summarize([record]), LIMITS)
    cell = next(c for c in out["expert_cells"] if c["expert"] == 3)
    assert cell["stderr"] is None and not math.isnan(cell["scale"])


def test_compare_shows_each_backend_per_range_side_by_side(tmp_path):
    """`moe-eval compare`: a row per dispatch range with each run's error against the exact MoE (x its
    incumbent arithmetic's), then each run's largest expert scale; vLLM's own kernel runs no check ("-")."""
    from moe_eval.report.compare import RunResult, _layer_rows

    def run(label, check):
        return RunResult(tmp_path, "m", label, 5, {}, "PASSED", {}, layer_check=check)

    triton = summary_record(summarize([_record(ratio=1.0)]), LIMITS)
    mutated = summary_record(summarize([_record(ratio=1.7, experts={(5, 0): (40, -0.0101, 0.0005)})]), LIMITS)
    rows = {r[0]: r[3:] for r in _layer_rows([run("vllm", None), run("triton", triton), run("bug", mutated)])}
    assert rows["layer error M=1024-4095"][0] == "-"
    assert rows["layer error M=1024-4095"][1].endswith("(x1.00)") and rows["layer error M=1024-4095"][
        2
    ].endswith("(x1.70)")
    assert rows["layer expert scale"] == ["-", "-", "-0.0101 (expert 0, M=1024-4095)"]
    assert _layer_rows([run("vllm", None)]) == []
