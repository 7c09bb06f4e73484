"""Find which FlashInfer CUTLASS MoE call setup faults (tuning per M, tuning once, workspace size).

An illegal memory access poisons the CUDA context, so every variant runs in a process of its own:
  tune      none: FlashInfer's default tactic; per-m: autotune(tuning_buckets=(M,)) at this M;
            once: autotune over --buckets with tune_max_num_tokens = the largest bucket
  workspace none: FlashInfer allocates per call; m: sized for this M; max: sized for the largest bucket
Each variant runs the call twice after tuning (plus once more per other bucket for `once`) and
checks it against fused_moe_ref (fp32). One JSON line per variant on stdout and in --out.

FlashInfer must be importable and its fused_moe_90 module built or installed (flashinfer_h200.py
--aot-library installs it into site-packages). Usage:
    python benchmarks/flashinfer_probe.py --out probe.jsonl --shape "Qwen3-30B-A3B TP1" --m 256 \\
        --variants none:m per-m:none per-m:m once:max
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BUCKETS = (1, 16, 64, 256, 1024, 4096, 16384)


def run_one(shape_name: str, M: int, tune: str, workspace: str, buckets: tuple[int, ...]) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from flashinfer_h200 import install_bf16_source_filter

    install_bf16_source_filter()  # a rebuild, should the AOT module be missing, stays BF16-only
    from flashinfer.autotuner import autotune
    from flashinfer.fused_moe import cutlass_fused_moe_workspace_size

    from moe_eval.kernels.flashinfer_cutlass import flashinfer_cutlass_moe, to_flashinfer_w31
    from moe_eval.kernels.testing import rel_err, shape_case
    from moe_eval.kernels.tile_configs import SHIPPED_SHAPES

    shape = {s.name: s for s in SHIPPED_SHAPES}[shape_name]
    case = shape_case(shape, M, seed=11 + M)
    w31 = to_flashinfer_w31(case.w13_eFD)
    ep_size = 1 if case.expert_map_E is None else 2
    max_tokens = max(buckets) if tune == "once" else None
    ws = None
    if workspace != "none":
        tokens = M if workspace == "m" else max(buckets)
        ws = torch.empty(
            cutlass_fused_moe_workspace_size(
                tokens, shape.D, shape.F, shape.local_experts * ep_size, shape.top_k,
                x_dtype=torch.bfloat16, weight_dtype=torch.bfloat16, ep_size=ep_size, ep_rank=0,
            ),
            dtype=torch.uint8, device="cuda",
        )  # fmt: skip
    out = torch.empty_like(case.hidden_TD)

    def call() -> None:
        flashinfer_cutlass_moe(
            case.hidden_TD, w31, case.w2_eDF, case.topk_weights_TK, case.topk_ids_TK,
            expert_map_E=case.expert_map_E, out=out, workspace=ws, tune_max_num_tokens=max_tokens,
        )  # fmt: skip

    print("stage: tune", file=sys.stderr, flush=True)  # the parent names the stage a fault came in
    t = time.perf_counter()
    if tune != "none":
        with autotune(True, tuning_buckets=(M,) if tune == "per-m" else buckets):
            call()
        torch.cuda.synchronize()
    tune_s = time.perf_counter() - t
    print("stage: run", file=sys.stderr, flush=True)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    return {"rel_err": rel_err(out, case.reference_fp32()), "nan": bool(out.isnan().any()), "tune_s": tune_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="Qwen3-30B-A3B TP1")
    parser.add_argument("--m", type=int, nargs="+", default=[256])
    parser.add_argument("--variants", nargs="+", default=["none:m", "per-m:none", "per-m:m", "once:max"],
                        help="TUNE:WORKSPACE pairs")  # fmt: skip
    parser.add_argument("--buckets", type=int, nargs="+", default=list(BUCKETS))
    parser.add_argument("--timeout-s", type=float, default=120)
    parser.add_argument("--child", nargs=2, metavar=("M", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one variant in this process; the parent reads the last line
        tune, workspace = args.child[1].split(":")
        print(json.dumps(run_one(args.shape, int(args.child[0]), tune, workspace, tuple(args.buckets))))
        return 0
    with open(args.out, "a") as fh:
        for M in args.m:
            for variant in args.variants:
                cmd = [sys.executable, __file__, "--out", args.out, "--shape", args.shape,
                       "--buckets", *map(str, args.buckets), "--child", str(M), variant]  # fmt: skip
                t = time.perf_counter()
                try:
                    proc = subprocess.run(
                        cmd, capture_output=True, text=True, timeout=args.timeout_s, check=False
                    )
                    rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
                except subprocess.TimeoutExpired as exc:
                    rc, stdout, stderr = "timeout", str(exc.stdout or ""), str(exc.stderr or "")
                row = {"shape": args.shape, "M": M, "variant": variant, "rc": rc,
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
