"""benchmarks/golden_cost_report.py: the medians of golden_cost_ab.sh's runs, pooled over its folders, the
gate's own seconds from the configs' timings, and no ratio where a run did not pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import golden_cost_report as report  # noqa: E402


def _work(root: Path, times: list[tuple[str, int, float]], gate: float = 1.5) -> Path:
    root.mkdir()
    (root / "times.txt").write_text("".join(f"{n} exit {rc} seconds {s}\n" for n, rc, s in times))
    for name, _, _ in times:
        timings = {"total_seconds": 50.0}
        if name.startswith("with-"):
            timings |= {"decode_seconds": gate, "golden_seconds": 0.5}
        path = root / name / "20261201-000000" / "canary-tp" / "torch" / "results.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"timings": timings}))
    return root


def test_medians_pool_over_folders_and_the_gate_part_is_its_timings(tmp_path, capsys):
    a = _work(tmp_path / "a", [("with-gate-1", 0, 110.0), ("without-gate-1", 0, 100.0)])
    b = _work(tmp_path / "b", [("with-gate-1", 0, 130.0), ("without-gate-1", 0, 100.0)])
    assert report.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "a/with-gate-1: 110.0 s, the gate's own 2.0 s" in out
    assert f"{b}: median with the gate 130.0 s, without 100.0 s: x1.300 (1 pairs)" in out
    assert "all: median with the gate 120.0 s, without 100.0 s: x1.200 (2 pairs)" in out


def test_a_run_that_did_not_pass_gives_no_ratio(tmp_path):
    work = _work(tmp_path / "a", [("with-gate-1", 1, 110.0), ("without-gate-1", 0, 100.0)])
    with pytest.raises(SystemExit, match="with-gate-1 exited 1"):
        report.main([str(work)])
