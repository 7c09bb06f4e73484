"""The compiled CPU MoE of this tree against its own source at other git revisions and vLLM's CPU kernel: an
A/B of kernel versions in one process, so a change's gain is read without this machine's drift between runs
(issue 56, the CPU path; docs/kernels.md, "The tile kernel").

Each revision's `moe_eval/kernels/csrc/cpu_moe.cpp` is built under its own module name (torch's C++ extension
tools, ~25 s a revision, cached in the temp folder) and called directly, as `cpu_moe` calls this tree's: its
own weight packing, int64 ids, fp32 router weights, so the Python wrapper is out of the comparison. The
kernels are timed interleaved in a shuffled order at every repeat, each on its own rotated input (no kernel
finds the previous one's inputs in cache), medians; vLLM's kernel too, its weights prepacked once. Each
revision's output is checked against this tree's, bit for bit, on one input per cell.

    PYTHONPATH=.:benchmarks python benchmarks/bench_cpu_moe_ab.py REV [REV ...] [--threads 1] [--tokens ...]

REV: any git revision since the compiled kernel came (9761539), e.g. 85bb45b (oneDNN brgemm) or HEAD~3.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_torch_moe import table_cells, vllm_cpu_kernel

from moe_eval.kernels import cpu_moe
from moe_eval.kernels.testing import MoeCase

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "moe_eval/kernels/csrc/cpu_moe.cpp"


def kernel_at(rev: str) -> Any:
    """The compiled kernel of `rev`'s source, built once per commit under its own name."""
    from torch.utils.cpp_extension import load

    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    source = subprocess.run(
        ["git", "show", f"{sha}:{SOURCE}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    directory = Path(tempfile.gettempdir()) / f"moe-eval-cpu-moe-{sha[:12]}"
    directory.mkdir(exist_ok=True)
    path = directory / f"cpu_moe_{sha[:12]}.cpp"
    if not path.exists() or path.read_text() != source:
        path.write_text(source)
    return load(
        f"cpu_moe_{sha[:12]}", [str(path)], extra_cflags=cpu_moe.CFLAGS, extra_ldflags=cpu_moe.LDFLAGS,
        build_directory=str(directory),
    )  # fmt: skip


def direct_call(module: Any, first: MoeCase) -> Any:
    """`module.moe` on its own packing of the cell's shared weights."""
    w13 = module.pack_weights(first.w13_eFD.contiguous())
    w2 = module.pack_weights(first.w2_eDF.contiguous())

    def call(case: MoeCase) -> torch.Tensor:
        ids = case.topk_ids_TK.long().contiguous()
        weights = case.topk_weights_TK.float().contiguous()
        return module.moe(case.hidden_TD, w13, w2, weights, ids, 1.0, False)

    return call


def shuffled_medians_us(kernels: dict[str, Any], cases: list[MoeCase], repeats: int) -> dict[str, float]:
    """Each repeat calls every kernel once, in a new random order, each on the next input of the rotation."""
    for kernel in kernels.values():
        kernel(cases[0])
    order = list(kernels)
    rotation = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    step = 0
    for _ in range(repeats):
        rotation.shuffle(order)
        for name in order:
            case = cases[step % len(cases)]
            step += 1
            t0 = time.perf_counter()
            kernels[name](case)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="+", help="git revisions whose kernel to time beside this tree's")
    parser.add_argument("--threads", nargs="*", type=int, default=[1])
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 100, 512, 2048])
    parser.add_argument("--repeats", type=int, default=201)
    args = parser.parse_args(argv)
    runs, why = cpu_moe.implementation()  # also asks the OS for AMX tile data, for every build in the process
    print(f"this tree's kernel here: {why}", flush=True)
    if not runs:
        return 1
    builds = {rev: kernel_at(rev) for rev in args.revs}
    builds["this tree"] = cpu_moe._module()
    names = list(builds)
    print("| E | K | D | F | T | threads | vLLM CPU us | " + " | ".join(f"{n} us (x vLLM)" for n in names)
          + " | bits as this tree's |")  # fmt: skip
    print("|---:" * 6 + "|---:" * (len(names) + 1) + "|---|")
    for threads, (E, K, D, F), T, cases in table_cells(args.threads, args.tokens):
        kernels = {name: direct_call(module, cases[0]) for name, module in builds.items()}
        vllm = vllm_cpu_kernel(cases[0])
        if vllm is not None:
            kernels["vllm"] = vllm
        ours = kernels["this tree"](cases[0]).view(torch.int16)
        same = [f"{rev} {(kernels[rev](cases[0]).view(torch.int16) == ours).float().mean().item():.4f}"
                for rev in args.revs]  # fmt: skip
        us = shuffled_medians_us(kernels, cases, args.repeats)
        peer = us.get("vllm")
        cells = [f"{peer:.0f}" if peer else "-"]
        cells += [f"{us[n]:.0f}" + (f" (x{us[n] / peer:.2f})" if peer else "") for n in names]
        print(f"| {E} | {K} | {D} | {F} | {T} | {threads} | " + " | ".join(cells) + f" | {', '.join(same)} |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
