"""BF16 fused MoE: the readable reference `fused_moe_ref` and the Triton launcher `fused_moe`.

For each token t and each of its K experts: y = (silu(x W_gate^T) * (x W_up^T)) W_down^T, and
out_t = sum_k w_tk * y_tk. Under expert parallelism `expert_map_E` sends global expert ids to
local slots (-1: the expert lives on another rank and the slot contributes nothing here). With
`apply_router_weight_on_input` the weight multiplies x before GEMM1 instead of y.

`fused_moe` stages (bodies in `_fused_moe_kernels.py`): align slots by expert into BLOCK_M
blocks -> GEMM1 with SiLU-and-mul in its epilogue -> GEMM2 with the routing weight in its
epilogue -> sum over K. At a few tokens a config may skip the alignment (`naive`) and run both
GEMMs as GEMVs with the sum over K inside GEMM2 (`gemv`: two launches, no tl.dot). Usage:

    out_TD = fused_moe(hidden_TD, w13_eFD, w2_eDF, topk_weights_TK, topk_ids_TK)

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k,
P padded slot count. w13_eFD is [e, 2F, D], gate rows first, then up rows; w2_eDF is [e, D, F].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from moe_eval.kernels import _fused_moe_kernels as kernels
from moe_eval.kernels.tile_configs import (
    GemmTile,
    GemvTiles,
    MoeTileConfig,
    fit_shared_memory,
    get_tile_config,
)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Above this many slots (T*K) the alignment runs as three launches (count per chunk, scan, scatter)
# instead of one program holding every slot in registers. H200, Qwen3-30B-A3B (e=128), BLOCK_M=16:
# one program 3.6 / 4.1 / 5.1 / 11.4 / 39.1 us at 8 / 128 / 512 / 2048 / 8192 slots, three
# launches 9.2 / 11.4 / 16.1 / 16.1 / 17.4 us (docs/perf.md). The crossover lies between 2048 and
# 8192; the tuned configs and the benchmark were measured with this value.
SINGLE_PROGRAM_MAX_SLOTS = 4096


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def fused_moe_ref(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    expert_map_E: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """The oracle: every product and sum in fp32, one loop over local experts, output in x's dtype."""
    T, D = hidden_TD.shape
    F = w2_eDF.shape[2]
    x_TD = hidden_TD.float()
    local_TK = topk_ids_TK.long()
    if expert_map_E is not None:
        local_TK = expert_map_E.long()[local_TK]
    out_TD = torch.zeros(T, D, dtype=torch.float32, device=hidden_TD.device)
    for expert in range(w13_eFD.shape[0]):
        t_idx, k_idx = (local_TK == expert).nonzero(as_tuple=True)
        if t_idx.numel() == 0:
            continue
        x_ND = x_TD[t_idx]
        w_N1 = topk_weights_TK[t_idx, k_idx].float()[:, None]
        if apply_router_weight_on_input:
            x_ND = x_ND * w_N1
        gate_up_N2F = x_ND @ w13_eFD[expert].float().T
        h_NF = torch.nn.functional.silu(gate_up_N2F[:, :F]) * gate_up_N2F[:, F:]
        y_ND = h_NF @ w2_eDF[expert].float().T
        if not apply_router_weight_on_input:
            y_ND = y_ND * w_N1
        out_TD.index_add_(0, t_idx, y_ND)
    return out_TD.to(hidden_TD.dtype)


# ---------------------------------------------------------------------------------------------
# Routing alignment
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeAlignment:
    """Slots sorted by local expert into blocks of `block_m` rows (stays on the device: no sync).

    sorted_ids_P: slot index t*K + k at each sorted position; `num_slots` marks padding.
    expert_ids_B: local expert owning each block; -1 for blocks past `num_post_pad`.
    num_post_pad_1: positions in use (a multiple of block_m); the rest of the buffers is unwritten.

    Naive (`naive_alignment`): no alignment at all, one M-block per slot (block b is slot b, its
    expert read by the GEMMs from topk_ids_S through expert_map_E); the three tensors are None.
    """

    sorted_ids_P: torch.Tensor | None
    expert_ids_B: torch.Tensor | None
    num_post_pad_1: torch.Tensor | None
    block_m: int
    num_slots: int
    top_k: int = 0  # naive only (FOLD_K's grid is tokens = num_slots / top_k)
    topk_ids_S: torch.Tensor | None = None  # naive only
    expert_map_E: torch.Tensor | None = None  # naive only

    @property
    def naive(self) -> bool:
        return self.sorted_ids_P is None

    @property
    def max_blocks(self) -> int:
        return self.num_slots if self.naive else self.expert_ids_B.numel()

    @property
    def h_rows(self) -> int:
        """Rows of GEMM1's output: one per sorted position, or one per slot when naive."""
        return self.num_slots if self.naive else self.sorted_ids_P.numel()


