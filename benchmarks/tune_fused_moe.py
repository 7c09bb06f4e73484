"""Tune the Triton fused MoE's tile configs on this GPU; write tuned_configs/E=..,F=..,D=..,device=...json.

For each shipped per-rank shape and each M of the grid: candidate BLOCK_Ms from the mean rows per
expert; for each BLOCK_M the alignment, GEMM1 and GEMM2 are timed separately (CUDA graphs over
rotated input sets, as in bench_fused_moe.py) over their candidate tiles, and the BLOCK_M with the
least alignment + best GEMM1 + best GEMM2 wins (the sum over K does not depend on the tiles).

Every candidate is compiled first by parallel worker processes into Triton's disk cache: a few
hundred variants compiled one after another would spend minutes of GPU time on the CPU.

Usage: PYTHONPATH=. python benchmarks/tune_fused_moe.py [--out-dir moe_eval/kernels/tuned_configs]
       [--shapes "Qwen3-30B-A3B TP1" ...] [--m 1 16 ...] [--workers 16] [--merge]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import itertools
import json
import multiprocessing
import sys
import time
import types
from pathlib import Path

import torch

from moe_eval.kernels.fused_moe import launch_gemm1, launch_gemm2, moe_align_block_size
from moe_eval.kernels.testing import shape_case
from moe_eval.kernels.tile_configs import (
    SHIPPED_SHAPES,
    TUNED_DIR,
    GemmTile,
    MoeShape,
    MoeTileConfig,
    config_file_name,
    read_tuned_file,
    write_tuned_file,
)

sys.path.insert(0, str(Path(__file__).parent))
from bench_fused_moe import add_shape_args, log, median_us, rotated_sets, shapes_named

# Hopper allows 227 KiB (232448 bytes) of shared memory per block, and Triton 3.6 allocates
# num_stages tiles (seen on the H200: "Required: 245760" for 3 stages of 80 KiB).
SMEM_LIMIT = 232448


def rows_per_expert(shape: MoeShape, M: int) -> float:
    """Mean rows of an expert that gets any: M*K/E slots spread over the experts they hit."""
    slots = M * shape.top_k * shape.local_experts / shape.num_experts
    hit = shape.local_experts * (1 - (1 - shape.top_k / shape.num_experts) ** M)
    return slots / max(hit, 1.0)


def block_m_candidates(rows: float) -> list[int]:
    if rows <= 4:
        return [16]
    if rows <= 24:
        return [16, 32]
    if rows <= 96:
        return [32, 64]
    return [64, 128]


def gemm_candidates(kind: int, block_m: int) -> list[GemmTile]:
    """GEMM1 computes gate and up tiles (two B tiles per stage); GEMM2 one."""
    n_b = 2 if kind == 1 else 1
    grids = []
    if block_m <= 64:
        # Weight streaming: long K steps and deep pipelines keep bytes in flight; narrow N tiles
        # give enough programs when few experts are hit. BLOCK_M = 64 is in both spaces: with
        # 64 rows per expert the layer is still bandwidth-bound (H200 run 2: Mixtral M=256 GEMM1
        # streamed 3.6 TB/s with the compute tiles against 4.3 TB/s at M=64).
        if kind == 1:
            grids.append(itertools.product([16, 32, 64, 128], [128, 256], [4], [3, 4, 5]))
        else:
            grids.append(itertools.product([32, 64, 128], [64, 128, 256], [4], [3, 4]))
    if block_m >= 64:
        # Compute-bound: wgmma-sized tiles, GROUP_M swizzle for weight reuse in L2.
        if kind == 1:
            grids.append(itertools.product([64, 128], [64, 128], [4, 8], [3, 4]))
        else:
            grids.append(itertools.product([64, 128, 256], [64, 128], [4, 8], [3, 4]))
    tiles = []
    for bn, bk, warps, stages in itertools.chain(*grids):
        tile = GemmTile(block_n=bn, block_k=bk, group_m=8, num_warps=warps, num_stages=stages)
        if stages * (block_m * bk + n_b * bk * bn) * 2 <= SMEM_LIMIT and tile not in tiles:
            tiles.append(tile)
    return tiles


def candidate_jobs(shape: MoeShape, Ms: list[int]) -> list[tuple[int, int, GemmTile]]:
    jobs = set()
    for M in Ms:
        for bm in block_m_candidates(rows_per_expert(shape, M)):
            for kind in (1, 2):
                for tile in gemm_candidates(kind, bm):
                    jobs.add((bm, kind, tile))
    return sorted(
        jobs, key=lambda j: (j[0], j[1], j[2].block_n, j[2].block_k, j[2].num_warps, j[2].num_stages)
    )


class Buffers:
    """One input set's alignment and GEMM outputs for one BLOCK_M."""

    def __init__(self, case, shape: MoeShape, block_m: int):
        self.case = case
        T = case.hidden_TD.shape[0]
        self.align = moe_align_block_size(case.topk_ids_TK, block_m, shape.local_experts, case.expert_map_E)
        x = case.hidden_TD
        self.h_PF = x.new_empty(self.align.sorted_ids_P.numel(), shape.F)
        self.y_SD = x.new_empty(T if shape.top_k == 1 else T * shape.top_k, shape.D)

    def gemm1(self, shape: MoeShape, tile: GemmTile) -> None:
        c = self.case
        launch_gemm1(c.hidden_TD, c.w13_eFD, self.h_PF, c.topk_weights_TK, self.align, shape.top_k, tile,
                     shape.apply_router_weight_on_input)  # fmt: skip

    def gemm2(self, shape: MoeShape, tile: GemmTile) -> None:
        c = self.case
        launch_gemm2(self.h_PF, c.w2_eDF, self.y_SD, c.topk_weights_TK, self.align, tile,
                     not shape.apply_router_weight_on_input)  # fmt: skip


