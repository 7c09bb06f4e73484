"""The slow_range mutation's delay on this GPU (benchmarks/device/served_speed.sh STAGE=power SPIN=1): a 1 ms
sleep wrapped by kernels/slowdown.Slowdown at 5 % and 10 %, eager and replayed from a CUDA graph, timed by
the MoE timer as the server times it. Prints each case's mean and its ratio to the unwrapped sleep."""

from __future__ import annotations

import torch

from moe_eval.kernels.moe_timer import MoeTimer
from moe_eval.kernels.slowdown import Slowdown

CALLS = 50


def sleep_kernel(hidden, *args):
    torch.cuda._sleep(1_000_000)
    return hidden


def timed(kernel, graph: bool) -> float:
    timer = MoeTimer("probe", None, "probe")
    timer.attach_device(torch.device("cuda"))
    x = torch.zeros(3, 8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside any capture
            started = timer.start(x)
            kernel(x)
            timer.stop(started, x)
        torch.cuda.synchronize()
        timer.table.zero_()
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                started = timer.start(x)
                kernel(x)
                timer.stop(started, x)
            for _ in range(CALLS):
                g.replay()
        else:
            for _ in range(CALLS):
                started = timer.start(x)
                kernel(x)
                timer.stop(started, x)
    torch.cuda.synchronize()
    calls, ns = timer.table[3][0].item(), timer.table[3][1].item()
    assert calls == CALLS, calls
    return ns / calls / 1e3


def main() -> None:
    failures = 0
    for graph in (False, True):
        plain = timed(sleep_kernel, graph)
        for pct in (5.0, 10.0):
            slowed = timed(Slowdown(sleep_kernel, 1, None, pct), graph)
            ratio = slowed / plain
            ok = abs(ratio - (1 + pct / 100)) < 0.01
            failures += not ok
            kind = "graph" if graph else "eager"
            verdict = "OK" if ok else "WRONG"
            print(f"{kind} {pct:4.1f} %: {plain:8.1f} -> {slowed:8.1f} us x{ratio:.4f} {verdict}")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