@dataclass(frozen=True)
class AlignVariant:
    """The compile-time constants of the alignment for one slot count: which Triton kernels run.

    single: one program holds every slot (SLOTS lanes, NB_BLOCKS block owners); else count /
    scan / scatter over chunks of ALIGN_CHUNK slots (BLOCKS_PER_PROGRAM owners per program).
    naive: no alignment launch; the GEMMs run one block per slot (NAIVE constexpr).
    Slot counts that share a variant share the compiled kernels (moe_eval.kernels.warmup
    compiles each variant once, before the server serves).
    """

    single: bool
    slots: int = 0
    nb_blocks: int = 0
    blocks_per_program: int = 0
    naive: bool = False


def naive_qualifies(num_tokens: int, top_k: int, num_local_experts: int) -> bool:
    """Whether a config with `naive=True` skips the alignment for this call.

    One token: its K slots have K distinct experts, so one block per slot is exactly what the
    alignment would build, minus its launch. vLLM's rule (T*K*4 <= e, fused_moe.py
    `_prepare_expert_assignment`) adds the few-token calls where most slots still have an expert
    of their own; past it, duplicate experts would stream their weights once per slot.
    """
    return num_tokens == 1 or num_tokens * top_k * 4 <= num_local_experts


ALIGN_CHUNK = 1024  # slots per program of the three-launch alignment


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _max_blocks(num_slots: int, num_local_experts: int, block_m: int) -> int:
    # Worst case without a device->host sync: every non-empty expert pads by block_m - 1, and at
    # most min(T*K, e) experts are non-empty.
    return triton.cdiv(num_slots + min(num_slots, num_local_experts) * (block_m - 1), block_m)


def align_variant(
    num_slots: int, block_m: int, num_local_experts: int, naive: bool = False
) -> AlignVariant | None:
    """None for no slots (nothing is launched). `naive`: the caller's `naive_qualifies` verdict."""
    if num_slots == 0:
        return None
    if naive:
        return AlignVariant(False, naive=True)
    if num_slots <= SINGLE_PROGRAM_MAX_SLOTS:
        slots = max(16, _next_pow2(num_slots))
        # Sized for the largest slot count of the power-of-two bucket, not this call's: one
        # compiled kernel per bucket (a larger NB_BLOCKS only widens a masked histogram).
        return AlignVariant(
            True, slots=slots, nb_blocks=_next_pow2(_max_blocks(slots, num_local_experts, block_m) + 1)
        )
    num_chunks = triton.cdiv(num_slots, ALIGN_CHUNK)
    per_program = triton.cdiv(_max_blocks(num_slots, num_local_experts, block_m), num_chunks)
    return AlignVariant(False, blocks_per_program=max(16, _next_pow2(per_program)))


def naive_alignment(
    topk_ids_TK: torch.Tensor, block_m: int, expert_map_E: torch.Tensor | None = None
) -> MoeAlignment:
    """One block per slot, nothing launched: the GEMMs read each slot's expert themselves."""
    assert topk_ids_TK.dtype == torch.int32 and topk_ids_TK.is_contiguous(), "topk_ids: contiguous int32"
    return MoeAlignment(
        None, None, None, block_m, topk_ids_TK.numel(), top_k=topk_ids_TK.shape[-1],
        topk_ids_S=topk_ids_TK, expert_map_E=expert_map_E,
    )  # fmt: skip


def moe_align_block_size(
    topk_ids_TK: torch.Tensor, block_m: int, num_local_experts: int, expert_map_E: torch.Tensor | None = None,
    trigger_dependents: bool = False,
) -> MoeAlignment:  # fmt: skip
    """trigger_dependents: GEMM1 follows as a programmatic dependent (a pdl plan): the one-program
    alignment lets it onto the SMs at its start. The three-launch alignment (more than 4096 slots, not a
    decode size) does not; GEMM1 still waits for it."""
    num_slots = topk_ids_TK.numel()
    assert topk_ids_TK.dtype == torch.int32 and topk_ids_TK.is_contiguous(), "topk_ids: contiguous int32"
    assert block_m >= 16 and block_m & (block_m - 1) == 0, (
        f"block_m must be a power of two >= 16, got {block_m}"
    )
    if expert_map_E is not None:
        assert expert_map_E.dtype == torch.int32 and expert_map_E.is_contiguous(), (
            "expert_map: contiguous int32"
        )
    max_blocks = _max_blocks(num_slots, num_local_experts, block_m)
    device = topk_ids_TK.device
    sorted_ids_P = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids_B = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post_pad_1 = torch.empty(1, dtype=torch.int32, device=device)
    align = MoeAlignment(
        sorted_ids_P, expert_ids_B, num_post_pad_1, block_m, num_slots, topk_ids_TK.shape[-1]
    )
    variant = align_variant(num_slots, block_m, num_local_experts)
    if variant is None:
        num_post_pad_1.zero_()
        return align

    has_map = expert_map_E is not None
    map_arg = expert_map_E if has_map else topk_ids_TK  # any int32 pointer; never read
    nbins = _next_pow2(num_local_experts + 1)  # + 1: the bin of slots not computed on this rank
    if variant.single:
        cursor = torch.empty(nbins, dtype=torch.int32, device=device)
        kernels._align_single_kernel[(1,)](
            topk_ids_TK, map_arg, sorted_ids_P, expert_ids_B, num_post_pad_1, cursor,
            num_slots, num_local_experts, max_blocks,
            HAS_EXPERT_MAP=has_map, BLOCK_M=block_m, NBINS=nbins, SLOTS=variant.slots,
            NB_BLOCKS=variant.nb_blocks, TRIGGER_DEPENDENTS=trigger_dependents, num_warps=8,
        )  # fmt: skip
        return align

    num_chunks = triton.cdiv(num_slots, ALIGN_CHUNK)
    counts_cursor_ends = torch.zeros(3, nbins, dtype=torch.int32, device=device)
    counts, cursor, ends = counts_cursor_ends.unbind(0)
    kernels._align_count_kernel[(num_chunks,)](
        topk_ids_TK, map_arg, counts, num_slots, HAS_EXPERT_MAP=has_map, NBINS=nbins, CHUNK=ALIGN_CHUNK,
        num_warps=4,
    )  # fmt: skip
    kernels._align_scan_kernel[(1,)](
        counts, cursor, ends, sorted_ids_P, num_post_pad_1, num_slots, num_local_experts,
        BLOCK_M=block_m, NBINS=nbins, num_warps=4,
    )  # fmt: skip
    kernels._align_scatter_kernel[(num_chunks,)](
        topk_ids_TK, map_arg, cursor, ends, num_post_pad_1, sorted_ids_P, expert_ids_B,
        num_slots, num_local_experts, max_blocks,
        HAS_EXPERT_MAP=has_map, BLOCK_M=block_m, NBINS=nbins, CHUNK=ALIGN_CHUNK,
        BLOCKS_PER_PROGRAM=variant.blocks_per_program, num_warps=4,
    )  # fmt: skip
    return align


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    # The decorator read TRITON_INTERPRET when the bodies were imported; what counts is what it made.
    return type(kernels._gemm1_silu_kernel).__name__ == "InterpretedFunction"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@dataclass(frozen=True)
