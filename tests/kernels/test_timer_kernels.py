"""The MoE timer's stamp kernels (kernels/_timer_kernels.py) through Triton's interpreter on the CPU, with a
test clock that each read moves on by 1 us (the interpreter cannot read %globaltimer): the attach probe, the
cells, the distinct experts of a call's routing, and slow_range's spin. On a GPU the same kernels run with the
device clock (benchmarks/device/slowdown_probe.py)."""

from __future__ import annotations

import pytest
import torch

from moe_eval.core import moe_timing
from moe_eval.core.plugin_protocol import MOE_TIMING_DIR
from moe_eval.kernels.moe_timer import MoeTimer
from tests.kernels.conftest import HAS_GPU

pytestmark = pytest.mark.skipif(HAS_GPU, reason="the interpreter's test clock; a GPU runs the device clock")


def _timer(tmp_path) -> MoeTimer:
    timer = MoeTimer("triton", tmp_path / "t.json", "probe")
    timer.attach_device(torch.device("cpu"), device_clock=False)
    assert timer.device_problem is None and timer.snapshot()["timed_on"] == "device"
    return timer


def _cell(timer: MoeTimer, tokens: int) -> dict[str, float]:
    return dict(zip(moe_timing.FIELDS, timer.table[tokens].tolist(), strict=True))


def test_the_end_stamp_adds_the_call_and_counts_its_distinct_experts_then_clears_them(tmp_path):
    timer = _timer(tmp_path)
    hidden = torch.zeros(3, 8)
    for ids in ([[5, 9], [9, 127], [5, 5]], [[1, 1], [1, 1], [1, 1]]):
        started = timer.start(hidden)
        timer.stop(started, hidden, torch.tensor(ids, dtype=torch.int32))
        assert not timer._flags.any()  # cleared for the next call
    cell = _cell(timer, 3)
    assert (cell["calls"], cell["tokens"], cell["replayed"]) == (2, 6, 0)
    assert (cell["experts"], cell["experts_sq"]) == (3 + 1, 9 + 1)
    assert cell["ns"] > 0 and cell["experts_ns"] == pytest.approx(3 * cell["ns"] / 2 + cell["ns"] / 2)
    # a call with no routing given counts 0 experts
    timer.stop(timer.start(hidden), hidden)
    assert _cell(timer, 3)["experts"] == 4


def test_a_slowed_call_spins_until_it_took_its_own_time_again_times_the_share(tmp_path):
    """The test clock moves 1 us a read: a plain call reads 1 us; slowed by 150 % its end stamp spins until
    2.5 us have passed, and reads the clock the read after (3 us)."""
    timer = _timer(tmp_path)
    hidden = torch.zeros(1, 8)
    timer.stop(timer.start(hidden), hidden)
    timer.stop(timer.start(hidden), hidden, slow=1.5)
    plain_and_slowed = _cell(timer, 1)["ns"]
    assert plain_and_slowed == 1000 + 3000


def test_an_eager_calls_start_stamp_waits_for_the_hosts_release_or_gives_up_and_counts_it(tmp_path):
    """The interpreter runs each kernel as it is launched, before the host could release it: the gated start
    stamp waits its timeout out (5 reads of the test clock) and counts the give-up. A call released before
    its stamp ran waits for nothing. stop() releases the call after launching its end stamp."""
    timer = _timer(tmp_path)
    assert not timer.gate_eager and timer.snapshot()["eager_bracket"].startswith("host-paced")  # no CUDA
    timer.gate_eager, timer.gate_timeout_ns = True, 5000
    timer.yard_table = None  # the call's gate alone (the yardstick's bracket: its own test below)
    hidden = torch.zeros(2, 8)
    clock_before = int(timer._clock[0])
    started = timer.start(hidden)
    assert int(timer._timeouts[0]) == 1 and int(timer._clock[0]) - clock_before >= 6000  # it waited 5 us
    timer.stop(started, hidden)
    assert int(timer._release[0]) == timer._ticket  # released after the end stamp's launch
    assert _cell(timer, 2)["ns"] == 1000  # the wait is outside the bracket: one read after the start's
    timer._release[0] = timer._ticket + 1  # released before its stamp runs
    timer.stop(timer.start(hidden), hidden)
    assert int(timer._timeouts[0]) == 1
    assert (
        "gated" in timer.snapshot()["eager_bracket"]
        and "1 waits gave up" in timer.snapshot()["eager_bracket"]
    )


def test_after_repeated_give_ups_the_timer_stops_waiting_and_the_record_says_so(tmp_path):
    from moe_eval.kernels.moe_timer import GATE_MAX_TIMEOUTS

    timer = _timer(tmp_path)
    timer.gate_eager, timer.gate_timeout_ns = True, 3000
    timer.yard_table = None  # the call's gate alone
    hidden = torch.zeros(1, 8)
    for _ in range(GATE_MAX_TIMEOUTS - 1):  # give-ups, then a call released in time: the streak starts over
        timer.stop(timer.start(hidden), hidden)
    timer._release[0] = timer._ticket + 1
    timer.stop(timer.start(hidden), hidden)
    assert timer.gate_eager and int(timer._timeouts[0]) == GATE_MAX_TIMEOUTS - 1
    for _ in range(GATE_MAX_TIMEOUTS + 2):  # then GATE_MAX_TIMEOUTS in a row turn the wait off
        timer.stop(timer.start(hidden), hidden)
    assert int(timer._timeouts[0]) == 2 * GATE_MAX_TIMEOUTS - 1 and not timer.gate_eager
    assert _cell(timer, 1)["calls"] == 2 * GATE_MAX_TIMEOUTS + 2  # every call still timed
    assert "turned off" in timer.snapshot()["eager_bracket"]


