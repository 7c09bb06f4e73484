"""Tune the Triton fused MoE's tile configs on this GPU; write tuned_configs/E=..,F=..,D=..,device=...json.

For each cell (shipped per-rank shape x M): candidate BLOCK_Ms from the mean rows per expert, and
at few tokens the naive plan (no alignment, one block per slot; GEMM2 with or without the top-k
sum folded in) and the decode GEMVs (`gemv`: both GEMMs without tl.dot, the sum in GEMM2; their
best pair is timed once more back to back, with and without programmatic dependent launch, and that
pair's time is the plan's total; the config keeps the cell's best BLOCK_M-16 tl.dot tiles for the
calls where naive does not qualify). For each, the alignment, GEMM1 and GEMM2 are timed separately
(CUDA graphs over rotated input sets, as in bench_fused_moe.py) over their candidate tiles; the three
best tiles of each GEMM are then tried at GROUP_M 1 / 16 / 32 (a runtime argument: no compile; the
GEMVs have no GROUP_M, and ignore it). The plan with
the least alignment + GEMM1 + GEMM2 (+ the separate top-k sum where it is not folded) wins, after
a check of the whole call against the fp32 reference (a candidate that computes a wrong result
is dropped, never written). The best time of each kernel variant family (two-dot or interleaved
GEMM1, each BLOCK_M, naive or aligned, folded sum or not) goes into the file's meta, so a run
records what lost as well as what won.

GEMM2 at BLOCK_M >= 128 is also tried with TMA descriptor loads (`gemm2.tma`; the shipped shapes'
F * 2 bytes are multiples of 16, as TMA needs). Candidate tiles are pruned before anything runs: \
shared memory (227 KiB, num_stages stages, see
tile_configs.SMEM_LIMIT), the fp32 accumulator per thread (<= 128 registers: beyond it the large
tiles spill, seen in benchmarks/aot_sm90.py's ptxas reports), and tiles that cannot win a regime
(compute tiles for weight streaming and the reverse). During timing, a candidate whose first
replay is 30% slower than the best so far is not replayed further.

Every candidate is compiled first by parallel worker processes into Triton's disk cache: a few
hundred variants compiled one after another would spend minutes of GPU time on the CPU.

Usage: PYTHONPATH=. python benchmarks/tune_fused_moe.py [--out-dir moe_eval/kernels/tuned_configs]
       [--shapes "Qwen3-30B-A3B TP1" ...] [--m 1 16 ...] [--cells "Mixtral-8x7B TP2:256,1024" ...]
       [--workers 16] [--merge] [--deadline-s S]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import multiprocessing
import statistics
import sys
import time
import types
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moe_eval.kernels.fused_moe import (
    fused_moe,
    launch_gemm1,
    launch_gemm2,
    launch_gemv1,
    launch_gemv2,
    launch_sum,
    moe_align_block_size,
    naive_alignment,
    naive_qualifies,
    pdl_available,
)
from moe_eval.kernels.testing import rel_err, shape_case
from moe_eval.kernels.tile_configs import (
    SHIPPED_SHAPES,
    SMEM_LIMIT,
    TUNED_DIR,
    GemmTile,
    GemvTiles,
    MoeShape,
    MoeTileConfig,
    config_file_name,
    default_config,
    read_tuned_file,
    write_tuned_file,
)

sys.path.insert(0, str(Path(__file__).parent))
from bench_fused_moe import GraphTimer, add_shape_args, log, median_us, rotated_sets, shapes_named

# fp32 accumulator elements per thread above which a tile is dropped: 128 keeps the large-M tiles
# of both GEMMs at 198-254 registers with no spills (aot_sm90.py, triton 3.6 and 3.9, sm_90).
MAX_ACC_PER_THREAD = 128
EARLY_STOP = 1.3  # first replay this much slower than the best so far: not replayed further
GROUP_M_REFINE = (1, 16, 32)  # tried on the 3 best tiles of each GEMM (8 is the first pass's)
BF16_TOLERANCE = 1e-2  # the winner's whole call against fused_moe_ref (tests/kernels: same line)


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
        # 128 too: vLLM's H200 file runs Mixtral at M = 256 (64 rows per expert) with 128-row
        # blocks and wins there (ratio 0.95), half of each block padding. At 64 rows the layer
        # streams weights, and a 128-row block covers an expert in one M-block with a 256-wide tile.
        return [32, 64, 128]
    if rows <= 384:
        return [64, 128]
    return [128, 256]


def _fits(block_m: int, tile: GemmTile, b_tiles: int) -> bool:
    # Warp-specialized: two consumer warp groups of num_warps each share the accumulator (triton 3.6).
    warps = tile.num_warps * (2 if tile.warp_specialize else 1)
    acc = block_m * tile.block_n * b_tiles / (32 * warps)
    return tile.shared_bytes(block_m, b_tiles) <= SMEM_LIMIT and acc <= MAX_ACC_PER_THREAD


def prefill_variants(kind: int, block_m: int, tile: GemmTile) -> list[GemmTile]:
    """The persistent (prefill-path) version of a compute-bound tile. Never warp-specialized: triton
    3.6 compiles that for sm_90 only for GEMM2 at BLOCK_M 128 with 4 warps a group (GEMM1's gathered
    x loads and BLOCK_M 64 fail in its pass pipeline, benchmarks/aot_sm90.py), and those kernels hang
    on the H200 (benchmarks/prefill_probe.py, 2026-12-01: no result in 100 s, where the others took 5)."""
    if block_m < 64:
        return []
    if kind == 1:
        return [replace(tile, persistent=True)]
    return [replace(tile, tma=True, persistent=True)]


def gemm_candidates(kind: int, block_m: int) -> list[GemmTile]:
    """GEMM1 computes gate and up tiles (two B tiles per stage, as two dots or one interleaved); GEMM2 one."""
    b_tiles = 2 if kind == 1 else 1
    grids = []
    if block_m <= 64:
        # Weight streaming: long K steps and deep pipelines keep bytes in flight; narrow N tiles
        # give enough programs when few experts are hit. BLOCK_M = 64 is in both spaces: with
        # 64 rows per expert the layer is still bandwidth-bound (H200 run 2: Mixtral M=256 GEMM1
        # streamed 3.6 TB/s with the compute tiles against 4.3 TB/s at M=64).
        # 16-wide N only at 16-row blocks (few tokens): a folded GEMM2 has one program per token and
        # N tile (Qwen3 at M=1: 2048 / 16 = 128 programs for 132 SMs; 64 at N = 32).
        narrow = [16] if block_m == 16 else []
        if kind == 1:
            grids.append(itertools.product(narrow + [32, 64, 128], [128, 256], [4], [3, 4, 5]))
        else:
            grids.append(itertools.product(narrow + [32, 64, 128], [128, 256], [4], [3, 4, 5]))
    if block_m >= 64:
        # Compute-bound: wgmma-sized tiles (256-wide N: GEMM1 at BLOCK_N 128 is 2 x 128 wide),
        # 2 stages only for 128-deep K steps, GROUP_M swizzle for weight reuse in L2.
        if kind == 1:
            grids.append(itertools.product([64, 128], [64], [4, 8], [3, 4, 5]))
            grids.append(itertools.product([64, 128], [128], [4, 8], [2, 3]))
        else:
            grids.append(itertools.product([128, 256], [64], [4, 8], [3, 4, 5]))
            grids.append(itertools.product([128, 256], [128], [4, 8], [2, 3]))
    tiles = []
    for bn, bk, warps, stages in itertools.chain(*grids):
        # GEMM1: two dots or one interleaved; GEMM2 at the large-M blocks: pointer loads or TMA.
        for variant in (False, True) if kind == 1 or block_m >= 128 else (False,):
            tile = GemmTile(bn, bk, group_m=8, num_warps=warps, num_stages=stages,
                            interleave=variant and kind == 1, tma=variant and kind == 2)  # fmt: skip
            if _fits(block_m, tile, b_tiles) and tile not in tiles:
                tiles.append(tile)
    if block_m >= 64:  # the prefill path: every compute-bound tile also as a persistent grouped GEMM
        compute = [t for t in tiles if t.block_n >= 64 and t.block_k <= 128 and not t.tma]
        for tile in compute:
            for persistent in prefill_variants(kind, block_m, tile):
                if _fits(block_m, persistent, b_tiles) and persistent not in tiles:
                    tiles.append(persistent)
    return tiles


def gemv_candidates(kind: int, shape: MoeShape) -> list[GemmTile]:
    """Decode GEMV tiles (`GemvTiles`): a reduction step of 256-2048 (at most the whole of D or F rounded
    up), 4 or 8 warps, plain or 2-stage pipelined loops, and as many rows as make 32, 64 or 128 weights
    a thread a step (GEMM1: gate and up rows; GEMM2: next_pow2(K) slots of rows). Below 32 a step is
    too few bytes in flight, above 128 the registers limit the programs an SM holds."""
    reduce_dim = shape.D if kind == 1 else shape.F
    rows_per_output = 2 if kind == 1 else 1 << max(shape.top_k - 1, 0).bit_length()
    steps = [k for k in (256, 512, 1024, 2048) if k < 2 * reduce_dim]
    tiles = []
    for block_k, warps, stages, per_thread in itertools.product(steps, [4, 8], [1, 2], [32, 64, 128]):
        block_n = per_thread * 32 * warps // (rows_per_output * block_k)
        if block_n >= 1:
            tile = GemmTile(block_n, block_k, num_warps=warps, num_stages=stages)
            if tile not in tiles:
                tiles.append(tile)
    return tiles


@dataclass(frozen=True)
class Plan:
    """What one tuning branch times: a BLOCK_M, aligned or naive, (naive, K > 1) the folded sum, or
    (naive) the decode GEMVs."""

    block_m: int
    naive: bool = False
    gemv: bool = False

    def name(self) -> str:
        return f"bm={self.block_m}" + (" naive" if self.naive else "") + (" gemv" if self.gemv else "")


# The decode GEMVs join the candidates only with --gemv: no shipped file selects them yet (docs/perf.md,
# "Decode: the GEMV path"), and a routine re-tune must not ship them before a served model's layer check
# has run with them.
OFFER_GEMV = False


def plans_for(shape: MoeShape, M: int) -> list[Plan]:
    plans = [Plan(bm) for bm in block_m_candidates(rows_per_expert(shape, M))]
    if naive_qualifies(M, shape.top_k, shape.local_experts):
        plans += [Plan(16, naive=True)] + ([Plan(16, naive=True, gemv=True)] if OFFER_GEMV else [])
    return plans


def gemm2_folds(shape: MoeShape, plan: Plan) -> tuple[bool, ...]:
    # Folding the sum only matters when there is a sum (K > 1) and each block is one slot (naive); the
    # GEMV GEMM2 always sums over K itself.
    if plan.gemv:
        return (True,)
    return (False, True) if plan.naive and shape.top_k > 1 else (False,)


def plan_candidates(kind: int, shape: MoeShape, plan: Plan) -> list[GemmTile]:
    return gemv_candidates(kind, shape) if plan.gemv else gemm_candidates(kind, plan.block_m)


def candidate_jobs(shape: MoeShape, Ms: list[int]) -> set[tuple[int, int, GemmTile, bool, bool, bool]]:
    """(block_m, kind, tile, naive, fold_k, gemv) of every kernel variant the cells can time."""
    jobs = set()
    for M in Ms:
        for plan in plans_for(shape, M):
            for tile in plan_candidates(1, shape, plan):
                jobs.add((plan.block_m, 1, tile, plan.naive, False, plan.gemv))
            for fold in gemm2_folds(shape, plan):
                for tile in plan_candidates(2, shape, plan):
                    jobs.add((plan.block_m, 2, tile, plan.naive, fold, plan.gemv))
    return jobs


class Buffers:
    """One input set's slot assignment and GEMM outputs for one plan."""

    def __init__(self, case, shape: MoeShape, plan: Plan):
        self.case = case
        self.plan = plan
        T = case.hidden_TD.shape[0]
        if plan.naive:
            self.align = naive_alignment(case.topk_ids_TK, plan.block_m, case.expert_map_E)
        else:
            self.align = moe_align_block_size(
                case.topk_ids_TK, plan.block_m, shape.local_experts, case.expert_map_E
            )
        x = case.hidden_TD
        self.h_PF = x.new_empty(self.align.h_rows, shape.F)
        self.y_SD = x.new_empty(T if shape.top_k == 1 else T * shape.top_k, shape.D)
        self.out_TD = x.new_empty(T, shape.D)

    def gemm1(self, shape: MoeShape, tile: GemmTile, pdl: bool = False) -> None:
        c = self.case
        if self.plan.gemv:
            launch_gemv1(c.hidden_TD, c.w13_eFD, self.h_PF, c.topk_weights_TK, self.align, tile,
                         shape.apply_router_weight_on_input, pdl)  # fmt: skip
            return
        launch_gemm1(c.hidden_TD, c.w13_eFD, self.h_PF, c.topk_weights_TK, self.align, shape.top_k, tile,
                     shape.apply_router_weight_on_input)  # fmt: skip

    def gemm2(self, shape: MoeShape, tile: GemmTile, fold: bool = False, pdl: bool = False) -> None:
        c = self.case
        if self.plan.gemv:
            launch_gemv2(self.h_PF, c.w2_eDF, self.out_TD, c.topk_weights_TK, self.align, tile,
                         not shape.apply_router_weight_on_input, pdl)  # fmt: skip
            return
        launch_gemm2(self.h_PF, c.w2_eDF, self.out_TD if fold else self.y_SD, c.topk_weights_TK, self.align,
                     tile, not shape.apply_router_weight_on_input, fold_k=fold)  # fmt: skip

    def sum(self) -> None:
        launch_sum(self.y_SD, self.out_TD, self.case.topk_ids_TK, self.case.expert_map_E)


