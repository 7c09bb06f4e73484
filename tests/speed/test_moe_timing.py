"""The speed measurement's pieces on the CPU: the timer's table and file, the reader's difference and
summary, the speed gate's comparison, and the perf mutations' bits."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from moe_eval.core import moe_timing
from moe_eval.core.plugin_protocol import MOE_TIMING_DIR, layer_range_names
from moe_eval.gates.speed import EAGER_BETWEEN_SERVERS, MIN_CALLS, SPEED_Z, compare, speed_check
from moe_eval.kernels.moe_timer import MoeTimer

RANGES = layer_range_names()


def _process(pid: int, rows: dict[str, tuple[float, ...]], timed_on="device") -> dict:
    """rows: per range calls, ns, ns_sq, tokens and optionally replayed, replayed_ns (else 0: eager calls)."""
    blank = (0.0,) * len(moe_timing.FIELDS)
    table = [[*rows.get(name, blank), *blank][: len(blank)] for name in RANGES]
    return {"pid": pid, "backend": "triton", "scope": "s", "timed_on": timed_on, "rank": {}, "table": table}


def _write(run_dir, *processes: dict) -> None:
    folder = run_dir / MOE_TIMING_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for p in processes:
        (folder / f"{p['pid']}.json").write_text(json.dumps(p))


def _summary(means_us: dict[str, float], calls: int = 100) -> moe_timing.TimingSummary:
    ranges = tuple(moe_timing.RangeTiming(name, calls, calls, us, 0.0, us) for name, us in means_us.items())
    return moe_timing.TimingSummary(1, ("device",), ("s",), ("triton",), ranges)


def test_the_host_timer_sums_each_call_into_its_range_and_writes_its_file(tmp_path):
    path = tmp_path / MOE_TIMING_DIR / "1.json"
    timer = MoeTimer("torch", path, "bundled kernel call")
    for tokens in (1, 1, 5, 300):
        hidden = torch.zeros(tokens, 4)
        started = timer.start(hidden)
        torch.mm(torch.ones(64, 64), torch.ones(64, 64))
        timer.stop(started, hidden)
    timer.flush()
    snap = json.loads(path.read_text())
    assert snap["timed_on"] == "host" and snap["ranges"] == list(RANGES)
    assert snap["fields"] == ["calls", "ns", "ns_sq", "tokens", "replayed", "replayed_ns"]
    assert all(
        len(row) == 6 and row[4] == row[5] == 0 for row in snap["table"]
    )  # a host-timed call: no replay
    table = {name: row for name, row in zip(RANGES, snap["table"], strict=True)}
    assert table["M=1"][0] == 2 and table["M=1"][3] == 2
    assert table["M=2-16"][0] == 1 and table["M=2-16"][3] == 5
    assert table["M=257-1023"][0] == 1 and table["M=257-1023"][3] == 300
    assert all(row[1] > 0 for row in snap["table"] if row[0] > 0)  # time passed in each timed call
    assert table["M=17-64"] == [0.0] * 6


def test_since_keeps_only_what_the_workload_added_and_summarize_takes_the_slowest_rank(tmp_path):
    _write(tmp_path, _process(1, {"M=1": (10, 10_000, 1e7, 10)}), _process(2, {"M=1": (10, 20_000, 4e7, 10)}))
    before = moe_timing.read_folder(tmp_path)
    _write(
        tmp_path,
        _process(1, {"M=1": (30, 50_000, 1e8, 30)}),  # +20 calls, 40 us -> 2 us each
        _process(2, {"M=1": (30, 80_000, 2e8, 30), "M=2-16": (5, 50_000, 5e8, 40)}),  # +20 calls, 3 us each
        _process(3, {"M=1": (4, 4_000, 4e6, 4)}),  # a process new since `before` counts whole: 1 us each
    )
    summary = moe_timing.summarize(moe_timing.since(moe_timing.read_folder(tmp_path), before))
    by = summary.by_range()
    assert by["M=1"].calls == 44 and by["M=1"].mean_us == pytest.approx(3.0)
    assert by["M=2-16"].calls == 5 and by["M=2-16"].mean_us == pytest.approx(10.0)
    assert "M=17-64" not in by
    assert moe_timing.TimingSummary.from_dict(summary.as_dict()) == summary


def test_the_speed_gate_fails_a_range_beyond_the_margin_and_judges_none_without_enough_calls():
    reference = _summary({"M=1": 10.0, "M=2-16": 20.0, "M=17-64": 30.0})
    row = _summary({"M=1": 10.5, "M=2-16": 25.0, "M=17-64": 29.0})
    check, section = speed_check(row, reference, 0.10, "ref")
    assert not check.passed and "M=2-16" in check.detail and "x1.25" in check.detail
    assert [r["passed"] for r in section["ranges"]] == [True, False, True]
    check, _ = speed_check(_summary({"M=1": 10.9}), reference, 0.10, "ref")
    assert check.passed and "1 of 1" in check.detail
    few = _summary({"M=1": 50.0}, calls=MIN_CALLS - 1)
    check, section = speed_check(few, reference, 0.10, "ref")
    assert check is None and section["ranges"][0]["why_not"].startswith("fewer than")
    unmatched = compare(_summary({"M>=4096": 5.0}), reference, 0.1)[0]
    assert unmatched.why_not == "the reference made no call there"


def test_summarize_counts_replays_and_the_eager_share_of_the_time_and_an_old_record_reads_none(tmp_path):
    """Two ranks' graph-replayed calls add up per range like their calls; the eager share is the time of the
    calls that were not replays, in the process whose mean the range reports (the slowest). A record written
    before the timer counted replays reads None (unknown), never 0 (which would say every call replayed)."""
    _write(
        tmp_path,
        # M=1: 40 replays of 1 us; M=65-256: 36 replays of 10 us and 4 eager calls of 600 us (a range of
        # decode batches and a few prefill chunks: 10 % of the calls, 87 % of the time)
        _process(1, {"M=1": (40, 40_000, 4e4, 40, 40, 40_000), "M>=4096": (8, 8e6, 8e12, 40_000, 0, 0)}),
        _process(
            2, {"M=1": (40, 48_000, 6e4, 40, 36, 36_000), "M=65-256": (40, 2_760_000, 0, 4000, 36, 360_000)}
        ),
    )
    by = moe_timing.summarize(moe_timing.read_folder(tmp_path)).by_range()
    assert (by["M=1"].calls, by["M=1"].replayed, by["M=1"].eager_share) == (
        80,
        76,
        0.25,
    )  # rank 2's 12 of 48 us
    assert (by["M>=4096"].calls, by["M>=4096"].replayed, by["M>=4096"].eager_share) == (8, 0, 1.0)
    assert (by["M=65-256"].replayed, by["M=65-256"].eager_share) == (36, 0.8696)
    old = {"range": "M=1", "calls": 16, "tokens": 16, "mean_us": 10.0, "spread_us": 1.0, "us_per_token": 10.0}
    summary = moe_timing.TimingSummary.from_dict({"processes": 1, "timed_on": ["device"], "ranges": [old]})
    assert summary.ranges[0].replayed is None and summary.ranges[0].eager_share is None


def _prefill(mean_us: float, eager: float | None, timed_on: str = "device") -> moe_timing.TimingSummary:
    """One prefill range of 100 calls with tight within-run errors (1 % standard error), `eager` the share
    of its time in calls that were not graph replays."""
    replayed = None if eager is None else round(100 * (1 - eager))
    row = moe_timing.RangeTiming(
        "M>=4096", 100, 100 * 5000, mean_us, mean_us * 0.1, mean_us / 5000, replayed, eager
    )
    return moe_timing.TimingSummary(1, (timed_on,), ("s",), ("triton",), (row,))


def test_a_ranges_eager_time_is_judged_with_the_between_server_floor():
    """At x1.5 with 1 % standard errors the within-run rule fails a range (z ~ 19); eager calls' time moves
    by a factor between two servers of one kernel (log standard deviation EAGER_BETWEEN_SERVERS), so a wholly
    eager range passes there and names what it would fail above: (1 + margin) x exp(3 x 0.21 x sqrt 2),
    x2.80. Graph-replayed calls keep the within-run rule; a range between gets a floor by its eager time."""
    reference = _prefill(1000.0, eager=1.0)
    (eager,) = compare(_prefill(1500.0, eager=1.0), reference, 0.15)
    assert (
        eager.passed
        and eager.eager_share == 1.0
        and eager.fails_above == pytest.approx(1.15 * math.exp(3 * EAGER_BETWEEN_SERVERS * 2**0.5), abs=0.01)
    )
    check, section = speed_check(_prefill(1500.0, eager=1.0), reference, 0.15, "ref")
    assert check.passed and "M>=4096 (100% eager) 1500.0 us x1.50 (fails above x2.80" in check.detail
    assert section["ranges"][0]["eager_share"] == 1.0
    assert section["eager_between_servers"] == EAGER_BETWEEN_SERVERS
    # the same numbers, every call a graph replay (in both rows): fails as before
    (replayed,) = compare(_prefill(1500.0, eager=0.0), _prefill(1000.0, eager=0.0), 0.15)
    assert replayed.passed is False and replayed.eager_share == 0.0 and replayed.fails_above < 1.25
    # eager time in one row is enough: its mean carries the between-server noise
    (one_row,) = compare(_prefill(1500.0, eager=1.0), _prefill(1000.0, eager=0.0), 0.15)
    assert one_row.eager_share == 1.0 and one_row.passed
    # a third of the time eager: a narrower floor (x1.7 fails where a wholly eager range passes x1.5)
    (part,) = compare(_prefill(1700.0, eager=1 / 3), _prefill(1000.0, eager=1 / 3), 0.15)
    assert part.passed is False and eager.fails_above > part.fails_above > replayed.fails_above
    # a x3 slowdown stays beyond the floor: the row's floor is taken at reference x (1 + margin), not at its
    # own mean, so a slower row does not widen its own error
    (slow,) = compare(_prefill(3000.0, eager=1.0), reference, 0.15)
    assert slow.passed is False and slow.eager_share == 1.0 and slow.z > SPEED_Z
    check, _ = speed_check(_prefill(3000.0, eager=1.0), reference, 0.15, "ref")
    assert not check.passed and "slower: M>=4096 (100% eager) 3000.0 us x3.00" in check.detail
    # a record before the count beside one with it: the same requests, so the counted share stands for both
    (old,) = compare(_prefill(1500.0, eager=1.0), _prefill(1000.0, eager=None), 0.15)
    assert old.eager_share == 1.0 and old.passed


def test_records_without_the_eager_share_and_host_timed_rows_keep_the_within_run_rule():
    """Neither row counted replays (records before the count): judged as before, eager unknown. Host-timed
    rows (the CPU's: every call eager, none replayed) get no floor: their rule is unchanged."""
    for row, reference, share in (
        (_prefill(1500.0, None), _prefill(1000.0, None), None),
        (_prefill(1500.0, 1.0, "host"), _prefill(1000.0, 1.0, "host"), 0.0),
    ):
        (judged,) = compare(row, reference, 0.15)
        assert judged.passed is False and judged.eager_share == share and judged.fails_above < 1.25
        check, _ = speed_check(row, reference, 0.15, "ref")
        assert "eager" not in check.detail


def _torch_weights(e=4, F=8, D=16):
    from moe_eval.kernels.oracle import MoeBackend, convert_to_kernel_format

    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * F, D, generator=g)
    w2 = torch.randn(e, D, F, generator=g)
    return convert_to_kernel_format(MoeBackend.TORCH, w13, w2)


