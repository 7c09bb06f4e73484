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
     reads them contiguously. Two tl.dots of width BLOCK_N, or (INTERLEAVE) one of width
     2*BLOCK_N over a weight tile whose columns alternate gate and up rows.
  3. `_gemm2_kernel`: y = h W_down^T, routing weight multiplied in the epilogue, stored per slot
     (or straight into the output when K == 1). `_gemm2_tma_kernel` is the same GEMM with both
     operands loaded by TMA descriptors (optional, per tile: `gemm2.tma`).
  4. `_moe_sum_kernel`: out_t = sum_k y_{t,k} in fp32 (K > 1 only).

Naive plans (NAIVE, a few tokens: see `fused_moe.naive_qualifies`) skip stage 1: block b is slot b
alone and the GEMMs read its expert from the routing; GEMM2 may then also do stage 4 (FOLD_K:
one program walks a token's K slots in a fixed order), so a one-token call is two launches.
The decode path (last section: `_gemv1_silu_kernel`, `_gemv2_sum_kernel`) runs naive plans as two
GEMVs instead, without tl.dot, GEMM2 summing over K itself.
Every tl.dot takes DOT_PRECISION: "ieee" for fp32 operands unless the caller opted into TF32.

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
def _silu_mul(gate, up, SILU_SLOPE: tl.constexpr):
    """silu(gate) * up. SILU_SLOPE != 1 (`--mutate silu_slope` only, a deliberate bug) computes
    gate * sigmoid(SILU_SLOPE * gate) * up; the default compiles the plain SiLU."""
    if SILU_SLOPE != 1.0:
        return gate / (1.0 + tl.exp(-gate * SILU_SLOPE)) * up
    return gate / (1.0 + tl.exp(-gate)) * up


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
    TRIGGER_DEPENDENTS: tl.constexpr = False,  # GEMM1 follows as this grid's programmatic dependent
):
    """The whole alignment in one program (one launch for small T*K): histogram, scan, scatter.

    A slot's position is taken with an atomic increment of its expert's cursor, so the order of
    slots inside an expert is not fixed; each output row is computed from its own slot only, so
    the results do not depend on it.
    """
    if TRIGGER_DEPENDENTS:
        # GEMM1's programs may be put on the SMs now: they wait for this grid before reading what it
        # writes. This launch itself is a plain one (what comes before it is the caller's routing).
        tl.extra.cuda.gdc_launch_dependents()
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
def _work_item(tile, num_pid_m, num_pid_n, group_m):
    """(pid_m, pid_n) of work item `tile` in GROUP_M swizzle order: a program's own index
    (`_block_coords`) or a persistent program's loop index."""
    num_pid_in_group = group_m * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * group_m
    group_size_m = min(num_pid_m - first_pid_m, group_m)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _block_coords(num_pid_m, num_pid_n, group_m):
    """GROUP_M swizzle: consecutive programs share a weight tile (pid_n) across group_m blocks,
    so an expert split over several M-blocks reads its weights from L2 after the first.

    group_m is a runtime value: it only reorders programs, and as a constexpr every value the
    tuner tries (1, 8, 16, 32) would be another compile of an otherwise identical kernel."""
    return _work_item(tl.program_id(0), num_pid_m, num_pid_n, group_m)


