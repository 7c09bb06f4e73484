"""Write a tuned-tile file of *other* valid tiles for one layer shape: a legitimate numeric change.

For every M of the tuning grid, the config the kernel would use today (the package's tuned file, else the
default heuristic) with each GEMM's BLOCK_K changed (64 <-> 32, 128 -> 64, 16 -> 32): the K loop sums in
other chunks, so the fp32 accumulation order changes while the math stays exact. Serve it with
MOE_EVAL_TUNED_DIR=OUT (moe_eval.kernels.tile_configs); the golden gate must pass it (issue 20).

    python benchmarks/tile_variant.py OUT --experts 8 --F 128 --D 256 --top-k 2 [--device "NVIDIA H200"]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from moe_eval.kernels.tile_configs import (
    M_GRID,
    GemmTile,
    MoeTileConfig,
    config_file_name,
    fit_shared_memory,
    get_tile_config,
    write_tuned_file,
)

OTHER_BLOCK_K = {16: 32, 32: 64, 64: 32, 128: 64, 256: 128}


def other_k(tile: GemmTile) -> GemmTile:
    return replace(tile, block_k=OTHER_BLOCK_K[tile.block_k])


def variant(config: MoeTileConfig) -> MoeTileConfig:
    return fit_shared_memory(replace(config, gemm1=other_k(config.gemm1), gemm2=other_k(config.gemm2)), 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--experts", type=int, required=True, help="local experts (e)")
    parser.add_argument("--F", type=int, required=True)
    parser.add_argument("--D", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--device", default="NVIDIA H200")
    args = parser.parse_args()
    today = {
        m: get_tile_config(
            num_tokens=m,
            num_experts=args.experts,
            F=args.F,
            D=args.D,
            top_k=args.top_k,
            device_name=args.device,
        )  # fmt: skip
        for m in M_GRID
    }
    configs = {m: variant(c) for m, c in today.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / config_file_name(args.experts, args.F, args.D, args.device)
    meta = {
        "shape": f"e={args.experts} K={args.top_k} D={args.D} F={args.F}",
        "device": args.device,
        "command": "python benchmarks/tile_variant.py (today's tiles, each GEMM's BLOCK_K changed)",
        "today": {str(m): c.to_json() for m, c in today.items()},
    }
    write_tuned_file(path, configs, meta)
    print(f"wrote {path}")
    for m in M_GRID:
        print(f"M={m}: block_k {today[m].gemm1.block_k}/{today[m].gemm2.block_k} -> "
              f"{configs[m].gemm1.block_k}/{configs[m].gemm2.block_k}")  # fmt: skip


if __name__ == "__main__":
    main()