def test_extra_weight_copy_computes_the_same_bits_from_fresh_copies():
    from moe_eval.kernels.mutations import mutate_kernel
    from moe_eval.kernels.oracle import MoeBackend, make_moe_kernel

    weights = _torch_weights()
    kernel = make_moe_kernel(MoeBackend.TORCH)
    copies = []
    original_clone = torch.Tensor.clone

    def counting_clone(t, *a, **k):
        copies.append(t.shape)
        return original_clone(t, *a, **k)

    hidden = torch.randn(5, 16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]], dtype=torch.int32)
    w = torch.rand(5, 2)
    mutated = mutate_kernel("extra_weight_copy", kernel)
    torch.Tensor.clone = counting_clone
    try:
        out = mutated(hidden, weights, w, ids, None, False)
    finally:
        torch.Tensor.clone = original_clone
    assert torch.equal(out, kernel(hidden, weights, w, ids, None, False))
    assert tuple(weights.w13_eFD.shape) in copies and tuple(weights.w2_eDF.shape) in copies


def test_the_tile_mutations_choose_other_tiles_only_where_they_say():
    from moe_eval.kernels.mutations import tile_override
    from moe_eval.kernels.tile_configs import get_tile_config

    args = dict(num_local_experts=8, F=128, D=256, top_k=2, device_name="NVIDIA H200")
    bypass = tile_override("small_batch_bypassed", *args.values())
    prefill = get_tile_config(
        num_tokens=1024, num_experts=8, F=128, D=256, top_k=2, device_name=args["device_name"]
    )
    assert bypass(1).block_m == prefill.block_m and not bypass(1).naive and bypass(64) is not None
    assert bypass(65) is None
    poor = tile_override("poor_tiles:range=M=2-16", *args.values())
    assert poor(1) is None and poor(2).gemm1.block_k == 16 and poor(16) is not None and poor(17) is None
    assert tile_override("poor_tiles", *args.values())(40) is not None  # default range M=17-64
    assert tile_override("extra_weight_copy", *args.values()) is None


