"""The prefill cells of a retune run as the package now ships them: docs/perf.md's table (no GPU).

A `limit_bench.sh STAGES="tune prefill" PREFILL_PEERS="triton_package ..."` run times `triton` (the tuned
folder's tiles) beside `triton_package` (the package's tiles before the merge). After
`benchmarks/retuned_entries.py` the package ships, per cell, the tuned tiles where the file's
`meta.retuned` says "replaced" (or the tuner picked the shipped ones), else the tiles before: this prints each
cell on those tiles against torch's grouped GEMMs alone, the split of the gap (the bundled GEMMs alone, the
rest of the call) and both peers.

    python benchmarks/shipped_prefill_cells.py docs/data/limit_h100/prefill_night_rows.jsonl \
        --device "NVIDIA H100 80GB HBM3"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_moe import rows_by_cell  # noqa: E402

from moe_eval.kernels.tile_configs import (  # noqa: E402
    SHIPPED_SHAPES,
    TUNED_DIR,
    config_file_name,
)

BOUND = "bound:grouped_mm_gemms"
PEERS = ("vllm_triton", "flashinfer_cutlass")
TILES = {  # meta.retuned's outcome -> which row the package's tiles were timed as, and how the table says it
    "replaced": ("triton", "retuned"),
    "the tuner picked the shipped tiles": ("triton", "shipped (tuner agreed)"),
    "kept shipped": ("triton_package", "shipped"),
}


def _bold_if(ratio: float, missed: bool) -> str:
    return f"**{ratio:.2f}**" if missed else f"{ratio:.2f}"


def shipped_cells(rows: list[dict], retuned: dict[str, dict]) -> list[str]:
    """Markdown rows, one per (shape, M) of the run; `retuned`: shape name -> its file's meta.retuned."""
    by = rows_by_cell(rows)
    lines = [
        "| shape | M | shipped | tiles | tiles before | torch grouped GEMMs alone | shipped / grouped | "
        "bundled GEMMs alone / grouped | rest of the call | vllm_triton / shipped | flashinfer / shipped |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in SHIPPED_SHAPES:
        for M in sorted({r["M"] for r in rows}):
            us = {impl: by[(shape.name, M, impl)]["median_us"] for impl in
                  ("triton", "triton_package", "triton:gemms", BOUND, "vllm_triton", "flashinfer_cutlass")
                  if (shape.name, M, impl) in by}  # fmt: skip
            if "triton" not in us:
                continue
            outcome = retuned.get(shape.name, {}).get(str(M), {}).get("outcome", "")
            impl, tiles = TILES.get(outcome, ("triton_package", "not retuned"))
            shipped, grouped = us[impl], us[BOUND]
            cells = [
                shape.name, str(M), f"{shipped:.1f}", tiles, f"{us['triton_package']:.1f}", f"{grouped:.1f}",
                _bold_if(shipped / grouped, shipped > grouped), f"{us['triton:gemms'] / grouped:.2f}",
                f"{1 - us['triton:gemms'] / us['triton']:.0%}",
                *(_bold_if(us[peer] / shipped, us[peer] < shipped) for peer in PEERS),
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path, help="the run's prefill rows (prefill_rows.jsonl)")
    parser.add_argument("--device", required=True, help='the GPU\'s name, as "NVIDIA H100 80GB HBM3"')
    parser.add_argument("--tuned-dir", type=Path, default=TUNED_DIR, help="the files after the merge")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    retuned = {}
    for shape in SHIPPED_SHAPES:
        path = args.tuned_dir / config_file_name(shape.local_experts, shape.F, shape.D, args.device)
        if path.is_file():
            retuned[shape.name] = json.loads(path.read_text())["meta"].get("retuned", {})
    print("\n".join(shipped_cells(rows, retuned)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