def _precompile(shape_index: int, jobs: list[tuple[int, int, GemmTile]]) -> list[str]:
    """Worker: launch each candidate once on a small M so Triton compiles it into the disk cache."""
    shape = SHIPPED_SHAPES[shape_index]
    # Uninitialised weights compile the same kernels; random ones would cost each of the 16 workers
    # an fp32 temporary of up to 8 GB (run 1 ran the card out of memory that way).
    kw = {"dtype": torch.bfloat16, "device": "cuda"}
    weights = types.SimpleNamespace(
        w13_eFD=torch.empty(shape.local_experts, 2 * shape.F, shape.D, **kw),
        w2_eDF=torch.empty(shape.local_experts, shape.D, shape.F, **kw),
    )
    case = shape_case(shape, 8, seed=0, weights_from=weights)
    errors, buffers = [], {}
    for bm, kind, tile in jobs:
        if bm not in buffers:
            buffers[bm] = Buffers(case, shape, bm)
        try:
            (buffers[bm].gemm1 if kind == 1 else buffers[bm].gemm2)(shape, tile)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - out of shared memory and the like: skipped, logged
            errors.append(f"{shape.name} bm={bm} gemm{kind} {tile}: {type(exc).__name__}: {str(exc)[:200]}")
    return errors


def precompile(shapes: list[MoeShape], Ms: list[int], workers: int, per_task: int = 10) -> None:
    """Compile every candidate once. Shapes share compiled kernels when their constexprs agree
    (F and D are specialised only on divisibility by 16), so each variant is compiled once."""
    t0 = time.perf_counter()
    owner: dict[tuple, tuple[int, tuple[int, int, GemmTile]]] = {}
    for shape in shapes:
        for bm, kind, tile in candidate_jobs(shape, Ms):
            mul_routed = shape.apply_router_weight_on_input == (kind == 1)
            even_k = (shape.D if kind == 1 else shape.F) % tile.block_k == 0
            owner.setdefault(
                (bm, kind, tile, mul_routed, even_k), (SHIPPED_SHAPES.index(shape), (bm, kind, tile))
            )
    by_shape: dict[int, list] = {}
    for shape_index, job in owner.values():
        by_shape.setdefault(shape_index, []).append(job)
    tasks = [
        (si, jobs[i : i + per_task]) for si, jobs in by_shape.items() for i in range(0, len(jobs), per_task)
    ]
    log(f"precompiling {len(owner)} variants in {len(tasks)} tasks on {workers} workers")
    ctx = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            for errors in pool.map(_precompile, *zip(*tasks)):
                for err in errors:
                    log(f"  compile failed: {err}")
    except Exception as exc:  # noqa: BLE001 - what is left compiles inline while tuning: slower, not wrong
        log(f"precompile stopped: {type(exc).__name__}: {str(exc)[:300]}")
    log(f"precompiled in {time.perf_counter() - t0:.0f} s")