def test_tile_mutations_are_refused_for_a_backend_that_has_no_tiles(tmp_path):
    from types import SimpleNamespace

    from moe_eval.core.errors import ConfigError
    from moe_eval.kernels.mutations import check_mutation

    config = SimpleNamespace(moe_backend="torch", path=tmp_path / "c.yaml", layout=None)
    with pytest.raises(ConfigError, match="Triton"):
        check_mutation("small_batch_bypassed", config)
    check_mutation("extra_weight_copy", config)  # every backend


def test_compare_shows_each_runs_moe_time_per_range_against_the_reference_column(tmp_path):
    from moe_eval.report.compare import RunResult, _speed_rows

    def run(label: str, means: dict[str, float] | None) -> RunResult:
        timing = None if means is None else _summary(means).as_dict()
        return RunResult(tmp_path, "m", label, 5, {}, "PASSED", {}, moe_timing=timing)

    rows = _speed_rows(
        [run("vllm", {"M=1": 12.5, "M=2-16": 15.2}), run("triton", {"M=1": 10.0}), run("old", None)], 0
    )
    assert rows == [
        ["MoE time M=1", "", "us per call (x reference)", "12.5 us", "10.0 us (x0.80)", "-"],
        ["MoE time M=2-16", "", "us per call (x reference)", "15.2 us", "-", "-"],
    ]
    assert _speed_rows([run("a", None)], 0) == []  # runs from before the timing: no rows
    # A ratio only where the speed gate would compare too: the same machine, the same timed requests.
    base = dataclasses.replace(run("vllm", {"M=1": 12.5}), machine="NVIDIA H200", workload="ab")
    same = dataclasses.replace(run("triton", {"M=1": 10.0}), machine="NVIDIA H200", workload="ab")
    elsewhere = dataclasses.replace(same, machine="NVIDIA B200")
    other = dataclasses.replace(same, workload="cd")  # a run before the prompts changed, say
    cells = _speed_rows([base, same, elsewhere, other], 0)[0][3:]
    assert cells == ["12.5 us", "10.0 us (x0.80)", "10.0 us (other machine)", "10.0 us (other requests)"]


