"""benchmarks/golden_calibration_table.py counts each row once: in the run that ran it, not in a
--resume of a copy of that run (where it is carried over), nor where a copied row's config was not
selected at all; rows of two layouts whose configs share a name stay apart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import golden_calibration_table as table  # noqa: E402

STEM = "Canary-Qwen3-MoE-BF16-torch"  # the CPU list's TP1 and TEP rows share it


def _record(group: str, config: str, mutation: str | None, ratio: float) -> dict:
    """The fields of a golden-gated row's results.json that the table reads (the power as recorded: no
    golden folder lies beside these)."""
    return {
        "config": {"moe_backend": "torch"},
        "config_path": f"configs/{group}/{config}.yaml",
        "config_name": config,
        "layout": {"describe": group},
        "mutation": mutation,
        "scores": {"strict-match": {"accuracy": 1.0}},
        "checks": [{"name": "golden_gate", "passed": ratio <= 1.1}],
        "golden": {"path": "/elsewhere/goldens/abc"},
        "golden_gate": {
            "run": {"mean_abs": 0.02 * ratio},
            "incumbent": {
                "results": "/elsewhere/run/canary-tp/vllm/results.json",
                "errors": {"mean_abs": 0.02},
            },
            "ratio": ratio,
            "p": 0.001,
            "margin": 0.1,
            "passed": ratio <= 1.1,
            "power": {"scale_error": 0.02},
        },
        "status": "passed" if ratio <= 1.1 else "failed",
        "timings": {"total_seconds": 60.0},
    }


def _row(run_root: Path, group: str, config: str, mutation: str | None = None, ratio: float = 1.0) -> Path:
    path = run_root / group / config / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_record(group, config, mutation, ratio)))
    return path


def _summary(run_root: Path, device_root: str, ran: dict[tuple[str, str], bool]) -> None:
    """summary.json as written on another machine: run_dir paths under that machine's folder."""
    configs = [{"run_dir": f"{device_root}/{g}/{c}", "resumed": r} for (g, c), r in ran.items()]
    (run_root / "summary.json").write_text(json.dumps({"configs": configs}))


def test_a_resumed_or_unselected_row_is_not_counted_again(tmp_path):
    mutated = tmp_path / "mutate-x"
    vllm, triton, fi = (_row(mutated, "canary-gpu-tp", c) for c in ("vllm-triton", "triton", "fi-cutlass"))
    _summary(
        mutated,
        "/tmp/golden-tp/mut-x",
        {("canary-gpu-tp", "vllm-triton"): True, ("canary-gpu-tp", "triton"): False},
    )
    assert not table._ran_in_its_run(vllm, tmp_path)  # carried over by --resume
    assert table._ran_in_its_run(triton, tmp_path)  # ran mutated here
    assert not table._ran_in_its_run(fi, tmp_path)  # copied with the shipped run, not selected


def test_a_run_folder_without_summary_counts_whole(tmp_path):
    assert table._ran_in_its_run(_row(tmp_path / "old", "canary-tp", STEM), tmp_path)


def test_the_table_counts_each_layouts_row_in_the_run_that_ran_it(tmp_path):
    """Run 1 ran both layouts' rows; the mutation's run (a copy of run 1, resumed) ran only TP1's: its copy
    of the TEP row, carried over, is not a mutated row, and the TP1 row of the same name is not dropped."""
    first = tmp_path / "correct-1" / "20261201-180000"
    _row(first, "canary-tp", STEM)
    _row(first, "canary-tep", STEM)
    _summary(
        first, "/device/correct-1/20261201-180000", {("canary-tp", STEM): False, ("canary-tep", STEM): False}
    )
    mutated = tmp_path / "mutate-scale_one_expert"
    _row(mutated, "canary-tp", STEM, "scale_one_expert", ratio=2.0)
    _row(mutated, "canary-tep", STEM)  # run 1's, copied
    _summary(
        mutated, "/device/mutate-scale_one_expert", {("canary-tp", STEM): False, ("canary-tep", STEM): True}
    )
    found = sorted((r["run"], r["config"], r["mutation"], r["golden_gate"]) for r in table.rows(tmp_path))
    assert found == [
        ("correct-1", f"canary-tep/{STEM}", None, True),
        ("correct-1", f"canary-tp/{STEM}", None, True),
        ("mutate-scale_one_expert", f"canary-tp/{STEM}", "scale_one_expert", False),
    ]
