"""The speed measurement's pieces on the CPU: the timer's per-size table and file, the reader's difference
and summary, and the perf mutations' bits (the gate's rule: tests/speed/test_speed_gate.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from moe_eval.core import moe_timing
from moe_eval.core.plugin_protocol import MOE_TIMING_DIR, TIMER_MAX_SIZE, layer_range_names
from moe_eval.gates.speed import MIN_CALLS
from moe_eval.kernels.moe_timer import MoeTimer, size_cell
from tests.fake_clock import FakeClock

RANGES = layer_range_names()


def _process(pid: int, sizes: dict[int, tuple[float, ...]], timed_on="device") -> dict:
    """sizes: per call size M its calls, ns, ns_sq, tokens and optionally replayed, replayed_ns (else 0: eager
    calls), as the timer's file holds them."""
    blank = (0.0,) * len(moe_timing.FIELDS)
    rows = [[m, *[*cell, *blank][: len(blank)]] for m, cell in sizes.items()]
    return {"pid": pid, "backend": "triton", "scope": "s", "timed_on": timed_on, "rank": {}, "sizes": rows}


def _write(run_dir, *processes: dict) -> None:
    folder = run_dir / MOE_TIMING_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for p in processes:
        (folder / f"{p['pid']}.json").write_text(json.dumps(p))


def _summary(means_us: dict[str, float], calls: int = 100) -> moe_timing.TimingSummary:
    ranges = tuple(moe_timing.RangeTiming(name, calls, calls, us, 0.0, us) for name, us in means_us.items())
    return moe_timing.TimingSummary(1, ("device",), ("s",), ("triton",), ranges)


def test_the_host_timer_sums_each_call_into_its_sizes_cell_and_writes_its_file(tmp_path):
    """One cell per call size, so two rows compare size for size; calls beyond TIMER_MAX_SIZE share the last
    cell (their tokens say how large they were)."""
    path = tmp_path / MOE_TIMING_DIR / "1.json"
    timer = MoeTimer("torch", path, "bundled kernel call")
    for tokens in (1, 1, 5, 7, 300, TIMER_MAX_SIZE + 5):
        hidden = torch.zeros(tokens, 4)
        started = timer.start(hidden)
        torch.mm(torch.ones(64, 64), torch.ones(64, 64))
        timer.stop(started, hidden)
    timer.flush()
    snap = json.loads(path.read_text())
    assert snap["timed_on"] == "host"
    assert snap["fields"] == list(moe_timing.CELL_FIELDS)
    cells = {row[0]: row[1:] for row in snap["sizes"]}
    assert sorted(cells) == [1, 5, 7, 300, TIMER_MAX_SIZE]  # only the sizes called
    assert all(
        len(cell) == 12 and cell[4] == cell[5] == 0 for cell in cells.values()
    )  # host-timed: no replay
    assert all(cell[9:] == [0, 0, 0] for cell in cells.values())  # and no yardstick: it runs on a device
    assert snap["yardstick"] == "not run: host timing"
    assert (cells[1][0], cells[1][3]) == (2, 2) and (cells[5][0], cells[5][3]) == (1, 5)
    assert (cells[TIMER_MAX_SIZE][0], cells[TIMER_MAX_SIZE][3]) == (1, TIMER_MAX_SIZE + 5)
    assert all(cell[1] > 0 for cell in cells.values())  # time passed in each timed call
    by = moe_timing.summarize(moe_timing.read_folder(tmp_path)).by_range()
    assert [s.tokens for s in by["M=2-16"].sizes] == [5, 7] and by["M=2-16"].calls == 2


def test_since_keeps_only_what_the_workload_added_and_summarize_takes_the_slowest_rank(tmp_path):
    _write(tmp_path, _process(1, {1: (10, 10_000, 1e7, 10)}), _process(2, {1: (10, 20_000, 4e7, 10)}))
    before = moe_timing.read_folder(tmp_path)
    _write(
        tmp_path,
        _process(1, {1: (30, 50_000, 1e8, 30)}),  # +20 calls, 40 us -> 2 us each
        _process(2, {1: (30, 80_000, 2e8, 30), 8: (5, 50_000, 5e8, 40)}),  # +20 calls, 3 us each
        _process(3, {1: (4, 4_000, 4e6, 4)}),  # a process new since `before` counts whole: 1 us each
    )
    summary = moe_timing.summarize(moe_timing.since(moe_timing.read_folder(tmp_path), before))
    by = summary.by_range()
    assert by["M=1"].calls == 44 and by["M=1"].mean_us == pytest.approx(3.0)
    # per size: the slowest rank's own calls, never the sum over ranks (20, not 44)
    (m1,) = by["M=1"].sizes
    assert (m1.tokens, m1.calls, m1.mean_us) == (1, 20, pytest.approx(3.0))
    assert by["M=1"].rank_calls == 4  # the fewest calls one rank made there
    # only rank 2 called M=8: the other ranks made no call in the range, so no rank count stands
    assert by["M=2-16"].calls == 5 and by["M=2-16"].mean_us == pytest.approx(10.0)
    assert by["M=2-16"].rank_calls == 0
    assert "M=17-64" not in by
    assert moe_timing.TimingSummary.from_dict(summary.as_dict()) == summary


