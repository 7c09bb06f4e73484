"""The scheduler's dependency rule without servers: a baseline row kept by --resume is never waited for."""

from __future__ import annotations

from pathlib import Path

from moe_eval.devices import DevicePool
from moe_eval.scheduler import Planned, Scheduler, SchedulerOptions
from moe_eval.worker import Job


class _Recorder(Scheduler):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.launched: list[int] = []

    def _launch(self, planned: Planned, devices: list[int] | None) -> None:
        self.launched.append(planned.index)


def _scheduler(planned: list[Planned]) -> _Recorder:
    job = Job(config_path="", run_root=str(Path("/nonexistent")), hw="cpu", parent_pid=0)
    return _Recorder(planned, SchedulerOptions(job=job, pool=DevicePool("cpu", (0, 1)), jobs=None), object())


def test_a_dependency_kept_by_resume_does_not_hold_its_dependent_back():
    # Index 0 (the baseline) was kept from the earlier run: only index 1 is scheduled.
    scheduler = _scheduler([Planned(1, None, 1, depends_on=0)])
    scheduler._start_what_fits()
    assert scheduler.launched == [1]


def test_a_scheduled_dependency_is_still_waited_for():
    scheduler = _scheduler([Planned(0, None, 1), Planned(1, None, 1, depends_on=0)])
    scheduler._start_what_fits()
    assert scheduler.launched == [0]