def test_the_speed_check_says_judged_over_total_and_names_what_it_did_not_judge():
    """A range only one row reached, or with too few calls, is counted as not judged, never left out."""
    reference = _summary({"M=1": 10.0, "M=2-16": 20.0, "M>=4096": 700.0})
    few_in_both = _summary({"M=65-256": 11.0}, calls=3).ranges[0]
    reference = moe_timing.TimingSummary(
        1, ("device",), ("s",), ("triton",), (*reference.ranges, few_in_both)
    )
    few = moe_timing.RangeTiming("M=17-64", 5, 5, 9.0, 0.0, 1.8)
    row = moe_timing.TimingSummary(
        1,
        ("device",),
        ("s",),
        ("triton",),
        (*_summary({"M=1": 10.2, "M=2-16": 20.1}).ranges, few, few_in_both),
    )
    check, section = speed_check(row, reference, 0.10, "ref")
    assert check.passed and "judged 2/5 ranges" in check.detail and section["judged"] == 2
    assert "M=65-256: fewer than 12 calls timed (3 here, 3 there)" in check.detail
    assert "M=17-64: the reference made no call there" in check.detail
    assert "M>=4096: this row made no call there" in check.detail


def test_a_failed_gates_worst_is_its_worst_failing_range_not_a_wider_pass_by_noise():
    """M=2-16 fails (x1.25 on tight calls); M>=4096 reads x1.40 but its calls spread so wide that it passes by
    noise. results.json's worst_ratio and worst_range (and JUnit's properties) must name the failure."""
    reference = _summary({"M=1": 10.0, "M=2-16": 20.0})
    wide = moe_timing.RangeTiming("M>=4096", 100, 100, 1000.0, 3000.0, 1000.0)
    reference = dataclasses.replace(reference, ranges=(*reference.ranges, wide))
    row = _summary({"M=1": 10.0, "M=2-16": 25.0})
    row = dataclasses.replace(row, ranges=(*row.ranges, dataclasses.replace(wide, mean_us=1400.0)))
    check, section = speed_check(row, reference, 0.10, "ref")
    by_range = {r["range"]: r for r in section["ranges"]}
    assert by_range["M>=4096"]["passed"] is True and by_range["M>=4096"]["ratio"] == 1.4
    assert not check.passed and section["worst_ratio"] == 1.25 and section["worst_range"] == "M=2-16"
    check, section = speed_check(_summary({"M=1": 10.2, "M=2-16": 21.0}), reference, 0.10, "ref")
    assert check.passed and (section["worst_ratio"], section["worst_range"]) == (1.05, "M=2-16")