def test_summarize_counts_replays_and_the_eager_share_of_the_time_and_an_old_record_reads_none(tmp_path):
    """Two ranks' graph-replayed calls add up per range like their calls; the eager share is the time of the
    calls that were not replays, in the process whose mean the range reports (the slowest). A record written
    before the timer counted replays reads None (unknown), never 0 (which would say every call replayed)."""
    _write(
        tmp_path,
        # M=1: 40 replays of 1 us; M=65-256: 36 replays of 10 us and 4 eager calls of 600 us (a range of
        # decode batches and a few prefill chunks: 10 % of the calls, 87 % of the time)
        _process(1, {1: (40, 40_000, 4e4, 40, 40, 40_000), 5000: (8, 8e6, 8e12, 40_000, 0, 0)}),
        _process(2, {1: (40, 48_000, 6e4, 40, 36, 36_000), 100: (40, 2_760_000, 0, 4000, 36, 360_000)}),
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


def _torch_weights(e=4, F=8, D=16):
    from moe_eval.kernels.oracle import MoeBackend, convert_to_kernel_format

    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * F, D, generator=g)
    w2 = torch.randn(e, D, F, generator=g)
    return convert_to_kernel_format(MoeBackend.TORCH, w13, w2)


def test_extra_weight_copy_computes_the_same_bits_from_fresh_copies():
    from moe_eval.kernels.moe_call import MoeCall, Routing
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
    call = MoeCall(hidden, weights, Routing(w, ids))
    torch.Tensor.clone = counting_clone
    try:
        out = mutated.apply(call)
    finally:
        torch.Tensor.clone = original_clone
    assert torch.equal(out, kernel.apply(call))
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


def top_up_units(first: moe_timing.TimingSummary) -> dict[str, int]:
    """The units `top_up` sends after this reading (no eager margin: the CPU's), per range that needs any."""
    from moe_eval.evaluate.moe_speed import range_wants

    return {name: want.units for name, want in range_wants(first).items() if want.units}


def test_top_up_asks_for_enough_units_of_the_prefill_ranges_called_too_few_times():
    from moe_eval.evaluate.moe_speed import MAX_TOP_UP_UNITS

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


def test_top_up_counts_a_range_by_its_most_called_size():
    """16 calls over five chunk sizes (the twin's M>=4096 on the H100) are 6 calls the gate can match: more
    units; 12 of one size are enough."""

    def spread_over(sizes: dict[int, int]) -> moe_timing.TimingSummary:
        cells = tuple(moe_timing.SizeTiming(m, n, 1000.0, 10.0, 0) for m, n in sizes.items())
        total = sum(sizes.values())
        ranges = (moe_timing.RangeTiming("M>=4096", total, total, 1000.0, 0.0, 1.0, sizes=cells),)
        return moe_timing.TimingSummary(1, ("device",), ("s",), ("triton",), ranges)

    assert top_up_units(spread_over({4500: 2, 6000: 2, 6808: 2, 7500: 4, 8192: 6})) == {"M>=4096": 2}
    assert top_up_units(spread_over({6000: 4, 8192: MIN_CALLS})) == {}


def _range(
    name: str, sizes: dict[int, tuple[int, float, float]], yard: float | None = None
) -> moe_timing.RangeTiming:
    """One range of sizes {tokens: (calls, mean us, spread us)}, eager; yard: each size followed by a
    yardstick of that relative spread a call (mean 25 us), as on a GPU."""
    cells = tuple(
        moe_timing.SizeTiming(m, n, us, spread, 0)
        if yard is None
        else moe_timing.SizeTiming(
            m, n, us, spread, 0, yard_calls=n, yard_mean_us=25.0, yard_spread_us=25.0 * yard
        )
        for m, (n, us, spread) in sizes.items()
    )
    total = sum(n for n, _, _ in sizes.values())
    return moe_timing.RangeTiming(name, total, total, 1.0, 0.0, 1.0, sizes=cells)


