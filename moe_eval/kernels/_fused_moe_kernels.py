"""Triton bodies of the fused MoE: routing alignment, GEMM1 + SiLU-and-mul, GEMM2, sum over top-k.

The launcher in `fused_moe.py` calls these in order; read that file first.

Stages (a "slot" is one (token, k) pair, numbered t * K + k):
  1. alignment: sort the slots by local expert into blocks of BLOCK_M rows, each block owned by
     one expert, the tail of each expert's last block padded with the sentinel `num_slots`.
     Histogram of experts, scan, then each slot takes its position with an atomic increment of
     its expert's cursor. `_align_single_kernel` does it all in one program (small T*K, one
     launch); count -> scan -> scatter does it with one program per chunk of slots (large T*K).
  2. `_gemm1_silu_kernel`: h = silu(x W_gate^T) * (x W_up^T) for the gathered rows of one block,
     gate and up tiles computed by the same program so the SiLU-and-mul is the epilogue and the
     [T*K, 2F] product never reaches memory. h rows are indexed by sorted position, so GEMM2
     reads them contiguously.
  3. `_gemm2_kernel`: y = h W_down^T, routing weight multiplied in the epilogue, stored per slot
     (or straight into the output when K == 1).
  4. `_moe_sum_kernel`: out_t = sum_k y_{t,k} in fp32 (K > 1 only).

The kernels are dtype-generic (fp32 / fp16 / bf16 operands, fp32 accumulation): the CPU tests run
them under TRITON_INTERPRET=1 in fp16/fp32, where the interpreter's bf16 `tl.dot` is broken, and
the GPU tests run them in bf16.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k,
P = padded slot count (<= T*K + min(T*K, e) * (BLOCK_M - 1)).
"""

import triton
import triton.language as tl

# do_not_specialize: token and block counts change every call, and Triton would otherwise compile
# another variant when one of them is 1 or changes divisibility by 16. F and D stay specialised:
# a K-loop mask `offs_k < F - k * BLOCK_K` vectorises (and so is software-pipelined with cp.async)
# only when F is known to be a multiple of 16 (seen in the sm_90 TTGIR: no async copies without).

# ---------------------------------------------------------------------------------------------
# Stage 1: routing alignment
# ---------------------------------------------------------------------------------------------


@triton.jit
def _expert_bins(
    topk_ids_ptr,  # (T*K,) int32 global expert ids
    expert_map_ptr,  # (E,) int32 global -> local slot, -1 = not on this rank
    offs,
    num_slots,
    HAS_EXPERT_MAP: tl.constexpr,
    NBINS: tl.constexpr,  # next power of two > e: bin NBINS - 1 (>= e) collects the slots not computed here
):
    """Local expert of each slot in `offs`; NBINS - 1 for slots past the end or held on another rank.

    tl.histogram counts every lane, masked or not, so the slots to ignore need a bin of their own.
    """
    in_range = offs < num_slots
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=0)
    if HAS_EXPERT_MAP:
        ids = tl.load(expert_map_ptr + ids, mask=in_range, other=-1)
    return tl.where(in_range & (ids >= 0), ids, NBINS - 1)


