"""Time the bundled CPU MoE (moe_eval.kernels.cpu_moe: the compiled AMX kernel) against torch_moe and vLLM's
own CPU kernel on the tiny models' shapes, on this machine's CPU (issue 56, the CPU path).

Prints each cell's error against the fp32 oracle (cpu_moe beside torch_moe: the same roundings), the share of
elements whose bits equal torch_moe's, then the three timed interleaved (bench_torch_moe's method: 8 rotated
inputs sharing one set of weights, one call each in turn, medians; vLLM's weights prepacked once, as vLLM
does).

    PYTHONPATH=.:benchmarks python benchmarks/bench_cpu_moe.py [--threads 2] [--tokens 1 8 40 100 512 2048]
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_torch_moe import medians_us, table_cells, vllm_cpu_kernel

from moe_eval.kernels.cpu_moe import cpu_moe, implementation
from moe_eval.kernels.fused_moe import fused_moe_ref
from moe_eval.kernels.testing import rel_err
from moe_eval.kernels.torch_moe import torch_moe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="*", type=int, default=[2])
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 40, 100, 512, 2048])
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args(argv)
    runs, why = implementation()
    print(f"cpu_moe here: {why}", flush=True)
    if not runs:
        return 1  # timing torch_moe under cpu_moe's name would say nothing
    print("| E | K | D | F | T | threads | err torch_moe | err cpu_moe | bits as torch_moe | torch_moe us "
          "| cpu_moe us | vLLM CPU us | cpu_moe / vLLM |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for threads, (E, K, D, F), T, cases in table_cells(args.threads, args.tokens):
        first = cases[0]
        ref = fused_moe_ref(*first.args(), **first.kwargs())
        ours, theirs = cpu_moe(*first.args()), torch_moe(*first.args())
        same = (ours.view(torch.int16) == theirs.view(torch.int16)).float().mean().item()
        kernels = {
            "torch_moe": lambda c: torch_moe(*c.args(), **c.kwargs()),
            "cpu_moe": lambda c: cpu_moe(*c.args(), **c.kwargs()),
        }
        vllm = vllm_cpu_kernel(first)
        if vllm is not None:
            kernels["vllm"] = vllm
        us = medians_us(kernels, cases, args.repeats)
        peer = us.get("vllm")
        cells = [
            f"{rel_err(theirs, ref):.2e}",
            f"{rel_err(ours, ref):.2e}",
            f"{same:.4f}",
            f"{us['torch_moe']:.0f}",
            f"{us['cpu_moe']:.0f}",
            f"{peer:.0f}" if peer else "-",
            f"x{us['cpu_moe'] / peer:.2f}" if peer else "-",
        ]
        print(f"| {E} | {K} | {D} | {F} | {T} | {threads} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