GATED = ("gated: the start stamp waits for the host's last launch of the call; 0 waits gave up",)


def _summary_of(*ranges: moe_timing.RangeTiming, gated: bool = True) -> moe_timing.TimingSummary:
    """A reading of these ranges; gated: its eager calls timed from the host's last launch (a GPU's)."""
    return moe_timing.TimingSummary(
        1,
        ("device",),
        ("s",),
        ("triton",),
        ranges,
        eager_brackets=GATED if gated else ("ungated",),
        gate_timeouts=0,
    )


def test_top_up_lifts_a_single_prompt_ranges_own_size_to_two_thirds_of_its_time():
    """The canary's M=1024-4095 on an H100 (2026-12-07): 12 calls at the sweep's 1500 tokens beside sizes the
    batched prompts' steps made (1510, 1616, 3000), so 1500 held 35-49 % of a row's time (41 % here) and the
    range went unjudged against a row whose other sizes differed. The top-up now asks for enough 1500-token
    calls to hold two thirds: 35 here (2 x the others' 591 us / 34.3 us), 3 units of 2 prompts. It asks that
    of the unit's own length even where another size was called more. M>=4096's unit is a batched prefill
    whose steps land at several sizes: no share is asked of it. A compile among the other sizes' calls asks
    no more than MAX_WANTED_CALLS."""
    from moe_eval.evaluate.moe_speed import MAX_WANTED_CALLS, TOP_SIZE_SHARE, range_wants

    mid = _range(
        "M=1024-4095",
        {1500: (12, 34.3, 0.3), 1510: (4, 34.4, 0.3), 1616: (8, 36.4, 0.3), 3000: (4, 40.6, 0.1)},
    )
    large = _range("M>=4096", {4500: (8, 48.3, 0.4), 5308: (8, 48.8, 0.6), 8192: (12, 57.5, 0.3)})
    wants = range_wants(_summary_of(mid, large))
    want = wants["M=1024-4095"]
    assert (want.size, want.called, want.reason) == (1500, 12, "share")
    others = 4 * 34.4 + 8 * 36.4 + 4 * 40.6
    assert 0.40 < 12 * 34.3 / (12 * 34.3 + others) < 0.42
    assert want.calls == math.ceil(2 * others / 34.3) == 35
    assert want.calls * 34.3 / (want.calls * 34.3 + others) >= TOP_SIZE_SHARE
    assert want.units == math.ceil(1.5 * (35 - 12) / 12) == 3
    # 8192 holds 47 % of M>=4096's time with its 12 calls: enough calls, and no share asked there
    assert 12 * 57.5 / (12 * 57.5 + 8 * 48.3 + 8 * 48.8) < 0.5
    assert (wants["M>=4096"].reason, wants["M>=4096"].units) == ("min_calls", 0)
    # a size already holding two thirds asks nothing more
    alone = _range("M=1024-4095", {1500: (16, 30.1, 0.3), 1480: (4, 30.4, 0.3)})
    assert range_wants(_summary_of(alone))["M=1024-4095"].units == 0
    # the unit's own length, though the batched steps' 1616 was called more: units add to 1500 alone
    crowded = _range("M=1024-4095", {1500: (12, 34.3, 0.3), 1616: (16, 36.4, 0.3)})
    assert range_wants(_summary_of(crowded))["M=1024-4095"].size == 1500
    # vLLM's canary row (2026-12-07): four 565-token calls of 174 ms (a compile) beside 12 of 600 tokens
    compiled = _range("M=257-1023", {565: (4, 173976.1, 301283.2), 600: (12, 29.4, 0.3)})
    assert range_wants(_summary_of(compiled))["M=257-1023"].calls == MAX_WANTED_CALLS


