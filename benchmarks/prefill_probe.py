"""Probe the prefill path (persistent tiles) on the GPU: does each variant run, is it right, is it faster?

Each variant is the shape's tuned config with GEMM1 and/or GEMM2 swapped for a persistent tile. A
variant is first run once in a child process with a time limit (a kernel that hangs the GPU must
cost its own row, not the probe), at the shape's M=256 against fused_moe_ref. The ones that come
back right are then timed in this process beside the tuned config, replays interleaved in CUDA
graphs (bench_fused_moe.time_interleaved), at each (shape, M). One JSON row per (shape, M, variant).

Usage: PYTHONPATH=. python benchmarks/prefill_probe.py --out rows.jsonl [--shapes ...] [--m 1024 4096]
       [--smoke-timeout-s 60] [--variants g1-interleaved-s3 ...]
       PYTHONPATH=. python benchmarks/prefill_probe.py --report rows.jsonl    # the ratio table, no GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_moe import GraphTimer, layer_counts, log, rotated_sets, shapes_named, time_interleaved

from moe_eval.kernels.fused_moe import fused_moe, launch_plan
from moe_eval.kernels.testing import rel_err, shape_case
from moe_eval.kernels.tile_configs import GemmTile, MoeTileConfig

T = GemmTile
# name -> (GEMM1 tile or None: the tuned one, GEMM2 tile or None); BLOCK_M 128 throughout.
VARIANTS: dict[str, tuple[GemmTile | None, GemmTile | None]] = {
    "g1-interleaved-s3": (T(128, 64, 8, 8, 3, interleave=True, persistent=True), None),
    "g1-interleaved-s4": (T(128, 64, 8, 8, 4, interleave=True, persistent=True), None),
    "g1-two-dot-s3": (T(128, 64, 8, 8, 3, persistent=True), None),
    "g2-256-s3": (None, T(256, 64, 8, 8, 3, tma=True, persistent=True)),
    "g2-256-s4": (None, T(256, 64, 8, 8, 4, tma=True, persistent=True)),
    "g2-128-s4": (None, T(128, 64, 8, 8, 4, tma=True, persistent=True)),
    "g2-ws-128-s4": (None, T(128, 64, 8, 4, 4, tma=True, persistent=True, warp_specialize=True)),
    "g2-ws-256-s3": (None, T(256, 64, 8, 4, 3, tma=True, persistent=True, warp_specialize=True)),
    "both-s3": (
        T(128, 64, 8, 8, 3, interleave=True, persistent=True),
        T(256, 64, 8, 8, 3, tma=True, persistent=True),
    ),
}


def variant_config(tuned: MoeTileConfig, name: str) -> MoeTileConfig:
    g1, g2 = VARIANTS[name]
    return MoeTileConfig(128, g1 or tuned.gemm1, g2 or tuned.gemm2)


def tuned_config(shape, M: int) -> MoeTileConfig:
    return launch_plan(
        M, shape.local_experts, shape.F, shape.D, shape.top_k, torch.cuda.get_device_name()
    ).config


def smoke_child(shape_name: str, name: str) -> int:
    """Child: one call of the variant at M = 256 against the fp32 reference; prints a JSON line."""
    shape = shapes_named([shape_name])[0]
    case = shape_case(shape, 256, seed=5)
    config = variant_config(tuned_config(shape, 4096), name)
    out = torch.full_like(case.hidden_TD, float("nan"))
    t = time.perf_counter()
    fused_moe(*case.args(), **case.kwargs(), out=out, config=config)
    torch.cuda.synchronize()
    err = float("inf") if out.isnan().any() else rel_err(out, case.reference_fp32())
    print(
        json.dumps(
            {"variant": name, "shape": shape_name, "rel_err": err, "first_call_s": time.perf_counter() - t}
        )
    )
    return 0


def smoke_all(shape_name: str, names: list[str], timeout_s: float) -> dict[str, dict]:
    """Every variant's child at once (compiles in parallel); a hang is killed at the time limit."""
    procs = {
        n: subprocess.Popen(
            [sys.executable, __file__, "--smoke-child", shape_name, n],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for n in names
    }  # fmt: skip
    results, deadline = {}, time.monotonic() + timeout_s
    for n, p in procs.items():
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            line = out.strip().splitlines()[-1] if out.strip() else ""
            results[n] = (
                json.loads(line)
                if line.startswith("{")
                else {"error": err.strip()[-400:], "rc": p.returncode}
            )
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            results[n] = {"error": f"no result within {timeout_s:.0f} s (killed: a hang or a slow compile)"}
        log(f"smoke {shape_name} {n}: {results[n]}")
    return results


def ratio_table(rows: list[dict]) -> str:
    """Markdown: per (shape, M) the tuned config's time and each variant's time over it (< 1: faster)."""
    timed = [r for r in rows if "median_us" in r]
    names = [n for n in dict.fromkeys(r["variant"] for r in timed) if n != "tuned"]
    by = {(r["shape"], r["M"], r["variant"]): r["median_us"] for r in timed}
    lines = [
        "| shape | M | tuned, us | " + " | ".join(names) + " |",
        "|---|---:|---:|" + "---:|" * len(names),
    ]
    for shape, M in dict.fromkeys((r["shape"], r["M"]) for r in timed):
        tuned = by[(shape, M, "tuned")]
        cells = [f"{by[(shape, M, n)] / tuned:.3f}" if (shape, M, n) in by else "-" for n in names]
        lines.append(f"| {shape} | {M} | {tuned:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--shapes", nargs="*", default=["Qwen3-30B-A3B TP1", "Mixtral-8x7B TP2", "Llama-4-Scout TP2"]
    )
    parser.add_argument("--m", nargs="*", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--smoke-timeout-s", type=float, default=90.0)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--deadline-s", type=float, default=1e9)
    parser.add_argument("--smoke-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help="print the ratio table of a rows file (no GPU) and exit")
    args = parser.parse_args(argv)
    if args.report:
        print(
            ratio_table([json.loads(line) for line in args.report.read_text().splitlines() if line.strip()])
        )
        return 0
    if args.smoke_child:
        return smoke_child(*args.smoke_child)
    started = time.perf_counter()
    smoke = smoke_all(args.shapes[0], args.variants, args.smoke_timeout_s)
    good = [n for n in args.variants if smoke[n].get("rel_err", float("inf")) <= 1e-2]
    rows = [{"smoke": n, **r} for n, r in smoke.items()]
    log(f"timing {good} beside the tuned configs")
    for shape in shapes_named(args.shapes):
        base = shape_case(shape, 1, seed=7)
        for M in args.m:
            if time.perf_counter() - started > args.deadline_s:
                log(f"deadline: {shape.name} M={M} not timed")
                continue
            cases = rotated_sets(shape, M, base)
            tuned = tuned_config(shape, M)
            configs = {"tuned": tuned} | {n: variant_config(tuned, n) for n in good}
            timers = {}
            for n, cfg in list(configs.items()):
                try:
                    timers[n] = GraphTimer(
                        [lambda c=c, cfg=cfg: fused_moe(*c.args(), **c.kwargs(), config=cfg) for c in cases]
                    )
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory with the tuned tile
                    log(f"{shape.name} M={M} {n}: not timed ({type(exc).__name__}: {str(exc)[:200]})")
                    del configs[n]
            runs = [time_interleaved(timers, args.replays) for _ in range(3)]
            counts = layer_counts(shape, cases)
            ref = cases[0].reference_fp32()
            tuned_us = statistics.median(statistics.median(r["tuned"]) for r in runs)
            for n, cfg in configs.items():
                med = statistics.median(statistics.median(r[n]) for r in runs)
                err = rel_err(fused_moe(*cases[0].args(), **cases[0].kwargs(), config=cfg), ref)
                row = {"shape": shape.name, "M": M, "variant": n, "median_us": med,
                       "tflops": counts["flops"] / med / 1e6, "rel_err": err,
                       "config": dataclasses.asdict(cfg)}  # fmt: skip
                rows.append(row)
                log(f"{shape.name} M={M} {n:20s} {med:9.1f} us {row['tflops']:6.1f} TFLOP/s "
                    f"x tuned {med / tuned_us:.3f} err {err:.1e}")  # fmt: skip
            del timers, cases
            torch.cuda.empty_cache()
        del base
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
