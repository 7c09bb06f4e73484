"""Prove the FlashInfer CUTLASS adapter on an H200: BF16-only JIT build, correctness, timings beside Triton.

Stages, each logged on stderr with its elapsed time, results rewritten to DIR/flashinfer_h200.json
after every case so a run cut short keeps what it has:
  build    JIT-build FlashInfer's `fused_moe_90` with only the BF16 sources (32 of 247 files, see
           install_bf16_source_filter); the library is copied to DIR so a later machine can load it
           as an AOT module (<site-packages>/flashinfer/data/aot/fused_moe_90/fused_moe_90.so).
  correct  the adapter through the oracle (make_moe_kernel and its to_kernel_format) and, with its
           output poisoned (NaN), directly, against fused_moe_ref in fp32 at the shipped shapes.
  time     bench_fused_moe.bench_shape with peers triton, flashinfer_cutlass (autotuned at each M)
           and grouped_mm: CUDA graphs over rotated input sets, interleaved replays, ceilings
           measured before and after, while --timing-deadline-s allows.

FlashInfer must already be importable (the wheels are installed by the caller; this installs nothing).
Usage: python benchmarks/flashinfer_h200.py --out-dir DIR [--deadline-s 470] [--timing-deadline-s 430]
                                            [--skip-timing] [--aot-library fused_moe_90.so ...]

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

from moe_eval.kernels.tile_configs import M_GRID

# Build settings measured on the H200 (shared/notes/flashinfer-h200.md): 16 jobs of one nvcc thread,
# Hopper only, and lazy binding so the other dtypes' runners (not compiled) stay unresolved.
BUILD_ENV = {
    "MAX_JOBS": str(os.cpu_count() or 16),
    "FLASHINFER_NVCC_THREADS": "1",
    "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
    "FLASHINFER_EXTRA_LDFLAGS": "-Wl,-z,lazy",
    "FLASHINFER_JIT_VERBOSE": "1",  # ninja's [n/N] lines show how far a build got if it is cut off
    "FLASHINFER_JIT_DEBUG": "0",  # else JIT_VERBOSE=1 also turns on -O0 -g device code
}

SHAPES = ("Qwen3-30B-A3B TP1", "Mixtral-8x7B TP2", "Qwen3-30B-A3B TEP2")  # timing order: TP1 first
MS = (1, 64, 1024, 8192)  # correctness
TIMED_MS = M_GRID  # bench_fused_moe's grid
TIMED_PEERS = ("triton", "flashinfer_cutlass", "grouped_mm")
TOLERANCE_BF16 = 1e-2  # the bound; 3e-3..5e-3 expected (bf16 rounding of x, weights, out)
BF16_GROUPED_SM90 = "INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM(Sm90, __nv_bfloat16, __nv_bfloat16"
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def keep_source(path: Path) -> bool:
    """True for the sources a BF16-only SM90 module needs (the rule of the notes' 406 s build)."""
    name = path.name
    if name.endswith(".generated.cu"):
        text = path.read_text()
        return BF16_GROUPED_SM90 in text or ("sm80_generic_fused_moe" in text and "bfloat16" in text)
    if name.startswith("moe_gemm_kernels_"):
        return name == "moe_gemm_kernels_bf16_bf16.cu"
    return True


def install_bf16_source_filter() -> dict:
    """Wrap FlashInfer's SM90 fused-MoE JIT spec so it compiles only the BF16 sources.

    In-process, nothing edited on disk. It must be active in every process that may build or reload
    `fused_moe_90` from the JIT cache: an unfiltered spec rewrites build.ninja and rebuilds all 247.
    """
    from flashinfer.fused_moe import core

    original = core.gen_cutlass_fused_moe_sm90_module
    stats: dict = {}

    def bf16_only(use_fast_build: bool = False):
        spec = original(use_fast_build)
        kept = [s for s in spec.sources if keep_source(Path(s))]
        stats.update(
            total_sources=len(spec.sources), kept_sources=len(kept), kept=[Path(s).name for s in kept]
        )
        spec.sources = kept
        return spec

    core.gen_cutlass_fused_moe_sm90_module = bf16_only
    return stats


class Results:
    """One JSON document, rewritten after every change."""

    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.doc = {"meta": meta, "build": {}, "correctness": [], "timing": [], "errors": []}
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.doc, indent=1))