def test_top_up_aims_a_noisy_eager_size_at_catching_a_10_percent_slowdown_only_when_asked():
    """The canary's 8192-token calls spread 5.5 % one from the next; with 16 of them M>=4096 would
    catch only about x1.13. Given the eager margin (GPU runs), the top-up asks for the calls that make a range
    of that size catch x1.10 with 80 % probability in this row and a reference like it (calls_to_catch: 66
    here; 68 with the yardstick's own spread read against it), capped at MAX_WANTED_CALLS; without the margin,
    or where the eager calls were not gated (the floor then grows with the spread: no count would do), only
    MIN_CALLS. A quiet size (the twin's 1.3 %) needs 4: nothing more."""
    from moe_eval.evaluate.moe_speed import MAX_WANTED_CALLS, range_wants
    from moe_eval.gates.speed import EAGER_AIM, Margins, calls_to_catch, judge_range

    noisy = _range("M>=4096", {8192: (16, 50.0, 2.75)})
    assert range_wants(_summary_of(noisy))["M>=4096"].units == 0
    assert range_wants(_summary_of(noisy, gated=False), eager_margin=0.03)["M>=4096"].units == 0
    want = range_wants(_summary_of(noisy), eager_margin=0.03)["M>=4096"]
    assert want.reason == "aim" and want.calls == calls_to_catch(noisy.sizes[0], 0.03) == 66  # type: ignore[index]
    assert want.units == math.ceil(1.5 * (66 - 16) / 16)
    # the count is what it says: with 66 calls in both rows, the range's would_catch is x1.10
    margins = Margins(replayed=0.01, eager=0.03)
    many = _range("M>=4096", {8192: (66, 50.0, 2.75)})
    judged = judge_range(many, many, margins, gated=True)
    assert judged.would_catch is not None and 1.099 < judged.would_catch <= 1 + EAGER_AIM
    assert judge_range(noisy, noisy, margins, gated=True).would_catch > 1.12  # type: ignore[operator]
    # read against a yardstick of 2 % a call, its error counts too: 68 calls, and at 68 the paired reading
    # catches x1.10 again
    paired = _range("M>=4096", {8192: (16, 50.0, 2.75)}, yard=0.02)
    assert calls_to_catch(paired.sizes[0], 0.03) == 68  # type: ignore[index]
    sixty_eight = _range("M>=4096", {8192: (68, 50.0, 2.75)}, yard=0.02)
    paired_judged = judge_range(sixty_eight, sixty_eight, margins, gated=True, yardstick=True)
    assert paired_judged.sizes_paired == 1 and 1.099 < paired_judged.would_catch <= 1 + EAGER_AIM  # type: ignore[operator]
    # far noisier: the cap
    launch_bound = _range("M>=4096", {8192: (16, 50.0, 10.0)})
    assert range_wants(_summary_of(launch_bound), eager_margin=0.03)["M>=4096"].calls == MAX_WANTED_CALLS
    quiet = _range("M>=4096", {8192: (24, 1223.0, 16.3)})
    assert calls_to_catch(quiet.sizes[0], 0.03) == 4  # type: ignore[index]
    assert range_wants(_summary_of(quiet), eager_margin=0.03)["M>=4096"].reason == "min_calls"
    # a margin the floor alone leaves no room for: no count can, so none is asked
    assert calls_to_catch(noisy.sizes[0], margin=0.09) is None  # type: ignore[index]


def test_top_up_keeps_each_ranges_want_from_its_last_round(monkeypatch):
    """Two ranges, the first topped up in round 1 only, the second in rounds 1 and 2: results.json's
    `top_up.wanted` keeps both, each as its own last round read it."""
    from moe_eval.evaluate import moe_speed

    def reading(mid_calls: int, large_calls: int) -> moe_timing.TimingSummary:
        return _summary_of(
            _range("M=1024-4095", {1500: (mid_calls, 30.0, 0.3)}),
            _range("M>=4096", {8192: (large_calls, 50.0, 0.5)}),
        )

    readings = iter([reading(4, 2), reading(MIN_CALLS, 8), reading(MIN_CALLS, MIN_CALLS)])
    monkeypatch.setattr(
        moe_speed,
        "send_units",
        lambda t, units, *, first_index: {"units": dict(units), "requests": 1, "posts": 1},
    )
    sent = {"requests": 0, "posts": 0}
    moe_speed.top_up(None, lambda: next(readings), sent)
    wanted = sent["top_up"]["wanted"]
    assert wanted["M=1024-4095"] == {"size": 1500, "called": 4, "calls": MIN_CALLS, "reason": "min_calls"}
    assert wanted["M>=4096"] == {"size": 8192, "called": 8, "calls": MIN_CALLS, "reason": "min_calls"}
    assert sent["top_up"]["rounds"] == 2


def test_the_timed_workload_hands_the_eager_margin_to_its_top_up(monkeypatch, tmp_path):
    """_timed passes the margin it was given to top_up (the runner gives the config's on GPUs:
    steps.aimed_eager_margin)."""
    from moe_eval.evaluate import moe_speed

    given: list[float | None] = []
    _write(tmp_path, _stamped(7, 60.0))
    monkeypatch.setattr(moe_speed.time, "sleep", lambda s: None)
    monkeypatch.setattr(
        moe_speed, "sweep", lambda target, first_index=0: {"requests": 10, "posts": 5, "seconds": 0.1}
    )
    monkeypatch.setattr(moe_speed, "top_up", lambda t, read, sent, margin=None: given.append(margin))
    target = SimpleNamespace(prefix_cache_hits=lambda: 0)
    moe_speed.timed_sweep(target, tmp_path, eager_margin=0.04)  # type: ignore[arg-type]
    moe_speed.timed_sweep(target, tmp_path)  # type: ignore[arg-type]
    assert given == [0.04, None]


