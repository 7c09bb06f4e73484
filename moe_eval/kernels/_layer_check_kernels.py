"""Triton bodies of the layer check on a CUDA device (moe_eval.kernels.layer_check holds the launcher;
moe_eval.kernels.layer_check_ref the torch definition these kernels must agree with).

Five launches per MoE call, in stream order, with no host work (a captured call is checked when its graph
replays, its rows decided on the device at each replay):

1. `_pick_rows_kernel` (one program): counts the call, decides which rows it compares
   (layer_check_ref.pick_rows: spread rows on a background call, else the rows whose experts still lack
   slots in this layer and range) and writes them and their count;
2. `_exact_h_kernel`: per compared (row, slot) and F block, h = silu(g) u and the SiLU slope direction's
   g^2 sigmoid(g) (1 - sigmoid(g)) u, exact (fp32, IEEE: elementwise products and tl.sum, no tensor cores);
3. `_exact_y_kernel`: per (row, slot) and D block, y = W2 h, the incumbent's q = bf16(W2 bf16(h)) and
   v = W2 (slope direction), routing weight included;
4. `_row_stats_kernel` (one program a row): the row's joint least squares (the K x K Gram of its slot
   outputs inverted by Gauss-Jordan, each slot's direction made orthogonal to the others, the activation
   direction to all of them) and the sums against the served output, in fp64;
5. `_accumulate_kernel` (one program): adds each row's sums into the layer's tables on the device and writes
   every cell it changed to the layer's host mirror (pinned memory the flusher thread reads).

Kernels 2-5 read the row count first and return at once when it is 0, so a call that compares nothing costs
the pick and four near-empty launches; so does a captured call replayed while the check is paused.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k, R compared rows
(at most CAP), NR dispatch ranges, NF cell fields, NRF row fields.
"""

from __future__ import annotations

import triton
import triton.language as tl

ROW_STRIDE = tl.constexpr(7919)  # layer_check_ref.ROW_STRIDE


