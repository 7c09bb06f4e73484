"""Does a fresh process, or fresh buffers, move the canary's eager MoE call, and does it move another kernel
the same way? (issue 54; docs/perf.md, "The SM clock, the H100 tiles served, FlashInfer gated")

The canary's eager calls (24-55 us: ~6 kernels of ~3 us) moved 1.4 % a server between servers of one machine,
the SM clock pinned at its maximum, while its graph-replayed calls repeated within 1 %. A reference timed
inside the same server would cancel that drift only if it is common to kernels: this measures it outside
vLLM. PROCESSES fresh processes (a new CUDA context each, as a server is), each allocating the canary's layer
ALLOCS times (the earlier allocations kept alive, so each lands at other addresses; the same data every time);
at each, M = 600, 1500 and 8192 tokens (8192: most of the served M>=4096 calls), the bundled kernel and two
controls interleaved: six bf16 matmuls (256x128 and back, ~3 us each: another short-kernel chain) and vLLM's
own fused_experts on the same call (the incumbent a paired in-server reference would time; where the
installed vLLM imports), each call
queued behind a sleep kernel so the GPU runs it back to back whatever the host's pace (as the server's gated
bracket does), timed by CUDA events; the median of REPS. A host launch slower than the sleep is reported.

Prints per (process, allocation, M) both medians, then per M: the spread of the bundled medians between
processes and within one, and the share of the bundled kernel's log-variance that the control's explains
(common mode), for each control. Rows in $OUT/eager-drift.jsonl (or --out).

    bash .vgpu/device_env.sh python3 benchmarks/device/eager_drift_probe.py [--processes 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

E, K, D, F = 8, 2, 256, 128  # the canary's MoE layer (moe_eval/canary/checkpoint/config.json)
SIZES = (600, 1500, 8192)
ALLOCS = 3
REPS = 60
GATE_CYCLES = 2_000_000  # ~1 ms at ~2 GHz: far longer than the host takes to launch either call
GATE_US = 1000.0


def child(index: int) -> list[dict]:
    import time

    import torch

    from moe_eval.kernels.fused_moe import fused_moe
    from moe_eval.kernels.testing import make_case

    torch.manual_seed(index)
    vllm_peer = None
    try:  # vLLM's own kernel as it serves (benchmarks/vllm_moe_peer.py drives it as fused_experts does)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        import vllm_moe_peer

        vllm_peer = vllm_moe_peer.load_installed()
    except Exception as exc:  # noqa: BLE001 - whatever vLLM raises where it does not import
        print(f"process {index}: no vLLM control ({type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr)
    rows = []
    keep = []  # every allocation stays alive, so the next lands elsewhere
    for alloc in range(ALLOCS):
        keep.append(torch.empty(int(torch.randint(1, 64, ()).item()) << 20, dtype=torch.uint8, device="cuda"))
        for M in SIZES:
            # the same tokens and routing in every allocation and process: only the addresses change
            case = make_case(M, E, K, D, F, dtype=torch.bfloat16, device="cuda", seed=7 * M)
            a = torch.randn(M, D, dtype=torch.bfloat16, device="cuda")
            shapes = [(D, F), (F, D)] * 3  # up then down, three times
            w = [torch.randn(*s, dtype=torch.bfloat16, device="cuda") for s in shapes]
            keep.append((case, a, w))  # the control's buffers fresh too, as the kernel's are

            def bundled(case=case):
                fused_moe(*case.args(), **case.kwargs())

            def control(a=a, w=w):
                x = a
                for i in range(0, 6, 2):
                    x = (x @ w[i]) @ w[i + 1]

            calls = [("bundled", bundled), ("control", control)]
            if vllm_peer is not None:
                calls.append(("vllm", vllm_peer.whole_call(case, E)))
            times: dict[str, list[float]] = {name: [] for name, _ in calls}
            slowest_launch_us = 0.0
            for _, fn in calls:  # compiled and warm before any timing
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            for _ in range(REPS):
                for name, fn in calls:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda._sleep(GATE_CYCLES)
                    start.record()
                    launched = time.perf_counter()
                    fn()
                    slowest_launch_us = max(slowest_launch_us, (time.perf_counter() - launched) * 1e6)
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end) * 1000.0)
            row = {"process": index, "alloc": alloc, "M": M, "slowest_launch_us": slowest_launch_us}
            if slowest_launch_us > 0.8 * GATE_US:
                row["warning"] = "a launch took most of the sleep: the GPU may have waited on the host"
            row.update({f"{k}_us": statistics.median(v) for k, v in times.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def summarize(rows: list[dict]) -> None:
    for M in SIZES:
        at = [r for r in rows if r["M"] == M]
        if not at:
            continue
        b = [math.log(r["bundled_us"]) for r in at]
        mb = statistics.mean(b)
        per_process: dict[int, list[float]] = {}
        for r in at:
            per_process.setdefault(r["process"], []).append(math.log(r["bundled_us"]))
        between = [statistics.mean(v) for v in per_process.values()]
        within = [x - statistics.mean(v) for v in per_process.values() for x in v]
        var_b = statistics.pvariance(b)
        print(
            f"M={M}: bundled {math.exp(mb):.1f} us; bundled log sd between processes "
            f"{statistics.pstdev(between):.4f}, within one {statistics.pstdev(within):.4f}, "
            f"all {math.sqrt(var_b):.4f}"
        )
        for name in ("control", "vllm"):
            if not all(f"{name}_us" in r for r in at):
                continue
            c = [math.log(r[f"{name}_us"]) for r in at]
            mc, var_c = statistics.mean(c), statistics.pvariance(c)
            cov = sum((x - mb) * (y - mc) for x, y in zip(b, c)) / len(b)
            common = cov * cov / (var_b * var_c) if var_b > 0 and var_c > 0 else float("nan")
            # the speed gate's paired reading (gates/speed.YARDSTICK_WEIGHT): less half the control's log
            half = statistics.pstdev([x - 0.5 * y for x, y in zip(b, c)])
            print(
                f"  {name}: {math.exp(mc):.1f} us, log sd {math.sqrt(var_c):.4f}; r^2 {common:.2f}; "
                f"bundled / {name} log sd {statistics.pstdev([x - y for x, y in zip(b, c)]):.4f}, "
                f"less half its log {half:.4f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "eager-drift.jsonl"))
    parser.add_argument("--child", type=int, default=None)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    rows = []
    with open(args.out, "w") as out:
        for index in range(args.processes):  # one after another: a fresh CUDA context each, as servers are
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(index)], capture_output=True, text=True, check=False
            )
            for line in done.stdout.splitlines():
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    out.write(line + "\n")
            out.flush()
            if done.returncode != 0:
                print(f"process {index}: exit {done.returncode}: {done.stderr.strip()[-600:]}")
    summarize(rows)


if __name__ == "__main__":
    main()