def _at_8192(calls: int) -> moe_timing.TimingSummary:
    """M>=4096 with `calls` at 8192 tokens and 2 at 7500."""
    cells = (
        moe_timing.SizeTiming(7500, 2, 1000.0, 10.0, 0),
        moe_timing.SizeTiming(8192, calls, 1000.0, 10.0, 0),
    )
    ranges = (moe_timing.RangeTiming("M>=4096", calls + 2, calls + 2, 1000.0, 0.0, 1.0, sizes=cells),)
    return moe_timing.TimingSummary(1, ("device",), ("s",), ("triton",), ranges)


def test_top_up_reads_again_and_sends_another_round_while_the_most_called_size_is_short(monkeypatch):
    """vLLM's canary row on an H100 (2026-12-06): the one unit asked for left 8 calls at 8192 tokens (the
    scheduler packed its prompts into 7500-token steps too), and M>=4096 went unjudged beside FlashInfer's
    row. Now each round reads the calls anew: here a second round brings 8192 to MIN_CALLS, and what was sent
    is summed, its prompts after the sweep's and the first round's."""
    from moe_eval.evaluate import moe_speed

    enough = _at_8192(MIN_CALLS)
    readings = iter([_at_8192(4), _at_8192(8), enough])
    firsts: list[int] = []

    def send(target, units, *, first_index):
        firsts.append(first_index)
        return {"units": dict(units), "requests": 5 * sum(units.values()), "posts": sum(units.values())}

    monkeypatch.setattr(moe_speed, "send_units", send)
    sent = {"requests": 100, "posts": 40}
    # the reading that wanted nothing is the workload's as it stands: _timed takes it, waits for no flusher
    assert moe_speed.top_up(None, lambda: next(readings), sent) is enough
    wanted = {
        "M>=4096": {"size": 8192, "called": 8, "calls": MIN_CALLS, "reason": "min_calls"}
    }  # the last round's
    assert sent["top_up"] == {
        "units": {"M>=4096": 3 + 1},
        "requests": 20,
        "posts": 4,
        "rounds": 2,
        "wanted": wanted,
    }
    assert sent["requests"] == 120 and sent["posts"] == 44 and firsts == [100, 115]


def test_top_up_stops_after_its_rounds_or_when_nothing_can_be_sent(monkeypatch):
    from moe_eval.evaluate import moe_speed

    reads: list[int] = []

    def read():
        reads.append(1)
        return _at_8192(1)  # never enough

    monkeypatch.setattr(
        moe_speed, "send_units", lambda t, units, *, first_index: {"units": units, "requests": 1, "posts": 1}
    )
    sent = {"requests": 0, "posts": 0}
    assert moe_speed.top_up(None, read, sent) is None  # its last round sent after its reading: read again
    assert sent["top_up"]["rounds"] == moe_speed.TOP_UP_ROUNDS == len(reads)
    # a server that cannot make such calls: one reading, nothing sent, nothing recorded
    monkeypatch.setattr(
        moe_speed, "send_units", lambda t, units, *, first_index: {"units": {}, "requests": 0, "posts": 0}
    )
    sent = {"requests": 7, "posts": 7}
    short = _at_8192(1)
    assert moe_speed.top_up(None, lambda: short, sent) is short
    assert sent == {"requests": 7, "posts": 7}
    # enough already: no round, and that reading stands
    enough = _at_8192(MIN_CALLS)
    assert moe_speed.top_up(None, lambda: enough, sent) is enough
    assert sent == {"requests": 7, "posts": 7}


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
    assert (1 <= top_up.get("rounds", 0) <= 3) == bool(top_up["units"])  # each round read anew