@triton.jit
def _block_slots(
    pid_m,
    sorted_ids_ptr,  # (P,) int32 (aligned only)
    expert_ids_ptr,  # (num_pid_m,) int32 (aligned only)
    topk_ids_ptr,  # (T*K,) int32 global expert ids (naive only)
    expert_map_ptr,  # (E,) int32 (naive with HAS_EXPERT_MAP only)
    num_slots,
    NAIVE: tl.constexpr,
    HAS_EXPERT_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The slots of M-block pid_m, the h rows they own, and the block's local expert (-1: none here).

    Aligned: the block's rows are sorted positions pid_m * BLOCK_M + i, their slots and the
    block's expert come from the alignment. Naive (one block per slot, no alignment launch):
    block pid_m is slot pid_m alone (row 0; the other rows are padding), its expert read from
    the routing directly, and its h row is the slot index.
    """
    offs = tl.arange(0, BLOCK_M)
    if NAIVE:
        slot = tl.where(offs == 0, pid_m, num_slots)
        rows = slot
        expert = tl.load(topk_ids_ptr + pid_m)
        if HAS_EXPERT_MAP:
            expert = tl.load(expert_map_ptr + expert)
    else:
        rows = pid_m * BLOCK_M + offs
        slot = tl.load(sorted_ids_ptr + rows)
        expert = tl.load(expert_ids_ptr + pid_m)
    return slot, rows, expert


@triton.jit
def _zero_share(ptr, n, per_program, row_len, stride_row, ZERO_BLOCK: tl.constexpr):
    """This program's share of n elements (rows of row_len, stride_row apart) set to 0: GEMM1 zeroes the
    sum counters of GEMM2's SUM_IN_GEMM2 so a call needs neither a memset launch nor counters kept between
    calls (which two calls in flight on two streams would share)."""
    start = tl.program_id(0).to(tl.int64) * per_program
    offs = tl.arange(0, ZERO_BLOCK)
    for i in range(0, per_program, ZERO_BLOCK):
        idx = start + i + offs
        tl.store(
            ptr + (idx // row_len) * stride_row + idx % row_len,
            tl.zeros((ZERO_BLOCK,), ptr.dtype.element_ty),
            mask=(i + offs < per_program) & (idx < n),
        )


@triton.jit(
    do_not_specialize=["num_slots", "top_k", "num_pid_m", "group_m", "n_counters", "counters_per_program",
                       "n_out", "out_per_program"]
)  # fmt: skip
def _gemm1_silu_kernel(
    x_ptr,  # (T, D) activations, fp32 / fp16 / bf16
    w13_ptr,  # (e, 2F, D) same dtype: gate rows [0, F), up rows [F, 2F)
    h_ptr,  # (P, F) same dtype, out: silu(gate) * up, row = sorted position (naive: row = slot)
    topk_weights_ptr,  # (T*K,) fp32 / bf16 routing weights (read only when MUL_ROUTED_WEIGHT)
    sorted_ids_ptr,  # (P,) int32 slot of each sorted position, num_slots = padding (aligned only)
    expert_ids_ptr,  # (num_pid_m,) int32 local expert of each block (aligned only)
    num_post_pad_ptr,  # (1,) int32 (aligned only)
    topk_ids_ptr,  # (T*K,) int32 global expert ids (naive only)
    expert_map_ptr,  # (E,) int32 global -> local, -1 elsewhere (naive with HAS_EXPERT_MAP only)
    num_slots,
    top_k,
    num_pid_m,
    group_m,
    F,
    D,
    stride_xm,
    stride_we,
    stride_wn,
    stride_hm,
    counters_ptr,  # (n_counters,) int32 GEMM2's sum counters, zeroed here (ZERO_COUNTERS only)
    n_counters,
    counters_per_program,
    out_ptr,  # (T, D) the output, zeroed here under an expert map (ZERO_COUNTERS with n_out > 0)
    n_out,
    out_per_program,
    stride_om,
    MUL_ROUTED_WEIGHT: tl.constexpr,  # apply_router_weight_on_input: scale x (here: its products) by w
    EVEN_K: tl.constexpr,  # D % BLOCK_K == 0: the K loop needs no mask
    NAIVE: tl.constexpr,  # one block per slot, no alignment (see _block_slots)
    HAS_EXPERT_MAP: tl.constexpr,
    INTERLEAVE: tl.constexpr,  # gate and up rows interleaved in one [BLOCK_K, 2 * BLOCK_N] tile: one tl.dot
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands unless TF32 was asked for at the call
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # a programmatic dependent of the launch before, GEMM2 one of this
    SILU_SLOPE: tl.constexpr = 1.0,
    ZERO_COUNTERS: tl.constexpr = False,  # GEMM2 sums over K itself (SUM_IN_GEMM2): zero its counters
):
    if USE_PDL:
        # GEMM2 may be put on the SMs now: it waits for this grid before reading h. This grid waits
        # for the launch before it (which wrote x) before reading anything.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if ZERO_COUNTERS:  # before any program exits: every program zeroes its share
        _zero_share(counters_ptr, n_counters, counters_per_program, n_counters, 0, 128)
        # Under an expert map (n_out > 0; else no iteration): a token none of whose slots is here gets no
        # sum in GEMM2, so it must read 0.
        _zero_share(out_ptr, n_out, out_per_program, D, stride_om, 128)
    num_pid_n = tl.cdiv(F, BLOCK_N)
    pid_m, pid_n = _block_coords(num_pid_m, num_pid_n, group_m)
    # The grid is sized for the worst case (known on the host without a sync); blocks past the
    # padded total exit here. Nested: a naive plan must not load the (dummy) count at all.
    if not NAIVE:  # noqa: SIM102
        if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
            return
    slot, rows, expert = _block_slots(
        pid_m,
        sorted_ids_ptr,
        expert_ids_ptr,
        topk_ids_ptr,
        expert_map_ptr,
        num_slots,
        NAIVE,
        HAS_EXPERT_MAP,
        BLOCK_M,
    )
    if expert < 0:  # naive only: the slot's expert lives on another rank
        return
    # int64: expert * stride_we passes 2**31 for Llama-4-Scout TP1 (16 * 16384 * 5120 elements
    # fits, but a 32-expert layer of that size would not).
    expert = expert.to(tl.int64)
    row_ok = slot < num_slots
    token = (slot // top_k).to(tl.int64)  # int64: token * stride_xm can pass 2**31 at large T*D
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    w_base = w13_ptr + expert * stride_we + offs_k[:, None]

    if INTERLEAVE:
        # Column 2j of the weight tile is gate row n + j, column 2j + 1 is up row F + n + j: one
        # [BLOCK_M, 2 * BLOCK_N] MMA (the shape vLLM's kernel runs with a 2*BLOCK_N-wide N tile)
        # instead of two [BLOCK_M, BLOCK_N] ones, and the halves come apart in registers: in the
        # MMA accumulator layouts each thread holds column pairs (2j, 2j + 1).
        offs_2n = tl.arange(0, 2 * BLOCK_N)
        n_of = pid_n * BLOCK_N + offs_2n // 2
        w_ok = n_of < F
        w_ptrs = w_base + (n_of + (offs_2n % 2) * F)[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(D, BLOCK_K)):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=w_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < D - k * BLOCK_K
                x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & w_ok[None, :], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc_gate, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < F
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
            acc_gate = tl.dot(x, wg, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(x, wu, acc_up, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K

    if MUL_ROUTED_WEIGHT:
        # w * x through a linear map is w * (x W^T): scaling the fp32 products equals scaling x.
        w = tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc_gate = acc_gate * w[:, None]
        acc_up = acc_up * w[:, None]
    h = _silu_mul(acc_gate, acc_up, SILU_SLOPE)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
    if NAIVE:
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < F))
    else:
        # Padding rows are stored too (as 0: their x rows loaded as 0) so GEMM2 never reads garbage.
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=offs_n[None, :] < F)


@triton.jit
def _down_tile(
    h_ptr,  # (P, F) GEMM1's output
    w2_ptr,  # (e, D, F)
    rows,  # (BLOCK_M,) h rows of this block
    row_ok,  # (BLOCK_M,) rows holding a slot
    expert,  # int64 local expert
    offs_n,
    n_ok,
    F,
    stride_hm,
    stride_we,
    stride_wn,
    MASK_ROWS: tl.constexpr,  # naive: padding rows point past h, so their loads are masked
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] tile of h[rows] @ w2[expert][offs_n]^T."""
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    w_ptrs = w2_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(F, BLOCK_K)):
        if EVEN_K:
            if MASK_ROWS:
                h = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                h = tl.load(h_ptrs)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < F - k * BLOCK_K
            if MASK_ROWS:
                h = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                h = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["num_slots", "top_k", "num_pid_m", "group_m"])
