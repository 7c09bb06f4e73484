"""Time the CPU MoE path (torch_moe) against its peers on tiny-model shapes, on this machine's CPU.

Peers: torch_moe (the CPU server's path), grouped_mm_moe (torch grouped GEMM), fused_moe_ref (fp32
oracle). Minimum over repeats (the CPU is shared: the minimum is the least disturbed run), bf16.

Usage: PYTHONPATH=. python benchmarks/bench_torch_moe.py [--threads 1 2] [--tokens 1 16 128 512 2048]
Prints a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from moe_eval.kernels.fused_moe import fused_moe_ref
from moe_eval.kernels.testing import make_case
from moe_eval.kernels.torch_moe import grouped_mm_moe, torch_moe

# (E, K, D, F): the tiny Qwen3-MoE the CPU configs serve, and a wider one at the top of the range.
SHAPES = [(8, 2, 128, 64), (16, 2, 256, 256)]


def best_us(fn, case, repeats: int) -> float:
    fn(*case.args(), **case.kwargs())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*case.args(), **case.kwargs())
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 16, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    print("| E | K | D | F | T | threads | torch_moe us | grouped_mm us | reference us |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for E, K, D, F in SHAPES:
            for T in args.tokens:
                case = make_case(T, E, K, D, F, dtype=torch.bfloat16, device="cpu", seed=T)
                row = [best_us(fn, case, args.repeats) for fn in (torch_moe, grouped_mm_moe, fused_moe_ref)]
                print(
                    f"| {E} | {K} | {D} | {F} | {T} | {threads} | "
                    + " | ".join(f"{v:.0f}" for v in row)
                    + " |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