def test_top_up_prompts_continue_after_the_sweeps_and_never_repeat_one(monkeypatch):
    """Prefix caching would shorten a call whose prompt was sent before: the top-up's prompts start after the
    sweep's (first_index = the sweep's requests), and what it reports sent is what it sent."""
    from moe_eval.evaluate import layer_sweep

    posted: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        layer_sweep.SweepTarget, "post", lambda target, payloads, concurrency: posted.extend(
            tuple(p["prompt"]) for p in payloads
        ) or len(layer_sweep.together(payloads, concurrency))
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
        "posts": 0,
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
    (cell,) = timer.snapshot()["sizes"]
    assert cell[0] == 3  # the cell of 3-token calls
    row = dict(zip(moe_timing.CELL_FIELDS, cell[1:], strict=True))
    assert (row["calls"], row["replayed"], row["tokens"]) == (102, 100, 306)
    assert 0.95 * row["ns"] < row["replayed_ns"] < row["ns"]
    assert row["yard_calls"] == 2 and row["yard_ns"] > 0  # the yardstick followed the two eager calls only
    assert int(timer._timeouts[0]) == int(timer._yard_timeouts[0]) == 0  # every gated start was released


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_yardstick_never_gives_up_at_a_size_it_had_not_run_at(tmp_path):
    """Served on an H100 (2026-12-07), every row's yardstick gave up once at each size first called inside
    the timed requests (a shape's first matmul: host work past the 10 ms gate), which kept the speed gate from
    reading any size against it. Eager calls at 24 sizes new to the process, each the first of its size, the
    canary's D in bf16: no wait gives up, and each size's yardstick reads what a second call of it reads."""
    timer = MoeTimer("triton", tmp_path / "t.json", "probe")
    timer.attach_device(torch.device("cuda"))
    assert timer.snapshot()["timed_on"] == "device", timer.device_problem
    sizes = [300 + 331 * i for i in range(24)]  # 300..7913 tokens, none of them run before here
    for tokens in sizes + sizes:
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        timer.stop(timer.start(x), x)
    torch.cuda.synchronize()
    assert int(timer._timeouts[0]) == int(timer._yard_timeouts[0]) == 0
    for tokens in sizes:
        calls, ns, ns_sq = timer.yard_table[size_cell(tokens)][
            [moe_timing.CALLS, moe_timing.NS, moe_timing.NS_SQ]
        ].tolist()
        mean = ns / calls
        spread = math.sqrt(max(ns_sq / calls - mean * mean, 0.0))
        assert calls == 2 and spread < 0.5 * mean and mean < 500_000, (tokens, mean, spread)


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


def test_slow_range_delays_only_its_ranges_calls_by_their_own_time_on_the_host(tmp_path):
    """slow_range:range=R,pct=P: the timer's end stamp holds the calls of R until they took (1 + P/100) x
    their own time (the host timer here; the device's: tests/kernels/test_timer_kernels.py and
    benchmarks/device/slowdown_probe.py), the others as before."""
    from moe_eval.kernels.mutations import parse_mutation, slowdown

    spec = parse_mutation("slow_range:range=M=2-16,pct=50")
    assert (slowdown(spec, 8), slowdown(spec, 1), slowdown(spec, 17), slowdown(None, 8)) == (0.5, 0, 0, 0)
    timer = MoeTimer("torch", tmp_path / "t.json", "s")

    def timed(tokens: int) -> float:
        """One call's time as the timer's table took it, ms."""
        before = timer.table[tokens][1].item()
        hidden = torch.zeros(tokens, 4)
        started = timer.start(hidden)
        until = time.perf_counter_ns() + 2_000_000  # a call of a steady 2 ms
        while time.perf_counter_ns() < until:
            pass
        timer.stop(started, hidden, slow=slowdown(spec, tokens))
        return (timer.table[tokens][1].item() - before) / 1e6

    # The fastest of five: a busy 2-core machine can preempt a 2 ms spin (a plain call's mean read 3.7 ms
    # while a CI run shared the machine), and preemption only ever adds.
    slowed, plain = min(timed(8) for _ in range(5)), min(timed(1) for _ in range(5))
    assert 2.9 < slowed < 3.5 and 1.9 < plain < 2.5, (slowed, plain)
    assert parse_mutation("slow_range").pct == 5.0 and parse_mutation("slow_range").high == 1  # M=1, 5 %
    assert parse_mutation("slow_range:range=M>=4096,pct=10").low == 4096


def test_slow_range_needs_the_timer(tmp_path):
    from moe_eval.core.errors import ConfigError
    from moe_eval.kernels.mutations import check_mutation

    config = SimpleNamespace(moe_backend="torch", path=tmp_path / "c.yaml", layout=None, moe_timing=False)
    with pytest.raises(ConfigError, match="moe_timing false"):
        check_mutation("slow_range:pct=10", config)


