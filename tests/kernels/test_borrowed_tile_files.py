"""benchmarks/borrowed_tile_files.py on hand-made rows and files: pdl only where it paid in every repeat of
the run, over every measured size an entry serves; a tuned entry that takes sizes from a naive entry stays
naive there; the source GPU's numbers labelled apart; a shape not timed gets no file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moe_eval.kernels.tile_configs import (
    GemmTile,
    MoeTileConfig,
    config_file_name,
    read_tuned_file,
    write_tuned_file,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import borrowed_tile_files as borrowed  # noqa: E402

SHAPE = "Qwen3-30B-A3B TP2"  # e=128, F=384, D=2048, K=8
TILE = GemmTile(32, 128, num_stages=3)
ALIGNED = MoeTileConfig(16, TILE, GemmTile(64, 128, num_stages=3))
NAIVE_PDL = MoeTileConfig(16, TILE, GemmTile(64, 128, num_stages=3), naive=True, pdl=True)


def _row(M: int, impl: str, repeats: list[float]) -> dict:
    model, layout = SHAPE.rsplit(" ", 1)
    return {"model": model, "layout": layout, "M": M, "impl": impl, "median_us": sorted(repeats)[1],
            "repeat_medians_us": repeats}  # fmt: skip


def test_pdl_where_it_paid_in_every_repeat_and_naive_kept_below_a_tuned_entry(tmp_path):
    source_dir, tuned, out = tmp_path / "h200", tmp_path / "tuned", tmp_path / "out"
    for d in (source_dir, tuned, out):
        d.mkdir()
    source_configs = {1: NAIVE_PDL, 16: ALIGNED, 64: ALIGNED, 256: ALIGNED}
    name = config_file_name(128, 384, 2048, "NVIDIA H200")
    write_tuned_file(
        source_dir / name, source_configs, {"timings_us": {"1": {"total_us": 9.0}}, "command": "h200"}
    )
    here = config_file_name(128, 384, 2048, "NVIDIA H100 80GB HBM3")
    write_tuned_file(tuned / here, {**source_configs, 8: ALIGNED, 40: ALIGNED},
                     {"timings_us": {"1": {"total_us": 9.0}, "8": {"total_us": 90.0}},
                      "command": "h200; then tune here"})  # fmt: skip
    rows = [
        # M = 8: pdl faster by >= 0.5 % in all three repeats; M = 40: in two of three (noise): no edit.
        _row(8, "triton_pdl", [92.0, 91.7, 91.1]), _row(8, "triton_nopdl", [93.8, 93.7, 93.0]),
        _row(40, "triton_pdl", [196.1, 199.5, 197.9]), _row(40, "triton_nopdl", [198.6, 198.9, 199.8]),
        # M = 256: faster but by less than 0.5 % in one repeat.
        _row(256, "triton_pdl", [300.0, 300.0, 299.0]), _row(256, "triton_nopdl", [302.0, 302.0, 300.0]),
        _row(8, "triton", [93.8, 93.7, 93.0]), _row(8, "triton_default", [99.0, 99.0, 99.0]),
    ]  # fmt: skip
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "--tuned",
        str(tuned),
        "--rows",
        str(rows_path),
        "--device",
        "NVIDIA H100 80GB HBM3",
        "--gpu-uuid",
        "GPU-x",
        "--date",
        "2026-12-07",
        "--source-dir",
        str(source_dir),
        "--out",
        str(out),
    ]
    assert borrowed.main(args) == 0  # fmt: skip
    written = read_tuned_file(out / here)
    assert written[8].pdl and not written[40].pdl and not written[256].pdl and written[1] == NAIVE_PDL
    # Entry 8 takes M = 3 and 4 from the naive M = 1 entry: naive there (only where naive qualifies).
    assert written[8].naive and not written[40].naive
    meta = json.loads((out / here).read_text())["meta"]
    assert meta["timings_us"] == {"8": {"total_us": 90.0}} and meta["source_timings_us"] == {
        "1": {"total_us": 9.0}
    }
    assert meta["command"] == "tune here" and meta["source_command"] == "h200"
    expected = {"these_tiles_us": 93.7, "these_tiles_with_pdl_us": 91.7, "these_tiles_without_pdl_us": 93.7,
                "default_heuristic_us": 99.0}  # fmt: skip
    assert meta["measured_us"]["8"] == expected
    assert [e.split(":")[0] for e in meta["edits"]] == ["entry '8' (tuned here)", "entry '8'"]
    # Only shapes with rows get a file.
    assert [p.name for p in out.iterdir()] == [here]
