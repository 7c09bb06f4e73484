"""Waiting for the plugin's flushers (core/flushes.py, kernels/stats_file.py): the harness reads the call
counters and the layer check's tables once every live process has copied them after its last request, not
after two intervals slept blind. Real files, a fake clock."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from moe_eval.core import flushes
from moe_eval.core.plugin_protocol import FLUSHED_SUFFIX, STATS_INTERVAL_SECONDS
from moe_eval.kernels.stats_file import StatsFile
from tests.fake_clock import FakeClock

MARK = 5000.0  # the reader's moment (wall clock)


def _file(folder: Path, name: str, flushed: float | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("{}")
    if flushed is not None:
        Path(f"{path}{FLUSHED_SUFFIX}").write_text(repr(flushed))
    return path


def _wait(folders, clock: FakeClock, alive=lambda pid: True):
    return flushes.wait_for_flushes(
        folders, mark=MARK, is_alive=alive, clock=clock.monotonic, sleep=clock.sleep, wall=lambda: MARK
    )


def test_files_copied_after_the_moment_are_read_at_once(tmp_path):
    stats, layer = tmp_path / "kernel-stats", tmp_path / "layer-check"
    _file(stats, "11.json", MARK + 0.1)
    _file(layer, "11.npz", MARK + 0.2)
    _file(layer, "11-1.npz", MARK + 0.3)
    clock = FakeClock(start=0.0)
    assert _wait({stats: "*.json", layer: "*.npz"}, clock) == [] and clock.sleeps == 0


def test_a_process_behind_is_waited_for_until_its_flusher_ticks(tmp_path):
    """Two processes; one's last copy is from before the moment: the wait ends at the look after its
    flusher marks a later copy (here the third), not at a fixed two intervals."""
    stats = tmp_path / "kernel-stats"
    _file(stats, "11.json", MARK + 0.1)
    behind = _file(stats, "12.json", MARK - 0.3)
    ticked = Path(f"{behind}{FLUSHED_SUFFIX}")
    clock = FakeClock(start=0.0, on_sleep=lambda n: n == 3 and ticked.write_text(repr(MARK + 0.05)))
    assert _wait({stats: "*.json"}, clock) == [] and clock.sleeps == 3
    assert clock.now < 2 * STATS_INTERVAL_SECONDS


def test_a_file_without_a_mark_or_with_a_torn_one_counts_as_behind(tmp_path):
    stats = tmp_path / "kernel-stats"
    unmarked = _file(stats, "11.json", None)
    torn = _file(stats, "12.json", None)
    Path(f"{torn}{FLUSHED_SUFFIX}").write_text("50")  # cut mid-write: a number, but not a later one
    clock = FakeClock(start=0.0)
    assert _wait({stats: "*.json"}, clock) == [unmarked, torn]
    assert clock.now >= flushes.FLUSH_WAIT_SECONDS  # waited the whole bound, then read as they stand


def test_an_ended_process_is_not_waited_for(tmp_path):
    """A process that exited flushed for the last time at exit: its file is final, never marked again."""
    layer = tmp_path / "layer-check"
    _file(layer, "11.npz", MARK + 0.1)
    _file(layer, "99.npz", MARK - 30.0)
    clock = FakeClock(start=0.0)
    assert _wait({layer: "*.npz"}, clock, alive=lambda pid: pid != 99) == [] and clock.sleeps == 0


def test_a_row_without_the_plugin_waits_for_nothing(tmp_path):
    """vLLM's own rows: no counters, no tables (and a folder holding only the pause file or marks)."""
    layer = tmp_path / "layer-check"
    layer.mkdir()
    (layer / "paused").write_text("")
    clock = FakeClock(start=0.0)
    assert _wait({tmp_path / "kernel-stats": "*.json", layer: "*.npz"}, clock) == [] and clock.sleeps == 0


def test_the_pid_is_read_from_the_files_name():
    assert [flushes.pid_of(Path(n)) for n in ("123.json", "123-1.npz", "x.json")] == [123, 123, None]
    assert flushes.alive(os.getpid()) and flushes.alive(None)


def test_the_flusher_marks_after_every_tick_with_a_time_taken_before_its_copy(tmp_path):
    """The mark is written after the file (a reader that finds it later than its moment finds the file up to
    date) with the time before snapshot() (every call that finished before it is in the copy), and again
    at a tick whose numbers did not change (the file is not rewritten then, the mark is)."""
    path = tmp_path / "kernel-stats" / "11.json"
    mark = Path(f"{path}{FLUSHED_SUFFIX}")
    seen, copies = [], []

    def snapshot() -> dict:
        seen.append((mark.read_text() if mark.exists() else None, path.exists()))
        copies.append(time.time())
        return {"calls": 3}

    stats = StatsFile(path, snapshot, "test-flusher")
    stats.flush()
    first = float(mark.read_text())
    written = path.stat().st_mtime_ns
    stats.flush()
    assert seen == [(None, False), (repr(first), True)]  # at the copy, the mark was the tick's before
    assert first <= copies[0] <= float(mark.read_text()) <= copies[1]  # each mark taken before its copy
    assert path.stat().st_mtime_ns == written  # marked again, not rewritten
    assert json.loads(path.read_text()) == {"calls": 3}