@triton.jit(do_not_specialize=["T", "range_index", "cap", "burst", "period", "target"])
def _pick_rows_kernel(
    seen_ptr,  # (NR,) int64: this layer's calls per range, every call
    seen_mirror_ptr,  # (NR,) int64 pinned host copy
    cells_ptr,  # (NR, E, NF) fp64: this layer's cells (field 0: slots)
    routed_ptr,  # (NR, E) int64: this layer's routed slots per expert, every call
    routed_mirror_ptr,  # (NR, E) int64 pinned host copy
    topk_ids_ptr,  # (T, K) int32, global expert ids
    expert_map_ptr,  # (E,) int32, local slot or -1 (unused without HAS_MAP)
    rows_ptr,  # (CAP,) int32 out: the compared rows
    count_ptr,  # (1,) int32 out: how many
    paused_ptr,  # (1,) int32, host memory the host writes: nonzero, the call is neither counted nor compared
    T,
    E,
    range_index,
    cap,
    burst,
    period,
    target,
    K: tl.constexpr,
    NF: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_CAP: tl.constexpr,
    BLOCK_E: tl.constexpr,  # > E: the histogram's last bins take the slots of other ranks
):
    # Paused (the speed measurement's timed requests, LayerCheck.set_paused): read at every replay of a
    # captured call; the call then has no rows, so nothing is counted and kernels 2-5 return at once.
    active = tl.load(paused_ptr, volatile=True) == 0
    T = tl.where(active, T, 0)
    # One program, one stream: the layers' calls run in order, so the counters need no atomic.
    seen = tl.load(seen_ptr + range_index)
    tl.store(seen_ptr + range_index, seen + active.to(tl.int64))
    tl.store(seen_mirror_ptr + range_index, seen + active.to(tl.int64))
    count = tl.minimum(T, cap)
    searching = (seen >= burst) & ((seen % period) != 0)  # not a background call: needy rows
    start = (seen * ROW_STRIDE) % tl.maximum(T, 1)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_e = tl.arange(0, BLOCK_E)
    routed = tl.zeros((BLOCK_E,), dtype=tl.int32)
    room = tl.where(searching, count, 0)  # rows the search may write (none on a background call)
    picked = 0
    # Every row: the routing counts; on a call that is not a background one, also the needy rows in order
    # from `start` (layer_check_ref.pick_rows).
    for c0 in range(0, T, BLOCK_T):
        pos = c0 + tl.arange(0, BLOCK_T)
        in_call = pos < T
        t = ((start + pos) % T).to(tl.int32)
        mask = in_call[:, None] & mask_k[None, :]
        experts = tl.load(topk_ids_ptr + t[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask, other=0)
        held = mask
        if HAS_MAP:
            local = tl.load(expert_map_ptr + experts, mask=mask, other=-1)
            held = mask & (local >= 0)
        routed += tl.histogram(tl.reshape(tl.where(held, experts, E), (BLOCK_T * BLOCK_K,)), BLOCK_E)
        slots = tl.load(cells_ptr + (range_index * E + experts) * NF, mask=held, other=1e300)
        needy = (tl.max((held & (slots < target)).to(tl.int32), axis=1) > 0) & in_call
        position = tl.cumsum(needy.to(tl.int32), axis=0) - 1 + picked
        tl.store(rows_ptr + position, t, mask=needy & (position < room))
        picked += tl.sum(needy.to(tl.int32), axis=0)
    routed64 = routed.to(tl.int64)
    old = tl.atomic_add(routed_ptr + range_index * E + offs_e, routed64, mask=offs_e < E)
    tl.store(routed_mirror_ptr + range_index * E + offs_e, old + routed64, mask=offs_e < E)
    if searching:
        tl.store(count_ptr, tl.minimum(picked, count))
    else:
        offs = tl.arange(0, BLOCK_CAP)
        step = tl.maximum(count - 1, 1)
        spread = tl.where(count > 1, (offs * (T - 1)) // step, 0)
        tl.store(rows_ptr + offs, spread.to(tl.int32), mask=offs < count)
        tl.store(count_ptr, count)


@triton.jit
def _slot_expert(count_ptr, rows_ptr, topk_ids_ptr, expert_map_ptr, K: tl.constexpr, HAS_MAP: tl.constexpr):
    """For program (r * K + k): (r, k, row, global expert, local slot; local < 0 or r >= count: nothing)."""
    rk = tl.program_id(0)
    r = rk // K
    k = rk % K
    count = tl.load(count_ptr)
    row = tl.load(rows_ptr + r, mask=r < count, other=0)
    expert = tl.load(topk_ids_ptr + row.to(tl.int64) * K + k)
    local = expert
    if HAS_MAP:
        local = tl.load(expert_map_ptr + expert)
    local = tl.where(r < count, local, -1)
    return r, k, row, expert, local


@triton.jit(do_not_specialize=["T"])
def _exact_h_kernel(
    count_ptr,  # (1,) int32
    rows_ptr,  # (CAP,) int32
    x_ptr,  # (T, D) bf16/fp16
    topk_ids_ptr,  # (T, K) int32
    topk_w_ptr,  # (T, K) fp32
    expert_map_ptr,  # (E,) int32
    w13_ptr,  # (e, 2F, D) bf16: [gate; up] per local expert, as vLLM loaded it
    h_ptr,  # (CAP, K, F) fp32 out: silu(g) * u, exact
    hs_ptr,  # (CAP, K, F) fp32 out: g^2 sigmoid(g) (1 - sigmoid(g)) u, the SiLU slope direction
    T,
    D,
    F,
    stride_w13_e,
    stride_w13_f,
    K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r, k, row, expert, local = _slot_expert(count_ptr, rows_ptr, topk_ids_ptr, expert_map_ptr, K, HAS_MAP)
    if local < 0:
        return  # not compared, or another rank's expert: _exact_y_kernel writes its zeros
    weight = tl.load(topk_w_ptr + row.to(tl.int64) * K + k)
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = offs_f < F
    # int64: e * 2F * D passes 2**31 at real shapes.
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
    sig = 1.0 / (1.0 + tl.exp(-acc_gate))
    h = acc_gate * sig * acc_up
    hs = acc_gate * acc_gate * sig * (1.0 - sig) * acc_up
    tl.store(h_ptr + (r * K + k) * F + offs_f, h, mask=mask_f)
    tl.store(hs_ptr + (r * K + k) * F + offs_f, hs, mask=mask_f)


@triton.jit(do_not_specialize=["T"])
def _exact_y_kernel(
    count_ptr,  # (1,) int32
    rows_ptr,  # (CAP,) int32
    topk_ids_ptr,  # (T, K) int32
    topk_w_ptr,  # (T, K) fp32
    expert_map_ptr,  # (E,) int32
    w2_ptr,  # (e, D, F) bf16
    h_ptr,  # (CAP, K, F) fp32
    hs_ptr,  # (CAP, K, F) fp32
    y_ptr,  # (CAP, K, D) fp32 out: the exact contribution of the slot, routing weight included
    q_ptr,  # (CAP, K, D) fp32 out: the incumbent's slot output (h rounded to bf16, the output rounded too)
    v_ptr,  # (CAP, K, D) fp32 out: the SiLU slope direction of the slot
    T,
    D,
    F,
    stride_w2_e,
    stride_w2_d,
    K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r, k, row, expert, local = _slot_expert(count_ptr, rows_ptr, topk_ids_ptr, expert_map_ptr, K, HAS_MAP)
    if r >= tl.load(count_ptr):
        return
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    out = (r * K + k) * D + offs_d
    if local < 0:
        zero = tl.zeros((BLOCK_D,), dtype=tl.float32)
        tl.store(y_ptr + out, zero, mask=mask_d)
        tl.store(q_ptr + out, zero, mask=mask_d)
        tl.store(v_ptr + out, zero, mask=mask_d)
        return
    weight = tl.load(topk_w_ptr + row.to(tl.int64) * K + k)
    w_base = w2_ptr + local.to(tl.int64) * stride_w2_e
    acc_y = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc_q = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc_v = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        mask_f = offs_f < F
        h = tl.load(h_ptr + (r * K + k) * F + offs_f, mask=mask_f, other=0.0)
        hs = tl.load(hs_ptr + (r * K + k) * F + offs_f, mask=mask_f, other=0.0)
        h_rounded = h.to(tl.bfloat16).to(tl.float32)
        w2 = tl.load(
            w_base + offs_d[:, None].to(tl.int64) * stride_w2_d + offs_f[None, :],
            mask=mask_d[:, None] & mask_f[None, :],
            other=0.0,
        ).to(tl.float32)
        acc_y += tl.sum(w2 * h[None, :], axis=1)
        acc_q += tl.sum(w2 * h_rounded[None, :], axis=1)
        acc_v += tl.sum(w2 * hs[None, :], axis=1)
    if not WEIGHT_ON_INPUT:
        acc_y = acc_y * weight
        acc_q = acc_q * weight
        acc_v = acc_v * weight
    acc_q = acc_q.to(tl.bfloat16).to(tl.float32)  # the incumbent stores each slot's output in bf16
    tl.store(y_ptr + out, acc_y, mask=mask_d)
    tl.store(q_ptr + out, acc_q, mask=mask_d)
    tl.store(v_ptr + out, acc_v, mask=mask_d)


@triton.jit
def _finite(x):
    return (x - x) == 0.0  # NaN - NaN and inf - inf are NaN, which equals nothing


@triton.jit
def _inverse(A, BLOCK_K: tl.constexpr):
    """Gauss-Jordan inverse of a symmetric positive definite (BLOCK_K, BLOCK_K) fp64 tile (no pivoting: the
    diagonal of an SPD matrix stays positive through the elimination)."""
    ri = tl.arange(0, BLOCK_K)[:, None]
    ci = tl.arange(0, BLOCK_K)[None, :]
    inv = tl.where(ri == ci, 1.0, 0.0).to(tl.float64)
    for p in tl.static_range(BLOCK_K):
        on_row = ri == p
        on_col = ci == p
        pivot = tl.sum(tl.sum(tl.where(on_row & on_col, A, 0.0), axis=1), axis=0)
        row_a = tl.sum(tl.where(on_row, A, 0.0), axis=0) / pivot
        row_i = tl.sum(tl.where(on_row, inv, 0.0), axis=0) / pivot
        col = tl.sum(tl.where(on_col, A, 0.0), axis=1)
        factor = tl.where(tl.arange(0, BLOCK_K) == p, 0.0, col)
        A = A - factor[:, None] * row_a[None, :]
        inv = inv - factor[:, None] * row_i[None, :]
        A = tl.where(on_row, row_a[None, :], A)
        inv = tl.where(on_row, row_i[None, :], inv)
    return inv


@triton.jit(do_not_specialize=["T"])
def _row_stats_kernel(
    count_ptr,  # (1,) int32
    rows_ptr,  # (CAP,) int32
    out_ptr,  # (T, D) bf16/fp16: what the served kernel returned
    topk_ids_ptr,  # (T, K) int32
    expert_map_ptr,  # (E,) int32
    y_ptr,  # (CAP, K, D) fp32
    q_ptr,  # (CAP, K, D) fp32
    v_ptr,  # (CAP, K, D) fp32
    result_ptr,  # (CAP, NRES) fp64 out: [K x 6 slot sums][K valid flags][11 row sums]
    T,
    D,
    K: tl.constexpr,
    NRES: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    if r >= tl.load(count_ptr):
        return
    row = tl.load(rows_ptr + r).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    experts = tl.load(topk_ids_ptr + row * K + offs_k, mask=mask_k, other=0)
    held = mask_k
    if HAS_MAP:
        held = mask_k & (tl.load(expert_map_ptr + experts, mask=mask_k, other=-1) >= 0)
    base = (r * K + offs_k[:, None]) * D
    # Pass 1: the Gram of the slot outputs and their products with the activation direction.
    gram = tl.zeros((BLOCK_K, BLOCK_K), dtype=tl.float64)
    y_v = tl.zeros((BLOCK_K,), dtype=tl.float64)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = held[:, None] & (offs_d < D)[None, :]
        y = tl.load(y_ptr + base + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + base + offs_d[None, :], mask=mask, other=0.0)
        ok = (offs_d < D) & _finite(tl.sum(y, axis=0))
        y64 = tl.where(ok[None, :], y, 0.0).to(tl.float64)
        v64 = tl.where(ok, tl.sum(v, axis=0), 0.0).to(tl.float64)
        gram += tl.sum(y64[:, None, :] * y64[None, :, :], axis=2)
        y_v += tl.sum(y64 * v64[None, :], axis=1)
    ri = offs_k[:, None]
    ci = offs_k[None, :]
    diag = tl.sum(tl.where(ri == ci, gram, 0.0), axis=1)
    valid = held & (diag > 0)
    pair = valid[:, None] & valid[None, :]
    gram = tl.where(pair, gram, 0.0) + tl.where((ri == ci) & (valid[:, None] == 0), 1.0, 0.0)
    inv = _inverse(gram, BLOCK_K)
    inv_diag = tl.sum(tl.where(ri == ci, inv, 0.0), axis=1)
    scale = tl.where(valid, 1.0 / tl.where(valid, inv_diag, 1.0), 0.0)
    coef = tl.where(valid, tl.sum(inv * y_v[None, :], axis=1), 0.0)
    # Pass 2: each slot's direction y~ = (G^-1 Y)_k / (G^-1)_kk and the activation's V~ = V - sum_k c_k y_k,
    # against the residuals.
    a = tl.zeros((BLOCK_K,), dtype=tl.float64)
    b = tl.zeros((BLOCK_K,), dtype=tl.float64)
    vb = tl.zeros((BLOCK_K,), dtype=tl.float64)
    a_inc = tl.zeros((BLOCK_K,), dtype=tl.float64)
    vd = tl.zeros((BLOCK_K,), dtype=tl.float64)
    vd2 = tl.zeros((BLOCK_K,), dtype=tl.float64)
    # Row sums as fp64 vectors over D, reduced once at the end.
    sq_res = tl.zeros((BLOCK_D,), dtype=tl.float64)
    sq_exact = tl.zeros((BLOCK_D,), dtype=tl.float64)
    sq_inc = tl.zeros((BLOCK_D,), dtype=tl.float64)
    bad = tl.zeros((BLOCK_D,), dtype=tl.float64)
    sa = tl.zeros((BLOCK_D,), dtype=tl.float64)
    sb = tl.zeros((BLOCK_D,), dtype=tl.float64)
    svb = tl.zeros((BLOCK_D,), dtype=tl.float64)
    sa_inc = tl.zeros((BLOCK_D,), dtype=tl.float64)
    svd = tl.zeros((BLOCK_D,), dtype=tl.float64)
    svd2 = tl.zeros((BLOCK_D,), dtype=tl.float64)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mask = held[:, None] & mask_d[None, :]
        y = tl.load(y_ptr + base + offs_d[None, :], mask=mask, other=0.0)
        q = tl.load(q_ptr + base + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + base + offs_d[None, :], mask=mask, other=0.0)
        exact = tl.sum(y, axis=0)
        ref = tl.sum(q, axis=0).to(out_ptr.dtype.element_ty).to(tl.float32)
        served = tl.load(out_ptr + row * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        exact_ok = mask_d & _finite(exact)
        served_ok = _finite(served)
        keep = exact_ok & served_ok
        res = tl.where(keep, served - exact, 0.0).to(tl.float64)
        inc = tl.where(exact_ok, ref - exact, 0.0).to(tl.float64)
        diff = tl.where(keep, served - ref, 0.0).to(tl.float64)
        exact64 = tl.where(exact_ok, exact, 0.0).to(tl.float64)
        y64 = tl.where(exact_ok[None, :], y, 0.0).to(tl.float64)
        v64 = tl.where(exact_ok, tl.sum(v, axis=0), 0.0).to(tl.float64)
        yt = tl.sum(inv[:, :, None] * y64[None, :, :], axis=1) * scale[:, None]
        vt = v64 - tl.sum(coef[:, None] * y64, axis=0)
        a += tl.sum(yt * res[None, :], axis=1)
        b += tl.sum(yt * y64, axis=1)
        vb += tl.sum(yt * yt * res[None, :] * res[None, :], axis=1)
        a_inc += tl.sum(yt * inc[None, :], axis=1)
        terms = yt * yt * diff[None, :] * diff[None, :]
        vd += tl.sum(terms, axis=1)
        vd2 += tl.sum(terms * terms, axis=1)
        sq_res += res * res
        sq_exact += exact64 * exact64
        sq_inc += inc * inc
        bad += tl.where(exact_ok & (served_ok == 0), 1.0, 0.0).to(tl.float64)
        sa += vt * res
        sb += vt * v64
        svb += vt * vt * res * res
        sa_inc += vt * inc
        s_terms = vt * vt * diff * diff
        svd += s_terms
        svd2 += s_terms * s_terms
    out = result_ptr + r * NRES
    k6 = offs_k * 6
    tl.store(out + k6 + 0, tl.where(valid, a, 0.0), mask=mask_k)
    tl.store(out + k6 + 1, tl.where(valid, b, 0.0), mask=mask_k)
    tl.store(out + k6 + 2, tl.where(valid, vb, 0.0), mask=mask_k)
    tl.store(out + k6 + 3, tl.where(valid, a_inc, 0.0), mask=mask_k)
    tl.store(out + k6 + 4, tl.where(valid, vd, 0.0), mask=mask_k)
    tl.store(out + k6 + 5, tl.where(valid, vd2, 0.0), mask=mask_k)
    tl.store(out + 6 * K + offs_k, valid.to(tl.float64), mask=mask_k)
    offs_s = tl.arange(0, 16)
    sums = tl.where(offs_s == 0, 1.0, 0.0).to(tl.float64)  # rows
    sums = tl.where(offs_s == 1, tl.sum(sq_res, axis=0), sums)
    sums = tl.where(offs_s == 2, tl.sum(sq_exact, axis=0), sums)
    sums = tl.where(offs_s == 3, tl.sum(sq_inc, axis=0), sums)
    sums = tl.where(offs_s == 4, tl.sum(bad, axis=0), sums)
    sums = tl.where(offs_s == 5, tl.sum(sa, axis=0), sums)
    sums = tl.where(offs_s == 6, tl.sum(sb, axis=0), sums)
    sums = tl.where(offs_s == 7, tl.sum(svb, axis=0), sums)
    sums = tl.where(offs_s == 8, tl.sum(sa_inc, axis=0), sums)
    sums = tl.where(offs_s == 9, tl.sum(svd, axis=0), sums)
    sums = tl.where(offs_s == 10, tl.sum(svd2, axis=0), sums)
    tl.store(out + 7 * K + offs_s, sums, mask=offs_s < 11)


@triton.jit(do_not_specialize=["range_index"])
def _accumulate_kernel(
    count_ptr,  # (1,) int32
    rows_ptr,  # (CAP,) int32
    topk_ids_ptr,  # (T, K) int32
    result_ptr,  # (CAP, NRES) fp64 from _row_stats_kernel
    cells_ptr,  # (NR, E, NF) fp64: this layer's cells
    row_table_ptr,  # (NR, NRF) fp64: this layer's row sums
    cells_mirror_ptr,  # (NR, E, NF) fp64 pinned host copy
    row_mirror_ptr,  # (NR, NRF) fp64 pinned host copy
    E,
    range_index,
    K: tl.constexpr,
    NF: tl.constexpr,
    NRF: tl.constexpr,
    NRES: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    count = tl.load(count_ptr)
    if count == 0:
        return
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_s = tl.arange(0, 16)
    row_sums = tl.zeros((16,), dtype=tl.float64)
    for r in range(0, count):
        row = tl.load(rows_ptr + r).to(tl.int64)
        result = result_ptr + r * NRES
        experts = tl.load(topk_ids_ptr + row * K + offs_k, mask=mask_k, other=0)
        valid = mask_k & (tl.load(result + 6 * K + offs_k, mask=mask_k, other=0.0) > 0)
        cell = (range_index * E + experts) * NF
        one = tl.full((BLOCK_K,), 1.0, dtype=tl.float64)
        old = tl.atomic_add(cells_ptr + cell, one, mask=valid)
        tl.store(cells_mirror_ptr + cell, old + one, mask=valid)
        for f in tl.static_range(6):
            value = tl.load(result + offs_k * 6 + f, mask=mask_k, other=0.0)
            old = tl.atomic_add(cells_ptr + cell + 1 + f, value, mask=valid)
            tl.store(cells_mirror_ptr + cell + 1 + f, old + value, mask=valid)
        row_sums += tl.load(result + 7 * K + offs_s - 1, mask=(offs_s >= 1) & (offs_s < NRF), other=0.0)
        tl.debug_barrier()  # the next row may hold the same expert in another lane: its add sees this one
    row_sums = tl.where(offs_s == 0, 1.0, row_sums)  # one more sampled call
    where = range_index * NRF + offs_s
    old = tl.atomic_add(row_table_ptr + where, row_sums, mask=offs_s < NRF)
    tl.store(row_mirror_ptr + where, old + row_sums, mask=offs_s < NRF)
