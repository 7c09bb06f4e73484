"""The flusher thread of a server process's stats files (kernels/stats_file.py): a tick that fails is said
once and the next tick tries again, so one bad snapshot does not end the process's record (a torch internal
assert from a table changed mid-read killed the MoE timer's flusher once on the CPU, and the row's timed
window read no call)."""

from __future__ import annotations

import json
import time

from moe_eval.kernels.stats_file import StatsFile


def test_a_failed_tick_is_said_once_and_the_flusher_goes_on(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("moe_eval.kernels.stats_file.STATS_INTERVAL_SECONDS", 0.01)
    calls = {"n": 0}

    def snapshot() -> dict:
        calls["n"] += 1
        if 2 <= calls["n"] <= 4:  # the first (start's own flush) writes; three ticks then fail alike
            raise RuntimeError("table changed mid-read")
        return {"n": calls["n"]}

    path = tmp_path / "stats.json"
    stats = StatsFile(path, snapshot, "test-flusher")
    stats.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and json.loads(path.read_text())["n"] < 5:
        time.sleep(0.01)
    assert json.loads(path.read_text())["n"] >= 5  # written again after the failures
    said = capsys.readouterr().err
    assert said.count("test-flusher: a flush failed, the next tick tries again: RuntimeError") == 1


def test_the_timer_snapshot_reads_a_copy_of_its_table(tmp_path):
    """The snapshot's rows come from one copy of the table: a table changed after the copy does not move
    them (and nonzero() never runs over a table being written)."""
    import torch

    from moe_eval.kernels.moe_timer import MoeTimer

    timer = MoeTimer("torch", tmp_path / "t.json", "s")
    hidden = torch.zeros(3, 4)
    timer.stop(timer.start(hidden), hidden)
    real_clone = torch.Tensor.clone
    copies = []

    def clone_then_change(self, *args, **kwargs):
        copy = real_clone(self, *args, **kwargs)
        if self is timer.table:
            copies.append(copy)
            timer.table[7, 0] = 1.0  # a call of another size lands while the snapshot reads
        return copy

    torch.Tensor.clone = clone_then_change
    try:
        sizes = timer.snapshot()["sizes"]
    finally:
        torch.Tensor.clone = real_clone
    assert len(copies) == 1 and [row[0] for row in sizes] == [3]


def test_the_layer_check_rewrites_its_file_where_any_table_changed():
    """A tick may copy the tables while the device writes a call (its new `rows` beside its old `cells`, its
    new `seen` beside its old `routed`); the next tick, copied after the call, must rewrite the file even
    though the counts it compared before did not move, since its flush mark then vouches for the file."""
    import numpy as np

    from moe_eval.kernels.layer_check import _same

    meta = {"layers": ["l0"], "paused": False}
    tables = (
        np.zeros((1, 7, 4, 3)),
        np.zeros((1, 7, 2)),
        np.zeros((1, 7), dtype=np.int64),
        np.zeros((1, 7, 4), dtype=np.int64),
    )
    assert _same((meta, *tables), (dict(meta), *(t.copy() for t in tables)))
    for i in range(4):
        moved = [t.copy() for t in tables]
        moved[i].flat[0] += 1
        assert not _same((meta, *tables), (meta, *moved)), i
    assert not _same((meta, *tables), ({**meta, "paused": True}, *tables))