def test_the_mark_follows_the_file_and_a_failed_write_leaves_none(tmp_path):
    """When the file is written the mark still holds the tick before's time (or none), so a reader that
    finds the tick's mark finds its file; a write that fails marks nothing new."""
    path = tmp_path / "layer-check" / "11.npz"
    mark = Path(f"{path}{FLUSHED_SUFFIX}")
    at_write, fail = [], {"now": False}

    def write(p: Path, record: dict) -> None:
        at_write.append(float(mark.read_text()) if mark.exists() else None)
        if fail["now"]:
            raise OSError("disk full")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(record))

    n = {"calls": 0}

    def snapshot() -> dict:
        n["calls"] += 1
        return dict(n)

    stats = StatsFile(path, snapshot, "test-flusher", write=write)
    stats.flush()
    first = float(mark.read_text())
    stats.flush()
    second = float(mark.read_text())
    assert at_write == [None, first] and second >= first
    fail["now"] = True
    try:
        stats.flush()
    except OSError:
        pass
    assert float(mark.read_text()) == second


def test_a_mark_at_the_moment_itself_is_behind(tmp_path):
    stats = tmp_path / "kernel-stats"
    at_mark = _file(stats, "11.json", MARK)
    assert _wait({stats: "*.json"}, FakeClock(start=0.0)) == [at_mark]


def test_a_process_that_ended_is_not_alive_whether_reaped_or_not():
    """A zombie (ended, its parent has not waited for it yet) flushes no more, like a reaped one."""
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _state(child.pid) != "Z":
        time.sleep(0.01)
    assert _state(child.pid) == "Z" and not flushes.alive(child.pid)
    child.wait()
    assert not flushes.alive(child.pid)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_the_counters_step_waits_for_both_folders_marks(tmp_path):
    """steps.ReadCounters reads the call counters once this process's counter file (kernel-stats/<pid>.json)
    and layer-check table (layer-check/<pid>.npz) are marked after its moment: each mark comes late here (a
    thread stands in for the flushers), so a wrong folder or pattern would return at once. The wait is
    recorded, and nothing is named unflushed."""
    from moe_eval import steps

    pid = os.getpid()
    counters = _file(tmp_path / "kernel-stats", f"{pid}.json", 1.0)
    counters.write_text(json.dumps({"calls": 7, "tokens": 9, "python_calls": 7, "counted_on": "host"}))
    table = _file(tmp_path / "layer-check", f"{pid}.npz", 1.0)
    late = [(0.2, counters), (0.4, table)]
    timers = [threading.Timer(t, _mark_now, (p,)) for t, p in late]
    row = SimpleNamespace(
        run_dir=tmp_path,
        config=SimpleNamespace(layer_checked=False),
        record=SimpleNamespace(serving=SimpleNamespace(bundled_kernel_calls=None)),
        timings={},
    )
    for timer in timers:
        timer.start()
    steps.ReadCounters().run(row)  # type: ignore[arg-type]
    assert row.timings["counters_wait_seconds"] >= 0.4
    assert row.record.serving.bundled_kernel_calls["calls"] == 7
    assert "read_unflushed" not in row.record.serving.bundled_kernel_calls


def test_a_flusher_that_never_marks_is_read_after_the_bound_and_named(tmp_path, monkeypatch):
    from moe_eval import steps

    monkeypatch.setattr(
        steps, "wait_for_flushes", lambda folders: flushes.wait_for_flushes(folders, timeout=0.2)
    )
    _file(tmp_path / "layer-check", f"{os.getpid()}.npz", 1.0)
    row = SimpleNamespace(
        run_dir=tmp_path,
        config=SimpleNamespace(layer_checked=False),
        record=SimpleNamespace(serving=SimpleNamespace(bundled_kernel_calls=None)),
        timings={},
    )
    steps.ReadCounters().run(row)  # type: ignore[arg-type]
    assert row.record.serving.bundled_kernel_calls["read_unflushed"] == [f"layer-check/{os.getpid()}.npz"]


def _mark_now(path: Path) -> None:
    Path(f"{path}{FLUSHED_SUFFIX}").write_text(repr(time.time()))
