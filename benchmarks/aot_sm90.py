"""Compile the bundled fused-MoE GEMMs for sm_90 without a GPU: shared memory, registers, spills.

The Hopper facts a tile choice depends on (does it fit the 227 KiB of shared memory, does it spill,
does tl.dot become wgmma, are the loads pipelined with cp.async) are compile-time facts: this
script gets them from Triton's own compiler and the ptxas it ships, on any machine, so a tile or a
kernel variant can be checked before device time is spent on it. It imports only triton and the
kernel bodies (no torch), so it also runs under a bare venv holding another triton version (the
H200 image has 3.6, the development install 3.9).

Usage: python benchmarks/aot_sm90.py [--json OUT] [--quick]     # the variants of interest
       python benchmarks/aot_sm90.py --jobs JOBS.json --json OUT   # e.g. every tuner candidate:
         PYTHONPATH=. python benchmarks/tune_fused_moe.py --cells ... --dump-jobs JOBS.json  (no GPU)
       (ad hoc: from aot_sm90 import compile_gemm; compile_gemm(1, 128, GemmTile(128, 64, ...)))
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


# By file path: importing the package would import torch (fused_moe.py), which a bare venv lacks.
kernels = _load("_aot_fused_moe_kernels", ROOT / "moe_eval/kernels/_fused_moe_kernels.py")
tile_configs = _load("_aot_tile_configs", ROOT / "moe_eval/kernels/tile_configs.py")
GemmTile = tile_configs.GemmTile

# Triton 3.9 ships an older `ptxas` beside a newer `ptxas-blackwell` and emits PTX only the newer
# one reads (".version 9.4"); the first that assembles the PTX reports.
PTXAS = [Path(triton.__file__).parent / "backends/nvidia/bin" / name for name in ("ptxas", "ptxas-blackwell")]
TARGET = GPUTarget("cuda", 90, 32)


def _signature(fn, dtype: str, ints: dict[str, int]) -> tuple[dict, dict]:
    """Triton signature and the divisibility attributes the JIT would derive for these values:
    every pointer 16-byte aligned (torch allocations are), ints by their value (do_not_specialize
    ones get none)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in ("x_ptr", "w13_ptr", "h_ptr", "w2_ptr", "y_ptr", "out_ptr"):
                sig[name] = "*" + dtype
            elif name == "topk_weights_ptr":
                sig[name] = "*fp32"
            else:
                sig[name] = "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            value = ints.get(name, 17)
            if name not in fn.do_not_specialize and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _desc_signature(fn, dtype: str, blocks: dict[str, list[int]], ints: dict[str, int]) -> tuple[dict, dict]:
    """TMA kernels: descriptors are typed by their block shape ("tensordesc<bf16[128,64]>"); x_ptr
    and y_ptr are the dtype's, the routing weights fp32, the rest int32."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            sig[name] = "constexpr"
        elif name in blocks:
            sig[name] = f"tensordesc<{dtype}[{','.join(map(str, blocks[name]))}]>"
        elif name.endswith("_ptr"):
            sig[name] = (
                "*" + dtype
                if name in ("x_ptr", "y_ptr")
                else "*fp32"
                if name == "topk_weights_ptr"
                else "*i32"
            )
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name not in fn.do_not_specialize and ints.get(name, 17) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _tma_blocks(kind: int, block_m: int, tile) -> dict[str, list[int]]:
    """The descriptor block shapes fused_moe's TMA launchers build (`_launch_gemm*_persistent`, `_tma`)."""
    if kind == 2:
        return {"h_desc": [block_m, tile.block_k], "w2_desc": [1, tile.block_n, tile.block_k]}
    w13 = [1, tile.block_n, 2, tile.block_k] if tile.interleave else [1, tile.block_n, tile.block_k]
    return {"w13_desc": w13, "h_desc": [block_m, tile.block_n]}


