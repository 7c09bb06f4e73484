"""Why cells miss issue 23's roofline target: the numbers docs/perf.md gives, from committed data (no GPU).

Per (shape, M >= 1024) of a three-peer run (bench_fused_moe.py rows + its meta): the compute and memory
bounds at the run's ceilings (before the benchmark, as the roofline column; and the higher of before and
after), how much of the shorter phase the bundled kernel hid, FlashInfer's fraction of the roofline, the
padded rows of the benchmark's own routing (its seeds, the shipped BLOCK_M), the traffic the roofline
omits (each slot's GEMM2 output and h, written and read once), the tuner's stage timings of the same
shipped winner (meta.timings_us of the tuned file: eager events, another session's routing), and the
winner's shared memory per program (MoeTileConfig.shared_memory: above 114 KiB, one program an SM).

    python benchmarks/prefill_misses.py docs/data/bench_prefill_h200.jsonl \
        docs/data/bench_prefill_h200_meta.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_moe import ROOFLINE_FROM_M, rotated_sets  # noqa: E402

from moe_eval.kernels.tile_configs import (  # noqa: E402
    PREFILL_SHAPES,
    SHIPPED_SHAPES,
    TUNED_DIR,
    MoeShape,
    read_tuned_file,
)


def padded_over_slots(shape: MoeShape, M: int, block_m: int) -> float:
    """Padded rows / slots on this rank, over the benchmark's rotated input sets (its seeds)."""
    empty = torch.empty(0, dtype=torch.bfloat16)
    weights = types.SimpleNamespace(w13_eFD=empty, w2_eDF=empty)
    padded = slots = 0
    for case in rotated_sets(shape, M, weights):
        ids = case.topk_ids_TK.reshape(-1).long()
        if case.expert_map_E is not None:
            ids = case.expert_map_E.long()[ids]
        counts = torch.bincount(ids[ids >= 0], minlength=shape.local_experts).tolist()
        padded += sum(math.ceil(c / block_m) * block_m for c in counts)
        slots += sum(counts)
    return padded / slots


def miss_rows(rows: list[dict], meta: dict) -> list[dict]:
    before, after = meta["ceilings_before"], meta["ceilings_after"]
    best = {k: max(before[k], after[k]) for k in before}
    by = {(f"{r['model']} {r['layout']}", r["M"], r["impl"]): r for r in rows}
    shapes = {s.name: s for s in SHIPPED_SHAPES}
    out = []
    for name in PREFILL_SHAPES:
        shape = shapes[name]
        tuned = read_tuned_file(TUNED_DIR / shape.tuned_file)
        stages = json.loads((TUNED_DIR / shape.tuned_file).read_text())["meta"]["timings_us"]
        for M in sorted({k[1] for k in by if k[0] == name and k[1] >= ROOFLINE_FROM_M}):
            r, fi = by[(name, M, "triton")], by.get((name, M, "flashinfer_cutlass"))
            us = r["median_us"]
            flops, bytes_ = r["tflops"] * us * 1e6, r["gbps"] * us * 1e3

            def bound_us(ceilings: dict) -> tuple[float, float]:
                return flops / ceilings["matmul_tflops"] / 1e6, bytes_ / ceilings["copy_gbps"] / 1e3

            compute_us, memory_us = bound_us(before)
            unfused = r["slots"] * 2 * (shape.D + shape.F) * 2  # y (slots, D) and h (slots, F): written, read
            st = stages[str(M)]
            gemm1_flops = 2 * r["slots"] * shape.D * 2 * shape.F
            out.append({
                "shape": name, "M": M, "us": us, "compute_us": compute_us, "memory_us": memory_us,
                "sum_over_max": (compute_us + memory_us) / max(compute_us, memory_us),
                "hidden": (compute_us + memory_us - us) / min(compute_us, memory_us),
                "frac": r["frac_roofline"], "frac_best_ceiling": max(bound_us(best)) / us,
                "fi_frac": fi["frac_roofline"] if fi else None,
                "padded_over_slots": padded_over_slots(shape, M, tuned[M].block_m),
                "block_m": tuned[M].block_m, "shared_kib": [b / 1024 for b in tuned[M].shared_memory()],
                "unfused_mb": unfused / 1e6, "unfused_over_memory": unfused / bytes_,
                "stages_us": {k: st[k] for k in ("align_us", "gemm1_us", "gemm2_us", "sum_us", "total_us")},
                "align_sum_share": (st["align_us"] + st["sum_us"]) / st["total_us"],
                "gemm1_tflops": gemm1_flops / st["gemm1_us"] / 1e6,
                "gemm2_tflops": gemm1_flops / 2 / st["gemm2_us"] / 1e6,
            })  # fmt: skip
    return out


def markdown(rows: list[dict]) -> str:
    columns = [
        "shape", "M", "bundled us", "compute / memory bound us", "sum / max", "shorter phase hidden",
        "of roofline (before / best ceiling)", "FlashInfer of roofline", "padded / slots (BLOCK_M)",
        "unfused traffic MB (x memory bound)", "tuner stages: align + sum of total", "GEMM1 / GEMM2 TFLOP/s",
        "shared memory KiB GEMM1 / GEMM2",
    ]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for r in rows:
        st = r["stages_us"]
        cells = [
            r["shape"], str(r["M"]), f"{r['us']:.1f}", f"{r['compute_us']:.1f} / {r['memory_us']:.1f}",
            f"{r['sum_over_max']:.2f}", f"{r['hidden']:.0%}",
            f"{r['frac']:.0%} / {r['frac_best_ceiling']:.0%}",
            f"{r['fi_frac']:.0%}" if r["fi_frac"] is not None else "-",
            f"{r['padded_over_slots']:.2f} ({r['block_m']})",
            f"{r['unfused_mb']:.0f} ({r['unfused_over_memory']:.2f})",
            f"{st['align_us'] + st['sum_us']:.0f} of {st['total_us']:.0f} ({r['align_sum_share']:.0%})",
            f"{r['gemm1_tflops']:.0f} / {r['gemm2_tflops']:.0f}",
            f"{r['shared_kib'][0]:.0f} / {r['shared_kib'][1]:.0f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path, help="bench_fused_moe.py rows.jsonl")
    parser.add_argument("meta", type=Path, help="the run's meta (ceilings before and after)")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    print(markdown(miss_rows(rows, json.loads(args.meta.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