def test_a_rank_that_wrote_no_timing_leaves_the_gate_not_run():
    from moe_eval.gates.rules import judge_speed

    config = SimpleNamespace(layout=SimpleNamespace(world_size=2), speed_margin=0.15)
    timed = _summary({"M=1": 10.0})  # one process
    incumbent = SimpleNamespace(speed=timed, machine=None, results_path="ref", workload="w")
    m = SimpleNamespace(speed=timed, incumbent=incumbent, machine=None, workload="w")
    assert judge_speed(config, m, None) == "this row was timed on 1 of its 2 ranks"


def test_a_range_whose_mean_is_a_few_calls_time_is_named_not_judged_never_passed():
    """One call holding most of a range's time (a compile while serving) makes the mean that call's: judged,
    the range would pass whatever the other row did, its excess drowned in the error. Either row's: not
    judged, and said why."""

    def timing(mean_us: float, spread_us: float, calls: int = 20) -> moe_timing.TimingSummary:
        row = moe_timing.RangeTiming("M=1024-4095", calls, calls * 1500, mean_us, spread_us, mean_us / 1500)
        return moe_timing.TimingSummary(1, ("device",), ("s",), ("triton",), (row,))

    # 19 calls of 500 us and one of 1 s: mean ~50 ms, standard error ~ the mean
    calls = [500.0] * 19 + [1_000_000.0]
    mean = sum(calls) / len(calls)
    spread = (sum((c - mean) ** 2 for c in calls) / (len(calls) - 1)) ** 0.5
    compiled, plain, slow = timing(mean, spread), timing(500.0, 50.0), timing(2_000.0, 50.0)
    for row, reference, who in ((slow, compiled, "the reference"), (compiled, plain, "this row")):
        (judged,) = compare(row, reference, 0.15)
        assert judged.passed is None and judged.why_not.startswith(f"{who}'s calls spread too wide")
        check, _ = speed_check(row, reference, 0.15, "ref")
        assert check is None  # nothing judged: the gate is not run, not a pass
    # a row slower beyond SPEED_Z standard errors even so still fails: only a pass is withheld
    wide_reference = timing(1000.0, 510.0 * 20**0.5)
    (clear,) = compare(timing(3000.0, 30.0 * 20**0.5), wide_reference, 0.15)
    assert clear.passed is False and clear.z > 3
    # the eager ranges' real noise (3-23 % standard error) is still judged
    (noisy,) = compare(timing(560.0, 560.0 * 0.23 * 20**0.5), plain, 0.15)
    assert noisy.passed is not None