class LaunchPlan:
    """What selects the compiled kernels of one call: the tile config and the alignment variant.

    Two token counts with the same plan run the same compiled kernels (every other integer
    argument that varies with T is `do_not_specialize`), so compiling one call per distinct plan
    compiles everything a layer can run (moe_eval.kernels.warmup).
    """

    config: MoeTileConfig
    align: AlignVariant | None

    @property
    def gemv(self) -> GemvTiles | None:
        """The GEMV tiles when both GEMMs run as GEMVs (naive plans whose config has them), else None."""
        return self.config.gemv if self.align is not None and self.align.naive else None

    @property
    def pdl(self) -> bool:
        """GEMM1, GEMM2 and the sum as programmatic dependents (tl.dot plans that ask for it: naive calls,
        and aligned calls, whose GEMM1 follows the alignment; the config holds both GEMMs to the pointer
        kernels, which have the wait)."""
        return self.align is not None and self.config.pdl

    @property
    def sum_in_gemm2(self) -> bool:
        """GEMM2 sums each token's K slots on aligned calls (`MoeTileConfig.sum_in_gemm2`; K == 1 has no
        sum)."""
        return self.align is not None and not self.align.naive and self.config.sum_in_gemm2

    @property
    def fold_k(self) -> bool:
        """GEMM2 sums each token's K slots itself (naive plans whose config asks for it; GEMV plans too)."""
        naive = self.align is not None and self.align.naive
        return naive and (self.config.fold_k or self.config.gemv is not None)


def launch_plan(
    num_tokens: int, num_local_experts: int, F: int, D: int, top_k: int, device_name: str,
    config: MoeTileConfig | None = None, itemsize: int = 2,
) -> LaunchPlan:  # fmt: skip
    """The plan `fused_moe` follows for T tokens at one layer shape; `config` overrides the tuned tiles.

    itemsize: bytes per element of the operands; fp32 (4) gets fewer pipeline stages where the
    bf16 tiles would not fit shared memory.
    """
    if config is None:
        config = get_tile_config(
            num_tokens=num_tokens,
            num_experts=num_local_experts,
            F=F,
            D=D,
            top_k=top_k,
            device_name=device_name,
        )
    config = fit_shared_memory(config, itemsize)
    naive = config.naive and naive_qualifies(num_tokens, top_k, num_local_experts)
    return LaunchPlan(config, align_variant(num_tokens * top_k, config.block_m, num_local_experts, naive))


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """tl.dot's input_precision: fp32 operands are multiplied in IEEE fp32 unless TF32 is asked for.

    Triton's default for fp32 operands is TF32 (10-bit mantissa, relative error near 3e-4); for
    bf16 / fp16 operands the value has no effect and the backend default is passed.
    """
    if dtype == torch.float32 and not allow_tf32:
        return "ieee"
    return "tf32"


