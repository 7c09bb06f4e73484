"""The speed gate's rule (gates/speed.py) on made-up timings: matched call sizes, the evidence it needs, what
it would catch, and what it never passes."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_eval.core.moe_timing import RangeTiming, SizeTiming, TimingSummary
from moe_eval.gates.speed import (
    BETWEEN_CARDS,
    BETWEEN_SERVERS_EAGER,
    BETWEEN_SERVERS_REPLAYED,
    EAGER_SPREAD_FACTOR,
    MIN_CALLS,
    SPEED_Z,
    Margins,
    compare,
    judge_range,
    speed_check,
)

MARGINS = Margins(replayed=0.01, eager=0.03)


def _as_judged(check):
    """The check as the judge leaves it: the speed gate's floor (every graph-replayed range either row
    reached) applied by gates/judge.on_floor, as for every gate."""
    from moe_eval.gates.judge import on_floor
    from moe_eval.gates.speed import GATE

    return on_floor(SimpleNamespace(), GATE, check)


def _range(name: str, sizes: dict[int, tuple[int, float, float, bool]], rank_calls: int | None = None):
    """sizes: per call size M its calls, mean us, spread us (one call's standard deviation), replayed."""
    cells = tuple(SizeTiming(m, n, mean, spread, n if replayed else 0) for m, (n, mean, spread, replayed) in
                  sorted(sizes.items()))  # fmt: skip
    calls = sum(s.calls for s in cells)
    time_us = sum(s.calls * s.mean_us for s in cells)
    replayed_us = sum(s.replayed * s.mean_us for s in cells)
    return RangeTiming(
        name, calls, sum(s.calls * s.tokens for s in cells), time_us / calls, 0.0, time_us / calls,
        sum(s.replayed for s in cells), round(1 - replayed_us / time_us, 4) if time_us else 0.0, cells,
        calls if rank_calls is None else rank_calls,
    )  # fmt: skip


def _timing(*ranges: RangeTiming, processes: int = 1) -> TimingSummary:
    return TimingSummary(processes, ("device",), ("s",), ("triton",), ranges)


def _decode(scale: float = 1.0, calls: int = 24) -> dict[str, dict]:
    """The Qwen3 twin's decode ranges as graph-replayed sizes (us per call on the H100), times `scale`."""
    return {
        "M=1": {1: (calls, 37.8 * scale, 0.5, True)},
        "M=2-16": {8: (calls, 150.0 * scale, 2.0, True), 16: (calls, 190.0 * scale, 2.5, True)},
        "M=17-64": {40: (calls, 280.0 * scale, 3.0, True), 48: (calls, 300.0 * scale, 3.0, True)},
        "M=65-256": {104: (calls, 330.0 * scale, 4.0, True), 112: (calls, 345.0 * scale, 4.0, True)},
    }


def _twin(scale: dict[str, float] | None = None, calls: int = 24) -> TimingSummary:
    scale = scale or {}
    ranges = []
    for name, sizes in _decode(calls=calls).items():
        f = scale.get(name, 1.0)
        ranges.append(_range(name, {m: (n, us * f, sd, r) for m, (n, us, sd, r) in sizes.items()}))
    prefill = {600: (calls, 700.0, 5.0, False), 900: (calls, 820.0, 6.0, False)}
    f = scale.get("M=257-1023", 1.0)
    ranges.append(_range("M=257-1023", {m: (n, us * f, sd, r) for m, (n, us, sd, r) in prefill.items()}))
    return _timing(*ranges)


def test_a_change_of_the_size_mix_alone_moves_no_ratio():
    """M=65-256's mean moved 12 % between rows of identical code on the H100 (the mix of sizes differed):
    size for size the same calls read x1.00, and the range passes."""
    reference = _range("M=65-256", {72: (8, 300.0, 3.0, True), 248: (40, 360.0, 3.0, True)})
    row = _range("M=65-256", {72: (40, 300.0, 3.0, True), 248: (8, 360.0, 3.0, True)})
    assert row.mean_us / reference.mean_us == pytest.approx(0.88, abs=0.01)  # the old rule's range means
    judged = judge_range(row, reference, MARGINS)
    assert judged.ratio == pytest.approx(1.0) and judged.passed and judged.sizes_matched == 2


def test_a_five_percent_decode_slowdown_fails_in_its_range_alone_and_a_correct_row_passes():
    check, section = speed_check(_twin(), _twin(), MARGINS, "ref")
    assert check.passed and section["judged"] == 5 and check.evidence.judged == check.evidence.total == 5
    for name in ("M=1", "M=2-16", "M=17-64", "M=65-256"):
        check, section = speed_check(_twin({name: 1.05}), _twin(), MARGINS, "ref")
        failed = [r["range"] for r in section["ranges"] if r["passed"] is False]
        assert not check.passed and failed == [name], (name, check.detail)
        assert section["worst_range"] == name and section["worst_ratio"] == pytest.approx(1.05)
    # what each graph-replayed range would catch: within the x1.05 at these evidence counts
    by = {r["range"]: r for r in section["ranges"]}
    assert all(by[n]["fails_above"] <= 1.05 for n in ("M=1", "M=2-16", "M=17-64", "M=65-256"))
    assert all(by[n]["replayed"] for n in ("M=1", "M=2-16", "M=17-64", "M=65-256"))
    # a GPU-bound eager range at real shapes: a 10 % slowdown fails there
    check, section = speed_check(_twin({"M=257-1023": 1.10}), _twin(), MARGINS, "ref")
    assert not check.passed and section["worst_range"] == "M=257-1023"
    assert {r["range"]: r for r in section["ranges"]}["M=257-1023"]["fails_above"] <= 1.10


def test_fails_above_is_the_margin_widened_by_the_errors_and_the_between_server_floor():
    one = _range("M=1", {1: (400, 40.0, 0.0, True)})
    judged = judge_range(one, one, MARGINS)
    # no within-run error: the floor alone, both rows drifting apart
    expected = 1.01 * math.exp(SPEED_Z * math.sqrt(2) * BETWEEN_SERVERS_REPLAYED)
    assert judged.fails_above == pytest.approx(expected, abs=1e-4) and judged.would_catch > judged.fails_above
    eager = _range("M>=4096", {8192: (400, 4000.0, 0.0, False)})
    judged = judge_range(eager, eager, MARGINS)
    assert judged.fails_above == pytest.approx(
        1.03 * math.exp(SPEED_Z * math.sqrt(2) * BETWEEN_SERVERS_EAGER), abs=1e-4
    )
    assert not judged.replayed


def test_a_launch_bound_eager_size_is_judged_with_its_own_spread_as_the_floor():
    """The canary's tiny layer: eager calls wait for the host's launches, spread ~20 % within a run and move
    20-30 % between servers. Its floor follows its spread, so a correct row passes at x1.3, and what the
    range would catch says how little it sees there."""
    reference = _range("M=257-1023", {600: (24, 500.0, 100.0, False)})
    row = _range("M=257-1023", {600: (24, 650.0, 130.0, False)})
    judged = judge_range(row, reference, MARGINS)
    assert judged.passed and judged.fails_above > 2.0
    assert judged.between_servers == pytest.approx(EAGER_SPREAD_FACTOR * 0.2)


def test_one_judged_range_of_seven_is_not_a_pass():
    """The graph-replayed ranges either row reached must be judged: a pass on the one eager range that was
    is the gate not run (the row incomplete), naming what it lacked."""
    few = {
        name: {m: (2, us, sd, r) for m, (_, us, sd, r) in sizes.items()} for name, sizes in _decode().items()
    }
    ranges = [_range(name, sizes) for name, sizes in few.items()]
    ranges.append(_range("M=257-1023", {600: (24, 700.0, 10.0, False)}))
    check, section = speed_check(_timing(*ranges), _timing(*ranges), MARGINS, "ref")
    check = _as_judged(check)
    assert check.status == "not_run" and not check.passed
    assert section["required_not_judged"] == ["M=1", "M=2-16", "M=17-64", "M=65-256"]
    assert check.evidence.judged == 1 and check.evidence.required == 5
    assert "fewer than 12 calls per rank" in check.detail
    # the same, with a judged range failing: the failure stands
    slow = [*ranges[:-1], _range("M=257-1023", {600: (24, 900.0, 10.0, False)})]
    check, _ = speed_check(_timing(*slow), _timing(*ranges), MARGINS, "ref")
    assert _as_judged(check).status == "failed"


def test_a_zero_or_missing_own_time_is_never_a_pass():
    reference = _twin()
    zero = _twin()
    ranges = [r if r.range != "M=1" else _range("M=1", {1: (24, 0.0, 0.0, True)}) for r in zero.ranges]
    check, section = speed_check(_timing(*ranges), reference, MARGINS, "ref")
    m1 = {r["range"]: r for r in section["ranges"]}["M=1"]
    assert m1["passed"] is None and m1["why_not"] == "this row's mean call is 0 us"
    assert _as_judged(check).status == "not_run"
    missing = [r for r in reference.ranges if r.range != "M=1"]
    check, section = speed_check(_timing(*missing), reference, MARGINS, "ref")
    assert _as_judged(check).status == "not_run" and section["required_not_judged"] == ["M=1"]
    assert {r["range"]: r for r in section["ranges"]}["M=1"]["why_not"] == "this row made no call there"
    # nothing timed at all: no check (the rule then says the gate was not run)
    check, _ = speed_check(_timing(), reference, MARGINS, "ref")
    assert check is None


def test_calls_count_per_rank_and_a_rank_without_calls_leaves_a_range_unjudged():
    """Per size, the slowest rank's own calls: four ranks of 4 calls are 4, not 16 (MIN_CALLS per rank)."""
    per_rank = {8: (4, 150.0, 2.0, True), 16: (4, 190.0, 2.5, True)}
    judged = judge_range(_range("M=2-16", per_rank), _range("M=2-16", per_rank), MARGINS)
    assert judged.passed is None and f"fewer than {MIN_CALLS} calls per rank" in judged.why_not
    enough = {8: (12, 150.0, 2.0, True)}
    judged = judge_range(_range("M=2-16", enough, rank_calls=0), _range("M=2-16", enough), MARGINS)
    assert judged.why_not == "a rank of this row made no call there"


def test_an_unsteady_size_is_left_out_and_named():
    """One call of ~1 s among 20 (a compile while serving) makes a size's mean that call's: left out of the
    ratio, named; the range is judged on the rest if they hold enough of its time."""
    steady = {600: (24, 700.0, 10.0, False), 900: (24, 820.0, 12.0, False)}
    compiled = {**steady, 1500: (20, 50_500.0, 223_000.0, False)}
    judged = judge_range(_range("M=257-1023", steady | {1500: (20, 1000.0, 10.0, False)}),
                         _range("M=257-1023", compiled), MARGINS)  # fmt: skip
    assert judged.unsteady == (1500,) and judged.sizes_matched == 2
    # the steady sizes hold ~3 % of the reference's time there: too little to stand for the range
    assert judged.passed is None and "hold" in judged.why_not


def test_records_from_before_per_size_timing_are_not_judged():
    old = RangeTiming("M=1", 40, 40, 12.0, 0.3, 12.0, 40, 0.0)
    judged = judge_range(old, old, MARGINS)
    assert judged.passed is None and "per range only" in judged.why_not


def test_the_section_and_check_carry_the_evidence_and_what_each_range_would_catch():
    check, section = speed_check(_twin(), _twin(), MARGINS, "ref")
    assert section["evidence"] == {
        "unit": "dispatch range", "judged": 5, "total": 5, "required": None,
        "would_catch": check.evidence.would_catch,
    }  # fmt: skip
    # the least sensitive range names the gate's would_catch: here the eager one
    worst = max(section["ranges"], key=lambda r: r["would_catch"])
    assert worst["range"] == "M=257-1023" and check.evidence.would_catch.startswith(
        f"x{worst['would_catch']:.3f}"
    )
    assert all(r["would_catch"] < 1.07 for r in section["ranges"] if r["replayed"])
    assert "would catch (80 %): M=1 x1.0" in check.detail and "judged 5/5 ranges" in check.detail
    assert check.as_dict()["evidence"]["judged"] == 5


def test_compare_lists_every_range_either_row_called_in_order():
    reference = _timing(
        _range("M=1", {1: (24, 10.0, 0.1, True)}), _range("M>=4096", {8192: (24, 900.0, 9, 0)})
    )
    row = _timing(_range("M=2-16", {8: (24, 12.0, 0.1, True)}), _range("M=1", {1: (24, 10.0, 0.1, True)}))
    names = [(r.range, r.why_not) for r in compare(row, reference, MARGINS)]
    assert names == [
        ("M=1", None),
        ("M=2-16", "the reference made no call there"),
        ("M>=4096", "this row made no call there"),
    ]


def _speed_config(**keys):
    from moe_eval.configs.config import EvalConfig

    base = dict(
        path=Path("c.yaml"), sha256="0" * 64, model_name="m", num_questions=1, num_fewshot=0,
        random_weights=True, moe_backend="triton",
    )  # fmt: skip
    return EvalConfig(**base).with_keys(**keys)


def test_speed_gate_true_without_a_reference_or_timing_is_not_run_and_listed():
    from moe_eval.gates.judge import judge
    from moe_eval.gates.measurements import Measurements
    from moe_eval.gates.registry import describe_plan

    asked = _speed_config(speed_gate=True)
    assert "speed(not run: no incumbent)" in describe_plan(asked, has_incumbent=False)
    untimed = _speed_config(speed_gate=True, moe_timing=False)
    assert "speed(not run: moe_timing false)" in describe_plan(untimed, has_incumbent=True)
    got = judge(asked, Measurements(speed=_twin()))
    not_run = [c for c in got.checks if c.name == "speed_not_run"]
    assert not_run and not_run[0].status == "not_run" and got.verdict == "incomplete"
    # absent on a GPU run: called for only beside an incumbent; absent on the CPU: never (reported only)
    auto = _speed_config()
    assert "speed" not in [g.split("(")[0] for g in describe_plan(auto, has_incumbent=False)]
    from dataclasses import replace

    from moe_eval.gates.speed import speed_gated

    assert speed_gated(auto, True) is False and speed_gated(replace(auto, on_gpu=True), True)
    assert not speed_gated(replace(auto, on_gpu=True), False)


def test_the_cpu_reports_the_comparison_without_a_check():
    from dataclasses import replace

    from moe_eval.gates.judge import judge
    from moe_eval.gates.measurements import Measurements

    cpu = replace(_speed_config(), on_gpu=False)
    incumbent = SimpleNamespace(
        speed=_twin(), machine="cpu: x", workload="w", results_path="ref", speed_warnings=[],
        moe_backend_used="vllm:cpu", layout="TP (TP1)", correctness={}, logprobs_path=None, decode_path=None,
        world_size=1, cards=None,
    )  # fmt: skip
    got = judge(
        cpu, Measurements(speed=_twin({"M=1": 1.5}), incumbent=incumbent, machine="cpu: x", workload="w")
    )
    assert "speed_gate" not in [c.name for c in got.checks]
    assert got.sections["speed"]["gated"] is False and got.sections["speed"]["worst_range"] == "M=1"


def test_the_routing_line_takes_the_experts_spread_out_of_a_sizes_error(tmp_path):
    """At real shapes a decode call's time follows the experts its routing hit (the Qwen3 twin's M=16 calls
    spread 20-26 % on the H100, 2026-12-06). The timer counts them; a size's line of time against them leaves
    a small residual, and two rows of the same requests compare at one routing: a 5 % slowdown fails where the
    plain spread alone would fail above ~x1.1."""
    import json
    import random

    from moe_eval.core import moe_timing
    from moe_eval.core.plugin_protocol import MOE_TIMING_DIR

    def process(pid: int, scale: float) -> dict:
        rng = random.Random(7)  # the same routing in both rows: the same requests
        cell = [0.0] * len(moe_timing.FIELDS)
        for _ in range(30):
            experts = rng.randint(30, 60)
            ns = scale * (20_000 + 3_000 * experts) * (1 + rng.gauss(0, 0.01))
            for i, v in enumerate((1, ns, ns * ns, 16, 1, ns, experts, experts * experts, experts * ns)):
                cell[i] += v
        return {"pid": pid, "backend": "triton", "scope": "s", "timed_on": "device", "rank": {},
                "sizes": [[16, *cell]]}  # fmt: skip

    def summary(scale: float, name: str) -> TimingSummary:
        folder = tmp_path / name / MOE_TIMING_DIR
        folder.mkdir(parents=True)
        (folder / "1.json").write_text(json.dumps(process(1, scale)))
        return moe_timing.summarize(moe_timing.read_folder(folder.parent))

    reference, same, slower = summary(1.0, "ref"), summary(1.0, "same"), summary(1.05, "slower")
    (size,) = reference.by_range()["M=2-16"].sizes
    assert size.spread_us / size.mean_us > 0.1 and size.residual_us / size.mean_us < 0.02
    assert size.slope_us == pytest.approx(3.0, rel=0.05) and 30 <= size.experts <= 60
    ok = judge_range(same.by_range()["M=2-16"], reference.by_range()["M=2-16"], MARGINS)
    assert ok.passed and ok.fails_above < 1.04
    caught = judge_range(slower.by_range()["M=2-16"], reference.by_range()["M=2-16"], MARGINS)
    assert caught.passed is False and caught.ratio == pytest.approx(1.05, abs=0.005)
    # without the routing counted the same calls spread too wide to see 5 %
    plain = [dataclasses.replace(s, experts=None, slope_us=None, residual_us=None, experts_spread=None)
             for s in (size,)]  # fmt: skip
    blind = dataclasses.replace(reference.by_range()["M=2-16"], sizes=tuple(plain))
    assert judge_range(blind, blind, MARGINS).fails_above > 1.05


def test_gated_eager_calls_are_judged_on_the_constant_floor_not_a_multiple_of_their_spread():
    """With the host's launch gaps out of the bracket (every process "gated"), a 10 % slowdown of a
    prefill call spreading 4 % fails; timed at the host's pace (an older record, or a gate turned off) its
    floor is 1.7 x that spread, and the same 10 % passes."""
    from moe_eval.gates.speed import between_servers, gated_eager

    gated = "gated: the start stamp waits for the host's last launch of the call"
    plain = {1500: (20, 500.0, 20.0, False)}
    slowed = {1500: (20, 550.0, 22.0, False)}

    def summary(sizes, brackets):
        return dataclasses.replace(_timing(_range("M=1024-4095", sizes)), eager_brackets=brackets)

    size = _range("M=1024-4095", plain).sizes[0]
    assert between_servers(size, size, gated=True) == 0.01
    assert between_servers(size, size) == pytest.approx(1.7 * 0.04)
    for brackets, fails in (((gated,), True), ((), False), ((gated + "; then turned off: ...",), False)):
        row, reference = summary(slowed, brackets), summary(plain, brackets)
        assert gated_eager(row, reference) is fails
        check, section = speed_check(row, reference, MARGINS, "ref")
        assert check is not None and check.passed is not fails, brackets
        assert section["eager_gated"] is fails
    # one row gated, the other not: the wider floor
    assert not gated_eager(summary(slowed, (gated,)), summary(plain, ()))
    # a wait of the timed workload gave up (that call's bracket holds host gaps): the wider floor too
    gave_up = dataclasses.replace(summary(slowed, (gated,)), gate_timeouts=1)
    assert not gated_eager(gave_up, summary(plain, (gated,)))
    assert gated_eager(dataclasses.replace(gave_up, gate_timeouts=0), summary(plain, (gated,)))


def test_a_reference_from_other_cards_of_the_same_model_widens_every_range_and_says_so():
    """Two H100s differed by a common 1-3 % (2026-12-06): a --baseline from another machine's cards is judged
    with BETWEEN_CARDS added once to every range, so a correct row 4.5 % slower there passes; the section and
    the detail say the reference ran on other cards. Same cards, or cards not recorded: unchanged."""
    plain, plain_section = speed_check(_twin(), _twin(), MARGINS, "ref")
    same, same_section = speed_check(_twin(), _twin(), MARGINS, "ref", "same")
    assert same_section["ranges"] == plain_section["ranges"]
    assert plain_section["reference_cards"] == "not recorded"
    assert same_section["between_cards"] is None and "other GPUs" not in same.detail
    shifted = {name: 1.045 for name in ("M=1", "M=2-16", "M=17-64", "M=65-256", "M=257-1023")}
    on_one_machine, _ = speed_check(_twin(shifted), _twin(), MARGINS, "ref", "same")
    assert not on_one_machine.passed  # a 4.5 % shift is within one machine's reach where graphs replay
    other, section = speed_check(_twin(shifted), _twin(), MARGINS, "ref", "other")
    assert other.passed and section["reference_cards"] == "other"
    assert section["between_cards"] == BETWEEN_CARDS
    assert "the reference ran on other GPUs of this model" in other.detail
    from moe_eval.gates.speed import speed_cell

    assert "5/5 ranges judged, reference on other GPUs, would catch x" in speed_cell(section, None)
    assert "other GPUs" not in speed_cell(same_section, SimpleNamespace(timing=None))
    for wide, narrow in zip(section["ranges"], same_section["ranges"], strict=True):
        assert wide["fails_above"] > narrow["fails_above"]
    one = _range("M=1", {1: (400, 40.0, 0.0, True)})
    judged = compare(_timing(one), _timing(one), MARGINS, other_cards=True)[0]
    expected = math.sqrt(2 * BETWEEN_SERVERS_REPLAYED**2 + BETWEEN_CARDS**2)
    assert judged.fails_above == pytest.approx(1.01 * math.exp(SPEED_Z * expected), abs=1e-4)
    # a 10 % slowdown is still caught across cards
    slow, _ = speed_check(_twin({"M=1": 1.10}), _twin(), MARGINS, "ref", "other")
    assert not slow.passed


def test_the_gate_reads_the_cards_from_both_records():
    """The row's GPUs' UUIDs (results.json environment.hardware.gpu_uuids, speed.cards_of) against the
    reference's: other cards widen the ranges, a record without UUIDs (any before 2026-12-06) does not."""
    from dataclasses import replace

    from moe_eval.core.record import Hardware
    from moe_eval.gates.judge import judge
    from moe_eval.gates.measurements import Measurements
    from moe_eval.gates.speed import cards_of

    assert cards_of(Hardware("h100", ["NVIDIA H100"], "x", ["GPU-b", "GPU-a"])) == "GPU-a,GPU-b"
    assert cards_of(Hardware("cpu", [], "x")) is None and cards_of(Hardware("h100", ["H"], "x", [])) is None
    gpu = replace(_speed_config(), on_gpu=True)
    for mine, theirs, expected in (
        ("GPU-a", "GPU-a", "same"),
        ("GPU-a", "GPU-b", "other"),
        ("GPU-a", None, "not recorded"),
    ):
        incumbent = SimpleNamespace(
            speed=_twin(), machine="NVIDIA H100", workload="w", results_path="ref", speed_warnings=[],
            moe_backend_used="vllm:TRITON", layout="TP (TP1)", correctness={}, logprobs_path=None,
            decode_path=None, world_size=1, cards=theirs,
        )  # fmt: skip
        got = judge(
            gpu,
            Measurements(speed=_twin(), incumbent=incumbent, machine="NVIDIA H100", workload="w", cards=mine),
        )
        assert got.sections["speed"]["reference_cards"] == expected, (mine, theirs)
        (check,) = [c for c in got.checks if c.name == "speed_gate"]
        assert ("is not recorded" in check.detail) == (expected == "not recorded"), check.detail
        assert ("other GPUs of this model" in check.detail) == (expected == "other"), check.detail


def _with_yardstick(
    timing: RangeTiming, yard_us: float, calls: int = 20, spread_us: float = 0.2
) -> RangeTiming:
    """The range's sizes with the yardstick timed beside each (kernels/yardstick.py)."""
    sizes = tuple(
        dataclasses.replace(s, yard_calls=calls, yard_mean_us=yard_us, yard_spread_us=spread_us)
        for s in timing.sizes or ()
    )
    return dataclasses.replace(timing, sizes=sizes)


def test_a_paired_eager_size_reads_the_call_against_the_yardstick_timed_beside_it():
    """The canary's 10 % eager slowdown on a server whose pace ran 3 % fast (as the mutated canary rows' did,
    docs/perf.md): read alone it is x1.067 and passes under the floor; read against the yardstick, which ran
    3 % fast beside it, less half of that: x1.083, and it fails. A correct row on a server 3 % slow passes
    either way; a row without the yardstick is judged alone (sizes_paired 0)."""
    from moe_eval.gates.speed import BETWEEN_SERVERS_PAIRED, YARDSTICK_WEIGHT, between_servers, compare_size

    def eager(us: float) -> RangeTiming:
        return _range("M=257-1023", {600: (40, us, 0.3, False)})

    plain = _with_yardstick(eager(24.0), 22.0)
    fast_server = _with_yardstick(eager(24.0 * 1.10 * 0.97), 22.0 * 0.97)
    alone = judge_range(
        dataclasses.replace(fast_server, sizes=eager(24.0 * 1.10 * 0.97).sizes),
        plain,
        MARGINS,
        True,
        yardstick=True,
    )
    assert alone.passed and alone.sizes_paired == 0 and alone.ratio == pytest.approx(1.067, abs=1e-3)
    # not gated (a host-paced bracket), or a yardstick wait gave up: the size is read alone
    for gated, clean in ((False, True), (True, False)):
        judged = judge_range(fast_server, plain, MARGINS, gated, yardstick=clean)
        assert judged.sizes_paired == 0 and judged.ratio == pytest.approx(1.067, abs=1e-3), (gated, clean)
    judged = judge_range(fast_server, plain, MARGINS, True, yardstick=True)
    assert not judged.passed and judged.sizes_paired == 1
    assert judged.ratio == pytest.approx(1.067 / 0.97**YARDSTICK_WEIGHT, abs=1e-3)
    assert judged.between_servers == BETWEEN_SERVERS_PAIRED
    # the yardstick's own errors widen the size's (independent: an upper bound)
    size, ref = fast_server.sizes[0], plain.sizes[0]
    log_ratio, variance = compare_size(size, ref, pair=True)
    bare = compare_size(size, ref)[1]
    expected = bare + YARDSTICK_WEIGHT**2 * sum(
        (0.2 / math.sqrt(20) / s.yard_mean_us) ** 2 for s in (size, ref)
    )
    assert variance == pytest.approx(expected)
    assert between_servers(size, ref, gated=True, pair=True) == BETWEEN_SERVERS_PAIRED
    # not gated: the floor follows the call's own spread, paired or not
    assert between_servers(size, ref, pair=True) == between_servers(size, ref) > BETWEEN_SERVERS_PAIRED
    slow_server = _with_yardstick(eager(24.0 * 1.03), 22.0 * 1.03)
    assert judge_range(slow_server, plain, MARGINS, True, yardstick=True).passed
    # too few yardstick calls in one row, or a size partly replayed (the yardstick follows eager calls only):
    # not paired
    few = _with_yardstick(eager(24.0 * 1.10 * 0.97), 22.0 * 0.97, calls=2)
    assert judge_range(few, plain, MARGINS, True, yardstick=True).sizes_paired == 0
    mixed = dataclasses.replace(fast_server, sizes=(dataclasses.replace(size, replayed=5),))
    assert judge_range(mixed, plain, MARGINS, True, yardstick=True).sizes_paired == 0


def test_the_section_names_the_paired_floor_and_the_yardsticks_weight():
    from moe_eval.gates.speed import BETWEEN_SERVERS_PAIRED, YARDSTICK_WEIGHT

    gated = ("gated: the start stamp waits for the host's last launch of the call",)

    def paired_timing(us: float) -> TimingSummary:
        timing = _timing(_with_yardstick(_range("M=257-1023", {600: (40, us, 0.3, False)}), 22.0))
        return dataclasses.replace(timing, eager_brackets=gated, gate_timeouts=0, yardstick_timeouts=0)

    row = paired_timing(24.0)
    _, section = speed_check(row, row, MARGINS, "ref")
    assert section["yardstick_clean"] and section["eager_gated"]
    assert section["between_servers"]["paired"] == BETWEEN_SERVERS_PAIRED
    assert section["yardstick_weight"] == YARDSTICK_WEIGHT
    assert section["ranges"][0]["sizes_paired"] == 1
    check, _ = speed_check(paired_timing(24.0 * 1.1), row, MARGINS, "ref")
    assert not check.passed and "1 read against the yardstick" in check.detail
    # one yardstick wait of the timed workload gave up (uncounted: a record from before the count, too)
    for timeouts in (1, None):
        gave_up = dataclasses.replace(paired_timing(24.0), yardstick_timeouts=timeouts)
        _, section = speed_check(gave_up, row, MARGINS, "ref")
        assert not section["yardstick_clean"] and section["ranges"][0]["sizes_paired"] == 0


def test_the_timed_top_up_aims_at_the_eager_slowdown_on_gpus_at_the_configs_own_margin():
    """On a GPU run the top-up aims the eager ranges at EAGER_AIM at the config's speed_margin_eager; on the
    CPU (reported only) it tops up to MIN_CALLS and the share alone."""
    from dataclasses import replace

    from moe_eval.steps import aimed_eager_margin

    config = _speed_config(speed_margin_eager=0.05)
    assert aimed_eager_margin(replace(config, on_gpu=True)) == 0.05
    assert aimed_eager_margin(replace(_speed_config(), on_gpu=True)) == 0.03
    assert aimed_eager_margin(replace(config, on_gpu=False)) is None


def test_a_slowdown_hidden_under_the_rows_lead_is_named_with_the_size_that_would_still_pass():
    """Against vLLM's row a faster kernel hides its own regressions: here the row leads by 20 % at M=1 and a
    5 % slowdown there still passes. The pass says so per range (passes_up_to = fails_above / ratio, where
    the row leads beyond SPEED_Z standard errors), names the --baseline comparison that shows one, and the
    table's cell carries the widest; a lead within noise, a failed gate and a report-only row name none."""
    from moe_eval.gates.speed import speed_cell

    gated = SimpleNamespace(timing=None)
    for slowdown in (1.0, 1.05):
        check, section = speed_check(_twin({"M=1": 0.8 * slowdown}), _twin(), MARGINS, "vllm")
        m1 = {r["range"]: r for r in section["ranges"]}["M=1"]
        assert check.passed and section["hidden_under_lead"] == ["M=1"] and m1["leads"]
        assert m1["passes_up_to"] == pytest.approx(m1["fails_above"] / m1["ratio"], rel=1e-3)
        assert 1.01 * 1.025 / (0.8 * slowdown) < m1["passes_up_to"] < 1.01 * 1.045 / (0.8 * slowdown)
        assert m1["passes_up_to"] > m1["would_catch"]
        assert f"where this row could slow down this much and still pass: M=1 x{m1['passes_up_to']:.3f}" in (
            check.detail
        )
        assert "compare it with its own earlier run (run --baseline RUN)" in check.detail
        assert speed_cell(section, gated).endswith(
            f"x{m1['passes_up_to']:.2f} at M=1 would pass under its lead"
        )
    # the reference an earlier run of this kernel: the row got faster, and the next --baseline is this run
    check, section = speed_check(_twin({"M=1": 0.8}), _twin(), MARGINS, "earlier", own_kernel=True)
    assert (
        section["hidden_under_lead"] == ["M=1"] and "faster than its earlier run beyond noise" in check.detail
    )
    assert "this run as the next --baseline" in check.detail and "--baseline RUN" not in check.detail
    # level, or ahead by less than the noise (1 %, about one standard error here): nothing named
    for lead in (1.0, 0.99):
        check, section = speed_check(_twin({"M=1": lead}), _twin(), MARGINS, "ref")
        assert section["hidden_under_lead"] == [] and "still pass" not in check.detail
        assert "under its lead" not in speed_cell(section, gated)
        assert not any(r["leads"] for r in section["ranges"])
    # a failed gate names no lead: it failed
    check, section = speed_check(_twin({"M=1": 0.8, "M=2-16": 1.10}), _twin(), MARGINS, "ref")
    assert not check.passed and section["hidden_under_lead"] == []
    # report only (the CPU): the section keeps the ranges, the cell does not advise on a gate not run
    _, section = speed_check(_twin({"M=1": 0.8}), _twin(), MARGINS, "ref")
    cell = speed_cell(section | {"gated": False}, gated)
    assert cell.startswith("report only: ") and "under its lead" not in cell