def test_the_host_timer_counts_the_experts_each_call_routed_to(tmp_path):
    timer = MoeTimer("torch", tmp_path / "t.json", "s")
    for ids in ([[0, 1], [1, 2]], [[3, 3], [3, 3]]):
        hidden = torch.zeros(2, 4)
        timer.stop(timer.start(hidden), hidden, torch.tensor(ids))
    cell = dict(zip(moe_timing.FIELDS, timer.table[2].tolist(), strict=True))
    assert (cell["calls"], cell["experts"], cell["experts_sq"]) == (2, 3 + 1, 9 + 1)


def test_slow_range_refuses_a_slowdown_it_cannot_make():
    from moe_eval.core.errors import ConfigError
    from moe_eval.kernels.mutations import parse_mutation

    for bad in ("slow_range:pct=0", "slow_range:pct=-5", "slow_range:pct=x", "slow_range:scale=2"):
        with pytest.raises(ConfigError, match="slow_range"):
            parse_mutation(bad)


def test_slow_range_slows_eager_calls_by_eager_pct_and_captured_ones_by_pct():
    """One row shows the gate's power in every range at once: 5 % where graphs replay, 10 % where calls run
    eagerly (each range is judged on its own calls)."""
    from moe_eval.kernels.mutations import parse_mutation, slowdown

    spec = parse_mutation("slow_range:range=all,pct=5,eager_pct=10")
    assert (slowdown(spec, 8, captured=True), slowdown(spec, 8), slowdown(spec, 5000)) == (0.05, 0.1, 0.1)
    plain = parse_mutation("slow_range:range=all,pct=5")
    assert slowdown(plain, 8, captured=True) == slowdown(plain, 8) == 0.05  # eager_pct defaults to pct
    from moe_eval.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parameter eager_pct='0' is not valid"):
        parse_mutation("slow_range:eager_pct=0")


def test_the_gates_give_ups_count_per_timed_window_and_an_unsaid_bracket_is_never_gated():
    """A process's give-ups are counted since it started: the harness keeps the timed window's (since), the
    summary sums them, and a timer file from before the gate says nothing, which the summary names."""
    gated = "gated: the start stamp waits for the host's last launch of the call; 3 waits gave up"
    cell = (4.0, 4000.0, 4e6, 4.0 * 600, 0.0, 0.0, 0.0, 0.0, 0.0)
    before = moe_timing.ProcessTiming(1, "triton", "s", "device", {}, {600: cell}, eager_bracket=gated,
                                      gate_timeouts=3)  # fmt: skip
    after = dataclasses.replace(before, sizes={600: tuple(2 * v for v in cell)}, gate_timeouts=5)
    window = moe_timing.since([after], [before])
    assert window[0].gate_timeouts == 2
    assert moe_timing.summarize(window).gate_timeouts == 2
    assert moe_timing.summarize(moe_timing.since([before], [before])).gate_timeouts == 0
    old = dataclasses.replace(before, pid=2, eager_bracket=None, gate_timeouts=None)
    summary = moe_timing.summarize([before, old])
    assert summary.gate_timeouts is None and "not recorded" in summary.eager_brackets


def test_the_timed_workload_reads_the_timers_twice_when_nothing_is_topped_up(monkeypatch, tmp_path):
    """The top-up's reading that wanted nothing is already the whole workload's: the speed measurement takes
    it, so a row reads the timers twice (before and after) where nothing was topped up, not three times, and
    where every process has flushed since, neither reading waits."""
    from moe_eval.evaluate import moe_speed

    reads: list[int] = []
    sleeps: list[float] = []
    _write(tmp_path, _stamped(7, 60.0))  # every process has flushed since
    read_folder = moe_speed.moe_timing.read_folder
    monkeypatch.setattr(
        moe_speed.moe_timing, "read_folder", lambda run_dir: reads.append(1) or read_folder(run_dir)
    )
    monkeypatch.setattr(moe_speed.time, "sleep", sleeps.append)
    monkeypatch.setattr(
        moe_speed, "sweep", lambda target, first_index=0: {"requests": 10, "posts": 5, "seconds": 0.1}
    )
    target = SimpleNamespace(prefix_cache_hits=lambda: 0)
    sent, summary = moe_speed._timed(target, tmp_path, eager_margin=None)  # type: ignore[arg-type]
    assert len(reads) == 2 and sleeps == [] and summary.ranges == ()  # nothing called between the two
    assert "top_up" not in sent and sent["prefix_cache_hit_tokens"] == 0


def _stamped(pid: int, seconds_from_now: float | None) -> dict:
    record = _process(pid, {600: (1, 1000.0, 1e6, 600)})
    if seconds_from_now is not None:
        record["snapshot_at"] = time.time() + seconds_from_now
    return record