def fused_moe(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    expert_map_E: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    out: torch.Tensor | None = None,
    config: MoeTileConfig | None = None,
    allow_tf32: bool = False,
    silu_slope: float = 1.0,
) -> torch.Tensor:
    """Triton fused MoE; same contract as `fused_moe_ref`. `config` overrides the tuned tiles.
    silu_slope != 1: a deliberate SiLU slope bug (`--mutate silu_slope`; kernels._silu_mul).

    allow_tf32: fp32 inputs only; multiply them in TF32 instead of IEEE fp32 (faster, ~3e-4). The
    decode GEMVs (`MoeTileConfig.gemv`) have no tl.dot and stay IEEE fp32 either way.
    """
    T, D = hidden_TD.shape
    e, F2, D_w = w13_eFD.shape
    F = F2 // 2
    K = topk_ids_TK.shape[1]
    dtype = hidden_TD.dtype
    # Contract.
    assert dtype in SUPPORTED_DTYPES, f"hidden dtype {dtype} not in {SUPPORTED_DTYPES}"
    assert w13_eFD.dtype == dtype and w2_eDF.dtype == dtype, "weights must have the activations' dtype"
    assert D_w == D and F2 == 2 * F and w2_eDF.shape == (e, D, F), (
        f"shapes: hidden {tuple(hidden_TD.shape)}, w13 {tuple(w13_eFD.shape)}, w2 {tuple(w2_eDF.shape)}"
    )
    assert hidden_TD.stride(1) == 1 and w13_eFD.stride(2) == 1 and w2_eDF.stride(2) == 1, (
        "inner dims contiguous"
    )
    assert topk_ids_TK.shape == (T, K) and topk_weights_TK.shape == (T, K), "topk shapes must be (T, K)"
    assert topk_ids_TK.dtype == torch.int32 and topk_ids_TK.is_contiguous(), "topk_ids: contiguous int32"
    assert topk_weights_TK.is_floating_point() and topk_weights_TK.is_contiguous(), (
        "topk_weights: contiguous float"
    )
    if expert_map_E is not None:
        assert expert_map_E.dtype == torch.int32 and expert_map_E.dim() == 1, "expert_map: int32 [E]"
        assert K <= expert_map_E.numel(), f"top-k {K} > E {expert_map_E.numel()}"
    else:
        assert K <= e, f"top-k {K} > experts {e}"
    on_cpu = hidden_TD.device.type == "cpu"
    if on_cpu and not _interpreting():
        raise RuntimeError(
            "fused_moe needs CUDA tensors (CPU tensors only when the kernels were imported under "
            "TRITON_INTERPRET=1, for tests)"
        )
    if on_cpu and dtype == torch.bfloat16:
        # HACK: the triton 3.9 interpreter's tl.dot on bf16 operands returns garbage (rel. err ~1e10,
        # measured), and its fp32 -> bf16 cast truncates instead of rounding to nearest (measured on
        # the GEMVs, which have no tl.dot); the CPU tests run fp16/fp32. Remove when both are fixed.
        raise RuntimeError("fused_moe under TRITON_INTERPRET: bf16 tl.dot is broken there; use fp16 or fp32")

    # Tile config and alignment variant (see LaunchPlan).
    plan = launch_plan(T, e, F, D, K, _device_name(hidden_TD.device), config, dtype.itemsize)

    # Allocate.
    if out is None:
        out = torch.empty_like(hidden_TD)
    assert out.shape == (T, D) and out.dtype == dtype and out.stride(1) == 1, "out: (T, D), x's dtype"
    if (
        expert_map_E is not None
        and out.untyped_storage().data_ptr() == hidden_TD.untyped_storage().data_ptr()
    ):
        # Under an expert map the output is zeroed before GEMM1 has read all of x (K == 1, sum_in_gemm2).
        raise ValueError("fused_moe: out must not share memory with hidden_TD under an expert map")
    if plan.align is None:
        return out
    align = assign_slots(topk_ids_TK, plan, e, expert_map_E)
    h_PF, y_SD = allocate_intermediates(align, plan, hidden_TD, F, out)

    # Launch.
    launch_experts(
        hidden_TD, w13_eFD, w2_eDF, topk_weights_TK, topk_ids_TK, align, plan, h_PF, y_SD, out,
        expert_map_E=expert_map_E, apply_router_weight_on_input=apply_router_weight_on_input,
        precision=dot_precision(dtype, allow_tf32), silu_slope=silu_slope,
    )  # fmt: skip
    return out


# The stages one by one: fused_moe above, benchmarks/tune_fused_moe.py (each GEMM timed alone) and
# benchmarks/bench_fused_moe.py (the GEMMs timed without the alignment) call these.


def assign_slots(
    topk_ids_TK: torch.Tensor, plan: LaunchPlan, num_local_experts: int, expert_map_E: torch.Tensor | None
) -> MoeAlignment:
    """The plan's slot assignment: the alignment kernels, or nothing at all for a naive plan."""
    if plan.align.naive:
        return naive_alignment(topk_ids_TK, plan.config.block_m, expert_map_E)
    trigger = plan.pdl and pdl_available(topk_ids_TK.device)
    return moe_align_block_size(topk_ids_TK, plan.config.block_m, num_local_experts, expert_map_E, trigger)