def test_the_yardstick_follows_each_gated_eager_call_in_its_own_bracket_and_cell(tmp_path):
    """After a gated eager call's end stamp the timer runs the yardstick on the call's input between a gated
    start and an end stamp of its own, into the same size's row of its own table (the test clock: each
    bracket reads 1 us). A captured call (started = 1) and a host-paced one get none; the call's own cell is
    as without it; the snapshot carries the yardstick's calls, ns and squares after the call's fields."""
    import json

    timer = _timer(tmp_path)
    timer.gate_eager, timer.gate_timeout_ns = True, 3000
    hidden = torch.randn(5, 8, dtype=torch.bfloat16)
    for _ in range(3):
        timer.stop(timer.start(hidden), hidden)
        assert int(timer._release[0]) == timer._ticket  # the yardstick's bracket released too
    timer._launch_start()
    timer.stop(1, hidden)  # as if captured (start() returns 1 there): replays are not paired
    timer.gate_eager = False
    timer.stop(timer.start(hidden), hidden)  # host-paced: no yardstick either
    assert _cell(timer, 5)["calls"] == 5 and _cell(timer, 5)["ns"] == 5000
    yard = dict(zip(moe_timing.FIELDS, timer.yard_table[5].tolist(), strict=True))
    assert (yard["calls"], yard["ns"], yard["tokens"]) == (3, 3000, 15)
    # both gated starts of each call gave up in the interpreter (above), each counted on its own word: the
    # yardstick's give-ups neither turn the call's gate off nor make its calls host-paced
    assert int(timer._timeouts[0]) == 3 and int(timer._yard_timeouts[0]) == 3
    timer.flush()
    snap = json.loads((tmp_path / "t.json").read_text())
    assert snap["sizes"] == [[5, *timer.table[5].tolist(), 3.0, 3000.0, 3 * 1000.0**2]]
    assert snap["yardstick"].startswith("after each gated eager call") and snap["yardstick_timeouts"] == 3
    folder = tmp_path / "run" / MOE_TIMING_DIR
    folder.mkdir(parents=True)
    (folder / "1.json").write_text(json.dumps(snap))
    summary = moe_timing.summarize(moe_timing.read_folder(tmp_path / "run"))
    (size,) = summary.by_range()["M=2-16"].sizes
    assert (size.yard_calls, size.yard_mean_us, size.yard_spread_us) == (3, 1.0, 0.0)
    assert summary.yardstick_timeouts == 3 and summary.yardsticks[0].startswith("after each gated")


def test_the_yardstick_runs_once_outside_its_bracket_at_each_size_it_has_not_run_at(tmp_path, monkeypatch):
    """A shape's first matmul in a process does host work that outlasted the 10 ms gate on an H100 (every
    served row's yardstick gave up once at each size first called inside the timed requests): the chain runs
    once untimed, before the yardstick's ticket is taken, at each new (M, D); later calls of that size run it
    only inside the bracket."""
    timer = _timer(tmp_path)
    timer.gate_eager, timer.gate_timeout_ns = True, 3000
    runs: list[tuple[int, bool]] = []  # (M, whether a yardstick ticket was open: taken and not released)
    real_run = timer.yardstick.run

    def counted(hidden):
        runs.append((hidden.shape[0], timer._ticket > timer._released))
        return real_run(hidden)

    monkeypatch.setattr(timer.yardstick, "run", counted)
    for tokens in (5, 5, 5, 6, 5, 6):
        hidden = torch.randn(tokens, 8, dtype=torch.bfloat16)
        timer.stop(timer.start(hidden), hidden)
    assert runs == [(5, False), (5, True), (5, True), (5, True), (6, False), (6, True), (5, True), (6, True)]
    yard = timer.yard_table
    assert (int(yard[5][0]), int(yard[6][0])) == (4, 2)  # the untimed runs are in no cell
    assert timer.yardstick.prepare(torch.zeros(6, 16)) is True  # another D is another shape


def test_a_yardstick_that_raises_stops_and_says_why_and_the_call_goes_on(tmp_path, monkeypatch):
    """Out of memory at a large call, say: the yardstick's start stamp is released (it would otherwise wait
    its timeout out), the request is not failed for the timer's sake, and the record says why it stopped."""
    timer = _timer(tmp_path)
    timer.gate_eager, timer.gate_timeout_ns = True, 3000
    hidden = torch.zeros(2, 8)

    def fails(_hidden):
        raise torch.OutOfMemoryError("CUDA out of memory (made up)")

    timer.yardstick.prepare(hidden)  # this size run once already: the raise comes inside the bracket
    monkeypatch.setattr(timer.yardstick, "run", fails)
    before = timer._ticket
    timer.stop(timer.start(hidden), hidden)
    # the call's ticket and the yardstick's: both taken, both released
    assert timer._ticket == before + 2 and int(timer._release[0]) == timer._ticket
    assert timer.yard_table is None
    assert timer.snapshot()["yardstick"].startswith("stopped: OutOfMemoryError: CUDA out of memory")
    timer.stop(timer.start(hidden), hidden)  # later calls are timed, with no yardstick
    assert _cell(timer, 2)["calls"] == 2 and timer.snapshot()["sizes"][0][-3:] == [0.0, 0.0, 0.0]


def test_the_yardstick_is_off_with_moe_eval_yardstick_0(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_EVAL_YARDSTICK", "0")
    timer = _timer(tmp_path)
    timer.gate_eager, timer.gate_timeout_ns = True, 3000
    hidden = torch.zeros(2, 8)
    timer.stop(timer.start(hidden), hidden)
    assert timer.yard_table is None and timer.snapshot()["sizes"][0][-3:] == [0.0, 0.0, 0.0]
    assert timer.snapshot()["yardstick"] == "off (MOE_EVAL_YARDSTICK=0)"