def _ptxas_report(ptx: str) -> dict:
    log = ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for ptxas in PTXAS:
            if not ptxas.is_file():
                continue
            run = subprocess.run(
                [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            log = run.stdout + run.stderr
            if run.returncode == 0:
                break
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "n_regs": int(regs.group(1)) if regs else None,
        "spill_bytes": (int(spill.group(1)) + int(spill.group(2))) if spill else None,
    }


def compile_gemm(
    kind: int,
    block_m: int,
    tile,
    *,
    dtype: str = "bf16",
    F: int = 768,
    D: int = 2048,
    mul_routed: bool | None = None,
    naive: bool = False,
    fold_k: bool = False,
    has_map: bool = False,
    precision: str = "tf32",
    sum_in_gemm2: bool = False,
) -> dict:
    """Compile GEMM `kind` (1 or 2) for sm_90; report shared bytes, registers, spills, MMA kind.
    sum_in_gemm2: the pointer kernels with the top-k sum in GEMM2 (GEMM1 zeroing its counters)."""
    persistent = getattr(tile, "persistent", False)
    tma = persistent or (kind == 2 and getattr(tile, "tma", False))
    if persistent:
        fn = kernels._gemm1_persistent_kernel if kind == 1 else kernels._gemm2_persistent_kernel
    elif kind == 1:
        fn = kernels._gemm1_silu_kernel
    else:
        fn = kernels._gemm2_tma_kernel if tma else kernels._gemm2_kernel
    if mul_routed is None:
        mul_routed = kind == 2
    reduce_dim = D if kind == 1 else F
    ints = {"F": F, "D": D, "stride_xm": D, "stride_we": 2 * F * D if kind == 1 else D * F,
            "stride_wn": D if kind == 1 else F, "stride_hm": F, "stride_ym": D, "stride_om": D}  # fmt: skip
    if tma:
        sig, attrs = _desc_signature(fn, dtype, _tma_blocks(kind, block_m, tile), ints)
        constexprs = {"MUL_ROUTED_WEIGHT": mul_routed, "DOT_PRECISION": precision, "BLOCK_M": block_m,
                      "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k}  # fmt: skip
        if persistent:
            constexprs |= {"FLATTEN": not tile.warp_specialize, "WARP_SPECIALIZE": tile.warp_specialize}
            if kind == 1:
                constexprs |= {"EVEN_K": D % tile.block_k == 0, "INTERLEAVE": tile.interleave}
    else:
        sig, attrs = _signature(fn, dtype, ints)
        constexprs = {
            "MUL_ROUTED_WEIGHT": mul_routed, "EVEN_K": reduce_dim % tile.block_k == 0, "NAIVE": naive,
            "HAS_EXPERT_MAP": has_map, "DOT_PRECISION": precision,
            "BLOCK_M": block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
        }  # fmt: skip
        if kind == 1:
            constexprs |= {"INTERLEAVE": tile.interleave, "ZERO_COUNTERS": sum_in_gemm2, "SILU_SLOPE": 1.0}
        else:
            constexprs |= {"FOLD_K": fold_k, "SUM_IN_GEMM2": sum_in_gemm2}
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
            target=TARGET,
            options={"num_warps": tile.num_warps, "num_stages": tile.num_stages},
        )
    except Exception as exc:  # noqa: BLE001 - reported as the row's error
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "seconds": time.perf_counter() - t0}
    ptx = compiled.asm["ptx"]
    ttgir = compiled.asm.get("ttgir", "")
    return {
        "shared": compiled.metadata.shared,
        "warp_specialized": "ttg.warp_specialize" in ttgir,
        "tma_stores": "cp.async.bulk.tensor.2d.global.shared" in ptx,
        "mma": "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none",
        "cp_async": "cp.async" in ptx,
        "tma_loads": "cp.async.bulk.tensor" in ptx,
        "seconds": round(time.perf_counter() - t0, 1),
        **_ptxas_report(ptx),
    }


def compile_gemv(
    kind: int,
    tile,
    *,
    dtype: str = "bf16",
    F: int = 768,
    D: int = 2048,
    top_k: int = 8,
    mul_routed: bool | None = None,
    has_map: bool = False,
    pdl: bool = False,
) -> dict:
    """Compile decode GEMV `kind` (1: `_gemv1_silu_kernel`, 2: `_gemv2_sum_kernel`) for sm_90: registers,
    spills, shared memory, whether the weight loads are 16-byte vectors, pipelined (cp.async), and
    whether the grid-dependency instructions of PDL are there."""
    fn = kernels._gemv1_silu_kernel if kind == 1 else kernels._gemv2_sum_kernel
    if mul_routed is None:
        mul_routed = kind == 2
    reduce_dim = D if kind == 1 else F
    ints = {"F": F, "D": D, "stride_xm": D, "stride_we": 2 * F * D if kind == 1 else D * F,
            "stride_wn": D if kind == 1 else F, "stride_hm": F, "stride_om": D}  # fmt: skip
    sig, attrs = _signature(fn, dtype, ints)
    constexprs = {"MUL_ROUTED_WEIGHT": mul_routed, "HAS_EXPERT_MAP": has_map, "USE_PDL": pdl,
                  "NUM_STAGES": tile.num_stages}  # fmt: skip
    if kind == 1:
        constexprs |= {
            "EVEN_D": reduce_dim % tile.block_k == 0,
            "BLOCK_F": tile.block_n,
            "BLOCK_D": tile.block_k,
        }
    else:
        constexprs |= {"EVEN_F": reduce_dim % tile.block_k == 0, "K_PAD": 1 << max(top_k - 1, 0).bit_length(),
                       "BLOCK_D": tile.block_n, "BLOCK_F": tile.block_k}  # fmt: skip
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
            target=TARGET,
            options={"num_warps": tile.num_warps, "num_stages": tile.num_stages, "launch_pdl": pdl},
        )
    except Exception as exc:  # noqa: BLE001 - reported as the row's error
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "seconds": time.perf_counter() - t0}
    ptx = compiled.asm["ptx"]
    return {
        "shared": compiled.metadata.shared,
        "vector_loads_16B": len(re.findall(r"ld\.global(?:\.[a-z_:0-9]+)*\.v4\.b32", ptx)),
        "scalar_or_narrow_loads": len(
            re.findall(r"ld\.global(?:\.[a-z_:0-9]+)*\.(?:b16|b32|v2\.b32)\b", ptx)
        ),
        "cp_async": "cp.async" in ptx,
        "griddepcontrol": sorted(set(re.findall(r"griddepcontrol\.\w+", ptx))),
        "seconds": round(time.perf_counter() - t0, 1),
        **_ptxas_report(ptx),
    }


