"""Triton fused MoE against fused_moe_ref, the routing alignment's invariants, and the tile configs.

Without a GPU the kernels run in Triton's interpreter (conftest.py) in fp32 and fp16: its bf16
tl.dot is broken (relative error ~1e10, measured with triton 3.9). With a GPU they run in bf16,
at small shapes and at every shipped per-rank shape for every M of the benchmark grid, and in
fp32 at odd shapes (IEEE dots: fp32 must mean fp32).

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import pytest
import torch

from moe_eval.kernels import fused_moe as fused_moe_module
from moe_eval.kernels.fused_moe import fused_moe, moe_align_block_size
from moe_eval.kernels.testing import MoeCase, make_case, rel_err, shape_case
from moe_eval.kernels.tile_configs import (
    M_GRID,
    SHIPPED_SHAPES,
    SMEM_LIMIT,
    GemmTile,
    GemvTiles,
    MoeTileConfig,
    default_gemv_tiles,
)
from tests.kernels.conftest import HAS_GPU, INTERPRETER_PROBLEM

# ||out - ref|| / ||ref||, ref = fused_moe_ref on the same inputs upcast to fp32 (so input rounding
# cancels). What remains is what the kernel rounds on the way: h = silu(gate) * up, y per slot and
# out are each stored in the dtype, three roundings of relative rms u / sqrt(3) (u = unit
# roundoff), about sqrt(3) * u / sqrt(3) = u in all; fp32 accumulation adds ~sqrt(D) * 2^-24.
TOLERANCE = {
    # u = 2^-24 = 6e-8, times sqrt(D) ~ 10 for the dot lengths here: ~1e-6; the interpreter's numpy
    # dot and the GPU's MMA sum in another order than torch. A TF32 dot (10-bit mantissa) would land
    # near 3e-4 and fail: this line is what "fp32 means fp32" is held to.
    torch.float32: 1e-5,
    torch.float16: 2e-3,  # u = 2^-11 = 4.9e-4 -> ~5e-4 expected, 4x margin
    torch.bfloat16: 1e-2,  # u = 2^-8 = 3.9e-3 -> ~4e-3 expected ("near 4e-3"); issue 3 fails above 1e-2
}
# ||gemv - other|| / ||other|| between the decode GEMVs and a path that rounds at the same points (the
# tl.dot naive plan, or the incumbent's arithmetic in torch): only the fp32 summation order differs, so
# an element moves only where an fp32 sum sits within its own rounding error of a rounding boundary of
# the dtype (probability ~ sqrt(D) 2^-24 / u a rounding), and then by one unit: ~u / sqrt(D) in the
# norm for one flip at these small D. Measured under the interpreter, fp16, GEMV_CASES x 2 seeds: 0 against
# the incumbent everywhere, against the tl.dot plan 0 but once 7.0e-5 (K = E, D = 256); fp32 <= 3.2e-7. A
# path that skips a rounding (the tl.dot fold_k GEMM2 sums each slot's output unrounded) lands at
# 1.6e-4 to 4.6e-4 from the incumbent in fp16 (K > 1, no map).
AGREEMENT = {
    torch.float32: 1e-6,  # ~sqrt(D) 2^-24 = 1e-6 at D = 256; measured 3.2e-7
    torch.float16: 1e-4,  # between one flip's 7.0e-5 and a skipped rounding's 1.6e-4
    # H200 real shapes, 2026-12-02 (test_real_shape_gemv_bf16's cells): 0 to 1.02e-3, the largest at
    # Mixtral M = 2 and 4 (F = 14336: another fp32 order of the long sums flips some h elements by one
    # bf16 ulp before GEMM2). A skipped per-slot rounding is what the fp16 line above tells apart (CPU:
    # exactly 0 against 1.6e-4); here, a half of bf16's own error.
    torch.bfloat16: 2e-3,
}
DTYPES = [torch.bfloat16] if HAS_GPU else [torch.float32, torch.float16]

# Small tiles keep the interpreter fast; GROUP_M=2 makes the swizzle reorder blocks.
SMALL = MoeTileConfig(
    block_m=16, gemm1=GemmTile(block_n=32, block_k=32), gemm2=GemmTile(block_n=32, block_k=32)
)
SWIZZLED = MoeTileConfig(
    block_m=32,
    gemm1=GemmTile(block_n=16, block_k=64, group_m=2),
    gemm2=GemmTile(block_n=64, block_k=16, group_m=2),
)
# GEMM1 as one tl.dot over interleaved gate/up rows (GROUP_M 3: a swizzle width that divides nothing).
INTERLEAVED = MoeTileConfig(
    block_m=16,
    gemm1=GemmTile(block_n=16, block_k=32, group_m=3, interleave=True),
    gemm2=GemmTile(block_n=32, block_k=32, group_m=3),
)
# No alignment for the calls that qualify (one token, or T*K*4 <= e); GEMM2 sums over K itself.
NAIVE_FOLD = MoeTileConfig(
    block_m=16,
    gemm1=GemmTile(block_n=32, block_k=32),
    gemm2=GemmTile(block_n=32, block_k=32),
    naive=True,
    fold_k=True,
)
NAIVE = MoeTileConfig(
    block_m=16,
    gemm1=GemmTile(block_n=32, block_k=32, interleave=True),
    gemm2=GemmTile(block_n=16, block_k=32),
    naive=True,
)
CONFIGS = [
    pytest.param(SMALL, id="bm16"),
    pytest.param(SWIZZLED, id="bm32-swizzled"),
    pytest.param(INTERLEAVED, id="bm16-interleaved"),
]
# The decode GEMVs on the calls where naive applies (the tl.dot tiles above serve the other calls).
# Small steps so the test shapes loop over D and F and hit their masked edges.
GEMV = MoeTileConfig(
    block_m=16,
    gemm1=GemmTile(block_n=32, block_k=32),
    gemm2=GemmTile(block_n=32, block_k=32),
    naive=True,
    gemv=GemvTiles(GemmTile(8, 16, num_stages=1), GemmTile(4, 16, num_stages=1)),
)
# Pipelined loops (num_stages > 1), 2 warps, one output row per GEMM2 program, and PDL asked for (on a GPU
# GEMM2 waits for GEMM1 through griddepcontrol; the interpreter runs the same kernels without it).
GEMV_PIPELINED = MoeTileConfig(
    block_m=16,
    gemm1=GemmTile(block_n=32, block_k=32),
    gemm2=GemmTile(block_n=32, block_k=32),
    naive=True,
    gemv=GemvTiles(GemmTile(4, 32, num_warps=2, num_stages=2), GemmTile(1, 32, num_stages=3), pdl=True),
)
# The tl.dot naive chain with GEMM2 and the sum as programmatic dependents (on a GPU with PDL; the
# interpreter runs the same kernels without it).
NAIVE_PDL = dataclasses.replace(NAIVE, pdl=True)
NAIVE_CONFIGS = [
    pytest.param(NAIVE_FOLD, id="naive-fold"),
    pytest.param(NAIVE, id="naive-interleaved"),
    pytest.param(NAIVE_PDL, id="naive-interleaved-pdl"),
    pytest.param(dataclasses.replace(NAIVE_FOLD, pdl=True), id="naive-fold-pdl"),
    pytest.param(GEMV, id="naive-gemv"),
    pytest.param(GEMV_PIPELINED, id="naive-gemv-pipelined-pdl"),
]


def test_triton_can_run_here():
    # Fails (never skips) when the interpreter could not be switched on: the tests below would
    # then fail one by one with "fused_moe needs CUDA tensors".
    assert INTERPRETER_PROBLEM is None, INTERPRETER_PROBLEM


def _check(case: MoeCase, config: MoeTileConfig | None) -> float:
    dtype = case.hidden_TD.dtype
    out_TD = torch.full_like(case.hidden_TD, float("nan"))  # poison: every element must be written
    returned = fused_moe(*case.args(), **case.kwargs(), out=out_TD, config=config)
    assert returned is out_TD
    assert not torch.isnan(out_TD).any(), "output has NaN: some element was never written"
    err = rel_err(out_TD, case.reference_fp32())
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]:.0e} ({dtype})"
    return err


# --- comparisons with the reference --------------------------------------------------------------

CASES = [
    (1, 8, 2, 64, 32),  # one token: one row per block, the rest padding
    (7, 4, 2, 48, 40),  # T < BLOCK_M; F = 40 is not a multiple of BLOCK_N
    (40, 6, 3, 64, 48),  # E not a power of two; several blocks per expert
    (150, 16, 4, 32, 16),  # T*K = 600: many blocks, so the swizzle reorders them
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("T", "E", "K", "D", "F"), CASES)
def test_matches_reference(T, E, K, D, F, config, dtype, device):
    _check(make_case(T, E, K, D, F, dtype=dtype, device=device, seed=T * 1000 + E), config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_token(dtype, device):
    _check(make_case(1, 16, 4, 64, 32, dtype=dtype, device=device, seed=1), SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_tokens_to_one_expert(dtype, device):
    # 40 rows of one expert span three blocks of 16; the other 7 experts get nothing.
    ids_TK = torch.full((40, 1), 3, dtype=torch.int32, device=device)
    _check(make_case(40, 8, 1, 32, 32, dtype=dtype, device=device, seed=2, topk_ids_TK=ids_TK), SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_experts_with_no_tokens(dtype, device):
    # Only experts 0..3 of 16 are routed to: 12 experts must produce no block at all.
    ids_TK = torch.stack([torch.randperm(4)[:2] for _ in range(20)]).to(torch.int32).to(device)
    _check(make_case(20, 16, 2, 32, 32, dtype=dtype, device=device, seed=3, topk_ids_TK=ids_TK), SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_k_equals_e(dtype, device):
    _check(make_case(16, 8, 8, 32, 32, dtype=dtype, device=device, seed=4), SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_e_not_power_of_two(dtype, device):
    _check(make_case(30, 7, 3, 32, 32, dtype=dtype, device=device, seed=5), SWIZZLED)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_d_and_f(dtype, device):
    # D = 45 and F = 23: masks on every tile edge, unaligned rows, no EVEN_K fast path.
    _check(make_case(23, 5, 2, 45, 23, dtype=dtype, device=device, seed=6), SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [1, 2])  # K = 1 writes the output directly (and zeroes it first)
def test_expert_map_with_unmapped_slots(K, dtype, device):
    # This rank holds global experts 5, 1, 6, 2 in slots 0..3; slots routed to 0, 3, 4, 7 contribute 0.
    case = make_case(33, 8, K, 32, 48, dtype=dtype, device=device, seed=7 + K, local_experts=[5, 1, 6, 2])
    _check(case, SMALL)


def test_in_place_output_refused_under_an_expert_map(device):
    # The output is zeroed before GEMM1 has read all of x there (K = 1; sum_in_gemm2): x would be lost.
    case = make_case(8, 8, 1, 32, 48, dtype=DTYPES[0], device=device, seed=3, local_experts=[5, 1, 6, 2])
    with pytest.raises(ValueError, match="must not share memory with hidden_TD"):
        fused_moe(*case.args(), **case.kwargs(), config=SMALL, out=case.hidden_TD)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [1, 2])
def test_no_slot_on_this_rank_gives_zeros(K, dtype, device):
    case = make_case(9, 8, K, 32, 32, dtype=dtype, device=device, seed=9, local_experts=[6, 7])
    case.topk_ids_TK = torch.stack([torch.randperm(6)[:K] for _ in range(9)]).to(torch.int32).to(device)
    out_TD = torch.full_like(case.hidden_TD, float("nan"))
    fused_moe(*case.args(), **case.kwargs(), out=out_TD, config=SMALL)
    assert torch.equal(out_TD, torch.zeros_like(out_TD))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [1, 3])
def test_apply_router_weight_on_input(K, dtype, device):
    case = make_case(
        21, 6, K, 32, 32, dtype=dtype, device=device, seed=10 + K, apply_router_weight_on_input=True
    )
    _check(case, SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_tokens(dtype, device):
    case = make_case(0, 8, 2, 32, 32, dtype=dtype, device=device, seed=12)
    out_TD = fused_moe(*case.args(), config=SMALL)
    assert out_TD.shape == (0, 32) and out_TD.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_three_launch_alignment_path(dtype, device, monkeypatch):
    # Force the count/scan/scatter alignment (normally only above SINGLE_PROGRAM_MAX_SLOTS slots).
    monkeypatch.setattr(fused_moe_module, "SINGLE_PROGRAM_MAX_SLOTS", 0)
    _check(
        make_case(70, 8, 2, 32, 32, dtype=dtype, device=device, seed=13, local_experts=[0, 2, 4, 6, 7]), SMALL
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_config(dtype, device):
    # No config: the launcher picks one (tuned file on a GPU, the heuristic elsewhere).
    _check(make_case(24, 8, 2, 64, 64, dtype=dtype, device=device, seed=14), None)


@pytest.mark.skipif(HAS_GPU, reason="about the interpreter only")
def test_bf16_refused_under_interpreter():
    case = make_case(4, 4, 2, 32, 32, dtype=torch.bfloat16, device="cpu", seed=15)
    with pytest.raises(RuntimeError, match="bf16"):
        fused_moe(*case.args(), config=SMALL)


# --- naive plans: no alignment, one block per slot ------------------------------------------------

NAIVE_CASES = [
    # (T, E, K, D, F, local experts)
    (1, 8, 2, 64, 48, None),  # one token: K distinct experts, exactly one block each
    (1, 16, 4, 48, 40, None),  # odd D and F: masked K loop and N edge
    (3, 32, 2, 32, 32, None),  # T*K*4 = 24 <= 32: vLLM's small-batch rule, experts may repeat
    (1, 8, 8, 32, 32, None),  # K = E
    (1, 8, 3, 32, 32, [5, 1, 6, 2]),  # expert map: some of the token's slots live on another rank
    (2, 16, 1, 32, 32, [0, 3, 9, 12, 1, 5, 7, 15]),  # K = 1 with a map (2 * 1 * 4 <= 8 local experts)
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", NAIVE_CONFIGS)
@pytest.mark.parametrize(("T", "E", "K", "D", "F", "local"), NAIVE_CASES)
def test_naive_plan_matches_reference(T, E, K, D, F, local, config, dtype, device):
    case = make_case(T, E, K, D, F, dtype=dtype, device=device, seed=100 + T * E + K, local_experts=local)
    e = E if local is None else len(local)
    plan = fused_moe_module.launch_plan(T, e, F, D, K, "test", config)
    assert plan.align.naive, "these cases must take the naive path"
    assert plan.gemv == config.gemv
    assert plan.fold_k == (config.fold_k or config.gemv is not None), "a GEMV plan always sums in GEMM2"
    _check(case, config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", NAIVE_CONFIGS)
@pytest.mark.parametrize("K", [1, 2])
def test_naive_token_held_elsewhere_gives_zeros(K, config, dtype, device):
    # The one token's experts all live on another rank: nothing is computed, the output must be 0.
    case = make_case(1, 8, K, 32, 32, dtype=dtype, device=device, seed=110 + K, local_experts=[6, 7])
    case.topk_ids_TK = torch.tensor([[0, 1][:K]], dtype=torch.int32, device=device)
    out_TD = torch.full_like(case.hidden_TD, float("nan"))
    fused_moe(*case.args(), **case.kwargs(), out=out_TD, config=config)
    assert torch.equal(out_TD, torch.zeros_like(out_TD))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [NAIVE_FOLD, GEMV], ids=["naive-fold", "naive-gemv"])
@pytest.mark.parametrize("K", [1, 3])
def test_naive_fold_with_router_weight_on_input(K, config, dtype, device):
    case = make_case(
        1, 12, K, 32, 48, dtype=dtype, device=device, seed=120 + K, apply_router_weight_on_input=True
    )
    _check(case, config)


@pytest.mark.parametrize(("T", "e", "K", "naive"), [
    (1, 8, 2, True),  # one token always qualifies
    (4, 128, 8, True),  # 4 * 8 * 4 = 128 <= 128: vLLM's rule, exactly at the edge
    (5, 128, 8, False),  # 160 > 128: experts would repeat too often; aligned
    (2, 8, 2, False),  # Mixtral-like: two tokens already share experts
])  # fmt: skip
def test_naive_only_where_it_qualifies(T, e, K, naive):
    plan = fused_moe_module.launch_plan(T, e, 32, 32, K, "test", NAIVE_FOLD)
    assert plan.align.naive is naive and plan.fold_k is naive
    gemv = fused_moe_module.launch_plan(T, e, 32, 32, K, "test", GEMV)
    assert (gemv.gemv is not None) is naive and gemv.fold_k is naive
    # A config without naive never skips the alignment.
    assert not fused_moe_module.launch_plan(T, e, 32, 32, K, "test", SMALL).align.naive


# --- the decode GEMVs (`gemv`): both GEMMs without tl.dot on naive plans ---------------------------


def _incumbent(case: MoeCase) -> torch.Tensor:
    """vLLM's fused_experts arithmetic in torch (moe_eval.kernels.layer_check's model): fp32 sums of the
    operands, h rounded to the dtype, each slot's weighted output rounded, the K slots summed in fp32 in
    slot order and rounded once."""
    dtype = case.hidden_TD.dtype
    x_TD = case.hidden_TD.float()
    local_TK = case.topk_ids_TK.long()
    if case.expert_map_E is not None:
        local_TK = case.expert_map_E.long()[local_TK]
    F = case.w2_eDF.shape[2]
    out_TD = torch.zeros_like(x_TD)
    for t, k in itertools.product(*map(range, local_TK.shape)):
        expert = int(local_TK[t, k])
        if expert < 0:
            continue
        weight = case.topk_weights_TK[t, k].float()
        gate_up = case.w13_eFD[expert].float() @ x_TD[t]
        if case.apply_router_weight_on_input:
            gate_up = gate_up * weight
        h_F = (torch.nn.functional.silu(gate_up[:F]) * gate_up[F:]).to(dtype).float()
        y_D = case.w2_eDF[expert].float() @ h_F
        if not case.apply_router_weight_on_input:
            y_D = y_D * weight
        out_TD[t] += y_D.to(dtype).float()
    return out_TD.to(dtype)


GEMV_CASES = [
    # (T, E, K, D, F, local experts, weight on input)
    pytest.param(1, 8, 2, 64, 48, None, False, id="one-token"),
    pytest.param(1, 8, 8, 256, 128, None, False, id="K-equals-E"),  # longest sums here: most flips
    pytest.param(2, 32, 3, 45, 23, None, False, id="odd-D-F-K"),  # every mask, K_PAD 4 > K; 2 tokens
    pytest.param(1, 16, 3, 32, 40, [0, 3, 9, 12, 1, 5, 7, 15, 2, 4, 6, 8], False, id="expert-map"),
    pytest.param(1, 12, 3, 32, 48, None, True, id="weight-on-input"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("T", "E", "K", "D", "F", "local", "on_input"), GEMV_CASES)
def test_gemv_agrees_with_the_tl_dot_naive_plan(T, E, K, D, F, local, on_input, dtype, device):
    # Same rounding points as the tl.dot naive plan with its separate sum: only fp32 summation order differs.
    case = make_case(T, E, K, D, F, dtype=dtype, device=device, seed=180 + T + K, local_experts=local,
                     apply_router_weight_on_input=on_input)  # fmt: skip
    e = E if local is None else len(local)
    assert fused_moe_module.launch_plan(T, e, F, D, K, "test", GEMV).gemv is not None, "must run the GEMVs"
    _check(case, GEMV)
    gemv = fused_moe(*case.args(), **case.kwargs(), config=GEMV)
    tl_dot = fused_moe(*case.args(), **case.kwargs(), config=NAIVE)
    assert rel_err(gemv, tl_dot) <= AGREEMENT[dtype]


@pytest.mark.parametrize(("T", "E", "K", "D", "F", "local", "on_input"), GEMV_CASES)
def test_gemv_rounds_where_the_incumbent_does(T, E, K, D, F, local, on_input, device):
    # The layer check compares served outputs with the incumbent's arithmetic: a path that rounds at other
    # points moves that ratio. fp16 on the CPU (the interpreter's bf16 cast truncates), bf16 on a GPU.
    dtype = torch.bfloat16 if HAS_GPU else torch.float16
    case = make_case(T, E, K, D, F, dtype=dtype, device=device, seed=190 + T + K, local_experts=local,
                     apply_router_weight_on_input=on_input)  # fmt: skip
    incumbent = _incumbent(case)
    assert rel_err(fused_moe(*case.args(), **case.kwargs(), config=GEMV), incumbent) <= AGREEMENT[dtype]
    if K > 1 and local is None and not HAS_GPU:
        # The line can see a missing rounding: the tl.dot fold_k GEMM2 sums the K slots unrounded (with a
        # map a token may have one local slot, where that rounding does not show).
        assert (
            rel_err(fused_moe(*case.args(), **case.kwargs(), config=NAIVE_FOLD), incumbent) > AGREEMENT[dtype]
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_config_outside_naive_calls_runs_the_aligned_gemms(dtype, device):
    # T*K*4 > e: the alignment and the tl.dot tiles serve the call; the GEMV tiles are not used.
    plan = fused_moe_module.launch_plan(20, 8, 32, 32, 2, "test", GEMV)
    assert not plan.align.naive and plan.gemv is None and not plan.fold_k
    _check(make_case(20, 8, 2, 32, 32, dtype=dtype, device=device, seed=200), GEMV)


def test_pdl_config_rules():
    tile = GemmTile(32, 32)
    for gemm1, gemm2 in ((GemmTile(32, 32, persistent=True), tile), (tile, GemmTile(32, 32, tma=True)),
                         (tile, GemmTile(32, 32, tma=True, persistent=True))):  # fmt: skip
        with pytest.raises(ValueError, match="pdl needs the pointer GEMMs"):
            MoeTileConfig(64, gemm1, gemm2, pdl=True)
    with pytest.raises(ValueError, match="a gemv config says it in gemv.pdl"):
        dataclasses.replace(GEMV, pdl=True)
    # JSON: round-trips; a config without it writes no "pdl" key (the shipped files stay as they were).
    assert MoeTileConfig.from_json(NAIVE_PDL.to_json()) == NAIVE_PDL
    assert "pdl" not in NAIVE.to_json()
    with pytest.raises(ValueError, match="pdl must be true or false"):
        MoeTileConfig.from_json(NAIVE.to_json() | {"pdl": "yes"})
    # The plan carries it on naive calls and on aligned ones (GEMM1 then follows the alignment).
    naive_call = fused_moe_module.launch_plan(1, 8, 32, 32, 2, "test", NAIVE_PDL)
    aligned_call = fused_moe_module.launch_plan(20, 8, 32, 32, 2, "test", NAIVE_PDL)
    assert naive_call.pdl and naive_call.align.naive
    assert aligned_call.pdl and not aligned_call.align.naive
    assert not fused_moe_module.launch_plan(20, 8, 32, 32, 2, "test", NAIVE).pdl


def test_pdl_computes_the_same_bits(device):
    # PDL changes when GEMM2 and the sum start, never what they compute (with and without a sum launch,
    # with an expert map). On the CPU this holds the plumbing only (the interpreter runs the kernels without
    # PDL: pdl_available is False); test_real_shape_pdl_bf16 holds the GPU.
    # Aligned calls too (T = 20: the alignment, then GEMM1 as its dependent), and K = 1 with an expert
    # map, where the output is zeroed between the alignment and GEMM1.
    for config in (NAIVE, NAIVE_FOLD, SWIZZLED):
        for T, K, local in ((1, 3, None), (2, 3, [0, 5, 2, 7]), (20, 3, None), (20, 3, [0, 5, 2, 7]),
                            (20, 1, [1, 6])):  # fmt: skip
            case = make_case(
                T, 8, K, 96, 80, dtype=DTYPES[0], device=device, seed=220 + T + K, local_experts=local
            )
            plain = fused_moe(*case.args(), **case.kwargs(), config=config)
            with_pdl = fused_moe(*case.args(), **case.kwargs(), config=dataclasses.replace(config, pdl=True))
            assert torch.equal(plain, with_pdl)
            assert rel_err(plain, case.reference_fp32()) <= TOLERANCE[DTYPES[0]]


def test_sum_in_gemm2_config_rules():
    tile = GemmTile(32, 32)
    for gemm1, gemm2 in ((GemmTile(32, 32, persistent=True), tile), (tile, GemmTile(32, 32, tma=True)),
                         (tile, GemmTile(32, 32, tma=True, persistent=True))):  # fmt: skip
        with pytest.raises(ValueError, match="sum_in_gemm2 needs the pointer GEMMs"):
            MoeTileConfig(64, gemm1, gemm2, sum_in_gemm2=True)
    summing = dataclasses.replace(NAIVE_FOLD, sum_in_gemm2=True)
    assert MoeTileConfig.from_json(summing.to_json()) == summing
    assert "sum_in_gemm2" not in NAIVE_FOLD.to_json()  # the shipped files stay as they were
    with pytest.raises(ValueError, match="sum_in_gemm2 must be true or false"):
        MoeTileConfig.from_json(NAIVE.to_json() | {"sum_in_gemm2": 1})
    # Aligned calls only: a naive call keeps its fold_k (or the sum launch).
    assert not fused_moe_module.launch_plan(1, 8, 32, 32, 2, "test", summing).sum_in_gemm2
    assert fused_moe_module.launch_plan(20, 8, 32, 32, 2, "test", summing).sum_in_gemm2


SUM_IN_GEMM2_CASES = [
    # (T, K, local experts, router weight on input, three-launch alignment)
    (20, 3, None, False, False),
    (70, 2, None, True, False),  # GEMM2 multiplies no weight
    (9, 8, None, False, True),  # K = E: every token in every block; the three-launch alignment
    (33, 1, None, False, False),  # K = 1: GEMM2 writes the output itself, nothing to sum
    (20, 3, [0, 5, 2, 7], False, False),  # expert map: slots held elsewhere add 0, GEMM1 zeroes the output
    (30, 2, [3, 6], True, True),  # expert map with tokens none of whose slots is here (they read 0)
]


@pytest.mark.parametrize(
    "config", CONFIGS + [pytest.param(dataclasses.replace(SWIZZLED, pdl=True), id="pdl")]
)
@pytest.mark.parametrize(("T", "K", "local", "on_input", "three_launch"), SUM_IN_GEMM2_CASES)
def test_sum_in_gemm2_computes_the_same_bits(
    T, K, local, on_input, three_launch, config, device, monkeypatch
):
    # The sum inside GEMM2 adds a token's K rows in slot order in fp32 and rounds once, as the sum launch
    # does: the same bits, into an output that starts as NaN (every token written). Where it applies the
    # sum launch must not run at all (else this test would compare the sum launch with itself).
    if three_launch:
        monkeypatch.setattr(fused_moe_module, "SINGLE_PROGRAM_MAX_SLOTS", 0)
    dtype = DTYPES[0]
    case = make_case(T, 8, K, 96, 80, dtype=dtype, device=device, seed=240 + T + K, local_experts=local,
                     apply_router_weight_on_input=on_input)  # fmt: skip
    plain = fused_moe(*case.args(), **case.kwargs(), config=config)
    summing = dataclasses.replace(config, sum_in_gemm2=True)
    launches = []
    real_sum = fused_moe_module.launch_sum
    monkeypatch.setattr(
        fused_moe_module, "launch_sum", lambda *a, **k: launches.append(1) or real_sum(*a, **k)
    )
    out = torch.full_like(case.hidden_TD, float("nan"))
    fused_moe(*case.args(), **case.kwargs(), config=summing, out=out)
    assert len(launches) == 0  # the sum is in GEMM2 (K = 1 has none)
    assert torch.equal(out, plain)
    assert rel_err(out, case.reference_fp32()) <= TOLERANCE[dtype]


def test_sum_in_gemm2_counters_are_zeroed_by_gemm1(device, monkeypatch):
    # The counters come from torch.empty (whatever the allocator hands back: often zeros by luck): GEMM1
    # must zero them. Handed counters full of garbage, the call still gives the plain bits; handed them
    # after GEMM1 (so nothing zeroes them) at K, no row is ever last and no output row is written.
    dtype = DTYPES[0]
    case = make_case(40, 8, 3, 96, 80, dtype=dtype, device=device, seed=251)
    config = dataclasses.replace(SMALL, sum_in_gemm2=True)
    plain = fused_moe(*case.args(), **case.kwargs(), config=SMALL)
    real_counters = fused_moe_module.sum_counters
    monkeypatch.setattr(fused_moe_module, "sum_counters", lambda *a: real_counters(*a).fill_(7))
    out = torch.full_like(case.hidden_TD, float("nan"))
    assert torch.equal(fused_moe(*case.args(), **case.kwargs(), config=config, out=out), plain)

    real_gemm2 = fused_moe_module.launch_gemm2

    def counters_left_at_k(*args, sum_into=None, **kwargs):
        sum_into[1].fill_(3)
        real_gemm2(*args, sum_into=sum_into, **kwargs)

    monkeypatch.setattr(fused_moe_module, "launch_gemm2", counters_left_at_k)
    out = torch.full_like(case.hidden_TD, float("nan"))
    fused_moe(*case.args(), **case.kwargs(), config=config, out=out)
    assert torch.isnan(out).all()


def test_gemv_config_rules():
    tile = GemmTile(32, 32)
    gemv = GemvTiles(GemmTile(4, 64, num_stages=1), GemmTile(2, 64, num_stages=1))
    with pytest.raises(ValueError, match="gemv needs naive"):
        MoeTileConfig(16, tile, tile, gemv=gemv)
    with pytest.raises(ValueError, match="gemv always sums over K"):
        MoeTileConfig(16, tile, tile, naive=True, fold_k=True, gemv=gemv)
    with pytest.raises(ValueError, match="mean nothing to a GEMV"):
        GemvTiles(GemmTile(4, 64, interleave=True), gemv.gemm2)
    with pytest.raises(ValueError, match="mean nothing to a GEMV"):
        GemvTiles(gemv.gemm1, GemmTile(4, 64, group_m=8))
    with pytest.raises(ValueError, match="powers of two"):
        GemvTiles(GemmTile(3, 64), gemv.gemm2)
    # JSON: the field round-trips; a config without it writes no "gemv" key (files stay as they were).
    config = MoeTileConfig(16, tile, tile, naive=True, gemv=dataclasses.replace(gemv, pdl=True))
    assert MoeTileConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    assert "gemv" not in MoeTileConfig(16, tile, tile, naive=True).to_json()
    # A gemv entry is whole or absent: {} is no "off", a missing GEMM or a pdl that is no bool is refused.
    written = config.to_json()
    for gemv_json, message in (
        ({}, "missing keys"),
        ({k: v for k, v in written["gemv"].items() if k != "gemm2"}, "missing keys"),
        (written["gemv"] | {"pdl": "false"}, "pdl must be true or false"),
    ):
        with pytest.raises(ValueError, match=message):
            MoeTileConfig.from_json(written | {"gemv": gemv_json})


def test_pdl_never_under_the_interpreter(monkeypatch):
    # The GEMVs' PDL needs a CUDA grid to depend on; elsewhere (a CPU tensor, or a CUDA device while the
    # interpreter runs the kernels) the same kernels run without it.
    monkeypatch.setattr(fused_moe_module, "_pdl_supported", lambda index: True)
    assert not fused_moe_module.pdl_available(torch.device("cpu"))
    monkeypatch.setattr(fused_moe_module, "_interpreting", lambda: True)
    assert not fused_moe_module.pdl_available(torch.device("cuda", 0))
    monkeypatch.setattr(fused_moe_module, "_interpreting", lambda: False)
    assert fused_moe_module.pdl_available(torch.device("cuda", 0))  # the stub: what a capable GPU says


@pytest.mark.parametrize("shape", SHIPPED_SHAPES, ids=lambda s: s.name.replace(" ", "-"))
def test_default_gemv_tiles_fill_the_h200(shape):
    # The probe's starting point: powers of two, at least 2 programs per H200 SM (132) for both GEMVs at
    # M = 1, and each step's tile a few 16-byte loads per thread (registers, not shared memory).
    tiles = default_gemv_tiles(shape.F, shape.D, shape.top_k)
    slots = shape.top_k * shape.local_experts // shape.num_experts or 1  # local slots of one token
    k_pad = 1 << max(shape.top_k - 1, 0).bit_length()
    assert -(-shape.F // tiles.gemm1.block_n) * slots >= 264, tiles.gemm1
    assert -(-shape.D // tiles.gemm2.block_n) >= 264, tiles.gemm2
    threads = [32 * t.num_warps for t in (tiles.gemm1, tiles.gemm2)]
    per_thread = (2 * tiles.gemm1.block_n * tiles.gemm1.block_k / threads[0],
                  k_pad * tiles.gemm2.block_n * tiles.gemm2.block_k / threads[1])  # fmt: skip
    assert all(16 <= n <= 64 for n in per_thread), per_thread


def test_config_fields_the_code_would_ignore_are_errors():
    with pytest.raises(ValueError, match="fold_k needs naive"):
        MoeTileConfig(16, GemmTile(32, 32), GemmTile(32, 32), fold_k=True)
    with pytest.raises(ValueError, match="interleave is GEMM1"):
        MoeTileConfig(16, GemmTile(32, 32), GemmTile(32, 32, interleave=True))
    with pytest.raises(ValueError, match="tma is GEMM2"):
        MoeTileConfig(16, GemmTile(32, 32, tma=True), GemmTile(32, 32))
    with pytest.raises(ValueError, match="tma needs aligned"):
        MoeTileConfig(16, GemmTile(32, 32), GemmTile(32, 32, tma=True), naive=True)


@pytest.mark.parametrize(
    "config",
    [SWIZZLED, INTERLEAVED, NAIVE_FOLD, GEMV, GEMV_PIPELINED],
    ids=["aligned", "interleaved", "naive-fold", "naive-gemv", "naive-gemv-pipelined-pdl"],
)
def test_bitwise_repeatable(config, device, monkeypatch):
    # No atomics touch the values: the alignment's atomics only order slots inside an expert, and each
    # output row depends on its own slot. Three-launch alignment forced (its order varies most).
    monkeypatch.setattr(fused_moe_module, "SINGLE_PROGRAM_MAX_SLOTS", 0)
    dtype = DTYPES[0]
    for T in (1, 70):  # 1: the naive plan when the config allows it
        case = make_case(T, 8, 2, 32, 32, dtype=dtype, device=device, seed=130 + T)
        first = fused_moe(*case.args(), **case.kwargs(), config=config)
        again = fused_moe(*case.args(), **case.kwargs(), config=config)
        assert torch.equal(first, again)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_blocks(dtype, device):
    # The large-M shapes of the tuner: 128-row blocks with a 2 x 64-wide interleaved GEMM1 and a
    # 128-wide GEMM2, GROUP_M 16; several blocks per expert.
    config = MoeTileConfig(
        128,
        GemmTile(64, 32, group_m=16, num_warps=8, interleave=True),
        GemmTile(128, 32, group_m=16, num_warps=8),
    )
    _check(make_case(300, 4, 2, 64, 64, dtype=dtype, device=device, seed=140), config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [1, 2])  # K = 1: GEMM2 writes the output itself
def test_gemm2_tma(K, dtype, device):
    # GEMM2's operands through TMA descriptors: F = 40 is not a multiple of BLOCK_K (zero-filled
    # past the edge), D = 48 not of BLOCK_N, several blocks per expert.
    config = MoeTileConfig(32, GemmTile(16, 32, group_m=2), GemmTile(32, 32, group_m=2, tma=True))
    _check(make_case(70, 6, K, 48, 40, dtype=dtype, device=device, seed=150 + K), config)


def _prefill(interleave: bool, block_m: int = 32, ws: bool = False) -> MoeTileConfig:
    """The persistent prefill path at test sizes (GROUP_M 3: a swizzle width that divides nothing)."""
    return MoeTileConfig(
        block_m,
        GemmTile(16, 32, group_m=3, interleave=interleave, persistent=True),
        GemmTile(32, 32, group_m=3, tma=True, persistent=True, warp_specialize=ws),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "interleave,K,local,on_input",
    [
        pytest.param(True, 2, None, False, id="interleaved-K2"),
        pytest.param(False, 3, None, False, id="two-dot-K3"),
        pytest.param(True, 1, None, True, id="interleaved-K1-weight-on-input"),
        pytest.param(True, 2, [1, 4, 5], False, id="interleaved-expert-map"),
        # K = 1 under a map: GEMM2 writes the output itself, and tokens it never visits stay 0.
        pytest.param(True, 1, [0, 2, 3], True, id="interleaved-K1-expert-map"),
    ],
)
def test_persistent_prefill_path(interleave, K, local, on_input, dtype, device):
    # D = 48 is not a multiple of BLOCK_K (the gathered x loads are masked), F = 40 not of BLOCK_N
    # (TMA zero-fills the weight boxes and clips the h store), several blocks per expert, and more
    # work items than the interpreter's 4 programs, so each program walks several.
    case = make_case(
        70, 6, K, 48, 40, dtype=dtype, device=device, seed=160 + K, local_experts=local,
        apply_router_weight_on_input=on_input,
    )  # fmt: skip
    _check(case, _prefill(interleave))


def test_persistent_prefill_path_is_deterministic(device):
    # No atomics in the GEMMs or the sum: the same call gives the same bits, whatever the order in
    # which the programs take their work items.
    dtype = DTYPES[0]
    case = make_case(90, 8, 2, 32, 32, dtype=dtype, device=device, seed=170)
    config = _prefill(True)
    assert torch.equal(fused_moe(*case.args(), **case.kwargs(), config=config),
                       fused_moe(*case.args(), **case.kwargs(), config=config))  # fmt: skip


def test_rel_err_against_a_zero_reference():
    # Under EP a call whose tokens' experts all live elsewhere has a zero reference: exact zeros pass,
    # anything else fails (not 0 / 0 = NaN, which the tuner and the benchmark read as wrong).
    zero = torch.zeros(3, 8)
    assert rel_err(zero, zero) == 0.0
    assert rel_err(zero + 0.1, zero) > TOLERANCE[torch.bfloat16]
    assert abs(rel_err(torch.full((3, 8), 1.01), torch.ones(3, 8)) - 0.01) < 1e-6


def test_persistent_config_rules():
    tile = GemmTile(32, 32)
    with pytest.raises(ValueError, match="persistent needs aligned"):
        MoeTileConfig(16, GemmTile(32, 32, persistent=True), tile, naive=True)
    with pytest.raises(ValueError, match="set gemm2.tma too"):
        MoeTileConfig(16, tile, GemmTile(32, 32, persistent=True))
    with pytest.raises(ValueError, match="warp_specialize needs persistent"):
        GemmTile(32, 32, warp_specialize=True)
    # JSON round trip keeps the new fields; files without them read as the pointer path.
    config = _prefill(True, ws=True)
    assert MoeTileConfig.from_json(config.to_json()) == config
    old = {"block_m": 16, "gemm1": {"block_n": 32, "block_k": 32}, "gemm2": {"block_n": 32, "block_k": 32}}
    assert not MoeTileConfig.from_json(old).gemm1.persistent


def test_persistent_shared_memory_counts_the_epilogue():
    # triton 3.6, sm_90 (benchmarks/aot_sm90.py): GEMM1 128 x (2 x 128) x 64 in 4 stages takes
    # 229408 bytes persistent (196608 for its stages); GEMM2 128 x 256 x 64 in 4 stages 229408.
    gemm1 = GemmTile(128, 64, num_warps=8, num_stages=4, interleave=True)
    gemm2 = GemmTile(256, 64, num_warps=8, num_stages=4, tma=True)
    assert gemm1.shared_bytes(128, 2) == 196608
    for tile, b_tiles in ((gemm1, 2), (gemm2, 1)):
        assert 229408 <= dataclasses.replace(tile, persistent=True).shared_bytes(128, b_tiles) <= SMEM_LIMIT


def test_fp32_stages_fit_shared_memory():
    # A bf16 tile at the limit: fp32 operands double every stage, so the plan drops stages.
    big = MoeTileConfig(
        128, GemmTile(128, 64, num_warps=8, num_stages=4), GemmTile(256, 64, num_warps=8, num_stages=4)
    )
    assert max(big.shared_memory(2)) <= SMEM_LIMIT
    plan = fused_moe_module.launch_plan(4096, 8, 1024, 1024, 2, "test", big, itemsize=4)
    assert max(plan.config.shared_memory(4)) <= SMEM_LIMIT
    assert plan.config.gemm1.num_stages == 2 and plan.config.gemm2.num_stages == 2
    assert fused_moe_module.launch_plan(4096, 8, 1024, 1024, 2, "test", big, itemsize=2).config == big


def test_dot_precision():
    assert fused_moe_module.dot_precision(torch.float32, allow_tf32=False) == "ieee"
    assert fused_moe_module.dot_precision(torch.float32, allow_tf32=True) == "tf32"
    assert fused_moe_module.dot_precision(torch.bfloat16, allow_tf32=False) == "tf32"  # no effect on bf16


# --- fp32 on the GPU: IEEE dots at odd shapes ------------------------------------------------------

FP32_CASES = [
    # (T, E, K, D, F, local experts, weight on input)
    pytest.param(37, 13, 3, 96, 80, None, False, id="E-prime"),
    pytest.param(29, 5, 5, 64, 48, None, False, id="K-equals-E"),
    pytest.param(0, 7, 2, 64, 32, None, False, id="T-zero"),
    pytest.param(41, 11, 2, 80, 48, [5, 1, 6, 2, 10], False, id="EP-map"),
    pytest.param(23, 11, 1, 64, 48, [0, 3, 7], False, id="EP-map-K1"),
    pytest.param(31, 7, 1, 96, 64, None, True, id="weight-on-input"),
    pytest.param(1, 13, 3, 96, 80, None, False, id="one-token"),
]
FP32_CONFIGS = [
    pytest.param(None, id="tuned-or-default"),
    pytest.param(SWIZZLED, id="bm32-swizzled"),
    pytest.param(INTERLEAVED, id="interleaved"),
    pytest.param(NAIVE_FOLD, id="naive-fold"),
    pytest.param(GEMV_PIPELINED, id="naive-gemv-pipelined-pdl"),  # IEEE with no tl.dot at all
]


@pytest.fixture
def ieee_torch_matmul():
    # The reference must not be TF32 either (torch's CUDA default is off; made explicit here).
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", FP32_CONFIGS)
@pytest.mark.parametrize(("T", "E", "K", "D", "F", "local", "on_input"), FP32_CASES)
def test_fp32_odd_shapes_gpu(T, E, K, D, F, local, on_input, config, ieee_torch_matmul):
    case = make_case(T, E, K, D, F, dtype=torch.float32, device="cuda", seed=200 + T + E, local_experts=local,
                     apply_router_weight_on_input=on_input)  # fmt: skip
    if T == 0:
        out_TD = fused_moe(*case.args(), **case.kwargs(), config=config)
        assert out_TD.shape == (0, D) and out_TD.dtype == torch.float32
        return
    err = _check(case, config)
    assert err <= TOLERANCE[torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_fp32_tf32_opt_in_is_tf32_gpu(ieee_torch_matmul):
    # The opt-in named at the call does what it says: TF32-sized error, well above the IEEE line.
    case = make_case(64, 8, 2, 256, 128, dtype=torch.float32, device="cuda", seed=300)
    ref = case.reference_fp32()
    ieee = rel_err(fused_moe(*case.args(), config=SWIZZLED), ref)
    tf32 = rel_err(fused_moe(*case.args(), config=SWIZZLED, allow_tf32=True), ref)
    assert ieee <= TOLERANCE[torch.float32] < tf32 <= 3e-3, (ieee, tf32)


# --- alignment invariants ------------------------------------------------------------------------

ALIGN_CASES = [
    # (T, E, K, block_m, local_experts)
    (1, 8, 2, 16, None),  # one token
    (50, 6, 3, 16, None),  # E not a power of two
    (64, 128, 8, 64, None),  # Qwen-like routing, few rows per expert
    (200, 8, 2, 32, [3, 1, 7]),  # expert map: most slots elsewhere
    (300, 40, 1, 16, None),  # K = 1, more experts than the one-hot tile's 16 columns
    (300, 8, 2, 256, None),  # BLOCK_M 256 (large-M tiles): most of each block is padding here
]


@pytest.mark.parametrize("single_program", [True, False], ids=["single", "three-launch"])
@pytest.mark.parametrize(("T", "E", "K", "block_m", "local"), ALIGN_CASES)
def test_alignment_invariants(T, E, K, block_m, local, single_program, device, monkeypatch):
    monkeypatch.setattr(fused_moe_module, "SINGLE_PROGRAM_MAX_SLOTS", 1 << 30 if single_program else 0)
    case = make_case(T, E, K, 16, 16, dtype=torch.float32, device=device, seed=T + E, local_experts=local)
    e = E if local is None else len(local)
    align = moe_align_block_size(case.topk_ids_TK, block_m, e, case.expert_map_E)
    num_slots = T * K
    n = int(align.num_post_pad_1.item())
    sorted_ids = align.sorted_ids_P[:n].cpu()
    expert_ids = align.expert_ids_B.cpu()
    local_S = case.topk_ids_TK.reshape(-1).long().cpu()
    if case.expert_map_E is not None:
        local_S = case.expert_map_E.long().cpu()[local_S]
    counts = torch.bincount(local_S[local_S >= 0], minlength=e)

    assert n % block_m == 0
    assert n == int(sum(-(-c // block_m) * block_m for c in counts.tolist())), "padded total"
    real = sorted_ids[sorted_ids < num_slots]
    assert sorted(real.tolist()) == (local_S >= 0).nonzero().flatten().tolist(), (
        "every valid slot exactly once"
    )
    assert real.numel() == int(counts.sum()), "counts sum to the valid slots (T*K without an expert map)"
    assert torch.all(sorted_ids[sorted_ids >= num_slots] == num_slots), "padding is marked with num_slots"
    assert (sorted_ids >= num_slots).sum().item() == n - real.numel()
    num_blocks = n // block_m
    owners = expert_ids[:num_blocks]
    assert torch.all(owners[1:] >= owners[:-1]), "blocks in expert order"
    for b in range(num_blocks):
        block = sorted_ids[b * block_m : (b + 1) * block_m]
        slots = block[block < num_slots].long()
        assert slots.numel() > 0, f"block {b} is all padding"
        assert torch.all(local_S[slots] == owners[b]), f"block {b} mixes experts"
    assert torch.all(expert_ids[num_blocks:] == -1), "blocks past the end are marked -1"


# --- the real shapes, on the GPU -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", M_GRID)
@pytest.mark.parametrize("shape", SHIPPED_SHAPES, ids=lambda s: s.name.replace(" ", "-"))
def test_real_shape_bf16(shape, M):
    """Tuned configs at every shipped per-rank shape and every benchmark M: bf16 error near 4e-3."""
    case = shape_case(shape, M, seed=M)
    out_TD = torch.full_like(case.hidden_TD, float("nan"))
    fused_moe(*case.args(), **case.kwargs(), out=out_TD)
    nan = bool(torch.isnan(out_TD).any())
    err = rel_err(out_TD, case.reference_fp32())
    log_path = os.environ.get("MOE_EVAL_CORRECTNESS_LOG")
    if log_path:
        with open(log_path, "a") as f:
            f.write(json.dumps({"shape": shape.name, "M": M, "rel_err": err, "nan": nan}) + "\n")
    assert not nan
    assert err <= TOLERANCE[torch.bfloat16], f"{shape.name} M={M}: relative error {err:.2e}"


# The prefill path forced at the real shapes (whatever the tuned files pick there): the large tiles
# the tuner offers it with, interleaved and two-dot GEMM1. Never warp-specialized: those kernels hang
# on the H200 with triton 3.6 (docs/perf.md, "The prefill path").
PREFILL_FORCED = {
    "pipelined": MoeTileConfig(
        128,
        GemmTile(128, 64, group_m=8, num_warps=8, num_stages=3, interleave=True, persistent=True),
        GemmTile(256, 64, group_m=8, num_warps=8, num_stages=3, tma=True, persistent=True),
    ),
    "two-dot": MoeTileConfig(
        128,
        GemmTile(64, 64, group_m=8, num_warps=4, num_stages=4, persistent=True),
        GemmTile(128, 64, group_m=8, num_warps=4, num_stages=4, tma=True, persistent=True),
    ),
}


@pytest.mark.parametrize(
    "config", [SWIZZLED, INTERLEAVED, NAIVE_FOLD], ids=["aligned", "interleaved", "naive-fold"]
)
def test_the_same_tokens_in_another_order_give_the_same_bits(config, device):
    """Batches of other composition under one plan (same T, same tile config): each token's output is its
    own slots' arithmetic, summed in slot order, wherever the token sits in the batch. (Across plans, other
    T, the tiles differ and so may the last bit: vLLM is not batch-invariant either.)"""
    case = make_case(37, 8, 2, 32, 32, dtype=DTYPES[0], device=device, seed=141)
    order = torch.randperm(37, generator=torch.Generator().manual_seed(5)).to(device)
    shuffled = dataclasses.replace(
        case,
        hidden_TD=case.hidden_TD[order].contiguous(),
        topk_weights_TK=case.topk_weights_TK[order].contiguous(),
        topk_ids_TK=case.topk_ids_TK[order].contiguous(),
    )
    out = fused_moe(*case.args(), **case.kwargs(), config=config)
    again = fused_moe(*shuffled.args(), **shuffled.kwargs(), config=config)
    assert torch.equal(out[order], again)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", list(PREFILL_FORCED))
@pytest.mark.parametrize("M", [1, 256, 4096])
@pytest.mark.parametrize("shape", SHIPPED_SHAPES, ids=lambda s: s.name.replace(" ", "-"))
def test_real_shape_prefill_path_forced(shape, M, variant):
    case = shape_case(shape, M, seed=M + 1)
    out_TD = torch.full_like(case.hidden_TD, float("nan"))
    fused_moe(*case.args(), **case.kwargs(), out=out_TD, config=PREFILL_FORCED[variant])
    assert not torch.isnan(out_TD).any()
    err = rel_err(out_TD, case.reference_fp32())
    assert err <= TOLERANCE[torch.bfloat16], f"{shape.name} M={M} {variant}: relative error {err:.2e}"
    again = fused_moe(*case.args(), **case.kwargs(), config=PREFILL_FORCED[variant])
    assert torch.equal(out_TD, again), "the prefill path must be bitwise repeatable"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "M", [1, 2, 3, 4, 8, 40]
)  # naive sizes (H100: 3 and 4 take M = 8's entry), aligned ones
@pytest.mark.parametrize("shape", SHIPPED_SHAPES, ids=lambda s: s.name.replace(" ", "-"))
def test_real_shape_pdl_bf16(shape, M):
    """The tuned plan's calls with GEMM1, GEMM2 and the sum as programmatic dependents (naive calls, and
    aligned ones, GEMM1 following the alignment): the bits of the plain launches, eager and replayed from a
    CUDA graph (as vLLM serves decode), many times."""
    case = shape_case(shape, M, seed=M + 3)
    tuned = fused_moe_module.launch_plan(M, shape.local_experts, shape.F, shape.D, shape.top_k,
                                         torch.cuda.get_device_name()).config  # fmt: skip
    # Every shipped entry at these sizes is a tl.dot pointer chain (no GEMVs, persistent or tma GEMMs).
    assert tuned.pdl_capable, f"{shape.name} M={M}"
    plain_config = dataclasses.replace(tuned, pdl=False)
    pdl_config = dataclasses.replace(tuned, pdl=True)
    plan = fused_moe_module.launch_plan(M, shape.local_experts, shape.F, shape.D, shape.top_k,
                                        torch.cuda.get_device_name(), pdl_config)  # fmt: skip
    assert plan.pdl
    assert fused_moe_module.pdl_available(case.hidden_TD.device), "an sm_90 GPU with triton 3.6 has PDL"
    plain = fused_moe(*case.args(), **case.kwargs(), config=plain_config)
    assert rel_err(plain, case.reference_fp32()) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(fused_moe(*case.args(), **case.kwargs(), config=pdl_config), plain)
    # Three calls back to back in one graph, as a model's layers follow each other, each on other inputs
    # (tokens and routing) and with its own output: a launch that read before its wait would find the
    # previous call's h or y in the reused buffers, which differ from its own.
    cases = [shape_case(shape, M, seed=M + 3 + 10 * i) for i in range(3)]
    plains = [fused_moe(*c.args(), **c.kwargs(), config=plain_config) for c in cases]
    assert not torch.equal(plains[0], plains[1])
    _graph_replays_give(plains, cases, pdl_config)


def _graph_replays_give(plains: list[torch.Tensor], cases: list[MoeCase], config: MoeTileConfig) -> None:
    """The calls on `cases` under `config`, captured back to back in one CUDA graph (after an eager warm-up on
    a side stream) and replayed 20 times into NaN-filled outputs, give `plains` bit for bit each time."""
    outs = [torch.empty_like(p) for p in plains]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c, o in zip(cases, outs):
            fused_moe(*c.args(), **c.kwargs(), out=o, config=config)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for c, o in zip(cases, outs):
                fused_moe(*c.args(), **c.kwargs(), out=o, config=config)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(20):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for o, p in zip(outs, plains):
            assert torch.equal(o, p)


def _pointer_tiles(config: MoeTileConfig) -> MoeTileConfig:
    """The config with both GEMMs as the pointer kernels (large-M entries ship TMA / persistent ones)."""
    flags = {"tma": False, "persistent": False, "warp_specialize": False}
    return dataclasses.replace(config, gemm1=dataclasses.replace(config.gemm1, **flags),
                               gemm2=dataclasses.replace(config.gemm2, **flags))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("M", [8, 40, 1024])
@pytest.mark.parametrize(
    "shape",
    [s for s in SHIPPED_SHAPES if s.top_k > 1],  # K = 1 has no sum; TEP2 shapes: the expert-map path
    ids=lambda s: s.name.replace(" ", "-"),
)
def test_real_shape_sum_in_gemm2_bf16(shape, M, pdl):
    """The top-k sum inside GEMM2 (the last program to store a token's slot of an N-tile sums its K rows)
    on the GPU, where programs really race: the bits of the sum launch, eager and replayed from a CUDA graph
    many times, three calls back to back on other inputs (a read-back that came before another program's
    store, or counters left from an earlier call, would show as other bits or NaN). Under an expert map (the
    TEP2 shapes) a token counts only its slots held here and GEMM1 zeroes the output first."""
    device_name = torch.cuda.get_device_name()
    tuned = fused_moe_module.launch_plan(
        M, shape.local_experts, shape.F, shape.D, shape.top_k, device_name
    ).config
    plain_config = dataclasses.replace(_pointer_tiles(tuned), gemv=None, pdl=pdl)  # M >= 8: aligned calls
    summing = dataclasses.replace(plain_config, sum_in_gemm2=True)
    plan = fused_moe_module.launch_plan(
        M, shape.local_experts, shape.F, shape.D, shape.top_k, device_name, summing
    )
    assert plan.sum_in_gemm2, f"{shape.name} M={M}: an aligned call"
    cases = [shape_case(shape, M, seed=M + 5 + 10 * i) for i in range(3)]
    plains = [fused_moe(*c.args(), **c.kwargs(), config=plain_config) for c in cases]
    assert rel_err(plains[0], cases[0].reference_fp32()) <= TOLERANCE[torch.bfloat16]
    for c, p in zip(cases, plains):
        assert torch.equal(fused_moe(*c.args(), **c.kwargs(), config=summing), p)
    _graph_replays_give(plains, cases, summing)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 2, 4])  # the token counts the M = 1 entry serves
@pytest.mark.parametrize("shape", SHIPPED_SHAPES, ids=lambda s: s.name.replace(" ", "-"))
def test_real_shape_naive_pdl_computes_the_aligned_bits(shape, M):
    """The M = 1 entry's tiles run naive with pdl give the aligned plan's bits (Qwen3 TP2 and TEP2 ship so):
    each row's MMAs are the same whatever rows share its block, so such an entry can switch to the decode
    launches without moving what the layer check compares."""
    if not fused_moe_module.naive_qualifies(M, shape.top_k, shape.local_experts):
        pytest.skip("naive does not qualify")
    case = shape_case(shape, M, seed=5 + M)
    tuned = fused_moe_module.launch_plan(1, shape.local_experts, shape.F, shape.D, shape.top_k,
                                         torch.cuda.get_device_name()).config  # fmt: skip
    aligned = dataclasses.replace(tuned, naive=False, fold_k=False, pdl=False, gemv=None)
    naive = dataclasses.replace(aligned, naive=True, pdl=True)
    out_aligned = fused_moe(*case.args(), **case.kwargs(), config=aligned)
    out_naive = fused_moe(*case.args(), **case.kwargs(), config=naive)
    log_path = os.environ.get("MOE_EVAL_CORRECTNESS_LOG")
    if log_path:
        with open(log_path, "a") as f:
            f.write(json.dumps({"shape": shape.name, "M": M, "plan": "naive+pdl vs aligned, same tiles",
                                "equal": bool(torch.equal(out_aligned, out_naive)),
                                "rel_diff": rel_err(out_naive, out_aligned)}) + "\n")  # fmt: skip
    assert torch.equal(out_aligned, out_naive)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 2, 4])  # the token counts the tuned M = 1 entry serves (nearest in log2)
@pytest.mark.parametrize("shape", SHIPPED_SHAPES, ids=lambda s: s.name.replace(" ", "-"))
def test_real_shape_gemv_bf16(shape, M, ieee_torch_matmul):
    """The decode GEMVs (default_gemv_tiles, the probe's starting point) in place of the tuned plan's naive
    calls: bf16 error as the tuned plan's, bitwise repeatable, the same bits with and without PDL, and
    within rounding of the incumbent's arithmetic (what the layer check compares with). Where naive does
    not qualify (Mixtral at M = 2, 4; TEP2 at M = 4) the config falls back to its tl.dot tiles, which
    this checks too."""
    case = shape_case(shape, M, seed=M + 2)
    tuned = fused_moe_module.launch_plan(M, shape.local_experts, shape.F, shape.D, shape.top_k,
                                         torch.cuda.get_device_name()).config  # fmt: skip
    outs = {}
    for pdl in (False, True):
        gemv = default_gemv_tiles(shape.F, shape.D, shape.top_k, pdl=pdl)
        config = dataclasses.replace(tuned, naive=True, fold_k=False, pdl=False, gemv=gemv)
        out_TD = torch.full_like(case.hidden_TD, float("nan"))
        fused_moe(*case.args(), **case.kwargs(), out=out_TD, config=config)
        assert not torch.isnan(out_TD).any()
        err = rel_err(out_TD, case.reference_fp32())
        assert err <= TOLERANCE[torch.bfloat16], f"{shape.name} M={M} pdl={pdl}: relative error {err:.2e}"
        assert torch.equal(out_TD, fused_moe(*case.args(), **case.kwargs(), config=config)), "not repeatable"
        outs[pdl] = out_TD
        log_path = os.environ.get("MOE_EVAL_CORRECTNESS_LOG")
        if log_path:
            with open(log_path, "a") as f:
                f.write(
                    json.dumps({"shape": shape.name, "M": M, "plan": f"gemv pdl={pdl}", "rel_err": err})
                    + "\n"
                )
    if fused_moe_module.naive_qualifies(M, shape.top_k, shape.local_experts):
        # The GEMVs ran (elsewhere both runs take the same aligned tl.dot path and compare nothing).
        assert fused_moe_module.pdl_available(case.hidden_TD.device), "an H200 with triton 3.6 has PDL"
        assert torch.equal(outs[False], outs[True]), "PDL changes when GEMM2 starts, never what it computes"
    # Not the tuned plan itself: its tl.dot fold_k (Mixtral at M = 1) skips the per-slot rounding.
    assert rel_err(outs[True], _incumbent(case)) <= AGREEMENT[torch.bfloat16], "rounds elsewhere"