def tune_shape(shape: MoeShape, Ms: list[int]) -> tuple[dict[int, MoeTileConfig], dict]:
    base = shape_case(shape, 1, seed=7)
    configs, timings = {}, {}
    for M in Ms:
        t0 = time.perf_counter()
        cases = rotated_sets(shape, M, base)
        replays = 5 if M >= 4096 else 8
        best = None
        for bm in block_m_candidates(rows_per_expert(shape, M)):
            bufs = [Buffers(c, shape, bm) for c in cases]
            align_us = median_us(
                [lambda c=c, bm=bm: moe_align_block_size(c.topk_ids_TK, bm, shape.local_experts, c.expert_map_E) for c in cases],
                replays,
            )  # fmt: skip
            picks = {}
            for kind in (1, 2):
                scores = []
                for tile in gemm_candidates(kind, bm):
                    fn = Buffers.gemm1 if kind == 1 else Buffers.gemm2
                    try:
                        us = median_us(
                            [lambda b=b, t=tile, fn=fn: fn(b, shape, t) for b in bufs], replays, warm_s=0.01
                        )
                    except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is skipped, logged
                        log(f"  skip bm={bm} gemm{kind} {tile}: {type(exc).__name__}")
                        continue
                    scores.append((us, tile))
                if not scores:
                    break
                scores.sort(key=lambda s: s[0])
                picks[kind] = scores[0]
                if kind == 1:  # GEMM2 reads GEMM1's output: fill it with real values before timing it
                    for b in bufs:
                        b.gemm1(shape, scores[0][1])
            if len(picks) < 2:
                log(f"  {shape.name} M={M} bm={bm}: no candidate ran")
                continue
            total = align_us + picks[1][0] + picks[2][0]
            log(f"  {shape.name} M={M} bm={bm}: align {align_us:.1f} + gemm1 {picks[1][0]:.1f} + gemm2 "
                f"{picks[2][0]:.1f} = {total:.1f} us")  # fmt: skip
            if best is None or total < best[0]:
                best = (total, bm, picks, align_us)
            del bufs
        total, bm, picks, align_us = best
        configs[M] = MoeTileConfig(block_m=bm, gemm1=picks[1][1], gemm2=picks[2][1])
        timings[str(M)] = {"align_us": round(align_us, 2), "gemm1_us": round(picks[1][0], 2),
                           "gemm2_us": round(picks[2][0], 2), "total_us": round(total, 2)}  # fmt: skip
        log(f"{shape.name} M={M}: {configs[M]} ({time.perf_counter() - t0:.1f} s)")
        del cases
        torch.cuda.empty_cache()
    return configs, timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=TUNED_DIR)
    add_shape_args(parser)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument(
        "--merge", action="store_true", help="keep the entries of an existing file for M not tuned now"
    )
    args = parser.parse_args(argv)
    import triton

    # TP1 shapes first: they carry the targets, and a time-boxed run keeps what it finished.
    shapes = (
        shapes_named(args.shapes) if args.shapes else sorted(SHIPPED_SHAPES, key=lambda s: s.layout != "TP1")
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.workers > 0:
        precompile(shapes, args.m, args.workers)
    device = torch.cuda.get_device_name()
    for shape in shapes:
        t0 = time.perf_counter()
        configs, timings = tune_shape(shape, args.m)
        meta = {
            "shape": f"{shape.name}: E={shape.num_experts} e={shape.local_experts} K={shape.top_k} D={shape.D} F={shape.F}",
            "device": device, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv),
            "timings_us": timings,
        }  # fmt: skip
        path = args.out_dir / config_file_name(shape.local_experts, shape.F, shape.D, device)
        if args.merge and path.is_file():
            old = json.loads(path.read_text())
            configs = {**read_tuned_file(path), **configs}
            meta["timings_us"] = {**old["meta"].get("timings_us", {}), **timings}
            meta["command"] = f"{old['meta'].get('command')}; then {meta['command']}"
        write_tuned_file(path, configs, meta)
        log(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