def default_matrix(quick: bool) -> list[tuple[int, int, object, dict]]:
    """(kind, block_m, tile, extra kwargs): the new variants beside the shipped large-M tiles."""
    T = GemmTile
    rows = [
        # GEMM1 at the large-M tiles: two dots (shipped) vs one interleaved dot of the same width.
        (1, 128, T(128, 64, 8, 8, 4), {}),
        (1, 128, T(128, 64, 8, 8, 4, interleave=True), {}),
        (1, 128, T(64, 64, 8, 8, 4, interleave=True), {}),
        (1, 256, T(64, 64, 8, 8, 3, interleave=True), {}),
        (1, 256, T(64, 64, 8, 8, 3), {}),
        # GEMM2: vLLM's large-M tile, and BLOCK_M 256; pointer loads and TMA.
        (2, 128, T(256, 64, 8, 8, 4), {}),
        (2, 128, T(256, 64, 8, 8, 4, tma=True), {}),
        (2, 256, T(128, 64, 8, 8, 4), {}),
        (2, 256, T(128, 64, 8, 8, 3, tma=True), {}),
        # The prefill path: persistent, weights by TMA, pipelined across work items or warp-specialized.
        (1, 128, T(128, 64, 8, 8, 4, interleave=True, persistent=True), {}),
        (1, 128, T(128, 64, 8, 8, 3, interleave=True, persistent=True), {}),
        (1, 128, T(128, 64, 8, 8, 3, interleave=True, persistent=True, warp_specialize=True), {}),
        (1, 128, T(128, 64, 8, 8, 3, persistent=True), {}),
        (2, 128, T(256, 64, 8, 8, 4, tma=True, persistent=True), {}),
        (2, 128, T(256, 64, 8, 8, 3, tma=True, persistent=True, warp_specialize=True), {}),
        (2, 128, T(128, 64, 8, 8, 4, tma=True, persistent=True), {}),
        # M = 1: naive GEMM1 and the folded GEMM2.
        (1, 16, T(64, 128, 8, 4, 4), {"naive": True}),
        (2, 16, T(32, 128, 1, 4, 4), {"naive": True, "fold_k": True}),
    ]
    if not quick:
        rows += [
            (1, 128, T(128, 64, 8, 8, 4), {"dtype": "fp32", "precision": "ieee"}),
            (1, 64, T(64, 64, 8, 4, 3, interleave=True), {"dtype": "fp32", "precision": "ieee"}),
            (2, 16, T(64, 128, 1, 4, 3), {"naive": True, "fold_k": True, "has_map": True}),
            (1, 128, T(128, 64, 8, 8, 4), {"F": 4096, "D": 5120, "mul_routed": True}),  # Scout
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--quick", action="store_true", help="the first few variants only")
    parser.add_argument("--jobs", type=Path, help="compile these variants (tune_fused_moe.py --dump-jobs)")
    args = parser.parse_args(argv)
    rows = []
    print(f"triton {triton.__version__}, target sm_90", file=sys.stderr)
    if args.jobs is not None:
        matrix = [
            (j["kind"], j["block_m"], GemmTile(**j["tile"]),
             {"F": j["F"], "D": j["D"], "mul_routed": j["mul_routed"], "naive": j["naive"],
              "fold_k": j["fold_k"], "has_map": j.get("has_map", False)})
            for j in json.loads(args.jobs.read_text())
        ]  # fmt: skip
    else:
        matrix = default_matrix(args.quick)
    for kind, block_m, tile, extra in matrix:
        report = compile_gemm(kind, block_m, tile, **extra)
        row = {
            "triton": triton.__version__,
            "gemm": kind,
            "block_m": block_m,
            **tile.__dict__,
            **extra,
            **report,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
