"""benchmarks/golden_calibration_table.py counts each row once: in the run that ran it, not in a
--resume of a copy of that run (where it is carried over), nor where a copied row's config was not
selected at all."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import golden_calibration_table as table  # noqa: E402


def _row(run_root: Path, config: str) -> Path:
    path = run_root / "canary-gpu-tp" / config / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    return path


def _summary(run_root: Path, device_root: str, ran: dict[str, bool]) -> None:
    """summary.json as written on another machine: run_dir paths under that machine's folder."""
    configs = [{"run_dir": f"{device_root}/canary-gpu-tp/{c}", "resumed": r} for c, r in ran.items()]
    (run_root / "summary.json").write_text(json.dumps({"configs": configs}))


def test_a_resumed_or_unselected_row_is_not_counted_again(tmp_path):
    mutated = tmp_path / "mutate-x"
    vllm, triton, fi = (_row(mutated, c) for c in ("vllm-triton", "triton", "fi-cutlass"))
    _summary(mutated, "/tmp/golden-tp/mut-x", {"vllm-triton": True, "triton": False})
    assert not table._ran_in_its_run(vllm, tmp_path)  # carried over by --resume
    assert table._ran_in_its_run(triton, tmp_path)  # ran mutated here
    assert not table._ran_in_its_run(fi, tmp_path)  # copied with the shipped run, not selected


def test_a_run_folder_without_summary_counts_whole(tmp_path):
    assert table._ran_in_its_run(_row(tmp_path / "old", "triton"), tmp_path)
