"""benchmarks/retuned_entries.py on hand-made rows and files: a retuned entry replaces the shipped one only
where the whole call on it was faster in every repeat of the run; every size tried is on the record."""

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
import retuned_entries  # noqa: E402

GPU = "NVIDIA H100 80GB HBM3"
SHAPE = "Qwen3-30B-A3B TP1"  # e=128, F=768, D=2048
SHIPPED = MoeTileConfig(
    128, GemmTile(64, 64, num_warps=8, num_stages=3), GemmTile(128, 64, num_warps=8, num_stages=3)
)
FRESH = MoeTileConfig(
    128, GemmTile(128, 64, num_warps=8, num_stages=4), GemmTile(128, 64, num_warps=4, num_stages=4)
)


def _row(
    M: int, impl: str, repeats: list[float], tiles: MoeTileConfig | None = None, err: float = 3e-3
) -> dict:
    """A benchmark row: `triton` timed the tuned tiles (FRESH where retuned), `triton_package` SHIPPED."""
    model, layout = SHAPE.rsplit(" ", 1)
    tiles = tiles or (SHIPPED if impl == "triton_package" else FRESH)
    return {"model": model, "layout": layout, "M": M, "impl": impl, "median_us": sorted(repeats)[1],
            "repeat_medians_us": repeats, "config": json.dumps(tiles.to_json()), "rel_err": err}  # fmt: skip


def test_replaced_only_where_faster_in_every_repeat(tmp_path):
    base, tuned, out = tmp_path / "base", tmp_path / "tuned", tmp_path / "out"
    for d in (base, tuned, out):
        d.mkdir()
    name = config_file_name(128, 768, 2048, GPU)
    shipped = {1: SHIPPED, 1024: SHIPPED, 4096: SHIPPED, 16384: SHIPPED}
    write_tuned_file(base / name, shipped, {"edits": ["entry '1': pdl"], "measured_us": {"1": {}}})
    write_tuned_file(
        tuned / name, {**shipped, 1024: FRESH, 4096: FRESH},
        {"timings_us": {"1024": {"total_us": 300.0}, "4096": {"total_us": 900.0}, "16384": {"total_us": 3e3}},
         "command": "h200; then tune here"},
    )  # fmt: skip
    rows = [
        _row(1024, "triton", [300.0, 301.0, 299.0]), _row(1024, "triton_package", [310.0, 309.0, 311.0]),
        # Faster in two repeats of three: noise, the shipped tiles stay.
        _row(4096, "triton", [900.0, 905.0, 921.0]), _row(4096, "triton_package", [920.0, 919.0, 921.0]),
        # The tuner picked the shipped tiles: nothing to replace.
        _row(16384, "triton", [3000.0, 3001.0, 3002.0], tiles=SHIPPED),
        _row(16384, "triton_package", [3010.0, 3011.0, 3012.0]),
    ]  # fmt: skip
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--tuned", str(tuned), "--rows", str(rows_path), "--m", "1024", "4096", "16384",
            "--device", GPU, "--gpu-uuid", "GPU-x", "--date", "2026-12-07", "--base-dir", str(base),
            "--out", str(out)]  # fmt: skip
    assert retuned_entries.main(args) == 0
    written = read_tuned_file(out / name)
    assert written == {1: SHIPPED, 1024: FRESH, 4096: SHIPPED, 16384: SHIPPED}
    meta = json.loads((out / name).read_text())["meta"]
    assert {m: r["outcome"] for m, r in meta["retuned"].items()} == {
        "1024": "replaced", "4096": "kept shipped", "16384": "the tuner picked the shipped tiles"
    }  # fmt: skip
    assert meta["retuned"]["1024"]["tuner_timings_us"] == {"total_us": 300.0}
    assert meta["retuned"]["4096"]["tuned_tiles_us"] == [900.0, 905.0, 921.0]
    assert meta["edits"][0] == "entry '1': pdl" and "entry '1024': retuned" in meta["edits"][1]
    assert len(meta["edits"]) == 2 and meta["measured_us"] == {"1": {}}
    assert meta["retune_command"] == "tune here"


def test_a_size_not_timed_is_left_alone(tmp_path):
    base, tuned, out = tmp_path / "base", tmp_path / "tuned", tmp_path / "out"
    for d in (base, tuned, out):
        d.mkdir()
    name = config_file_name(128, 768, 2048, GPU)
    write_tuned_file(base / name, {1024: SHIPPED}, {})
    write_tuned_file(tuned / name, {1024: FRESH}, {"timings_us": {"1024": {"total_us": 1.0}}})
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text(json.dumps(_row(1024, "triton", [1.0, 1.0, 1.0])) + "\n")  # no triton_package row
    args = ["--tuned", str(tuned), "--rows", str(rows_path), "--m", "1024", "--device", GPU,
            "--gpu-uuid", "G", "--date", "d", "--base-dir", str(base), "--out", str(out)]  # fmt: skip
    assert retuned_entries.main(args) == 0
    assert (out / name).read_bytes() == (base / name).read_bytes()  # no record, not even an empty one


def _merge(tmp_path: Path, rows: list[dict], sizes: list[str], base: Path | None = None) -> int:
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--tuned", str(tmp_path / "tuned"), "--rows", str(rows_path), "--m", *sizes, "--device", GPU,
            "--gpu-uuid", "GPU-x", "--date", "2026-12-07", "--base-dir", str(base or tmp_path / "base"),
            "--out", str(tmp_path / "out")]  # fmt: skip
    return retuned_entries.main(args)


