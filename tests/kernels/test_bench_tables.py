"""The benchmark's issue-23 verdict (`bench_fused_moe.prefill_tables`) on hand-made rows: which
cells miss, how a miss is marked, and that one miss fails the whole run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_fused_moe as bench  # noqa: E402


def _row(shape: str, M: int, impl: str, us: float, frac: float = 0.9, err: float = 3e-3) -> dict:
    model, layout = shape.rsplit(" ", 1)
    return {"model": model, "layout": layout, "M": M, "impl": impl, "median_us": us, "frac_roofline": frac,
            "rel_err": err}  # fmt: skip


def _rows(
    fi_4096: float = 110.0, frac_4096: float = 0.8, m1_us: float = 20.0, err: float = 3e-3
) -> list[dict]:
    shape = "Qwen3-30B-A3B TP1"
    return [
        _row(shape, 1, "triton", m1_us), _row(shape, 1, "flashinfer_cutlass", 40.0),
        _row(shape, 1, "vllm_triton", 30.0),
        _row(shape, 4096, "triton", 100.0, frac_4096, err), _row(shape, 4096, "flashinfer_cutlass", fi_4096),
        _row(shape, 4096, "vllm_triton", 120.0),
        # A shape outside the issue's list counts for nothing.
        _row("Mixtral-8x7B TP1", 4096, "triton", 100.0, 0.1),
        _row("Mixtral-8x7B TP1", 4096, "vllm_triton", 50.0),
    ]  # fmt: skip


def test_every_target_met():
    text, ok = bench.prefill_tables(_rows())
    assert ok, text
    assert "2 of 2 cells at >= 1.00" in text and "Mixtral-8x7B TP1" not in text
    assert "Decode: Qwen3-30B-A3B TP1 M=1 bundled whole call 20.0 us (target <= 22 us): PASS" in text


def test_a_peer_ahead_fails_and_is_marked():
    text, ok = bench.prefill_tables(_rows(fi_4096=95.0))
    assert not ok
    assert "| Qwen3-30B-A3B TP1 | 2.00 | **0.95** |" in text and "1 of 2 cells at >= 1.00" in text


def test_roofline_decode_and_a_wrong_output_each_fail():
    for rows, mark in (
        (_rows(frac_4096=0.7), "**70%**"),
        (_rows(m1_us=23.0), "(target <= 22 us): FAIL"),
        (_rows(err=2e-2), "WRONG"),
    ):
        text, ok = bench.prefill_tables(rows)
        assert not ok and mark in text, text


def test_probe_report_is_the_docs_table():
    # docs/perf.md's probe table is `prefill_probe.py --report` of the committed rows.
    import prefill_probe

    rows_path = Path(__file__).resolve().parents[2] / "docs/data/prefill_probe_h200.jsonl"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    table = prefill_probe.ratio_table(rows)
    assert (
        "| Mixtral-8x7B TP2 | 16384 | 10397.8 | 0.853 | 0.855 | 1.140 | 0.982 | 0.967 | 0.991 | 0.827 |"
        in table
    )
    docs = (rows_path.parents[1] / "perf.md").read_text()
    assert (
        "| Mixtral-8x7B TP2 | 16384 | 10397.8 | 0.853 | 0.855 | 1.140 | 0.982 | 0.967 | 0.991 | **0.827** |"
        in docs
    )


def test_three_peer_report_is_the_docs_table():
    # docs/perf.md's issue-23 tables are `bench_fused_moe.py --report-only --prefill-targets` of the
    # committed rows, verbatim: a re-run that changes the rows must change the docs with them.
    rows_path = Path(__file__).resolve().parents[2] / "docs/data/bench_prefill_h200.jsonl"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    table, ok = bench.prefill_tables(rows)
    assert not ok  # the roofline and decode targets are missed (docs/perf.md says where and why)
    assert "49 of 49 cells at >= 1.00" in table
    assert table in (rows_path.parents[1] / "perf.md").read_text()


def test_bounds_report_is_the_docs_table():
    # Issue 34's prefill run (docs/perf.md, "Prefill: the cells under 75 %"): the tables, the grouped-GEMM
    # bound's among them, are `--report-only --prefill-targets` of the committed rows, verbatim.
    data = Path(__file__).resolve().parents[2] / "docs/data"
    rows = [
        json.loads(line)
        for line in (data / "prefill_bounds_h200_rows.jsonl").read_text().splitlines()
        if line
    ]
    table, ok = bench.prefill_tables(rows)
    assert not ok and "21 of 21 cells at >= 1.00" in table
    assert "| Qwen3-30B-A3B TP2 | 0.92 (64%) | 0.99 (49%) | 1.07 (68%) |" in table
    assert table.strip() in (data.parent / "perf.md").read_text()


def test_miss_causes_are_the_docs_table():
    # docs/perf.md's table of the misses' causes is `prefill_misses.py` of the committed rows and meta
    # with the shipped tuned files (their tiles and stage timings).
    import prefill_misses

    data = Path(__file__).resolve().parents[2] / "docs/data"
    rows = [json.loads(line) for line in (data / "bench_prefill_h200.jsonl").read_text().splitlines() if line]
    misses = prefill_misses.miss_rows(rows, json.loads((data / "bench_prefill_h200_meta.json").read_text()))
    assert len(misses) == 21  # seven shapes x M = 1024, 4096, 16384
    table = prefill_misses.markdown(misses)
    assert "| Qwen3-30B-A3B TP1 | 4096 | 715.6 | 422.7 / 291.6 | 1.69 |" in table
    assert table in (data.parent / "perf.md").read_text()


def _decode_row(shape: str, M: int, impl: str, us: float, err: float = 3e-3) -> dict:
    # Qwen3-30B-A3B TP1 at M = 1: 8 experts x 3 x 2048 x 768 x 2 bytes = 75.5 MB, floor 17.8 us at 4238 GB/s.
    return {**_row(shape, M, impl, us, err=err), "weight_bytes": 8 * 3 * 2048 * 768 * 2}


def test_decode_verdict_takes_the_best_bundled_call_at_m1():
    """Issue 34: within 1.25 x the copy floor at M = 1; the best `triton*` whole call counts, a wrong
    output never does, a GEMMs-alone timer is no whole call, and the tuned plan gets its own line."""
    shape = "Qwen3-30B-A3B TP1"
    floor_us = 8 * 3 * 2048 * 768 * 2 / bench.DECODE_COPY_GBPS / 1e3
    rows = [_decode_row(shape, 1, "triton", 26.6), _decode_row(shape, 1, "triton_gemv_pdl", 21.0),
            _decode_row(shape, 1, "triton_gemv", 19.0, err=2e-2), _decode_row(shape, 1, "triton:gemms", 10.0),
            _decode_row(shape, 16, "triton", 100.0)]  # fmt: skip
    text, ok = bench.decode_tables(rows)
    assert ok, text
    assert f"tuned triton 26.6 us = {26.6 / floor_us:.2f}x (FAIL)" in text
    assert f"best bundled triton_gemv_pdl 21.0 us = {21.0 / floor_us:.2f}x (PASS)" in text
    assert "WRONG" in text and "| M=1 | M=16 |" in text
    text, ok = bench.decode_tables([r for r in rows if r["impl"] != "triton_gemv_pdl"])
    assert not ok, text


def test_read_verdict_takes_the_best_cut_and_the_best_right_bundled_call():
    """Issue 56: within 1.10 x the one-launch read (the best of its cuts) at M = 1, 8, 40; the best right
    `triton*` whole call counts, a miss is bold and fails the run, the peers stand beside it."""
    tp1, tp2 = "Qwen3-30B-A3B TP1", "Qwen3-30B-A3B TP2"
    rows = [
        _decode_row(tp1, 1, "bound:weights_read", 21.0), _decode_row(tp1, 1, "bound:weights_read_c4k", 20.0),
        _decode_row(tp1, 1, "triton", 23.0), _decode_row(tp1, 1, "triton_pdl", 21.9),
        _decode_row(tp1, 1, "triton_naive_forced", 15.0, err=5e-2), _decode_row(tp1, 1, "vllm_triton", 30.0),
        _decode_row(tp1, 8, "bound:weights_read", 50.0), _decode_row(tp1, 8, "triton", 54.9),
        # M = 16 is no target size: no line.
        _decode_row(tp1, 16, "bound:weights_read", 80.0), _decode_row(tp1, 16, "triton", 200.0),
    ]  # fmt: skip
    text, ok = bench.read_tables(rows)
    assert ok, text
    assert (
        "| Qwen3-30B-A3B TP1 | 1 | 20.0 | 23.0 (1.15x) | triton_pdl | 21.9 (1.09x) | 30.0 (1.50x) |" in text
    )
    assert "| Qwen3-30B-A3B TP1 | 8 | 50.0 | 54.9 (1.10x) | triton | 54.9 (1.10x) | - |" in text
    assert "| 16 |" not in text and "2 of 2 cells within 1.10x of the read." in text
    # One cell over: bold, and the run fails; decode_tables takes this verdict where reads were timed.
    rows += [_decode_row(tp2, 40, "bound:weights_read", 100.0), _decode_row(tp2, 40, "triton", 111.0)]
    text, ok = bench.read_tables(rows)
    assert not ok and "| **111.0 (1.11x)** |" in text and "2 of 3 cells" in text
    decode_text, decode_ok = bench.decode_tables(rows)
    assert not decode_ok and text in decode_text
    # Only wrong bundled calls: missed.
    text, ok = bench.read_tables([rows[0], _decode_row(tp1, 1, "triton", 20.0, err=2e-2)])
    assert not ok and "| - | **-** |" in text, text


def _stored(name: str) -> list[dict]:
    path = Path(__file__).resolve().parents[2] / "docs/data/limit_h100" / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_issue56_h100_tables_are_the_docs_tables():
    # docs/perf.md, "The bundled kernel at the one-launch read": the decode and prefill tables are
    # read_tables / prefill_tables of run 3's committed rows, verbatim, and the counts the text gives.
    perf = (Path(__file__).resolve().parents[2] / "docs/perf.md").read_text()
    decode = _stored("decode_run3_rows.jsonl")
    table, ok = bench.read_tables(decode)
    assert not ok and "10 of 21 cells within 1.10x of the read." in table
    assert table.strip() in perf
    prefill, ok = bench.prefill_tables(_stored("prefill_run3_rows.jsonl"))
    assert not ok and "20 of 21 cells at >= 1.00." in prefill and "21 of 21 cells at >= 1.00." in prefill
    assert prefill.strip() in perf
    # Run 1 (another H100, the H200's tiles): 12 of 21.
    assert "12 of 21 cells within 1.10x" in bench.read_tables(_stored("decode_run1_rows.jsonl"))[0]
    # The shipped plan ahead of both peers at every decode cell; every output right.
    by = {(r["model"], r["layout"], r["M"], r["impl"]): r for r in decode}
    cells = {k[:3] for k in by}
    assert len(cells) == 21
    for cell in cells:
        ours = by[(*cell, "triton")]["median_us"]
        assert (
            ours < by[(*cell, "vllm_triton")]["median_us"]
            and ours < by[(*cell, "flashinfer_cutlass")]["median_us"]
        )
    assert all(r.get("rel_err", 0) <= bench.CHECK_TOLERANCE for r in decode)


def test_package_peer_times_the_shipped_tiles_past_a_tuned_folder(tmp_path, monkeypatch):
    """`triton_package` is the package's file for this GPU even where MOE_EVAL_TUNED_DIR holds a fresh tuning
    (what `triton` then reads): the prefill tuning's new tiles and the shipped ones in the same replays."""
    import types

    import torch

    from moe_eval.kernels.tile_configs import (
        SHIPPED_SHAPES,
        TUNED_DIR,
        config_file_name,
        default_config,
        nearest_m,
        read_tuned_file,
        write_tuned_file,
    )

    gpu = "NVIDIA H100 80GB HBM3"
    shape = next(s for s in SHIPPED_SHAPES if s.name == "Qwen3-30B-A3B TP1")
    name = config_file_name(shape.local_experts, shape.F, shape.D, gpu)
    shipped = read_tuned_file(TUNED_DIR / name)
    fresh = {m: default_config(m, shape.local_experts, shape.top_k) for m in shipped}
    write_tuned_file(tmp_path / name, fresh, {"note": "a fresh tuning"})
    monkeypatch.setenv("MOE_EVAL_TUNED_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "_device_name", lambda case: gpu)
    for T in (1, 4096, 12000):
        case = types.SimpleNamespace(hidden_TD=torch.empty(T, 8))
        _calls, notes = bench.package_tiles_peer(shape, [case], [T])
        want = shipped[nearest_m(list(shipped), T)]
        assert json.loads(notes["config"]) == want.to_json()
        assert want != fresh[nearest_m(list(fresh), T)] or T == 1  # the folder's entry would differ
    monkeypatch.setattr(bench, "_device_name", lambda case: "NVIDIA B200")
    try:
        bench.package_tiles_peer(shape, [types.SimpleNamespace(hidden_TD=torch.empty(1, 8))], [1])
    except ValueError as e:
        assert "no tuned file" in str(e) and "B200" in str(e)
    else:
        raise AssertionError("a GPU without a package file must be refused")


def test_split_table_names_the_gemms_and_the_rest_of_the_call():
    """With `triton:gemms` timed, a prefill cell's gap to the grouped GEMMs is split: the bundled GEMMs alone
    against torch's, and the rest of the bundled call as a share of the whole."""
    shape = "Qwen3-30B-A3B TP1"
    rows = [_row(shape, 4096, "triton", 1100.0), _row(shape, 4096, "triton:gemms", 990.0),
            _row(shape, 4096, "bound:grouped_mm_gemms", 1000.0),
            _row(shape, 16384, "triton", 4000.0),
            _row(shape, 16384, "bound:grouped_mm_gemms", 3900.0)]  # fmt: skip
    by = bench.rows_by_cell(rows)
    lines = bench.bound_lines(by, [shape], [4096, 16384])
    assert f"| {shape} | 1.10 (90%) | 1.03 (90%) |" in lines
    split = lines[lines.index(next(line for line in lines if "GEMMs alone / torch" in line)) :]
    assert f"| {shape} | 0.99; 10% | - |" in split  # the GEMMs win; the rest of the call is the gap
    no_split = [r for r in rows if r["impl"] != "triton:gemms"]
    assert not any(
        "GEMMs alone / torch" in line
        for line in bench.bound_lines(bench.rows_by_cell(no_split), [shape], [4096, 16384])
    )


def test_night_prefill_table_is_the_shipped_tiles_and_the_docs_table(capsys):
    # docs/perf.md, "Issue 56's open GPU items, run": benchmarks/shipped_prefill_cells.py on the night's rows
    # and the committed H100 files, verbatim. A cell the merge replaced reads the tuned tiles' row, a cell it
    # kept (or never tried) the package's tiles' row; the count of cells over the grouped GEMMs is the text's.
    import shipped_prefill_cells as cells

    rows_path = Path(__file__).resolve().parents[2] / "docs/data/limit_h100/prefill_night_rows.jsonl"
    rows = _stored(rows_path.name)
    retuned = {"Qwen3-30B-A3B TP1": {"1024": {"outcome": "replaced"}},
               "Qwen3-30B-A3B TP2": {"16384": {"outcome": "kept shipped"}}}  # fmt: skip
    by = bench.rows_by_cell(rows)
    lines = cells.shipped_cells(rows, retuned)
    tp1 = next(line for line in lines if line.startswith("| Qwen3-30B-A3B TP1 | 1024 |"))
    tp2 = next(line for line in lines if line.startswith("| Qwen3-30B-A3B TP2 | 16384 |"))
    assert f"| {by[('Qwen3-30B-A3B TP1', 1024, 'triton')]['median_us']:.1f} | retuned |" in tp1
    assert f"| {by[('Qwen3-30B-A3B TP2', 16384, 'triton_package')]['median_us']:.1f} | shipped |" in tp2
    assert cells.main([str(rows_path), "--device", "NVIDIA H100 80GB HBM3"]) == 0
    shipped = capsys.readouterr().out.strip()
    perf = (Path(__file__).resolve().parents[2] / "docs/perf.md").read_text()
    assert shipped in perf
    assert sum(line.split(" | ")[6].startswith("**") for line in shipped.splitlines()[2:]) == 13
    assert "13 of 21 cells over" in perf