def _read_with(monkeypatch, tmp_path, clock: FakeClock, expected=()) -> list[moe_timing.ProcessTiming]:
    from moe_eval.evaluate import moe_speed

    monkeypatch.setattr(moe_speed.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(moe_speed.time, "sleep", clock.sleep)
    return moe_speed.read_when_flushed(tmp_path, expected=expected)


def test_a_reading_waits_until_every_process_has_copied_its_table_since(monkeypatch, tmp_path):
    """Two processes, one of them stale (its copy from before the call): the reading waits until that one's
    flusher writes a copy stamped after the call (here at the third look), then returns both, fresh."""
    _write(tmp_path, _stamped(7, 60.0), _stamped(8, -1.0))
    clock = FakeClock(lambda n: n == 2 and _write(tmp_path, _stamped(8, 60.0)))
    processes = _read_with(monkeypatch, tmp_path, clock)
    assert clock.sleeps == 2 and sorted(p.pid for p in processes) == [7, 8]
    assert all(p.snapshot_at is not None and p.snapshot_at > time.time() for p in processes)


def test_a_reading_never_returns_with_a_process_left_out(monkeypatch, tmp_path):
    """A file the reader could not parse (mid-rewrite on a file system without atomic renames) or a process
    of the reading before that has no file now: the look does not count, however fresh the others are. A
    missing process is waited for PAUSE_WAIT_SECONDS, then the tables are read as they are."""
    from moe_eval.core.plugin_protocol import STATS_INTERVAL_SECONDS
    from moe_eval.evaluate.moe_speed import PAUSE_WAIT_SECONDS

    _write(tmp_path, _stamped(7, 60.0))
    (tmp_path / MOE_TIMING_DIR / "8.json").write_text('{"pid": 8, "backe')
    clock = FakeClock(lambda n: n == 3 and _write(tmp_path, _stamped(8, 60.0)))
    assert sorted(p.pid for p in _read_with(monkeypatch, tmp_path, clock)) == [7, 8] and clock.sleeps == 3
    (tmp_path / MOE_TIMING_DIR / "8.json").unlink()
    clock = FakeClock()
    (alone,) = _read_with(monkeypatch, tmp_path, clock, expected=[7, 8])
    looks = PAUSE_WAIT_SECONDS / (STATS_INTERVAL_SECONDS / 10)
    assert alone.pid == 7 and looks <= clock.sleeps <= looks + 1


def test_a_reading_of_timers_without_the_stamp_waits_the_two_intervals_it_replaces(monkeypatch, tmp_path):
    from moe_eval.core.plugin_protocol import STATS_INTERVAL_SECONDS

    _write(tmp_path, _stamped(7, None))
    clock = FakeClock()
    (unstamped,) = _read_with(monkeypatch, tmp_path, clock)
    waited = clock.now - 1000.0
    assert (
        unstamped.snapshot_at is None
        and 2 * STATS_INTERVAL_SECONDS <= waited <= 2.1 * STATS_INTERVAL_SECONDS + 1e-9
    )


def test_the_timer_stamps_its_copy_before_taking_it():
    """The stamp comes before the table's copy: a flusher held up between the two (the GIL, a loaded
    machine) stamps early, never late, so a copy stamped after the harness's mark holds every call before
    it."""
    from moe_eval.kernels import moe_timer

    timer = MoeTimer("torch", None, "s")
    order: list[str] = []
    table = timer.table

    class Watched:
        def clone(self):
            order.append("copy")
            return table.clone()

    timer.table = Watched()  # type: ignore[assignment]
    real_time = moe_timer.time.time
    try:
        moe_timer.time.time = lambda: order.append("stamp") or real_time()  # type: ignore[assignment]
        timer.snapshot()
    finally:
        moe_timer.time.time = real_time  # type: ignore[assignment]
    assert order == ["stamp", "copy"]


def test_the_timers_file_says_when_its_table_was_copied(tmp_path):
    """Every flush stamps its copy (so the file is rewritten at every tick); the reader reads the stamp."""
    timer = MoeTimer("torch", tmp_path / MOE_TIMING_DIR / "1.json", "s")
    before = time.time()
    timer.flush()
    (process,) = moe_timing.read_folder(tmp_path)
    assert process.snapshot_at is not None and before <= process.snapshot_at <= time.time()
    timer.flush()
    (again,) = moe_timing.read_folder(tmp_path)
    assert again.snapshot_at is not None and again.snapshot_at > process.snapshot_at
