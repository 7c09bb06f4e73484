"""Triton bodies of the layer check on a CUDA device (moe_eval.kernels.layer_check holds the launcher and
the torch definition these kernels must agree with).

Every kernel first reads the sample flag that `_tick_kernel` set for this call and returns at once when it
is 0, so a call that is not sampled costs four near-empty launches, also inside a CUDA graph (the flag is
decided on the device at each replay, not when the graph was captured). Sampled rows of a call of T tokens:
row_r = r * (T - 1) // (R - 1), r = 0 .. R-1 (a row equal to the one before is counted once).

Everything is fp32 with IEEE products and sums (no tensor cores: elementwise products and tl.sum), the
statistics in fp64.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k, R sampled rows,
NR dispatch ranges.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["range_index", "period", "burst"])
def _tick_kernel(
    seen_ptr,  # (NR,) int64: calls seen per range (every call, sampled or not)
    flag_ptr,  # (1,) int32: 1 when this call is sampled
    range_index,
    period,
    burst,
):
    # One program, one stream: the layers' calls run in order, so no atomic is needed.
    seen = tl.load(seen_ptr + range_index)
    tl.store(seen_ptr + range_index, seen + 1)
    sampled = (seen < burst) | ((seen % period) == 0)
    tl.store(flag_ptr, sampled.to(tl.int32))


@triton.jit
def _sample_row(r, T, R: tl.constexpr):
    if R == 1:
        return r * 0
    return (r * (T - 1)) // (R - 1)


@triton.jit(do_not_specialize=["T"])
def _exact_h_kernel(
    flag_ptr,  # (1,) int32
    x_ptr,  # (T, D) bf16/fp16
    topk_ids_ptr,  # (T, K) int32, global expert ids
    topk_w_ptr,  # (T, K) fp32
    expert_map_ptr,  # (E,) int32, local slot or -1 (unused without HAS_MAP)
    w13_ptr,  # (e, 2F, D) bf16: [gate; up] per local expert, as vLLM loaded it
    h_ptr,  # (R, K, F) fp32 out: silu(gate) * up, exact
    T,
    D,
    F,
    stride_w13_e,
    stride_w13_f,
    K: tl.constexpr,
    R: tl.constexpr,
    HAS_MAP: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    if tl.load(flag_ptr) == 0:
        return
    rk = tl.program_id(0)
    r = rk // K
    k = rk % K
    row = _sample_row(r, T, R)
    expert = tl.load(topk_ids_ptr + row * K + k)
    local = expert
    if HAS_MAP:
        local = tl.load(expert_map_ptr + expert)
    if local < 0:
        return  # another rank's expert: nothing of it is served here
    weight = tl.load(topk_w_ptr + row * K + k)
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = offs_f < F
    # int64: e * 2F * D passes 2**31 at real shapes (128 experts x 1536 x 2048 = 4e8 per layer is close).
    w_base = w13_ptr + local.to(tl.int64) * stride_w13_e
    acc_gate = tl.zeros((BLOCK_F,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x = tl.load(x_ptr + row.to(tl.int64) * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        if WEIGHT_ON_INPUT:
            x = x * weight
        mask = mask_f[:, None] & mask_d[None, :]
        gate = tl.load(
            w_base + offs_f[:, None].to(tl.int64) * stride_w13_f + offs_d[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        up = tl.load(
            w_base + (offs_f[:, None] + F).to(tl.int64) * stride_w13_f + offs_d[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        acc_gate += tl.sum(gate * x[None, :], axis=1)
        acc_up += tl.sum(up * x[None, :], axis=1)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(h_ptr + (r * K + k) * F + offs_f, h, mask=mask_f)


@triton.jit(do_not_specialize=["T"])
def _exact_y_kernel(
    flag_ptr,  # (1,) int32
    topk_ids_ptr,  # (T, K) int32
    topk_w_ptr,  # (T, K) fp32
    expert_map_ptr,  # (E,) int32
    w2_ptr,  # (e, D, F) bf16
    h_ptr,  # (R, K, F) fp32 from _exact_h_kernel
    y_ptr,  # (R, K, D) fp32 out: the exact contribution of slot (row, k), routing weight included
    q_ptr,  # (R, K, D) fp32 out: the incumbent's slot output (h rounded to bf16, the output rounded too)
    T,
    D,
    F,
    stride_w2_e,
    stride_w2_d,
    K: tl.constexpr,
    R: tl.constexpr,
    HAS_MAP: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    if tl.load(flag_ptr) == 0:
        return
    rk = tl.program_id(0)
    r = rk // K
    k = rk % K
    row = _sample_row(r, T, R)
    expert = tl.load(topk_ids_ptr + row * K + k)
    local = expert
    if HAS_MAP:
        local = tl.load(expert_map_ptr + expert)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    if local < 0:
        zero = tl.zeros((BLOCK_D,), dtype=tl.float32)
        tl.store(y_ptr + (r * K + k) * D + offs_d, zero, mask=mask_d)
        tl.store(q_ptr + (r * K + k) * D + offs_d, zero, mask=mask_d)
        return
    weight = tl.load(topk_w_ptr + row * K + k)
    w_base = w2_ptr + local.to(tl.int64) * stride_w2_e
    acc_y = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc_q = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        mask_f = offs_f < F
        h = tl.load(h_ptr + (r * K + k) * F + offs_f, mask=mask_f, other=0.0)
        h_rounded = h.to(tl.bfloat16).to(tl.float32)
        w2 = tl.load(
            w_base + offs_d[:, None].to(tl.int64) * stride_w2_d + offs_f[None, :],
            mask=mask_d[:, None] & mask_f[None, :],
            other=0.0,
        ).to(tl.float32)
        acc_y += tl.sum(w2 * h[None, :], axis=1)
        acc_q += tl.sum(w2 * h_rounded[None, :], axis=1)
    if not WEIGHT_ON_INPUT:
        acc_y = acc_y * weight
        acc_q = acc_q * weight
    acc_q = acc_q.to(tl.bfloat16).to(tl.float32)  # the incumbent stores each slot's output in bf16
    tl.store(y_ptr + (r * K + k) * D + offs_d, acc_y, mask=mask_d)
    tl.store(q_ptr + (r * K + k) * D + offs_d, acc_q, mask=mask_d)


@triton.jit
def _finite(x):
    return (x - x) == 0.0  # NaN - NaN and inf - inf are NaN, which equals nothing


@triton.jit(do_not_specialize=["T", "range_index"])
def _stats_kernel(
    flag_ptr,  # (1,) int32
    out_ptr,  # (T, D) bf16/fp16: what the served kernel returned
    topk_ids_ptr,  # (T, K) int32
    expert_map_ptr,  # (E,) int32
    y_ptr,  # (R, K, D) fp32
    q_ptr,  # (R, K, D) fp32
    range_sums_ptr,  # (NR, 6) fp64: sampled calls, rows, sum res^2, sum exact^2, sum inc^2, non-finite served
    expert_sums_ptr,  # (NR, E, 6) fp64: n, sum a, sum b, sum vb, sum a_inc, sum vd
    seen_ptr,  # (NR,) int64
    mirror_ptr,  # (NR*6 + NR*E*6 + NR,) fp64 in pinned host memory: a copy the flusher thread reads
    T,
    D,
    E,
    range_index,
    K: tl.constexpr,
    R: tl.constexpr,
    NR: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_COPY: tl.constexpr,
):
    """One program: per sampled slot a = <res, y>, b = <y, y>, vb = sum y^2 res^2, a_inc = <inc, y> and
    vd = sum y^2 (served - incumbent)^2 (res = served - exact, inc = incumbent - exact; layer_check.call_sums
    is the definition, elements whose exact value is not finite left out), summed per range and expert; then
    the whole table is copied to the host mirror."""
    if tl.load(flag_ptr) == 0:
        return
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    rows_used = 0.0
    # fp64 vectors over D, summed once at the end (loop-carried values keep one type in Triton loops).
    sq_res_D = tl.zeros((BLOCK_D,), dtype=tl.float64)
    sq_exact_D = tl.zeros((BLOCK_D,), dtype=tl.float64)
    sq_inc_D = tl.zeros((BLOCK_D,), dtype=tl.float64)
    bad_D = tl.zeros((BLOCK_D,), dtype=tl.float64)
    for r in tl.static_range(R):
        row = _sample_row(r, T, R)
        fresh = row >= 0  # the first sampled row always counts
        if r > 0:
            fresh = row != _sample_row(r - 1, T, R)  # a row equal to the one before counts once
        fresh_f = fresh.to(tl.float64)
        rows_used = rows_used + fresh_f
        experts = tl.load(topk_ids_ptr + row * K + offs_k, mask=mask_k, other=0)
        local = experts
        if HAS_MAP:
            local = tl.load(expert_map_ptr + experts, mask=mask_k, other=-1)
        valid_k = mask_k & (local >= 0)
        a_K = tl.zeros((BLOCK_K,), dtype=tl.float64)
        b_K = tl.zeros((BLOCK_K,), dtype=tl.float64)
        vb_K = tl.zeros((BLOCK_K,), dtype=tl.float64)
        a_inc_K = tl.zeros((BLOCK_K,), dtype=tl.float64)
        vd_K = tl.zeros((BLOCK_K,), dtype=tl.float64)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            mask = valid_k[:, None] & mask_d[None, :]
            y = tl.load(y_ptr + (r * K + offs_k[:, None]) * D + offs_d[None, :], mask=mask, other=0.0)
            q = tl.load(q_ptr + (r * K + offs_k[:, None]) * D + offs_d[None, :], mask=mask, other=0.0)
            exact = tl.sum(y, axis=0)
            ref = tl.sum(q, axis=0).to(tl.bfloat16).to(tl.float32)
            served = tl.load(out_ptr + row.to(tl.int64) * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            exact_ok = mask_d & _finite(exact)
            served_ok = _finite(served)
            keep = exact_ok & served_ok
            res = tl.where(keep, served - exact, 0.0)
            inc = tl.where(exact_ok, ref - exact, 0.0)
            diff = tl.where(keep, served - ref, 0.0)
            exact = tl.where(exact_ok, exact, 0.0)
            y = tl.where(exact_ok[None, :], y, 0.0).to(tl.float64)
            bad_D += tl.where(exact_ok & (served_ok == 0), 1.0, 0.0).to(tl.float64) * fresh_f
            sq_res_D += (res * res).to(tl.float64) * fresh_f
            sq_exact_D += (exact * exact).to(tl.float64) * fresh_f
            sq_inc_D += (inc * inc).to(tl.float64) * fresh_f
            res64 = res.to(tl.float64)[None, :]
            diff64 = diff.to(tl.float64)[None, :]
            a_K += tl.sum(y * res64, axis=1)
            b_K += tl.sum(y * y, axis=1)
            vb_K += tl.sum(y * y * res64 * res64, axis=1)
            a_inc_K += tl.sum(y * inc.to(tl.float64)[None, :], axis=1)
            vd_K += tl.sum(y * y * diff64 * diff64, axis=1)
        cell = expert_sums_ptr + (range_index * E + experts) * 6
        write = valid_k & ((offs_k * 0 + fresh.to(tl.int32)) > 0)  # the row's flag, as a (BLOCK_K,) mask
        tl.atomic_add(cell + 0, tl.full((BLOCK_K,), 1.0, dtype=tl.float64), mask=write)
        tl.atomic_add(cell + 1, a_K, mask=write)
        tl.atomic_add(cell + 2, b_K, mask=write)
        tl.atomic_add(cell + 3, vb_K, mask=write)
        tl.atomic_add(cell + 4, a_inc_K, mask=write)
        tl.atomic_add(cell + 5, vd_K, mask=write)
    # The range's six sums in one masked vector add.
    offs_f = tl.arange(0, 8)
    sums = tl.where(offs_f == 0, 1.0, 0.0).to(tl.float64)
    sums = tl.where(offs_f == 1, rows_used, sums)
    sums = tl.where(offs_f == 2, tl.sum(sq_res_D, axis=0), sums)
    sums = tl.where(offs_f == 3, tl.sum(sq_exact_D, axis=0), sums)
    sums = tl.where(offs_f == 4, tl.sum(sq_inc_D, axis=0), sums)
    sums = tl.where(offs_f == 5, tl.sum(bad_D, axis=0), sums)
    tl.atomic_add(range_sums_ptr + range_index * 6 + offs_f, sums, mask=offs_f < 6)
    tl.debug_barrier()
    # The host mirror: range sums, then expert sums, then the calls seen (as fp64), one plain copy.
    n_range = NR * 6
    n_expert = NR * E * 6
    for start in range(0, n_range + n_expert + NR, BLOCK_COPY):
        offs = start + tl.arange(0, BLOCK_COPY)
        from_range = tl.load(range_sums_ptr + offs, mask=offs < n_range, other=0.0, volatile=True)
        from_expert = tl.load(
            expert_sums_ptr + (offs - n_range),
            mask=(offs >= n_range) & (offs < n_range + n_expert),
            other=0.0,
            volatile=True,
        )
        from_seen = tl.load(
            seen_ptr + (offs - n_range - n_expert),
            mask=(offs >= n_range + n_expert) & (offs < n_range + n_expert + NR),
            other=0,
            volatile=True,
        ).to(tl.float64)
        value = tl.where(
            offs < n_range, from_range, tl.where(offs < n_range + n_expert, from_expert, from_seen)
        )
        tl.store(mirror_ptr + offs, value, mask=offs < n_range + n_expert + NR)