def _files(tmp_path: Path, tuned: dict) -> str:
    for d in ("base", "tuned", "out"):
        (tmp_path / d).mkdir()
    name = config_file_name(128, 768, 2048, GPU)
    write_tuned_file(tmp_path / "base" / name, {1024: SHIPPED, 4096: SHIPPED}, {"source": "the H200's tiles"})
    timings = {str(m): {"total_us": 1.0} for m in tuned}  # the tuner reached every size of the folder
    write_tuned_file(tmp_path / "tuned" / name, tuned, {"command": "tune here", "timings_us": timings})
    return name


def test_a_faster_wrong_output_is_never_shipped(tmp_path):
    name = _files(tmp_path, {1024: FRESH, 4096: SHIPPED})
    rows = [_row(1024, "triton", [100.0, 100.0, 100.0], err=0.2), _row(1024, "triton_package", [200.0] * 3)]
    assert _merge(tmp_path, rows, ["1024"]) == 0
    assert read_tuned_file(tmp_path / "out" / name)[1024] == SHIPPED
    outcome = json.loads((tmp_path / "out" / name).read_text())["meta"]["retuned"]["1024"]["outcome"]
    assert outcome == "kept shipped: the tuned tiles computed a wrong output"


def test_decided_on_the_recorded_times_and_the_source_says_what_was_retuned(tmp_path):
    """994.96 against 1000.0 us is faster by more than 0.5 % unrounded, by exactly 0.5 % as the file records
    it (995.0): the record is what test_tile_configs re-checks, so the script decides on it and keeps the
    shipped tiles. 990.0 is kept as retuned, and the file's source says so."""
    name = _files(tmp_path, {1024: FRESH, 4096: FRESH})
    rows = [_row(1024, "triton", [994.96] * 3), _row(1024, "triton_package", [1000.0] * 3),
            _row(4096, "triton", [990.0] * 3), _row(4096, "triton_package", [1000.0] * 3)]  # fmt: skip
    assert _merge(tmp_path, rows, ["1024", "4096"]) == 0
    meta = json.loads((tmp_path / "out" / name).read_text())["meta"]
    assert meta["retuned"]["1024"]["tuned_tiles_us"] == [995.0] * 3
    assert (
        meta["retuned"]["1024"]["outcome"] == "kept shipped"
        and meta["retuned"]["4096"]["outcome"] == "replaced"
    )
    assert read_tuned_file(tmp_path / "out" / name) == {1024: SHIPPED, 4096: FRESH}
    assert meta["source"].startswith(
        "the H200's tiles; entries [4096] retuned on this GPU (GPU-x, 2026-12-07)"
    )


def test_a_second_pass_over_the_merged_file_keeps_the_record_and_rows_of_other_tiles_are_refused(tmp_path):
    name = _files(tmp_path, {1024: FRESH, 4096: SHIPPED})
    rows = [_row(1024, "triton", [300.0] * 3), _row(1024, "triton_package", [310.0] * 3)]
    assert _merge(tmp_path, rows, ["1024"]) == 0
    first = (tmp_path / "out" / name).read_text()
    # Again, the merged file as the base (perf.md's call 3 writes into the package it reads): the same bytes.
    assert _merge(tmp_path, rows, ["1024"], base=tmp_path / "out") == 0
    assert (tmp_path / "out" / name).read_text() == first
    # Rows of a run that timed other tiles than these files: refused, nothing written.
    other = [_row(1024, "triton", [300.0] * 3, tiles=SHIPPED), _row(1024, "triton_package", [310.0] * 3)]
    (tmp_path / "out" / name).unlink()
    try:
        _merge(tmp_path, other, ["1024"])
    except SystemExit as e:
        assert "timed other tiles" in str(e)
    else:
        raise AssertionError("rows of other tiles must be refused")
    assert not (tmp_path / "out" / name).exists()


def test_a_size_the_tuner_did_not_reach_is_not_on_the_record(tmp_path):
    # A time-boxed (or crashed) tune leaves the package's entries in the tuned folder: their rows time the
    # same tiles twice, and no record may say the tuner picked them. Neither timings of their own (absent)
    # nor the package file's timings copied along count as tuned.
    base, tuned, out = tmp_path / "base", tmp_path / "tuned", tmp_path / "out"
    for d in (base, tuned, out):
        d.mkdir()
    name = config_file_name(128, 768, 2048, GPU)
    shipped = {1024: SHIPPED, 4096: SHIPPED, 16384: SHIPPED}
    write_tuned_file(base / name, shipped, {"timings_us": {"4096": {"total_us": 950.0}}})
    timings = {"1024": {"total_us": 300.0}, "4096": {"total_us": 950.0}}
    write_tuned_file(tuned / name, {**shipped, 1024: FRESH}, {"timings_us": timings, "command": "tune"})
    rows = [_row(1024, "triton", [300.0, 301.0, 299.0]), _row(1024, "triton_package", [310.0, 309.0, 311.0])]
    rows += [r for m in (4096, 16384) for r in (_row(m, "triton", [9.0, 9.0, 9.0], tiles=SHIPPED),
                                                _row(m, "triton_package", [10.0, 10.0, 10.0]))]  # fmt: skip
    assert _merge(tmp_path, rows, ["1024", "4096", "16384"]) == 0
    meta = json.loads((out / name).read_text())["meta"]
    assert list(meta["retuned"]) == ["1024"]
    assert read_tuned_file(out / name) == {**shipped, 1024: FRESH}