def allocate_intermediates(
    align: MoeAlignment, plan: LaunchPlan, hidden_TD: torch.Tensor, F: int, out_TD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h (GEMM1's output) and y (GEMM2's: per slot, or the output itself when nothing is summed after)."""
    h_PF = hidden_TD.new_empty(align.h_rows, F)
    if plan.fold_k or align.top_k == 1:  # folded sum, or K == 1: one row per token
        return h_PF, out_TD
    return h_PF, hidden_TD.new_empty(align.num_slots, out_TD.shape[1])


def launch_experts(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    align: MoeAlignment,
    plan: LaunchPlan,
    h_PF: torch.Tensor,
    y_SD: torch.Tensor,
    out_TD: torch.Tensor,
    *,
    expert_map_E: torch.Tensor | None,
    apply_router_weight_on_input: bool,
    precision: str,
    with_sum: bool = True,
    silu_slope: float = 1.0,
) -> None:
    """GEMM1 + SiLU-and-mul, GEMM2 + routing weight, then the sum over K (unless `with_sum` is False
    or GEMM2 folded it in). The alignment is already done: `align` (from `assign_slots`)."""
    config = plan.config
    K = topk_ids_TK.shape[1]
    if plan.gemv is not None:
        # Two launches and nothing else: GEMM2 writes every token's row (zeros where no slot is local).
        use_pdl = plan.gemv.pdl and pdl_available(hidden_TD.device)
        launch_gemv1(hidden_TD, w13_eFD, h_PF, topk_weights_TK, align, plan.gemv.gemm1,
                     apply_router_weight_on_input, use_pdl, silu_slope=silu_slope)  # fmt: skip
        launch_gemv2(h_PF, w2_eDF, out_TD, topk_weights_TK, align, plan.gemv.gemm2,
                     not apply_router_weight_on_input, use_pdl)  # fmt: skip
        return
    if y_SD is out_TD and not plan.fold_k and expert_map_E is not None:
        # K == 1 writes the output directly, and tokens whose expert lives on another rank must
        # read as zero because GEMM2 never visits them (a folded GEMM2 writes every token).
        out_TD.zero_()
    use_pdl = plan.pdl and pdl_available(hidden_TD.device)
    # The sum inside GEMM2 where the plan asks and there is a sum (K > 1: K == 1 writes the output directly).
    summed = with_sum and y_SD is not out_TD
    sum_in_gemm2 = summed and plan.sum_in_gemm2
    sum_into = (
        (out_TD, sum_counters(out_TD, config.gemm2), topk_ids_TK, expert_map_E) if sum_in_gemm2 else None
    )
    launch_gemm1(
        hidden_TD,
        w13_eFD,
        h_PF,
        topk_weights_TK,
        align,
        K,
        config.gemm1,
        apply_router_weight_on_input,
        precision,
        use_pdl=use_pdl,
        silu_slope=silu_slope,
        sum_into=sum_into,
    )
    launch_gemm2(h_PF, w2_eDF, y_SD, topk_weights_TK, align, config.gemm2, not apply_router_weight_on_input,
                 precision, fold_k=plan.fold_k, use_pdl=use_pdl, sum_into=sum_into)  # fmt: skip
    if summed and not sum_in_gemm2:
        launch_sum(y_SD, out_TD, topk_ids_TK, expert_map_E, use_pdl=use_pdl)


# (out, counters from `sum_counters`, topk_ids, expert map or None): the top-k sum inside GEMM2.
SumInto = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def sum_counters(out_TD: torch.Tensor, gemm2: GemmTile) -> torch.Tensor:
    """GEMM2's sum counters, one per (token, N-tile): allocated per call (the caching allocator: free of
    other streams' calls and safe in a CUDA graph), zeroed by GEMM1."""
    T, D = out_TD.shape
    return torch.empty(T * triton.cdiv(D, gemm2.block_n), dtype=torch.int32, device=out_TD.device)


def _naive_args(align: MoeAlignment) -> tuple:
    """(sorted_ids, expert_ids, num_post_pad, topk_ids, expert_map) pointers; unread ones get a dummy."""
    if align.naive:
        dummy = align.topk_ids_S
        emap = align.expert_map_E if align.expert_map_E is not None else dummy
        return dummy, dummy, dummy, align.topk_ids_S, emap
    dummy = align.sorted_ids_P
    return align.sorted_ids_P, align.expert_ids_B, align.num_post_pad_1, dummy, dummy


def launch_gemm1(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    h_PF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    align: MoeAlignment,
    top_k: int,
    tile: GemmTile,
    mul_routed_weight: bool,
    precision: str = "tf32",
    use_pdl: bool = False,
    silu_slope: float = 1.0,
    sum_into: SumInto | None = None,
) -> None:
    """use_pdl: launched as the previous launch's programmatic dependent (it waits for it before reading
    anything: x, or the alignment's blocks), and GEMM2 after it as its own. sum_into: GEMM2's (see
    `launch_gemm2`); this launch's programs zero its counters, and under an expert map its output too (the
    tokens with no slot here get no sum in GEMM2, and must read 0)."""
    D = hidden_TD.shape[1]
    F = h_PF.shape[1]
    assert not use_pdl or not tile.persistent, "pdl: the pointer GEMM1 (the persistent one has no wait)"
    assert sum_into is None or not (tile.persistent or align.naive), "sum_in_gemm2: aligned, pointer GEMM1"
    if tile.persistent:
        _launch_gemm1_persistent(hidden_TD, w13_eFD, h_PF, topk_weights_TK, align, top_k, tile,
                                 mul_routed_weight, precision, silu_slope)  # fmt: skip
        return
    num_pid_m = align.max_blocks
    grid = num_pid_m * triton.cdiv(F, tile.block_n)
    if sum_into is None:  # dummies, nothing zeroed
        out_TD, counters, n_counters, n_out = hidden_TD, _naive_args(align)[0], 0, 0
    else:
        out_TD, counters, _, expert_map_E = sum_into
        n_counters, n_out = counters.numel(), out_TD.numel() if expert_map_E is not None else 0
    kernels._gemm1_silu_kernel[(grid,)](
        hidden_TD, w13_eFD, h_PF, topk_weights_TK, *_naive_args(align),
        align.num_slots, top_k, num_pid_m, tile.group_m, F, D,
        hidden_TD.stride(0), w13_eFD.stride(0), w13_eFD.stride(1), h_PF.stride(0),
        counters, n_counters, triton.cdiv(n_counters, grid), out_TD, n_out, triton.cdiv(n_out, grid),
        out_TD.stride(0),
        MUL_ROUTED_WEIGHT=mul_routed_weight, EVEN_K=D % tile.block_k == 0, NAIVE=align.naive,
        HAS_EXPERT_MAP=align.expert_map_E is not None, INTERLEAVE=tile.interleave, DOT_PRECISION=precision,
        BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, USE_PDL=use_pdl,
        ZERO_COUNTERS=sum_into is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_pdl_launch(use_pdl), **_slope(silu_slope),
    )  # fmt: skip


def launch_gemm2(
    h_PF: torch.Tensor,
    w2_eDF: torch.Tensor,
    y_SD: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    align: MoeAlignment,
    tile: GemmTile,
    mul_routed_weight: bool,
    precision: str = "tf32",
    fold_k: bool = False,
    use_pdl: bool = False,
    sum_into: SumInto | None = None,
) -> None:
    """use_pdl: launched as GEMM1's programmatic dependent (the launch just before this one must be
    GEMM1's, with use_pdl too), and the sum after it as this one's. sum_into: (out, counters zeroed by
    GEMM1, topk_ids, expert map or None): the program storing a token's last slot of an N-tile sums
    its K rows into out."""
    D = y_SD.shape[1]
    F = h_PF.shape[1]
    assert not fold_k or align.naive, "the sum over K folds into GEMM2 on naive plans only"
    assert sum_into is None or not (align.naive or tile.persistent or tile.tma), (
        "sum_in_gemm2: aligned, pointer GEMM2"
    )
    assert not use_pdl or not (tile.persistent or tile.tma), (
        "pdl: the pointer GEMM2 (neither persistent nor tma)"
    )
    if tile.persistent:
        _launch_gemm2_persistent(
            h_PF, w2_eDF, y_SD, topk_weights_TK, align, tile, mul_routed_weight, precision
        )
        return
    if tile.tma:
        _launch_gemm2_tma(h_PF, w2_eDF, y_SD, topk_weights_TK, align, tile, mul_routed_weight, precision)
        return
    # FOLD_K: one program row per token (it walks the token's K slots); else per M-block.
    num_pid_m = align.num_slots // align.top_k if fold_k else align.max_blocks
    routing = _naive_args(align)
    has_map = align.expert_map_E is not None
    if sum_into is None:
        out_TD, counters = y_SD, routing[0]  # dummies
    else:
        out_TD, counters, topk_ids_TK, expert_map_E = sum_into
        if expert_map_E is not None:  # the sum counts and reads only the slots held here
            routing, has_map = (*routing[:3], topk_ids_TK, expert_map_E), True
    kernels._gemm2_kernel[(num_pid_m * triton.cdiv(D, tile.block_n),)](
        h_PF, w2_eDF, y_SD, topk_weights_TK, *routing,
        align.num_slots, max(align.top_k, 1), num_pid_m, tile.group_m, D, F,
        h_PF.stride(0), w2_eDF.stride(0), w2_eDF.stride(1), y_SD.stride(0),
        out_TD, counters, out_TD.stride(0),
        MUL_ROUTED_WEIGHT=mul_routed_weight, EVEN_K=F % tile.block_k == 0, NAIVE=align.naive,
        HAS_EXPERT_MAP=has_map, FOLD_K=fold_k, DOT_PRECISION=precision,
        BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, USE_PDL=use_pdl,
        SUM_IN_GEMM2=sum_into is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_pdl_launch(use_pdl),
    )  # fmt: skip


# The decode path: GEMVs on naive plans (`MoeTileConfig.gemv`).


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    """Programmatic dependent launch: sm_90+, and a Triton with the grid-dependency ops and the
    `launch_pdl` launch option (3.3 on; the H200 image has 3.6). Asked once per device."""
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def pdl_available(device: torch.device) -> bool:
    """Whether a plan asking for PDL (`GemvTiles.pdl`, `MoeTileConfig.pdl`) gets it here. Never under the
    interpreter (no grid to depend on): there the same kernels run without it, which is what they compute
    either way."""
    if device.type != "cuda" or _interpreting():
        return False
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


def _pdl_launch(use_pdl: bool) -> dict:
    """Triton's launch option that makes a launch the programmatic dependent of the one before it."""
    return {"launch_pdl": True} if use_pdl else {}


def _expert_map_arg(align: MoeAlignment) -> torch.Tensor:
    # Any int32 pointer when there is no map (never read).
    return align.expert_map_E if align.expert_map_E is not None else align.topk_ids_S


def launch_gemv1(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    h_SF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    align: MoeAlignment,
    tile: GemmTile,
    mul_routed_weight: bool,
    use_pdl: bool = False,
    silu_slope: float = 1.0,
) -> None:
    """GEMM1 + SiLU-and-mul as a GEMV: one program per (block of tile.block_n F rows, slot)."""
    assert align.naive, "the GEMVs run naive plans only (one h row per slot)"
    D = hidden_TD.shape[1]
    F = h_SF.shape[1]
    kernels._gemv1_silu_kernel[(triton.cdiv(F, tile.block_n), align.num_slots)](
        hidden_TD, w13_eFD, h_SF, topk_weights_TK, align.topk_ids_S, _expert_map_arg(align),
        align.top_k, F, D, hidden_TD.stride(0), w13_eFD.stride(0), w13_eFD.stride(1), h_SF.stride(0),
        MUL_ROUTED_WEIGHT=mul_routed_weight, HAS_EXPERT_MAP=align.expert_map_E is not None,
        EVEN_D=D % tile.block_k == 0, USE_PDL=use_pdl, NUM_STAGES=tile.num_stages,
        BLOCK_F=tile.block_n, BLOCK_D=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **_slope(silu_slope),
    )  # fmt: skip


def _slope(silu_slope: float) -> dict:
    """The SILU_SLOPE constexpr only when it is not the default: the shipped launches stay as they were."""
    return {} if silu_slope == 1.0 else {"SILU_SLOPE": float(silu_slope)}


def launch_gemv2(
    h_SF: torch.Tensor,
    w2_eDF: torch.Tensor,
    out_TD: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    align: MoeAlignment,
    tile: GemmTile,
    mul_routed_weight: bool,
    use_pdl: bool = False,
) -> None:
    """GEMM2 + routing weight + the sum over K as a GEMV: one program per (block of tile.block_n D rows,
    token), each walking the token's K slots. use_pdl: launched as GEMM1's programmatic dependent (the
    launch just before this one must be GEMM1's, with use_pdl too)."""
    assert align.naive, "the GEMVs run naive plans only (one h row per slot)"
    T, D = out_TD.shape
    F = h_SF.shape[1]
    K = align.top_k
    assert align.num_slots == T * K, "out: one row per token"
    kernels._gemv2_sum_kernel[(triton.cdiv(D, tile.block_n), T)](
        h_SF, w2_eDF, out_TD, topk_weights_TK, align.topk_ids_S, _expert_map_arg(align),
        K, D, F, h_SF.stride(0), w2_eDF.stride(0), w2_eDF.stride(1), out_TD.stride(0),
        MUL_ROUTED_WEIGHT=mul_routed_weight, HAS_EXPERT_MAP=align.expert_map_E is not None,
        EVEN_F=F % tile.block_k == 0, USE_PDL=use_pdl, NUM_STAGES=tile.num_stages, K_PAD=_next_pow2(K),
        BLOCK_D=tile.block_n, BLOCK_F=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **_pdl_launch(use_pdl),
    )  # fmt: skip


def _gemm2_descriptors(
    h_PF: torch.Tensor, w2_eDF: torch.Tensor, align: MoeAlignment, tile: GemmTile, what: str
):
    """TMA descriptors of GEMM2's operands: h rows (contiguous sorted positions) and w2's per-expert tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, D, F = w2_eDF.shape
    _check_tma_operands(what, align, w2_eDF, h_PF)
    w2_desc = TensorDescriptor(w2_eDF, [e, D, F], [D * F, F, 1], [1, tile.block_n, tile.block_k])
    return _h_descriptor(h_PF, align.block_m, tile.block_k), w2_desc


def _launch_gemm2_tma(
    h_PF: torch.Tensor,
    w2_eDF: torch.Tensor,
    y_SD: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    align: MoeAlignment,
    tile: GemmTile,
    mul_routed_weight: bool,
    precision: str,
) -> None:
    e, D, F = w2_eDF.shape
    h_desc, w2_desc = _gemm2_descriptors(h_PF, w2_eDF, align, tile, "gemm2.tma")
    num_pid_m = align.max_blocks
    kernels._gemm2_tma_kernel[(num_pid_m * triton.cdiv(D, tile.block_n),)](
        h_desc, w2_desc, y_SD, topk_weights_TK, align.sorted_ids_P, align.expert_ids_B, align.num_post_pad_1,
        align.num_slots, num_pid_m, tile.group_m, D, F, y_SD.stride(0),
        MUL_ROUTED_WEIGHT=mul_routed_weight, DOT_PRECISION=precision,
        BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


# The prefill path (`persistent` tiles): one program per SM walks the work items of the blocks in use.


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent GEMM: one per SM (the large tiles hold one CTA per SM); 4 in the
    interpreter, so the tests walk several work items per program."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(device_index: int) -> int:
    # Asked once per device: the launcher runs on every layer of every step.
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _persistent_grid(align: MoeAlignment, n_tiles: int) -> int:
    # At most the worst case's work items (known without a sync); the loop bound is the real count.
    return max(1, min(persistent_programs(align.sorted_ids_P.device), align.max_blocks * n_tiles))


def _check_tma_operands(what: str, align: MoeAlignment, *tensors: torch.Tensor) -> None:
    # Contract: aligned plans (MoeTileConfig rejects naive ones with tma or persistent tiles); TMA boxes
    # need a contiguous inner dimension and 16-byte strides.
    assert not align.naive, f"{what} runs aligned plans only"
    for t in tensors:
        assert t.is_contiguous(), f"{what}: operands must be contiguous"
        assert (t.shape[-1] * t.element_size()) % 16 == 0, (
            f"{what}: rows of {t.shape[-1] * t.element_size()} bytes, not a multiple of 16 (TMA)"
        )


def _h_descriptor(h_PF: torch.Tensor, block_rows: int, block_cols: int):
    """TMA descriptor over h (P, F): GEMM1 stores its tiles through it, GEMM2 loads them."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(h_PF, list(h_PF.shape), [h_PF.shape[1], 1], [block_rows, block_cols])


def _launch_gemm1_persistent(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    h_PF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    align: MoeAlignment,
    top_k: int,
    tile: GemmTile,
    mul_routed_weight: bool,
    precision: str,
    silu_slope: float = 1.0,
) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, F2, D = w13_eFD.shape
    F = F2 // 2
    _check_tma_operands("gemm1.persistent", align, w13_eFD, h_PF)
    if tile.interleave:
        # w13 as (e, F, 2, D): the box [1, BLOCK_N, 2, BLOCK_K] is gate row n, up row n, gate row n + 1, ...
        w13_desc = TensorDescriptor(
            w13_eFD, [e, F, 2, D], [F2 * D, D, F * D, 1], [1, tile.block_n, 2, tile.block_k]
        )
    else:
        w13_desc = TensorDescriptor(w13_eFD, [e, F2, D], [F2 * D, D, 1], [1, tile.block_n, tile.block_k])
    h_desc = _h_descriptor(h_PF, align.block_m, tile.block_n)
    programs = _persistent_grid(align, triton.cdiv(F, tile.block_n))
    kernels._gemm1_persistent_kernel[(programs,)](
        hidden_TD, w13_desc, h_desc, topk_weights_TK,
        align.sorted_ids_P, align.expert_ids_B, align.num_post_pad_1,
        align.num_slots, top_k, tile.group_m, programs, F, D, hidden_TD.stride(0),
        MUL_ROUTED_WEIGHT=mul_routed_weight, EVEN_K=D % tile.block_k == 0, INTERLEAVE=tile.interleave,
        DOT_PRECISION=precision, FLATTEN=not tile.warp_specialize, WARP_SPECIALIZE=tile.warp_specialize,
        BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_slope(silu_slope),
    )  # fmt: skip


def _launch_gemm2_persistent(
    h_PF: torch.Tensor,
    w2_eDF: torch.Tensor,
    y_SD: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    align: MoeAlignment,
    tile: GemmTile,
    mul_routed_weight: bool,
    precision: str,
) -> None:
    e, D, F = w2_eDF.shape
    h_desc, w2_desc = _gemm2_descriptors(h_PF, w2_eDF, align, tile, "gemm2.persistent")
    programs = _persistent_grid(align, triton.cdiv(D, tile.block_n))
    kernels._gemm2_persistent_kernel[(programs,)](
        h_desc, w2_desc, y_SD, topk_weights_TK, align.sorted_ids_P, align.expert_ids_B, align.num_post_pad_1,
        align.num_slots, tile.group_m, programs, D, F, y_SD.stride(0),
        MUL_ROUTED_WEIGHT=mul_routed_weight, DOT_PRECISION=precision,
        FLATTEN=not tile.warp_specialize, WARP_SPECIALIZE=tile.warp_specialize,
        BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def launch_sum(
    y_SD: torch.Tensor,
    out_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_map_E: torch.Tensor | None,
    use_pdl: bool = False,
) -> None:
    """use_pdl: launched as GEMM2's programmatic dependent (GEMM2 launched with use_pdl just before)."""
    T, K = topk_ids_TK.shape
    D = out_TD.shape[1]
    block_d = min(1024, _next_pow2(D))
    kernels._moe_sum_kernel[(T, triton.cdiv(D, block_d))](
        y_SD, out_TD, topk_ids_TK, expert_map_E if expert_map_E is not None else topk_ids_TK,
        D, y_SD.stride(0), out_TD.stride(0),
        TOP_K=K, HAS_EXPERT_MAP=expert_map_E is not None, BLOCK_D=block_d, USE_PDL=use_pdl, num_warps=4,
        **_pdl_launch(use_pdl),
    )  # fmt: skip