def test_top_up_asks_for_enough_units_of_the_prefill_ranges_called_too_few_times():
    from moe_eval.evaluate.moe_speed import MAX_TOP_UP_UNITS, top_up_units

    def called(calls: dict[str, int]) -> moe_timing.TimingSummary:
        ranges = tuple(moe_timing.RangeTiming(name, n, n, 100.0, 0.0, 1.0) for name, n in calls.items())
        return moe_timing.TimingSummary(1, ("device",), ("s",), ("triton",), ranges)

    # the Qwen3 twin's bundled row on the H200 (two layers): 6, 8 and 4 calls in the prefill ranges
    calls = {"M=1": 22, "M=2-16": 58, "M=65-256": 5, "M=257-1023": 6, "M=1024-4095": 8, "M>=4096": 4}
    units = top_up_units(called(calls))
    assert units == {"M=257-1023": 2, "M=1024-4095": 1, "M>=4096": 3}  # never a decode range (M=65-256: 5)
    # each unit adds at least two thirds of the sweep's calls there: enough for MIN_CALLS
    assert all(calls[r] + n * calls[r] * 2 / 3 >= MIN_CALLS for r, n in units.items())
    assert top_up_units(called({"M>=4096": 1})) == {"M>=4096": min(MAX_TOP_UP_UNITS, 17)}
    assert top_up_units(called({"M=257-1023": MIN_CALLS, "M>=4096": 0})) == {}  # enough, or never reached


@pytest.mark.server
@pytest.mark.slow
def test_a_timed_two_layer_row_tops_up_its_prefill_ranges_to_be_judged(tmp_path, gsm8k_dir):
    """The random tiny MoE has two layers: the sweep's own prompts make 6-11 calls in a prefill range (which
    one falls short depends on how the server batched the decode batches' prompts: M=257-1023 in one run,
    M=1024-4095 in another), under the gate's MIN_CALLS. Its server gets more units of the short ranges
    before the second reading: every prefill range it reached ends with enough calls to be judged, and
    results.json says what the top-up sent."""
    from tests.conftest import run_args, run_cli, tiny_config
    from tests.harness.running import result_record

    config = tiny_config(tmp_path, "Tiny-BF16-vllm", questions=4)
    result = run_cli(run_args(tmp_path, gsm8k_dir, config))
    assert result.returncode == 0, result.stderr[-3000:]
    record = result_record(tmp_path, config.stem)
    workload = record["timing"]["workload"]
    calls = {r["range"]: r["calls"] for r in record["timing"]["moe"]["ranges"]}
    reached = [name for name in ("M=257-1023", "M=1024-4095", "M>=4096") if calls.get(name, 0) > 0]
    assert reached, calls
    assert all(calls[name] >= MIN_CALLS for name in reached), (calls, workload.get("top_up"))
    top_up = workload.get("top_up", {"units": {}, "requests": 0})
    assert set(top_up["units"]) <= set(reached) and (top_up["requests"] > 0) == bool(top_up["units"])