@triton.jit
def _padded_layout(counts, num_experts, BLOCK_M: tl.constexpr, NBINS: tl.constexpr):
    """Per expert: its slots, first and one-past-last padded position; and the padded total."""
    counts = tl.where(tl.arange(0, NBINS) < num_experts, counts, 0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    return counts, ends - padded, ends, tl.sum(padded, axis=0)


@triton.jit
def _write_padding(
    sorted_ids_ptr,  # (P,) int32 out
    starts,  # (NBINS,) first padded position of each expert
    counts,  # (NBINS,) slots of each expert
    ends,  # (NBINS,) one past the last padded position of each expert
    num_slots,
    BLOCK_M: tl.constexpr,
):
    """Mark the tail of each expert's last block with the sentinel `num_slots` (fewer than BLOCK_M)."""
    tail = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    sentinel = tl.full(tail.shape, 0, tl.int32) + num_slots
    tl.store(sorted_ids_ptr + tail, sentinel, mask=tail < ends[:, None])


@triton.jit(do_not_specialize=["num_slots", "max_blocks"])
def _align_single_kernel(
    topk_ids_ptr,  # (T*K,) int32 global expert ids
    expert_map_ptr,  # (E,) int32, or a dummy when HAS_EXPERT_MAP is False
    sorted_ids_ptr,  # (P,) int32 out: slot index, or num_slots for padding
    expert_ids_ptr,  # (max_blocks,) int32 out: local expert of each block, -1 past the end
    num_post_pad_ptr,  # (1,) int32 out: padded slot count (a multiple of BLOCK_M)
    cursor_ptr,  # (NBINS,) int32 scratch: next free position of each expert
    num_slots,
    num_experts,
    max_blocks,
    HAS_EXPERT_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NBINS: tl.constexpr,
    SLOTS: tl.constexpr,  # next power of two >= num_slots: every slot in registers at once
    NB_BLOCKS: tl.constexpr,  # next power of two > max_blocks
):
    """The whole alignment in one program (one launch for small T*K): histogram, scan, scatter.

    A slot's position is taken with an atomic increment of its expert's cursor, so the order of
    slots inside an expert is not fixed; each output row is computed from its own slot only, so
    the results do not depend on it.
    """
    offs = tl.arange(0, SLOTS)
    bins = _expert_bins(topk_ids_ptr, expert_map_ptr, offs, num_slots, HAS_EXPERT_MAP, NBINS)
    counts, starts, ends, total = _padded_layout(tl.histogram(bins, NBINS), num_experts, BLOCK_M, NBINS)
    tl.store(num_post_pad_ptr, total)
    tl.store(cursor_ptr + tl.arange(0, NBINS), starts)
    _write_padding(sorted_ids_ptr, starts, counts, ends, num_slots, BLOCK_M)
    # Owner of block b = experts whose padded range ends at or before b * BLOCK_M (empty experts
    # end where the previous one does): a histogram of the end blocks, summed up to b.
    owner = tl.cumsum(tl.histogram(ends // BLOCK_M, NB_BLOCKS), axis=0)
    blocks = tl.arange(0, NB_BLOCKS)
    tl.store(expert_ids_ptr + blocks, tl.where(blocks * BLOCK_M < total, owner, -1), mask=blocks < max_blocks)
    tl.debug_barrier()  # the cursors stored above are what the atomics below read
    valid = bins < num_experts
    pos = tl.atomic_add(cursor_ptr + bins, 1, mask=valid)
    tl.store(sorted_ids_ptr + pos, offs, mask=valid)


@triton.jit(do_not_specialize=["num_slots"])
def _align_count_kernel(
    topk_ids_ptr,  # (T*K,) int32 global expert ids
    expert_map_ptr,  # (E,) int32, or a dummy
    counts_ptr,  # (NBINS,) int32, zeroed: slots of each expert (atomically summed over programs)
    num_slots,
    HAS_EXPERT_MAP: tl.constexpr,
    NBINS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    hist = tl.histogram(
        _expert_bins(topk_ids_ptr, expert_map_ptr, offs, num_slots, HAS_EXPERT_MAP, NBINS), NBINS
    )
    tl.atomic_add(counts_ptr + tl.arange(0, NBINS), hist, mask=hist > 0)


@triton.jit(do_not_specialize=["num_slots"])
def _align_scan_kernel(
    counts_ptr,  # (NBINS,) int32 slots of each expert
    cursor_ptr,  # (NBINS,) int32 out: first padded position of each expert (the scatter's cursors)
    ends_ptr,  # (NBINS,) int32 out: one past the last padded position of each expert
    sorted_ids_ptr,  # (P,) int32 out: padding sentinels only
    num_post_pad_ptr,  # (1,) int32 out
    num_slots,
    num_experts,
    BLOCK_M: tl.constexpr,
    NBINS: tl.constexpr,
):
    bins = tl.arange(0, NBINS)
    counts, starts, ends, total = _padded_layout(tl.load(counts_ptr + bins), num_experts, BLOCK_M, NBINS)
    tl.store(num_post_pad_ptr, total)
    tl.store(cursor_ptr + bins, starts)
    tl.store(ends_ptr + bins, ends)
    _write_padding(sorted_ids_ptr, starts, counts, ends, num_slots, BLOCK_M)


@triton.jit(do_not_specialize=["num_slots", "max_blocks"])
def _align_scatter_kernel(
    topk_ids_ptr,  # (T*K,) int32 global expert ids
    expert_map_ptr,  # (E,) int32, or a dummy
    cursor_ptr,  # (NBINS,) int32: next free position of each expert
    ends_ptr,  # (NBINS,) int32
    num_post_pad_ptr,  # (1,) int32
    sorted_ids_ptr,  # (P,) int32 out
    expert_ids_ptr,  # (max_blocks,) int32 out
    num_slots,
    num_experts,
    max_blocks,
    HAS_EXPERT_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NBINS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,  # power of two; programs * this >= max_blocks
):
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    bins = _expert_bins(topk_ids_ptr, expert_map_ptr, offs, num_slots, HAS_EXPERT_MAP, NBINS)
    valid = bins < num_experts
    pos = tl.atomic_add(cursor_ptr + bins, 1, mask=valid)  # order inside an expert: see the single kernel
    tl.store(sorted_ids_ptr + pos, offs, mask=valid)
    # This program's share of the block owners: experts whose range ends at or before the block.
    blocks = pid * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    ends = tl.load(ends_ptr + tl.arange(0, NBINS))
    owner = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
    total = tl.load(num_post_pad_ptr)
    tl.store(expert_ids_ptr + blocks, tl.where(blocks * BLOCK_M < total, owner, -1), mask=blocks < max_blocks)


# ---------------------------------------------------------------------------------------------
# Stages 2-4: the GEMMs and the sum over K
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_coords(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """GROUP_M swizzle: consecutive programs share a weight tile (pid_n) across GROUP_M blocks,
    so an expert split over several M-blocks reads its weights from L2 after the first."""
    pid = tl.program_id(0)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["num_slots", "top_k", "num_pid_m"])
def _gemm1_silu_kernel(
    x_ptr,  # (T, D) activations, fp32 / fp16 / bf16
    w13_ptr,  # (e, 2F, D) same dtype: gate rows [0, F), up rows [F, 2F)
    h_ptr,  # (P, F) same dtype, out: silu(gate) * up, row = sorted position
    topk_weights_ptr,  # (T*K,) fp32 / bf16 routing weights (read only when MUL_ROUTED_WEIGHT)
    sorted_ids_ptr,  # (P,) int32 slot of each sorted position, num_slots = padding
    expert_ids_ptr,  # (num_pid_m,) int32 local expert of each block
    num_post_pad_ptr,  # (1,) int32
    num_slots,
    top_k,
    num_pid_m,
    F,
    D,
    stride_xm,
    stride_we,
    stride_wn,
    stride_hm,
    MUL_ROUTED_WEIGHT: tl.constexpr,  # apply_router_weight_on_input: scale x (here: its products) by w
    EVEN_K: tl.constexpr,  # D % BLOCK_K == 0: the K loop needs no mask
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_pid_n = tl.cdiv(F, BLOCK_N)
    pid_m, pid_n = _block_coords(num_pid_m, num_pid_n, GROUP_M)
    # The grid is sized for the worst case (known on the host without a sync); blocks past the
    # padded total exit here.
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    # int64: expert * stride_we passes 2**31 for Llama-4-Scout TP1 (16 * 16384 * 5120 elements
    # fits, but a 32-expert layer of that size would not).
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids_ptr + offs_m)
    row_ok = slot < num_slots
    token = (slot // top_k).to(tl.int64)  # int64: token * stride_xm can pass 2**31 at large T*D
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    w_base = w13_ptr + expert * stride_we + offs_k[:, None]
    wg_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn
    wu_ptrs = w_base + (offs_n[None, :] + F).to(tl.int64) * stride_wn

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(D, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wg = tl.load(wg_ptrs, mask=n_ok[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < D - k * BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_gate = tl.dot(x, wg, acc_gate)
        acc_up = tl.dot(x, wu, acc_up)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K

    if MUL_ROUTED_WEIGHT:
        # w * x through a linear map is w * (x W^T): scaling the fp32 products equals scaling x.
        w = tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc_gate = acc_gate * w[:, None]
        acc_up = acc_up * w[:, None]
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    # Padding rows are stored too (as 0: their x rows loaded as 0) so GEMM2 never reads garbage.
    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_slots", "num_pid_m"])
def _gemm2_kernel(
    h_ptr,  # (P, F) activations from GEMM1, row = sorted position
    w2_ptr,  # (e, D, F) same dtype
    y_ptr,  # (T*K, D) per-slot output, or (T, D) the final output when K == 1
    topk_weights_ptr,  # (T*K,) fp32 / bf16 routing weights
    sorted_ids_ptr,  # (P,) int32
    expert_ids_ptr,  # (num_pid_m,) int32
    num_post_pad_ptr,  # (1,) int32
    num_slots,
    num_pid_m,
    D,
    F,
    stride_hm,
    stride_we,
    stride_wn,
    stride_ym,
    MUL_ROUTED_WEIGHT: tl.constexpr,  # False when the weight was applied on GEMM1's input
    EVEN_K: tl.constexpr,  # F % BLOCK_K == 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_pid_n = tl.cdiv(D, BLOCK_N)
    pid_m, pid_n = _block_coords(num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)  # int64: see GEMM1

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids_ptr + offs_m)
    row_ok = slot < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)

    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    w_ptrs = w2_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(F, BLOCK_K)):
        if EVEN_K:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < F - k * BLOCK_K
            h = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(h, w, acc)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    y_ptrs = y_ptr + slot[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(
    y_ptr,  # (T*K, D) per-slot outputs, already weighted
    out_ptr,  # (T, D) out
    topk_ids_ptr,  # (T*K,) int32 global expert ids (read only when HAS_EXPERT_MAP)
    expert_map_ptr,  # (E,) int32, or a dummy
    D,
    stride_ym,
    stride_om,
    TOP_K: tl.constexpr,
    HAS_EXPERT_MAP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # int64: t * stride_ym * TOP_K can pass 2**31
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row_ok = d_ok
        if HAS_EXPERT_MAP:
            # Slots of experts held on another rank were never written by GEMM2: skip them. The id
            # is loaded as a (broadcast) vector because the interpreter rejects a mask made of a
            # vector & a scalar ("mask has unsupported dtype", triton 3.9).
            gid = tl.load(topk_ids_ptr + t * TOP_K + k + offs_d * 0)
            row_ok = row_ok & (tl.load(expert_map_ptr + gid) >= 0)
        acc += tl.load(y_ptr + (t * TOP_K + k) * stride_ym + offs_d, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_om + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)
