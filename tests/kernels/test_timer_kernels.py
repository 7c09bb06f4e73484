"""The MoE timer's stamp kernels (kernels/_timer_kernels.py) through Triton's interpreter on the CPU, with a
test clock that each read moves on by 1 us (the interpreter cannot read %globaltimer): the attach probe, the
cells, the distinct experts of a call's routing, and slow_range's spin. On a GPU the same kernels run with the
device clock (benchmarks/device/slowdown_probe.py)."""

from __future__ import annotations

import pytest
import torch

from moe_eval.core import moe_timing
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