def build(out_dir: Path, res: Results, filter_stats: dict) -> None:
    from flashinfer.fused_moe import core
    from flashinfer.jit import env as jit_env

    log("build: fused_moe_90 (BF16 only) starts; nothing more is printed until ninja reports")
    t = time.perf_counter()
    core.get_cutlass_fused_moe_module("90")
    build_s = time.perf_counter() - t
    aot = jit_env.get_aot_path("fused_moe_90")
    so = aot if aot.exists() else jit_env.FLASHINFER_JIT_DIR / "fused_moe_90" / "fused_moe_90.so"
    res.doc["build"] |= {
        "seconds": build_s, **filter_stats, "library": str(so), "from_aot": aot.exists(),
        "library_mib": so.stat().st_size / 2**20 if so.exists() else None,
    }  # fmt: skip
    res.save()
    kept, total = filter_stats.get("kept_sources"), filter_stats.get("total_sources")
    log(f"build: {build_s:.1f} s, {kept} of {total} sources")
    if so.exists() and not aot.exists():
        shutil.copy2(so, out_dir / "fused_moe_90.so")


def install_aot_libraries(paths: list[Path]) -> list[str]:
    """Place libraries built on an earlier machine where FlashInfer loads them with no build:
    <site-packages>/flashinfer/data/aot/<name>/<name>.so (name = the file's stem, e.g. fused_moe_90).
    Built by this script on the same image (torch 2.11.0+cu130, nvcc 13.0, flashinfer 0.7.0.post1)."""
    from flashinfer.jit import env as jit_env

    placed = []
    for path in paths:
        dest = jit_env.FLASHINFER_AOT_DIR / path.stem / f"{path.stem}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        placed.append(str(dest))
    return placed


def warm_triton(shapes: list, Ms: tuple[int, ...], report: dict) -> threading.Thread:
    """Compile the Triton kernels for every (shape, M) on a side thread while nvcc builds FlashInfer.

    The build is a ninja subprocess (the GIL is free) and leaves the GPU idle; the compiles cost
    the build about one of the 16 cores. Timing itself waits until the build is over.
    """
    import torch

    from moe_eval.kernels.fused_moe import fused_moe
    from moe_eval.kernels.testing import shape_case

    def run() -> None:
        t = time.perf_counter()
        try:
            for shape in shapes:
                base = shape_case(shape, 1, seed=7)
                for M in Ms:
                    c = shape_case(shape, M, seed=1000 * M, weights_from=base)
                    fused_moe(*c.args(), **c.kwargs())
                torch.cuda.synchronize()
                del base
            report["triton_warm_s"] = time.perf_counter() - t
        except Exception as exc:  # noqa: BLE001 -- timing will compile on demand instead; say why
            report["triton_warm_error"] = f"{type(exc).__name__}: {exc}"[:2000]

    thread = threading.Thread(target=run, name="triton-warm", daemon=True)
    thread.start()
    return thread


def correctness(res: Results, shapes: list, Ms: tuple[int, ...], deadline: float) -> bool:
    import torch

    from moe_eval.kernels.flashinfer_cutlass import flashinfer_cutlass_moe
    from moe_eval.kernels.oracle import MoeBackend, make_moe_kernel
    from moe_eval.kernels.testing import rel_err, shape_case

    kernel = make_moe_kernel(MoeBackend.FLASHINFER_CUTLASS)
    ok = True
    for shape in shapes:
        for M in Ms:
            if time.perf_counter() > deadline:
                res.doc["errors"].append(f"correctness stopped at {shape.name} M={M}: deadline")
                return False
            case = shape_case(shape, M, seed=11 + M)
            ref = case.reference_fp32()
            call = case.call(MoeBackend.FLASHINFER_CUTLASS)
            weights = call.weights
            out_oracle = kernel.apply(call)
            out_TD = torch.full_like(case.hidden_TD, float("nan"))  # poisoned: every row must be written
            flashinfer_cutlass_moe(  # on the oracle's converted weights (w31)
                case.hidden_TD, weights.w13_eFD, weights.w2_eDF, case.topk_weights_TK,
                case.topk_ids_TK, expert_map_E=case.expert_map_E, out=out_TD,
            )  # fmt: skip
            torch.cuda.synchronize()
            row = {
                "shape": shape.name, "M": M, "E": shape.num_experts, "e": shape.local_experts,
                "K": shape.top_k,
                "D": shape.D, "F": shape.F, "expert_map": case.expert_map_E is not None,
                "rel_err_oracle": rel_err(out_oracle, ref), "rel_err_poisoned_out": rel_err(out_TD, ref),
                "nan_oracle": bool(out_oracle.isnan().any()), "nan_poisoned_out": bool(out_TD.isnan().any()),
            }  # fmt: skip
            if case.expert_map_E is not None:  # tokens with no local expert must come out exactly 0
                local = case.expert_map_E[case.topk_ids_TK.long()] >= 0
                none_local = ~local.any(dim=1)
                row["rows_without_local_expert"] = int(none_local.sum())
                row["those_rows_zero"] = bool((out_TD[none_local] == 0).all()) if none_local.any() else None
            row["pass"] = (
                not row["nan_oracle"] and not row["nan_poisoned_out"]
                and row["rel_err_oracle"] <= TOLERANCE_BF16 and row["rel_err_poisoned_out"] <= TOLERANCE_BF16
            )  # fmt: skip
            ok &= row["pass"]
            res.doc["correctness"].append(row)
            res.save()
            log(f"correct {shape.name:20s} M={M:5d} rel_err {row['rel_err_oracle']:.2e} "
                f"(poisoned out {row['rel_err_poisoned_out']:.2e}) "
                f"{'ok' if row['pass'] else 'FAIL'}")  # fmt: skip
            del case, ref, weights, out_oracle, out_TD
        torch.cuda.empty_cache()
    return ok