def test_top_up_prompts_continue_after_the_sweeps_and_never_repeat_one(monkeypatch):
    """Prefix caching would shorten a call whose prompt was sent before: the top-up's prompts start after the
    sweep's (first_index = the sweep's requests), and what it reports sent is what it sent."""
    from moe_eval.evaluate import layer_sweep

    posted: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        layer_sweep.SweepTarget, "post", lambda target, payloads, concurrency: posted.extend(
            tuple(p["prompt"]) for p in payloads
        )
    )  # fmt: skip
    monkeypatch.setattr(layer_sweep.SweepTarget, "server_totals", lambda target: None)  # no /metrics here
    pool = layer_sweep.TokenPool(list(range(50_000)))  # distinct ids: equal prompts start at the same offset
    target = layer_sweep.SweepTarget("http://x", "m", pool, 8192, 8192, timeout=1.0, retries=1)
    sent = layer_sweep.sweep(target)
    assert len(posted) == sent["requests"]
    units = {"M=257-1023": 2, "M=1024-4095": 1, "M>=4096": 1, "M=1": 0}
    top_up = layer_sweep.send_units(target, units, first_index=sent["requests"])
    assert top_up["units"] == {"M=257-1023": 2, "M=1024-4095": 1, "M>=4096": 1}
    assert len(posted) == sent["requests"] + top_up["requests"]
    assert len(set(posted)) == len(posted)
    # the first top-up prompt is the one after the sweep's last
    assert posted[sent["requests"]] == tuple(pool.prompt(600, sent["requests"] + 1))
    # a range the server cannot reach sends nothing and is not reported sent
    small = layer_sweep.SweepTarget("http://x", "m", pool, 2048, 2048, timeout=1.0, retries=1)
    assert layer_sweep.send_units(small, {"M>=4096": 3}, first_index=0) == {
        "units": {},
        "requests": 0,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_device_timer_counts_graph_replays_and_their_time_apart_from_eager_calls(tmp_path):
    """Two eager calls, then one captured into a CUDA graph and replayed 100 times: the range holds 102 calls,
    100 of them replays, and the replays' share of the time is theirs (each call ~1 ms of device sleep)."""
    timer = MoeTimer("triton", tmp_path / "t.json", "probe")
    x = torch.zeros(3, 8, device="cuda")  # 3 tokens: M=2-16
    timer.attach_device(x.device)
    assert timer.snapshot()["timed_on"] == "device", timer.device_problem
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(2):
            started = timer.start(x)
            torch.cuda._sleep(2_000_000)
            timer.stop(started, x)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            started = timer.start(x)
            torch.cuda._sleep(2_000_000)
            timer.stop(started, x)
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    row = dict(zip(moe_timing.FIELDS, timer.snapshot()["table"][RANGES.index("M=2-16")], strict=True))
    assert (row["calls"], row["replayed"], row["tokens"]) == (102, 100, 306)
    assert 0.95 * row["ns"] < row["replayed_ns"] < row["ns"]


def test_the_engines_prefill_view_is_the_median_of_single_prefills_so_one_compile_does_not_move_it():
    """vLLM's row on the H100 compiled its kernel inside one 1500-token prefill: the mean of the three read
    0.41 s (3,672 tokens/s, docs/data/speed_h100/canary-tp1-engine-view.json); each prefill is now read apart
    and the median taken, as the client's wall times are."""
    from moe_eval.evaluate.moe_speed import end_to_end

    sent = {
        "prefill_seconds": {"1500": [0.024, 1.21, 0.023]},
        "decode_seconds": {"1": 0.0385},
        "engine_prefill_seconds": {"1500": [0.0178, 1.19, 0.0176], "600": [None, None, None]},
        "engine_decode_step_seconds": {"1": 0.0022, "8": None},
    }
    seen = end_to_end(sent)
    assert seen["engine_prefill_tokens_per_s"] == {"1500": round(1500 / 0.0178, 1)}  # 600: not said, left out
    assert seen["engine_decode_ms_per_step"] == {"1": 2.2}
    assert seen["prefill_tokens_per_s"] == {"1500": 62500.0} and seen["decode_ms_per_step"] == {"1": 3.21}