def _precompile(shape_index: int, jobs: list[tuple[int, int, GemmTile, bool, bool, bool]]) -> list[str]:
    """Worker: launch each candidate once on a small M so Triton compiles it into the disk cache."""
    shape = SHIPPED_SHAPES[shape_index]
    # Uninitialised weights compile the same kernels; random ones would cost each of the 16 workers
    # an fp32 temporary of up to 8 GB (run 1 ran the card out of memory that way).
    kw = {"dtype": torch.bfloat16, "device": "cuda"}
    weights = types.SimpleNamespace(
        w13_eFD=torch.empty(shape.local_experts, 2 * shape.F, shape.D, **kw),
        w2_eDF=torch.empty(shape.local_experts, shape.D, shape.F, **kw),
    )
    # Token counts are do_not_specialize: any count compiles the same variant; one token qualifies
    # for the naive plan.
    cases = {
        False: shape_case(shape, 8, seed=0, weights_from=weights),
        True: shape_case(shape, 1, seed=0, weights_from=weights),
    }
    errors, buffers = [], {}
    for bm, kind, tile, naive, fold, gemv in jobs:
        key = (bm, naive, gemv)
        if key not in buffers:
            buffers[key] = Buffers(cases[naive], shape, Plan(bm, naive, gemv))
        try:
            if kind == 1:
                buffers[key].gemm1(shape, tile)
            else:
                buffers[key].gemm2(shape, tile, fold)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - out of shared memory and the like: skipped, logged
            what = f"gemv{kind}" if gemv else f"gemm{kind}"
            errors.append(f"{shape.name} bm={bm} {what} {tile}: {type(exc).__name__}: {str(exc)[:200]}")
    return errors


