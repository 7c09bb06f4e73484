"""Write a GPU's tuned files from another GPU's tiles plus what was tuned and measured on it (issue 56).

The H100 had one tuned file (Qwen3-30B-A3B TP1, the H200's tiles); every other shipped shape ran the
default heuristic there. `benchmarks/device/limit_bench.sh STAGES="tune decode"` tunes the aligned decode
sizes (M = 8, 40) on the GPU at hand, merged into the H200's files under that GPU's name (`tuned.tgz`),
and times the result beside `triton_pdl` / `triton_nopdl` and the heuristic (`triton_default`). This
script turns that into the shipped files: each entry the tuner wrote keeps its tiles; `pdl` is set on a
tl.dot pointer entry where `triton_pdl` was faster than `triton_nopdl` at that entry's M by at least
PDL_MIN_GAIN in every repeat (not noise), and each file's meta says which entries came from where, with
the measured times.

Usage: python benchmarks/borrowed_tile_files.py --tuned DIR --rows decode_rows.jsonl
       [--more-rows prefill_rows.jsonl] --device "NVIDIA H100 80GB HBM3" --gpu-uuid GPU-... --date YYYY-MM-DD
       --out moe_eval/kernels/tuned_configs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from bench_fused_moe import (
    faster_in_every_repeat,
    one_launch_read,
    repeat_medians,
    rows_by_cell,
)  # beside this

from moe_eval.kernels.tile_configs import (
    SHIPPED_SHAPES,
    TUNED_DIR,
    config_file_name,
    nearest_m,
    read_tuned_file,
    write_tuned_file,
)

PDL_MIN_GAIN = 0.005  # 0.5 %: the repeats of one run agree within ~0.3 % at these sizes (H100, 2026-12-07)


def _rows_by_cell(paths: list[Path]) -> dict[tuple[str, int, str], dict]:
    return rows_by_cell(
        json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()
    )


def pdl_pays(by: dict, shape: str, M: int) -> bool:
    """triton_pdl faster than triton_nopdl in every repeat by PDL_MIN_GAIN of the slower one."""
    on, off = by.get((shape, M, "triton_pdl")), by.get((shape, M, "triton_nopdl"))
    if not on or not off:
        return False
    return faster_in_every_repeat(repeat_medians(on), repeat_medians(off), PDL_MIN_GAIN)


def measured(by: dict, shape: str, M: int) -> dict:
    names = {"triton": "these_tiles_us", "triton_pdl": "these_tiles_with_pdl_us",
             "triton_nopdl": "these_tiles_without_pdl_us", "triton_default": "default_heuristic_us",
             "vllm_triton": "vllm_0.32.0_triton_us",
             "flashinfer_cutlass": "flashinfer_cutlass_us"}  # fmt: skip
    out = {
        label: round(by[(shape, M, impl)]["median_us"], 1)
        for impl, label in names.items()
        if (shape, M, impl) in by
    }
    read = one_launch_read(by, shape, M)
    if read is not None:
        out["one_launch_read_us"] = round(read, 1)
    return out


def inherit_naive(source: dict, configs: dict, tuned_here: list[int]) -> list[int]:
    """Entries tuned here that now serve sizes a naive source entry served (nearest in log2): they keep
    those sizes naive (`naive` applies only where it qualifies, so their own size is unchanged). Without
    it a new M = 8 entry would take M = 3 and 4 from M = 1's naive plan. Returns the entries so changed."""
    changed = []
    for m in tuned_here:
        takes = [M for M in range(1, m + 1) if nearest_m(sorted(configs), M) == m]
        if not configs[m].naive and any(source[nearest_m(sorted(source), M)].naive for M in takes):
            configs[m] = dataclasses.replace(configs[m], naive=True)
            changed.append(m)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tuned", type=Path, required=True, help="limit_bench.sh's tuned folder (tuned.tgz)")
    parser.add_argument("--rows", type=Path, required=True, help="one run's decode rows: pdl is decided here")
    parser.add_argument("--more-rows", type=Path, nargs="*", default=[],
                        help="the same run's other rows (prefill): measured_us only")  # fmt: skip
    parser.add_argument("--device", required=True)
    parser.add_argument("--gpu-uuid", required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument("--source-device", default="NVIDIA H200")
    parser.add_argument("--source-dir", type=Path, default=TUNED_DIR, help="where the source GPU's files are")
    parser.add_argument("--tuned-m", type=int, nargs="+", default=[8, 40], help="the sizes tuned on this GPU")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    by = _rows_by_cell([args.rows])
    seen = {s for (s, _m, _i) in by}
    measured_by = {**_rows_by_cell(args.more_rows), **by}
    for shape in SHIPPED_SHAPES:
        name = config_file_name(shape.local_experts, shape.F, shape.D, args.device)
        tuned_path = args.tuned / name
        if not tuned_path.exists() or shape.name not in seen:
            continue  # a file is written only for a shape timed on this GPU
        tuned_meta = json.loads(tuned_path.read_text())["meta"]
        configs = read_tuned_file(tuned_path)
        source_name = config_file_name(shape.local_experts, shape.F, shape.D, args.source_device)
        source = read_tuned_file(args.source_dir / source_name)
        source_meta = json.loads((args.source_dir / source_name).read_text())["meta"]
        # The source GPU's files have no entry at the tuned sizes (M_GRID), so an entry there is this GPU's.
        tuned_here = [m for m in args.tuned_m if m in configs and m not in source]
        # The source's hand edits stay with the entries they name (a file holds one note or a list).
        source_edits = source_meta.get("edits", [])
        edits = list(source_edits) if isinstance(source_edits, list) else [source_edits]
        for m in inherit_naive(source, configs, tuned_here):
            edits.append(f"entry '{m}' (tuned here): naive, {args.date}, so the sizes below it that the "
                         "source's naive M = 1 entry served stay naive")  # fmt: skip
        served: dict[int, list[int]] = {}  # entry -> the measured M it serves (nearest in log2)
        for M in sorted({m for (s, m, _i) in by if s == shape.name}):
            served.setdefault(nearest_m(sorted(configs), M), []).append(M)
        for entry, entry_Ms in sorted(served.items()):
            cfg = configs[entry]
            # Only where pdl paid at every measured size the entry serves (and was measured at all there).
            if cfg.pdl_capable and not cfg.pdl and all(pdl_pays(by, shape.name, M) for M in entry_Ms):
                configs[entry] = dataclasses.replace(cfg, pdl=True)
                edits.append(f"entry '{entry}': pdl, {args.date} (triton_pdl faster than triton_nopdl by "
                             f">= {PDL_MIN_GAIN:.1%} in every repeat at M = {entry_Ms})")  # fmt: skip
        here = {str(m) for m in tuned_here}
        meta = {
            "shape": tuned_meta.get("shape", shape.name),
            "device": args.device,
            "torch": tuned_meta.get("torch"),
            "triton": tuned_meta.get("triton"),
            "date": args.date,
            "source": (
                f"entries {sorted(set(configs) - set(tuned_here))}: the tiles of {source_name} (tuned there),"
                " "
                f"not retuned on this GPU; entries {tuned_here}: tuned on this GPU ({args.gpu_uuid}); "
                "docs/perf.md 'The bundled kernel at the one-launch read'"
            ),
            # What the tuner timed here, apart from what it timed on the source GPU.
            "timings_us": {m: t for m, t in tuned_meta.get("timings_us", {}).items() if m in here},
            "variants_us": {m: v for m, v in tuned_meta.get("variants_us", {}).items() if m in here},
            "command": tuned_meta.get("command", "").split("; then ")[-1] if tuned_here else None,
            "source_timings_us": source_meta.get("timings_us"),
            "source_command": source_meta.get("command"),
            "measured_us": {
                str(M): measured(measured_by, shape.name, M)
                for M in sorted({m for (s, m, _i) in measured_by if s == shape.name})
            },  # fmt: skip
            "edits": edits,
        }
        write_tuned_file(args.out / name, configs, meta)
        print(f"{shape.name}: {name}: tuned here {tuned_here}, edits {edits[-3:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
