"""Find which FlashInfer CUTLASS MoE call setup faults (tuning per M, tuning once, workspace size).

An illegal memory access poisons the CUDA context, so every variant runs in a process of its own:
  tune      none: FlashInfer's default tactic; per-m: autotune(tuning_buckets=(M,)) at this M;
            once: autotune over --buckets with tune_max_num_tokens = the largest bucket
  workspace none: FlashInfer allocates per call; m: sized for this M; max: sized for the largest bucket
  mode      eager1, eager4 or graph4 (CUDA graph of 4 calls on rotated inputs, as the benchmark
            times them); flags wspercall and nopdl (see run_one)
Each variant checks its outputs against fused_moe_ref (fp32). One JSON line per variant on stdout
and in --out.

FlashInfer must be importable and its fused_moe_90 module built or installed (flashinfer_h200.py
--aot-library installs it into site-packages). Usage:
    python benchmarks/records/flashinfer_probe.py --out probe.jsonl --shape "Qwen3-30B-A3B TP1" --m 256 \\
        --variants none:m per-m:none per-m:m once:max once:max:graph4 once:max:graph4:nopdl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from moe_eval.kernels.tile_configs import M_GRID, SHIPPED_SHAPES

BUCKETS = M_GRID  # bench_fused_moe's default M grid: the M values it tunes FlashInfer at
GRAPH_REPLAYS = 300
EAGER_ROUNDS = 50  # eager4: the 4 calls, this many times


def run_one(
    shape_name: str, M: int, variant: str, buckets: tuple[int, ...], bench_inputs: bool = False
) -> dict:
    """variant = TUNE:WORKSPACE[:MODE[:FLAG...]]; MODE eager1 (default: one input set, called twice),
    eager4 (4 input sets back to back), graph4 (those 4 calls captured in one CUDA graph on a side
    stream, then replayed GRAPH_REPLAYS times); FLAGs: wspercall (a workspace per input set), nopdl."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
    from flashinfer_h200 import install_bf16_source_filter

    install_bf16_source_filter()  # a rebuild, should the AOT module be missing, stays BF16-only
    from flashinfer.autotuner import autotune

    from moe_eval.kernels.flashinfer_cutlass import flashinfer_cutlass_moe, new_workspace, to_flashinfer_w31
    from moe_eval.kernels.testing import rel_err, shape_case

    parts = variant.split(":")
    tune, workspace = parts[:2]
    mode, flags = (parts[2] if len(parts) > 2 else "eager1"), parts[3:]
    shape = {s.name: s for s in SHIPPED_SHAPES}[shape_name]
    if bench_inputs:  # exactly bench_fused_moe's weights and rotated input sets at this M
        from bench_fused_moe import rotated_sets

        base = shape_case(shape, 1, seed=7)
        cases = rotated_sets(shape, M, base)[: 1 if mode == "eager1" else 4]
    else:
        base = shape_case(shape, M, seed=11 + M)
        n_sets = 1 if mode == "eager1" else 4
        cases = [base] + [
            shape_case(shape, M, seed=1000 * M + i, weights_from=base) for i in range(1, n_sets)
        ]
    w31 = to_flashinfer_w31(base.w13_eFD)
    max_tokens = max(buckets) if tune == "once" else None
    expert_map = base.expert_map_E is not None

    def variant_workspace() -> torch.Tensor | None:
        if workspace == "none":
            return None
        tokens = M if workspace == "m" else max(buckets)
        return new_workspace(
            tokens, shape.D, shape.F, shape.local_experts, shape.top_k, expert_map=expert_map
        )

    shared = variant_workspace()
    spaces = [variant_workspace() for _ in cases] if "wspercall" in flags else [shared] * len(cases)
    outs = [torch.empty_like(c.hidden_TD) for c in cases]
    pdl = False if "nopdl" in flags else None

    def call(i: int) -> None:
        c = cases[i]
        flashinfer_cutlass_moe(
            c.hidden_TD, w31, c.w2_eDF, c.topk_weights_TK, c.topk_ids_TK, expert_map_E=c.expert_map_E,
            out=outs[i], workspace=spaces[i], tune_max_num_tokens=max_tokens, enable_pdl=pdl,
        )  # fmt: skip

    print("stage: tune", file=sys.stderr, flush=True)  # the parent names the stage a fault came in
    t = time.perf_counter()
    if tune != "none":
        with autotune(True, tuning_buckets=(M,) if tune == "per-m" else buckets):
            call(0)
        torch.cuda.synchronize()
    tune_s = time.perf_counter() - t
    print("stage: eager", file=sys.stderr, flush=True)
    for _ in range(2 if mode == "eager1" else EAGER_ROUNDS):
        for i in range(len(cases)):
            call(i)
        torch.cuda.synchronize()
    if mode == "graph4":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        print("stage: side-stream", file=sys.stderr, flush=True)
        with torch.cuda.stream(stream):
            for i in range(len(cases)):
                call(i)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        print("stage: capture", file=sys.stderr, flush=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(len(cases)):
                call(i)
        torch.cuda.synchronize()
        print("stage: replay", file=sys.stderr, flush=True)
        for _ in range(GRAPH_REPLAYS):  # a race shows only now and then: the benchmark replays ~100 times
            graph.replay()
            torch.cuda.synchronize()
    errs = [rel_err(o, c.reference_fp32()) for o, c in zip(outs, cases)]
    return {"rel_err": max(errs), "nan": any(bool(o.isnan().any()) for o in outs), "tune_s": tune_s}


GRAPH_SETUPS = {  # probe variant -> the benchmark's flags for the same call setup
    "once:max:graph4": "",
    "once:max:graph4:nopdl": "--fi-no-pdl",
    "once:max:graph4:wspercall": "--fi-workspace-per-call",
    "once:max:graph4:wspercall:nopdl": "--fi-workspace-per-call --fi-no-pdl",
}


def suggest_flags(probe_jsonl: str) -> str:
    rows = [json.loads(line) for line in Path(probe_jsonl).read_text().splitlines() if line.strip()]
    clean = {r["variant"] for r in rows if r["rc"] == 0 and not r["nan"] and r["rel_err"] < 1e-2}
    for variant, flags in GRAPH_SETUPS.items():
        if variant in clean:
            return flags
    return "--fi-workspace-per-call --fi-no-pdl"  # nothing clean probed: the most conservative setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="Qwen3-30B-A3B TP1")
    parser.add_argument("--m", type=int, nargs="+", default=[256])
    parser.add_argument("--variants", nargs="+", default=["none:m", "per-m:none", "per-m:m", "once:max"],
                        help="TUNE:WORKSPACE[:MODE[:FLAG...]] (see run_one)")  # fmt: skip
    parser.add_argument("--buckets", type=int, nargs="+", default=list(BUCKETS))
    parser.add_argument("--timeout-s", type=float, default=120)
    parser.add_argument(
        "--bench-inputs", action="store_true", help="bench_fused_moe's weights and input sets"
    )
    parser.add_argument("--suggest-flags", action="store_true",
                        help="print bench_fused_moe's --fi-* flags of the first clean graph4 setup "
                             "in --out")  # fmt: skip
    parser.add_argument("--child", nargs=2, metavar=("M", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.suggest_flags:
        print(suggest_flags(args.out))
        return 0
    if args.child:  # one variant in this process; the parent reads the last line
        print(
            json.dumps(
                run_one(args.shape, int(args.child[0]), args.child[1], tuple(args.buckets), args.bench_inputs)
            )
        )
        return 0
    with open(args.out, "a") as fh:
        for M in args.m:
            for variant in args.variants:
                cmd = [sys.executable, __file__, "--out", args.out, "--shape", args.shape,
                       "--buckets", *map(str, args.buckets), "--child", str(M), variant,
                       *(["--bench-inputs"] if args.bench_inputs else [])]  # fmt: skip
                t = time.perf_counter()
                try:
                    proc = subprocess.run(
                        cmd, capture_output=True, text=True, timeout=args.timeout_s, check=False
                    )
                    rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
                except subprocess.TimeoutExpired as exc:
                    rc, stdout, stderr = "timeout", str(exc.stdout or ""), str(exc.stderr or "")
                row = {"shape": args.shape, "M": M, "variant": variant, "rc": rc,
                       "bench_inputs": args.bench_inputs,
                       "seconds": round(time.perf_counter() - t, 1)}  # fmt: skip
                if rc == 0:
                    row |= json.loads(stdout.strip().splitlines()[-1])
                else:
                    errors = [ln for ln in stderr.splitlines() if "Error" in ln or "error" in ln]
                    row["error"] = (errors[-1] if errors else stderr[-300:])[:400]
                    stages = [ln for ln in stderr.splitlines() if ln.startswith("stage: ")]
                    row["failed_in"] = stages[-1][len("stage: ") :] if stages else "setup"
                print(json.dumps(row), flush=True)
                fh.write(json.dumps(row) + "\n")
                fh.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