def timing(
    res: Results, shapes: list, Ms: tuple[int, ...], deadline: float, replays: int, out_dir: Path
) -> None:
    """bench_fused_moe's peers, FlashInfer among them, interleaved in CUDA graphs; ceilings around."""
    from bench_fused_moe import bench_shape, markdown_table, measure_ceilings

    ceilings = measure_ceilings()
    res.doc["ceilings_before"] = ceilings
    log(f"time: ceilings {ceilings}")

    def save(rows: list[dict]) -> None:
        res.doc["timing"] += rows
        res.save()

    for shape in shapes:
        bench_shape(
            shape,
            list(Ms),
            ceilings,
            replays,
            peers=TIMED_PEERS,
            eager=False,
            deadline=deadline,
            on_rows=save,
        )
    res.doc["ceilings_after"] = measure_ceilings()
    res.save()
    (out_dir / "bench.md").write_text(markdown_table(res.doc["timing"]) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=470.0, help="no correctness case after this")
    parser.add_argument("--timing-deadline-s", type=float, default=430.0, help="no timing case after this")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--m", nargs="*", type=int, default=list(MS), help="M for correctness")
    parser.add_argument("--timed-m", nargs="*", type=int, default=list(TIMED_MS), help="M for timing")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    from bench_fused_moe import add_flashinfer_options, apply_flashinfer_options, shapes_named

    add_flashinfer_options(parser)
    parser.add_argument(
        "--aot-library", nargs="*", type=Path, default=[],
        help="fused_moe_90.so from an earlier run: loaded instead of building",
    )  # fmt: skip
    args = parser.parse_args(argv)
    apply_flashinfer_options(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for key, value in BUILD_ENV.items():
        os.environ.setdefault(key, value)
    deadline = T0 + args.deadline_s

    shapes = shapes_named(args.shapes)  # KeyError names an unknown shape before any GPU work
    Ms = tuple(args.m)

    import flashinfer
    import torch
    import triton

    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "flashinfer": flashinfer.__version__, "python": sys.version.split()[0],
        "command": "python " + " ".join(sys.argv), "build_env": {k: os.environ[k] for k in BUILD_ENV},
    }  # fmt: skip
    res = Results(args.out_dir / "flashinfer_h200.json", meta)
    log(f"meta: {json.dumps(meta)}")
    try:
        if args.aot_library:
            res.doc["build"]["aot_installed"] = install_aot_libraries(args.aot_library)
        stats = install_bf16_source_filter()
        warm_report: dict = {}  # filled by the side thread, merged once it has joined
        warm = warm_triton(shapes, tuple(args.timed_m), warm_report) if not args.skip_timing else None
        build(args.out_dir, res, stats)
        if warm is not None:
            warm.join()
            res.doc["build"].update(warm_report)
            res.save()
            log(f"triton warm-up: {warm_report}")
        ok = True if args.skip_correctness else correctness(res, shapes, Ms, deadline)
    except Exception as exc:  # record, then fail loudly: the JSON must say where it stopped
        res.doc["errors"].append(f"{type(exc).__name__}: {exc}"[:4000])
        res.save()
        raise
    if not args.skip_timing:
        try:
            timing(res, shapes, tuple(args.timed_m), T0 + args.timing_deadline_s, args.replays, args.out_dir)
        except Exception as exc:  # noqa: BLE001 -- correctness is kept; say why timing stopped
            log(f"timing failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            res.doc["errors"].append(f"timing: {type(exc).__name__}: {exc}"[:4000])
    res.save()
    summary = {k: res.doc[k] for k in ("build", "errors")}
    summary["build"] = {k: v for k, v in summary["build"].items() if k != "kept"}
    print(json.dumps(summary))
    for r in res.doc["correctness"]:
        print(
            f"{r['shape']:20s} M={r['M']:5d} rel_err {r['rel_err_oracle']:.2e} "
            f"/ {r['rel_err_poisoned_out']:.2e} pass={r['pass']}"
        )
    for r in res.doc["timing"]:
        print(f"{r['model']} {r['layout']:5s} M={r['M']:5d} {r['impl']:18s} {r['median_us']:9.1f} us")
    return 0 if ok else 3  # 3: a correctness gate failed (distinct from a crash)


if __name__ == "__main__":
    sys.exit(main())