# Variants whose precompile task never came back (a kernel that hangs the GPU, or a compile past the
# time limit): (block_m, kind, tile with group_m 1, naive, fold_k, gemv). They are not timed: timing one in
# this process would hang the tuner itself (2026-12-01: warp-specialized GEMM2s stalled two calls).
UNFINISHED: set[tuple] = set()


def _variant(bm: int, kind: int, tile: GemmTile, naive: bool, fold: bool, gemv: bool = False) -> tuple:
    return (bm, kind, replace(tile, group_m=1), naive, fold, gemv)


def runnable(
    block_m: int, kind: int, tiles: list[GemmTile], naive: bool, fold: bool = False, gemv: bool = False
) -> list[GemmTile]:
    """The candidates whose precompile finished (all of them when nothing was left unfinished)."""
    return [t for t in tiles if _variant(block_m, kind, t, naive, fold, gemv) not in UNFINISHED]


def precompile(
    cells: dict[MoeShape, list[int]], workers: int, per_task: int = 4, timeout_s: float = 180.0, worker=None
) -> None:
    """Compile every candidate once. Shapes share compiled kernels when their constexprs agree
    (F and D are specialised only on divisibility by 16), so each variant is compiled once. Each
    worker also runs what it compiled once, so this is the hang detector too: the variants of a task
    still out after `timeout_s` go to UNFINISHED and the workers are killed. `worker` replaces
    `_precompile` (tests: a module-level function, as spawn pickles it by name)."""
    t0 = time.perf_counter()
    owner: dict[tuple, tuple[int, tuple]] = {}
    for shape, Ms in cells.items():
        for bm, kind, tile, naive, fold, gemv in sorted(candidate_jobs(shape, Ms), key=str):
            mul_routed = shape.apply_router_weight_on_input == (kind == 1)
            even_k = (shape.D if kind == 1 else shape.F) % tile.block_k == 0
            has_map = naive and shape.local_experts != shape.num_experts
            # A GEMV GEMM2 also compiles per next_pow2(K) (its slot axis).
            k_pad = 1 << max(shape.top_k - 1, 0).bit_length() if gemv else 0
            # group_m is a runtime argument: tiles that differ only there share a compiled kernel.
            variant = (
                bm,
                kind,
                replace(tile, group_m=1),
                naive,
                fold,
                gemv,
                mul_routed,
                even_k,
                has_map,
                k_pad,
            )
            owner.setdefault(variant, (SHIPPED_SHAPES.index(shape), (bm, kind, tile, naive, fold, gemv)))
    by_shape: dict[int, list] = {}
    for shape_index, job in owner.values():
        by_shape.setdefault(shape_index, []).append(job)
    tasks = [
        (si, jobs[i : i + per_task]) for si, jobs in by_shape.items() for i in range(0, len(jobs), per_task)
    ]
    log(f"precompiling {len(owner)} variants in {len(tasks)} tasks on {workers} workers")
    ctx = multiprocessing.get_context("spawn")
    deadline = time.monotonic() + timeout_s
    # multiprocessing.Pool, not ProcessPoolExecutor: its terminate() kills a worker stuck in a kernel.
    with ctx.Pool(workers) as pool:
        pending = [(jobs, pool.apply_async(worker or _precompile, (si, jobs))) for si, jobs in tasks]
        for jobs, result in pending:
            try:
                errors = result.get(timeout=max(0.0, deadline - time.monotonic()))
            except multiprocessing.TimeoutError:
                UNFINISHED.update(_variant(*job) for job in jobs)
                continue
            except Exception as exc:  # noqa: BLE001 - the task's variants compile inline while tuning
                log(f"  precompile task failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            for err in errors:
                log(f"  compile failed: {err}")
        pool.terminate()
    if UNFINISHED:
        log(f"  {len(UNFINISHED)} variants not back within {timeout_s:.0f} s (not timed): "
            + "; ".join(f"bm={v[0]} gemm{v[1]} {v[2]}" for v in sorted(UNFINISHED, key=str)[:8]))  # fmt: skip
    log(f"precompiled in {time.perf_counter() - t0:.0f} s")


def dump_jobs(cells: dict[MoeShape, list[int]], path: Path) -> None:
    """The distinct compiled variants of the cells (as precompile() dedups them), as JSON rows."""
    from dataclasses import asdict

    jobs = {}
    for shape, Ms in cells.items():
        for bm, kind, tile, naive, fold, gemv in sorted(candidate_jobs(shape, Ms), key=str):
            if gemv:  # aot_sm90.py --jobs compiles the tl.dot GEMMs (compile_gemv for these)
                continue
            mul_routed = shape.apply_router_weight_on_input == (kind == 1)
            has_map = naive and shape.local_experts != shape.num_experts
            key = (bm, kind, replace(tile, group_m=1), naive, fold, mul_routed, has_map)
            jobs.setdefault(key, {"block_m": bm, "kind": kind, "tile": asdict(tile), "naive": naive,
                                  "fold_k": fold, "mul_routed": mul_routed, "has_map": has_map,
                                  "F": shape.F, "D": shape.D})  # fmt: skip
    path.write_text(json.dumps(list(jobs.values()), indent=0) + "\n")
    log(f"wrote {len(jobs)} variants to {path}")


def time_candidate(calls: list, replays: int, best_us: float | None) -> float:
    """Median microseconds per call; one replay only when it is already EARLY_STOP x the best."""
    timer = GraphTimer(calls)
    first = timer.replay_us()
    if best_us is not None and first > EARLY_STOP * best_us:
        return first
    timer.warm(0.01)
    return statistics.median([first] + [timer.replay_us() for _ in range(replays - 1)])


def _time_tiles(
    label: str, tiles: list[GemmTile], run, bufs, replays: int, refine_group_m: bool = True
) -> list[tuple[float, GemmTile]]:
    """(us, tile) sorted, best first; then GROUP_M variants of the three best (refine_group_m: the
    GEMVs have no GROUP_M, and GemvTiles refuses one)."""
    scores: list[tuple[float, GemmTile]] = []

    def one(tile: GemmTile) -> None:
        best = scores[0][0] if scores else None
        try:
            us = time_candidate([lambda b=b, t=tile: run(b, t) for b in bufs], replays, best)
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is skipped, logged
            log(f"  skip {label} {tile}: {type(exc).__name__}: {str(exc)[:120]}")
            return
        scores.append((us, tile))
        scores.sort(key=lambda s: s[0])

    for tile in tiles:
        one(tile)
    for _, tile in list(scores[:3]) if refine_group_m else []:
        for group_m in GROUP_M_REFINE:
            one(replace(tile, group_m=group_m))
    return scores


def _family(kind: int, plan: Plan, tile: GemmTile, fold: bool = False) -> str:
    if plan.gemv:
        return f"gemv{kind} {plan.name()}" + (" pipelined" if tile.num_stages > 1 else "")
    path = (" persistent" if tile.persistent else "") + (" ws" if tile.warp_specialize else "")
    if kind == 1:
        return f"gemm1 {plan.name()} {'interleaved' if tile.interleave else 'two-dot'}{path}"
    return f"gemm2 {plan.name()}" + (" fold_k" if fold else "") + (" tma" if tile.tma else "") + path


def _gemv_result(shape: MoeShape, M: int, bufs: list, g1: tuple, g2: tuple, results: list, replays: int,
                 note) -> tuple[float, MoeTileConfig, dict]:  # fmt: skip
    """The GEMV plan's (total, config, stages): its best GEMV pair timed back to back (one graph per call:
    GEMM1 then GEMM2), without and, where the device has it, with PDL; the faster pair's time is the
    total. The config's tl.dot tiles (for the calls where naive does not qualify) are the best BLOCK_M 16
    ones this cell timed, or the default heuristic's."""
    pair_us = {}
    for pdl in (False, True) if pdl_available(bufs[0].case.hidden_TD.device) else (False,):
        calls = [lambda b=b, p=pdl: (b.gemm1(shape, g1[1], p), b.gemm2(shape, g2[1], True, p)) for b in bufs]
        pair_us[pdl] = median_us(calls, replays)
        note(f"gemv pair bm=16 naive gemv{' pdl' if pdl else ''}", pair_us[pdl])
    pdl = min(pair_us, key=pair_us.get)
    fallback = min((r for r in results if r[1].block_m == 16), key=lambda r: r[0], default=None)
    base = fallback[1] if fallback else default_config(M, shape.local_experts, shape.top_k)
    config = MoeTileConfig(16, base.gemm1, base.gemm2, naive=True, gemv=GemvTiles(g1[1], g2[1], pdl=pdl))
    # Flat numbers, as every other plan's stages (readers of meta.timings_us take each value as us).
    pairs = {f"pair_{'pdl' if p else 'plain'}_us": round(us, 2) for p, us in pair_us.items()}
    stages = {"align_us": 0.0, "gemm1_us": round(g1[0], 2), "gemm2_us": round(g2[0], 2), "sum_us": 0.0,
              **pairs, "total_us": round(pair_us[pdl], 2)}  # fmt: skip
    log(f"  {shape.name} M={M} gemv: gemm1 {g1[0]:.1f} + gemm2 {g2[0]:.1f}; back to back "
        + ", ".join(f"{'pdl' if p else 'plain'} {us:.1f}" for p, us in pair_us.items()) + " us")  # fmt: skip
    return pair_us[pdl], config, stages


def tune_cell(shape: MoeShape, M: int, base) -> tuple[MoeTileConfig, dict, dict]:
    """(winning config, its stage timings, best us per variant family) for one (shape, M)."""
    cases = rotated_sets(shape, M, base)
    replays = 5 if M >= 4096 else 8
    K = shape.top_k
    results = []  # (total us, config, stage timings)
    families: dict[str, float] = {}

    def note(name: str, us: float) -> None:
        families[name] = round(min(us, families.get(name, float("inf"))), 2)

    sum_us = 0.0
    if K > 1:  # the separate sum's cost, added to every plan that does not fold it into GEMM2
        bufs = [Buffers(c, shape, Plan(16)) for c in cases]
        for b in bufs:
            b.y_SD.normal_()  # never time on zeros or garbage
        sum_us = median_us([b.sum for b in bufs], replays)
    for plan in plans_for(shape, M):
        bufs = [Buffers(c, shape, plan) for c in cases]
        align_us = 0.0
        if not plan.naive:
            align_us = median_us(
                [lambda c=c, bm=plan.block_m: moe_align_block_size(c.topk_ids_TK, bm, shape.local_experts,
                                                                    c.expert_map_E) for c in cases],
                replays,
            )  # fmt: skip
        g1_tiles = runnable(plan.block_m, 1, plan_candidates(1, shape, plan), plan.naive, gemv=plan.gemv)
        g1 = _time_tiles(f"{shape.name} M={M} {plan.name()} gemm1", g1_tiles,
                         lambda b, t: b.gemm1(shape, t), bufs, replays, not plan.gemv)  # fmt: skip
        if not g1:
            log(f"  {shape.name} M={M} {plan.name()}: no GEMM1 candidate ran")
            continue
        for us, tile in g1:
            note(_family(1, plan, tile), us)
        for b in bufs:  # GEMM2 reads GEMM1's output: fill it with real values before timing it
            b.gemm1(shape, g1[0][1])
        for fold in gemm2_folds(shape, plan):
            g2_tiles = runnable(plan.block_m, 2, plan_candidates(2, shape, plan), plan.naive, fold, plan.gemv)
            label = f"{shape.name} M={M} {plan.name()} gemm2{' fold' if fold else ''}"
            g2 = _time_tiles(label, g2_tiles, lambda b, t, f=fold: b.gemm2(shape, t, f), bufs, replays,
                             not plan.gemv)  # fmt: skip
            if not g2:
                continue
            for us, tile in g2:
                note(_family(2, plan, tile, fold), us)
            if plan.gemv:
                results.append(_gemv_result(shape, M, bufs, g1[0], g2[0], results, replays, note))
                continue
            total = align_us + g1[0][0] + g2[0][0] + (0.0 if fold else sum_us)
            # No pdl: the stages here are timed apart and cannot see it; it is set in a file where the
            # benchmark measured it faster (`triton` against `triton_nopdl`: faster at some shapes, 11-19 %
            # slower at others on the H200, docs/perf.md).
            config = MoeTileConfig(block_m=plan.block_m, gemm1=g1[0][1], gemm2=g2[0][1], naive=plan.naive,
                                   fold_k=fold)  # fmt: skip
            stages = {"align_us": round(align_us, 2), "gemm1_us": round(g1[0][0], 2),
                      "gemm2_us": round(g2[0][0], 2), "sum_us": round(0.0 if fold else sum_us, 2),
                      "total_us": round(total, 2)}  # fmt: skip
            results.append((total, config, stages))
            log(f"  {shape.name} M={M} {plan.name()}{' fold_k' if fold else ''}: "
                f"align {align_us:.1f} + gemm1 {g1[0][0]:.1f} + gemm2 {g2[0][0]:.1f} "
                f"+ sum {stages['sum_us']:.1f} = {total:.1f} us")  # fmt: skip
        del bufs
    results.sort(key=lambda r: r[0])
    # The winner must compute the layer: a variant that is fast and wrong is dropped, logged.
    reference = cases[0].reference_fp32()
    for total, config, stages in results:
        out = fused_moe(*cases[0].args(), **cases[0].kwargs(), config=config)
        err = rel_err(out, reference)  # a zero reference (EP, the token's experts elsewhere) wants zero
        if err <= BF16_TOLERANCE and not torch.isnan(out).any():
            stages["rel_err"] = round(err, 6)
            return config, stages, families
        log(f"  REJECTED {shape.name} M={M} {config}: relative error {err:.2e}")
    raise RuntimeError(f"{shape.name} M={M}: no candidate computed the layer correctly")


def parse_cells(args: argparse.Namespace) -> list[tuple[MoeShape, int]]:
    """(shape, M) in the order to tune: --cells "Name:M,M" ... as given (a shape may appear more
    than once: the most important cells first, for a time-boxed run); else --shapes (default all,
    TP1 first) x --m."""
    if args.cells:
        cells = []
        for spec in args.cells:
            name, _, ms = spec.rpartition(":")
            shape = shapes_named([name])[0]
            cells += [(shape, int(m)) for m in ms.split(",")]
        return cells
    # TP1 shapes first: they carry the targets, and a time-boxed run keeps what it finished.
    shapes = (
        shapes_named(args.shapes) if args.shapes else sorted(SHIPPED_SHAPES, key=lambda s: s.layout != "TP1")
    )
    return [(shape, M) for shape in shapes for M in args.m]


def write_shape(path: Path, shape: MoeShape, configs: dict, timings: dict, families: dict, device: str,
                merge: bool) -> None:  # fmt: skip
    import triton

    meta = {
        "shape": (f"{shape.name}: E={shape.num_experts} e={shape.local_experts} K={shape.top_k} "
                  f"D={shape.D} F={shape.F}"),
        "device": device, "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv),
        "timings_us": timings, "variants_us": families,
    }  # fmt: skip
    if merge and path.is_file():
        old = json.loads(path.read_text())
        configs = {**read_tuned_file(path), **configs}
        meta["timings_us"] = {**old["meta"].get("timings_us", {}), **timings}
        meta["variants_us"] = {**old["meta"].get("variants_us", {}), **families}
        # A hand edit's note stays with the entries the merge keeps (read_tuned_file keeps their fields).
        if "edits" in old["meta"]:
            meta["edits"] = old["meta"]["edits"]
        previous = old["meta"].get("command")  # None in a file borrowed from another GPU
        if previous and meta["command"] not in previous:
            meta["command"] = f"{previous}; then {meta['command']}"
    write_tuned_file(path, configs, meta)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=TUNED_DIR)
    add_shape_args(parser)
    parser.add_argument("--cells", nargs="*", help='"<shape name>:M,M,..." (overrides --shapes / --m)')
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--precompile-timeout-s", type=float, default=180.0,
                        help="variants whose precompile task is not back by then are not timed "
                             "(a hang)")  # fmt: skip
    parser.add_argument(
        "--merge", action="store_true", help="keep the entries of an existing file for M not tuned now"
    )
    parser.add_argument("--deadline-s", type=float, help="start no new cell after this many seconds")
    parser.add_argument("--gemv", action="store_true",
                        help="offer the decode GEMVs where naive qualifies (none shipped yet: off by "
                             "default)")  # fmt: skip
    parser.add_argument("--dump-jobs", type=Path,
                        help="write the kernel variants these cells would compile (JSON, for "
                             "benchmarks/aot_sm90.py --jobs; no GPU needed) and exit")  # fmt: skip
    args = parser.parse_args(argv)
    global OFFER_GEMV
    OFFER_GEMV = args.gemv
    started = time.perf_counter()
    cells = parse_cells(args)
    by_shape: dict[MoeShape, list[int]] = {}
    for shape, M in cells:
        by_shape.setdefault(shape, []).append(M)
    if args.dump_jobs is not None:
        dump_jobs(by_shape, args.dump_jobs)
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.workers > 0:
        precompile(by_shape, args.workers, timeout_s=args.precompile_timeout_s)
    device = torch.cuda.get_device_name()
    bases: dict[MoeShape, object] = {}
    done: dict[MoeShape, tuple[dict, dict, dict]] = {s: ({}, {}, {}) for s in by_shape}
    for shape, M in cells:
        if args.deadline_s is not None and time.perf_counter() - started > args.deadline_s:
            log(f"deadline: {shape.name} M={M} not tuned")
            continue
        if shape not in bases:
            bases[shape] = shape_case(shape, 1, seed=7)  # the weights every input set of the shape shares
        configs, timings, families = done[shape]
        t1 = time.perf_counter()
        try:
            configs[M], timings[str(M)], families[str(M)] = tune_cell(shape, M, bases[shape])
        except RuntimeError as exc:  # no correct candidate: the cell keeps its old entry, the run goes on
            log(f"{shape.name} M={M}: NOT TUNED: {exc}")
            continue
        log(f"{shape.name} M={M}: {configs[M]} ({time.perf_counter() - t1:.1f} s)")
        torch.cuda.empty_cache()
        if args.merge:  # a time-boxed run keeps every finished cell
            path = args.out_dir / config_file_name(shape.local_experts, shape.F, shape.D, device)
            write_shape(path, shape, configs, timings, families, device, merge=True)
            log(f"wrote {path.name} (+{time.perf_counter() - started:.0f} s)")
    if not args.merge:
        for shape, (configs, timings, families) in done.items():
            if configs:
                path = args.out_dir / config_file_name(shape.local_experts, shape.F, shape.D, device)
                write_shape(path, shape, configs, timings, families, device, merge=False)
                log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