def _gemm2_kernel(
    h_ptr,  # (P, F) activations from GEMM1, row = sorted position (naive: row = slot)
    w2_ptr,  # (e, D, F) same dtype
    y_ptr,  # (T*K, D) per-slot output, or (T, D) the final output when K == 1 or FOLD_K
    topk_weights_ptr,  # (T*K,) fp32 / bf16 routing weights
    sorted_ids_ptr,  # (P,) int32 (aligned only)
    expert_ids_ptr,  # (num_pid_m,) int32 (aligned only)
    num_post_pad_ptr,  # (1,) int32 (aligned only)
    topk_ids_ptr,  # (T*K,) int32 global expert ids (naive; SUM_IN_GEMM2 with HAS_EXPERT_MAP)
    expert_map_ptr,  # (E,) int32 (HAS_EXPERT_MAP: naive, or SUM_IN_GEMM2)
    num_slots,
    top_k,
    num_pid_m,  # M-blocks; with FOLD_K: tokens
    group_m,
    D,
    F,
    stride_hm,
    stride_we,
    stride_wn,
    stride_ym,
    out_ptr,  # (T, D) the output (SUM_IN_GEMM2 only)
    counters_ptr,  # (T * cdiv(D, BLOCK_N),) int32, zeroed by GEMM1 (SUM_IN_GEMM2 only)
    stride_om,
    MUL_ROUTED_WEIGHT: tl.constexpr,  # False when the weight was applied on GEMM1's input
    EVEN_K: tl.constexpr,  # F % BLOCK_K == 0
    NAIVE: tl.constexpr,
    HAS_EXPERT_MAP: tl.constexpr,
    FOLD_K: tl.constexpr,  # naive only: one program sums a token's K slots (no separate sum launch)
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched as GEMM1's programmatic dependent (the sum as this one's)
    SUM_IN_GEMM2: tl.constexpr = False,  # aligned, K > 1: the program storing a token's last slot sums
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # Nothing below may read h before GEMM1 is done (its writes are visible after the wait).
        tl.extra.cuda.gdc_wait()
    num_pid_n = tl.cdiv(D, BLOCK_N)
    pid_m, pid_n = _block_coords(num_pid_m, num_pid_n, group_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    if FOLD_K:
        # Program (token t, N-tile): out_t = sum_k w_k * h_{t,k} @ w2[e_k]^T, the K slots in a
        # fixed order, so the result is bitwise repeatable (no atomics). Slots whose expert lives
        # on another rank add nothing; a token with none here gets zeros.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(top_k):
            slot, rows, expert = _block_slots(
                pid_m * top_k + k, sorted_ids_ptr, expert_ids_ptr, topk_ids_ptr, expert_map_ptr,
                num_slots, True, HAS_EXPERT_MAP, BLOCK_M,
            )  # fmt: skip
            if expert >= 0:
                row_ok = slot < num_slots
                part = _down_tile(
                    h_ptr, w2_ptr, rows, row_ok, expert.to(tl.int64), offs_n, n_ok, F, stride_hm, stride_we,
                    stride_wn, True, EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                if MUL_ROUTED_WEIGHT:
                    part = part * tl.load(topk_weights_ptr + pid_m * top_k + k).to(tl.float32)
                acc += part
        first = tl.arange(0, BLOCK_M) == 0
        y_ptrs = y_ptr + pid_m.to(tl.int64) * stride_ym + tl.arange(0, BLOCK_M)[:, None] * 0 + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=first[:, None] & n_ok[None, :])
        return

    if not NAIVE:  # noqa: SIM102 (as in GEMM1)
        if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
            return
    slot, rows, expert = _block_slots(
        pid_m,
        sorted_ids_ptr,
        expert_ids_ptr,
        topk_ids_ptr,
        expert_map_ptr,
        num_slots,
        NAIVE,
        HAS_EXPERT_MAP,
        BLOCK_M,
    )
    if expert < 0:  # naive only
        return
    row_ok = slot < num_slots
    acc = _down_tile(
        h_ptr, w2_ptr, rows, row_ok, expert.to(tl.int64), offs_n, n_ok, F, stride_hm, stride_we, stride_wn,
        NAIVE, EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    y_ptrs = y_ptr + slot[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
    if SUM_IN_GEMM2:
        _sum_if_last(y_ptr, out_ptr, counters_ptr, topk_ids_ptr, expert_map_ptr, slot, row_ok, top_k,
                     pid_n, num_pid_n, offs_n, n_ok, stride_ym, stride_om, HAS_EXPERT_MAP, BLOCK_M,
                     BLOCK_N)  # fmt: skip


@triton.jit
def _sum_if_last(
    y_ptr, out_ptr, counters_ptr, topk_ids_ptr, expert_map_ptr, slot, row_ok, top_k, pid_n, num_pid_n, offs_n,
    n_ok, stride_ym, stride_om, HAS_EXPERT_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The top-k sum inside GEMM2, for the rows whose token this program completes.

    A block holds one expert, so a token's K slots lie in K programs (per N-tile; two in one block only where
    a routing repeats an expert, which the counter handles too: each row counts once). Once this program's y
    rows are stored, each row counts itself in on its (token, N-tile) counter;
    the row that brings it to K was the last to be stored, and its program reads
    the token's K rows back in slot order and adds them as `_moe_sum_kernel` does (fp32, rounded once): the
    same bits whichever program comes last, no atomics on the values. Under an expert map a token counts
    only its slots held here, and the read-back adds 0 for the others (as `_moe_sum_kernel` does); GEMM1
    zeroed the output for the tokens with none.

    Ordering: the barrier puts every thread's y stores before any thread's count (bar.sync orders them
    within the program; the count's release at GPU scope carries them to the program that reads the count
    with acquire); the second barrier puts every thread's read-back after the counts that decided it. The
    read-back loads skip L1 (.cg), which is not coherent across SMs.
    """
    token = slot // top_k  # padding rows: num_slots // top_k = T, masked below
    tl.debug_barrier()
    arrived = tl.atomic_add(
        counters_ptr + token * num_pid_n + pid_n, 1, mask=row_ok, sem="acq_rel", scope="gpu"
    )
    first_row = token.to(tl.int64) * top_k
    if HAS_EXPERT_MAP:
        here = tl.zeros_like(arrived)
        for k in range(top_k):
            gid = tl.load(topk_ids_ptr + first_row + k, mask=row_ok, other=0)
            here += (tl.load(expert_map_ptr + gid, mask=row_ok, other=-1) >= 0).to(arrived.dtype)
        last = row_ok & (arrived == here - 1)
    else:
        last = row_ok & (arrived == top_k - 1)
    tl.debug_barrier()
    if tl.sum(last.to(tl.int32), axis=0) > 0:
        mask = last[:, None] & n_ok[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(top_k):
            row_mask = mask
            if HAS_EXPERT_MAP:  # slots held on another rank were never written
                gid = tl.load(topk_ids_ptr + first_row + k, mask=last, other=0)
                row_mask = mask & (tl.load(expert_map_ptr + gid, mask=last, other=-1) >= 0)[:, None]
            rows = y_ptr + (first_row + k)[:, None] * stride_ym + offs_n[None, :]
            acc += tl.load(rows, mask=row_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        out = out_ptr + token.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_slots", "num_pid_m", "group_m"])
def _gemm2_tma_kernel(
    h_desc,  # TensorDescriptor over h (P, F), block [BLOCK_M, BLOCK_K]
    w2_desc,  # TensorDescriptor over w2 (e, D, F), block [1, BLOCK_N, BLOCK_K]
    y_ptr,  # (T*K, D) per-slot output, or (T, D) the final output when K == 1
    topk_weights_ptr,  # (T*K,) fp32 / bf16 routing weights
    sorted_ids_ptr,  # (P,) int32
    expert_ids_ptr,  # (num_pid_m,) int32
    num_post_pad_ptr,  # (1,) int32
    num_slots,
    num_pid_m,
    group_m,
    D,
    F,
    stride_ym,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """GEMM2 of an aligned plan with both operands loaded by TMA (the `gemm2.tma` tile field).

    GEMM2's A rows are contiguous sorted positions (GEMM1 wrote them so) and each block has one
    expert, so both tiles are plain boxes of 2-D / 3-D tensors: the copy engine loads them and
    zero-fills past F and D, instead of every thread computing addresses for cp.async. (GEMM1's A
    rows are gathered tokens: a Hopper TMA cannot gather, so GEMM1 keeps pointer loads.)
    """
    num_pid_n = tl.cdiv(D, BLOCK_N)
    pid_m, pid_n = _block_coords(num_pid_m, num_pid_n, group_m)
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids_ptr + offs_m)
    row_ok = slot < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(F, BLOCK_K)):
        h = h_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        w = w2_desc.load([expert, pid_n * BLOCK_N, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
        acc = tl.dot(h, w.T, acc, input_precision=DOT_PRECISION)
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    y_ptrs = y_ptr + slot[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < D))


# ---------------------------------------------------------------------------------------------
# The prefill path: persistent grouped GEMMs over (M-block, N-tile) work items, weights by TMA
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_slots", "top_k", "group_m", "num_programs"])
def _gemm1_persistent_kernel(
    x_ptr,  # (T, D) activations
    w13_desc,  # TMA over w13: INTERLEAVE (e, F, 2, D) box [1, BN, 2, BK], else (e, 2F, D) box [1, BN, BK]
    h_desc,  # TensorDescriptor over h (P, F), block [BLOCK_M, BLOCK_N]
    topk_weights_ptr,  # (T*K,) routing weights (read only when MUL_ROUTED_WEIGHT)
    sorted_ids_ptr,  # (P,) int32
    expert_ids_ptr,  # (max_blocks,) int32
    num_post_pad_ptr,  # (1,) int32
    num_slots,
    top_k,
    group_m,
    num_programs,  # the grid (one program per SM, at most one per work item): the loop's step
    F,
    D,
    stride_xm,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,  # D % BLOCK_K == 0: the gathered x loads need no K mask
    INTERLEAVE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FLATTEN: tl.constexpr,  # pipeline across work items (the next item's loads under this one's epilogue)
    WARP_SPECIALIZE: tl.constexpr,  # producer / consumer warp groups (Triton's automatic warp specialization)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU_SLOPE: tl.constexpr = 1.0,
):
    """GEMM1 + SiLU-and-mul of an aligned plan as a persistent grouped GEMM (tile field `gemm1.persistent`).

    The work items are the (M-block, N-tile) pairs of the blocks in use (the padded count, read on
    the device), so no program is launched for the worst case's empty blocks. The weight tiles come
    by TMA: with INTERLEAVE through a 4-D view of w13 whose box [1, BLOCK_N, 2, BLOCK_K] lands in
    shared memory as gate row n, up row n, gate row n + 1, ... (the interleave of the pointer
    kernel, built by the copy engine); x rows are a gather (sorted slots -> tokens), which a Hopper
    TMA cannot do, so they stay pointer loads. h rows are contiguous: TMA stores, clipped at F.
    """
    num_pid_m = tl.load(num_post_pad_ptr) // BLOCK_M
    num_pid_n = tl.cdiv(F, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(
        tl.program_id(0),
        num_pid_m * num_pid_n,
        num_programs,
        flatten=FLATTEN,
        warp_specialize=WARP_SPECIALIZE,
    ):
        pid_m, pid_n = _work_item(tile, num_pid_m, num_pid_n, group_m)
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        expert = tl.load(expert_ids_ptr + pid_m)
        row_ok = slot < num_slots
        token = (slot // top_k).to(tl.int64)
        x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
        n = pid_n * BLOCK_N
        if INTERLEAVE:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        else:
            acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(D, BLOCK_K)):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < D - k * BLOCK_K), other=0.0)
            if INTERLEAVE:
                w = w13_desc.load([expert, n, 0, k * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
                acc = tl.dot(x, w.T, acc, input_precision=DOT_PRECISION)
            else:
                # Rows past F of the gate box are up rows: their columns of h are past F and clipped.
                wg = w13_desc.load([expert, n, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
                wu = w13_desc.load([expert, F + n, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
                acc_gate = tl.dot(x, wg.T, acc_gate, input_precision=DOT_PRECISION)
                acc_up = tl.dot(x, wu.T, acc_up, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
        if INTERLEAVE:
            acc_gate, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        if MUL_ROUTED_WEIGHT:
            rw = tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
            acc_gate = acc_gate * rw[:, None]
            acc_up = acc_up * rw[:, None]
        h = _silu_mul(acc_gate, acc_up, SILU_SLOPE)
        # Padding rows are stored too (0: their x rows loaded as 0), as in the pointer kernel.
        h_desc.store([pid_m * BLOCK_M, n], h.to(h_desc.dtype))


@triton.jit(do_not_specialize=["num_slots", "group_m", "num_programs"])
def _gemm2_persistent_kernel(
    h_desc,  # TensorDescriptor over h (P, F), block [BLOCK_M, BLOCK_K]
    w2_desc,  # TensorDescriptor over w2 (e, D, F), block [1, BLOCK_N, BLOCK_K]
    y_ptr,  # (T*K, D) per-slot output, or (T, D) the final output when K == 1
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    num_slots,
    group_m,
    num_programs,
    D,
    F,
    stride_ym,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """`_gemm2_tma_kernel` as a persistent grouped GEMM (the `gemm2.persistent` tile field): see GEMM1's."""
    num_pid_m = tl.load(num_post_pad_ptr) // BLOCK_M
    num_pid_n = tl.cdiv(D, BLOCK_N)
    for tile in tl.range(
        tl.program_id(0),
        num_pid_m * num_pid_n,
        num_programs,
        flatten=FLATTEN,
        warp_specialize=WARP_SPECIALIZE,
    ):
        pid_m, pid_n = _work_item(tile, num_pid_m, num_pid_n, group_m)
        expert = tl.load(expert_ids_ptr + pid_m)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(F, BLOCK_K)):
            h = h_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w2_desc.load([expert, pid_n * BLOCK_N, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(h, w.T, acc, input_precision=DOT_PRECISION)
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = slot < num_slots
        if MUL_ROUTED_WEIGHT:
            rw = tl.load(topk_weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * rw[:, None]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + slot[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < D))


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
    USE_PDL: tl.constexpr = False,  # launched as GEMM2's programmatic dependent: wait before reading y
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
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


# ---------------------------------------------------------------------------------------------
# The decode path: both GEMMs as GEMVs on naive plans (`MoeTileConfig.gemv`)
# ---------------------------------------------------------------------------------------------
# At a few tokens each slot is one row against its expert's weights: the layer is a weight stream,
# and a 16-row MMA tile holding one real row spends registers, shared memory and a pipeline on 15
# rows of padding. These kernels load the weight tiles straight into registers (the reduction
# dimension contiguous: coalesced 16-byte loads) and reduce with multiply-add and tl.sum in fp32.
# They round where the tl.dot kernels do (the incumbent's arithmetic of layer_check.py: h in the
# dtype, each slot's weighted output in the dtype, the K slots summed in fp32 and rounded once), so
# a server switching paths moves only by fp32 summation order. No tl.dot: every dtype runs in IEEE
# fp32 arithmetic (TF32 does not apply).


@triton.jit
def _slot_experts(
    topk_ids_ptr,  # (T*K,) int32 global expert ids
    expert_map_ptr,  # (E,) int32 global -> local, -1 elsewhere (HAS_EXPERT_MAP only)
    slots,  # int32 slot numbers t * K + k (a scalar or a vector)
    valid,  # which of `slots` exist (same shape)
    HAS_EXPERT_MAP: tl.constexpr,
):
    """Local expert of each slot; -1 where the slot does not exist or its expert lives on another rank."""
    expert = tl.load(topk_ids_ptr + slots, mask=valid, other=-1)
    if HAS_EXPERT_MAP:
        expert = tl.load(expert_map_ptr + expert, mask=valid & (expert >= 0), other=-1)
    return expert


@triton.jit(do_not_specialize=["top_k"])
def _gemv1_silu_kernel(
    x_ptr,  # (T, D) activations, fp32 / fp16 / bf16
    w13_ptr,  # (e, 2F, D) same dtype: gate rows [0, F), up rows [F, 2F)
    h_ptr,  # (T*K, F) same dtype, out: silu(gate) * up, row = slot
    topk_weights_ptr,  # (T*K,) fp32 / bf16 routing weights (read only when MUL_ROUTED_WEIGHT)
    topk_ids_ptr,  # (T*K,) int32 global expert ids
    expert_map_ptr,  # (E,) int32, or a dummy when HAS_EXPERT_MAP is False
    top_k,
    F,
    D,
    stride_xm,
    stride_we,
    stride_wn,
    stride_hm,
    MUL_ROUTED_WEIGHT: tl.constexpr,  # apply_router_weight_on_input: scale the products by w
    HAS_EXPERT_MAP: tl.constexpr,
    EVEN_D: tl.constexpr,  # D % BLOCK_D == 0: the D loop needs no mask
    USE_PDL: tl.constexpr,  # GEMM2 is launched as this grid's programmatic dependent
    NUM_STAGES: tl.constexpr,  # > 1: the D loop's loads software-pipelined
    BLOCK_F: tl.constexpr,  # F rows of gate and of up per program
    BLOCK_D: tl.constexpr,  # D columns per step
    SILU_SLOPE: tl.constexpr = 1.0,
):
    """Program (F block, slot): h[slot, F block] = silu(x W_gate^T) * (x W_up^T) of the slot's expert.

    F blocks vary fastest in the grid, so consecutive programs read consecutive weight rows.
    """
    if USE_PDL:
        # GEMM2 may start once every program here has started: what it does before its own
        # gdc_wait (load weights) reads nothing this kernel writes.
        tl.extra.cuda.gdc_launch_dependents()
    pid_f = tl.program_id(0)
    slot = tl.program_id(1)
    expert = _slot_experts(topk_ids_ptr, expert_map_ptr, slot, slot >= 0, HAS_EXPERT_MAP)
    if expert < 0:  # the slot's expert lives on another rank: GEMM2 skips the slot too
        return
    # int64: expert * stride_we passes 2**31 for Llama-4-Scout TP1 sized layers (see GEMM1 above).
    expert = expert.to(tl.int64)
    token = (slot // top_k).to(tl.int64)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = offs_f < F
    offs_d = tl.arange(0, BLOCK_D)
    x_ptrs = x_ptr + token * stride_xm + offs_d
    gate_ptrs = w13_ptr + expert * stride_we + offs_f[:, None].to(tl.int64) * stride_wn + offs_d[None, :]
    up_ptrs = gate_ptrs + F * stride_wn
    # fp32 sums per row: a tl.sum over each step's columns, the steps added in order.
    acc_gate = tl.zeros((BLOCK_F,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(D, BLOCK_D), num_stages=NUM_STAGES):
        if EVEN_D:
            x = tl.load(x_ptrs)
            wg = tl.load(gate_ptrs, mask=f_ok[:, None], other=0.0)
            wu = tl.load(up_ptrs, mask=f_ok[:, None], other=0.0)
        else:
            d_ok = offs_d < D - k * BLOCK_D
            x = tl.load(x_ptrs, mask=d_ok, other=0.0)
            wg = tl.load(gate_ptrs, mask=f_ok[:, None] & d_ok[None, :], other=0.0)
            wu = tl.load(up_ptrs, mask=f_ok[:, None] & d_ok[None, :], other=0.0)
        x_row = x.to(tl.float32)[None, :]
        acc_gate += tl.sum(wg.to(tl.float32) * x_row, axis=1)
        acc_up += tl.sum(wu.to(tl.float32) * x_row, axis=1)
        x_ptrs += BLOCK_D
        gate_ptrs += BLOCK_D
        up_ptrs += BLOCK_D
    if MUL_ROUTED_WEIGHT:
        # As in the tl.dot GEMM1: scaling the fp32 products equals scaling x.
        w = tl.load(topk_weights_ptr + slot).to(tl.float32)
        acc_gate = acc_gate * w
        acc_up = acc_up * w
    h = _silu_mul(acc_gate, acc_up, SILU_SLOPE)
    tl.store(h_ptr + slot.to(tl.int64) * stride_hm + offs_f, h.to(h_ptr.dtype.element_ty), mask=f_ok)


@triton.jit
def _load_w2_step(
    w_ptrs,  # (K_PAD, BLOCK_D, BLOCK_F) pointers into w2 (e, D, F) at this step
    w_ok,  # (K_PAD, BLOCK_D, 1) live slot and row in range
    offs_f,
    F,
    step,
    EVEN_F: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    if EVEN_F:
        return tl.load(w_ptrs, mask=w_ok, other=0.0)
    return tl.load(w_ptrs, mask=w_ok & (offs_f[None, None, :] < F - step * BLOCK_F), other=0.0)


@triton.jit
def _load_h_step(
    h_ptrs,  # (K_PAD, 1, BLOCK_F) pointers into h (T*K, F) at this step
    h_ok,  # (K_PAD, 1, 1) live slot (GEMM1 skipped the others: their rows hold garbage)
    offs_f,
    F,
    step,
    EVEN_F: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    if EVEN_F:
        return tl.load(h_ptrs, mask=h_ok, other=0.0)
    return tl.load(h_ptrs, mask=h_ok & (offs_f[None, None, :] < F - step * BLOCK_F), other=0.0)


@triton.jit(do_not_specialize=["top_k"])
def _gemv2_sum_kernel(
    h_ptr,  # (T*K, F) GEMM1's output, row = slot
    w2_ptr,  # (e, D, F) same dtype
    out_ptr,  # (T, D) out: the sum over the token's K slots
    topk_weights_ptr,  # (T*K,) fp32 / bf16 routing weights (read only when MUL_ROUTED_WEIGHT)
    topk_ids_ptr,  # (T*K,) int32 global expert ids
    expert_map_ptr,  # (E,) int32, or a dummy when HAS_EXPERT_MAP is False
    top_k,
    D,
    F,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    MUL_ROUTED_WEIGHT: tl.constexpr,  # False when the weight was applied on GEMM1's input
    HAS_EXPERT_MAP: tl.constexpr,
    EVEN_F: tl.constexpr,  # F % BLOCK_F == 0
    USE_PDL: tl.constexpr,  # launched as GEMM1's programmatic dependent: wait before reading h
    NUM_STAGES: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of two >= top_k: the slot axis of the tiles
    BLOCK_D: tl.constexpr,  # output rows per program
    BLOCK_F: tl.constexpr,  # F columns per step
):
    """Program (D block, token): out[t, D block] = sum_k round(w_k * h_{t,k} @ w2[e_k][D block]^T).

    All K slots of the token in one program, one [K_PAD, BLOCK_D, BLOCK_F] weight tile a step, so
    the top-k sum needs no launch of its own and no atomics: the slots are added in slot order,
    each rounded to the dtype first (as the separate sum kernel sees them), and the result is
    bitwise repeatable. Parallelism comes from small D blocks (D / BLOCK_D programs a token), not
    from the slots: Qwen3-30B-A3B at M = 1 with BLOCK_D 1 runs 2048 programs, each streaming its
    8 rows of 768.
    """
    pid_d = tl.program_id(0)
    token = tl.program_id(1)
    offs_k = tl.arange(0, K_PAD)
    k_ok = offs_k < top_k
    slots = token * top_k + offs_k
    expert = _slot_experts(topk_ids_ptr, expert_map_ptr, slots, k_ok, HAS_EXPERT_MAP)
    live = expert >= 0  # slots past top_k and slots held on another rank add nothing
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_f = tl.arange(0, BLOCK_F)
    # int64: expert * stride_we (see GEMM1); dead slots point at expert -1 and are masked.
    w_ptrs = (
        w2_ptr
        + expert.to(tl.int64)[:, None, None] * stride_we
        + offs_d.to(tl.int64)[None, :, None] * stride_wn
        + offs_f[None, None, :]
    )
    w_ok = live[:, None, None] & (offs_d < D)[None, :, None]
    h_ptrs = h_ptr + slots.to(tl.int64)[:, None, None] * stride_hm + offs_f[None, None, :]
    h_ok = live[:, None, None]

    # The first step by hand: its weights are loaded before the wait for GEMM1 (with PDL, while
    # GEMM1's last programs still run); only h has to wait. The loop below starts after the wait,
    # so a pipelined prologue cannot hoist an h load above it.
    w = _load_w2_step(w_ptrs, w_ok, offs_f, F, 0, EVEN_F, BLOCK_F)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    h = _load_h_step(h_ptrs, h_ok, offs_f, F, 0, EVEN_F, BLOCK_F)
    acc = tl.sum(w.to(tl.float32) * h.to(tl.float32), axis=2)  # (K_PAD, BLOCK_D) fp32
    for step in tl.range(1, tl.cdiv(F, BLOCK_F), num_stages=NUM_STAGES):
        w_ptrs += BLOCK_F
        h_ptrs += BLOCK_F
        w = _load_w2_step(w_ptrs, w_ok, offs_f, F, step, EVEN_F, BLOCK_F)
        h = _load_h_step(h_ptrs, h_ok, offs_f, F, step, EVEN_F, BLOCK_F)
        acc += tl.sum(w.to(tl.float32) * h.to(tl.float32), axis=2)

    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + slots, mask=live, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    # Each slot's output rounded to the dtype, then the slots added in fp32 in slot order (picking
    # row k by a masked sum is exact: the other terms are zeros), then rounded once.
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(K_PAD):
        out += tl.sum(tl.where(offs_k[:, None] == k, y, 0.0), axis=0)
    out_ptrs = out_ptr + token.to(tl.int64) * stride_om + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)
