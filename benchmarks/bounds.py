"""Practical bounds timed beside the kernels in the same interleaved run (issue 34): what the same work
costs a vendor GEMM, and what reading the same weights costs one launch.

  bound:grouped_mm_gemms  GEMM1 and GEMM2 of the call alone, torch's grouped GEMM (`torch._grouped_mm`,
                          on sm_90 the CUTLASS grouped GEMM torch ships) over the slots already sorted
                          by expert and h already made: no routing, no SiLU, no top-k sum. Where the
                          bundled whole call is near or under this, the roofline gap is the GEMMs'.
  bound:weights_read      one Triton launch reading the weights of the experts the call hits once
                          each (w13 and w2, 16-byte loads, a sum kept so nothing is optimised away):
                          the copy floor as one launch of this size really reaches it (ramp and tail
                          included), the decode target's practical form; `weights_read_c4k` and
                          `weights_read_c64k` cut it in other chunks (take the best of them).

No output of these is checked: they compute no MoE. Rows are named `bound:<name>`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from moe_eval.kernels.testing import MoeCase
from moe_eval.kernels.torch_moe import _grouped_mm


def _local_slots(case: MoeCase) -> torch.Tensor:
    e = case.w13_eFD.shape[0]
    local_S = case.topk_ids_TK.reshape(-1).long()
    if case.expert_map_E is not None:
        local_S = case.expert_map_E.long()[local_S]
    return torch.where(local_S >= 0, local_S, e)  # elsewhere: past the last group, skipped


def grouped_mm_gemms(case: MoeCase) -> Callable[[], object]:
    """The two GEMMs of the call on sorted inputs, made here (outside the timing)."""
    e, twoF, D = case.w13_eFD.shape
    F = twoF // 2
    local_S = _local_slots(case)
    order_S = torch.argsort(local_S, stable=True)
    counts = torch.bincount(local_S, minlength=e + 1)[:e]
    offs_e = torch.cumsum(counts, 0).to(torch.int32)
    x_SD = case.hidden_TD[order_S // case.topk_ids_TK.shape[1]].contiguous()
    h_SF = torch.randn(x_SD.shape[0], F, device=x_SD.device, dtype=x_SD.dtype) * 0.1
    w13_t, w2_t = case.w13_eFD.transpose(1, 2), case.w2_eDF.transpose(1, 2)
    mm = _grouped_mm()

    def call() -> None:
        mm(x_SD, w13_t, offs=offs_e)
        mm(h_SF, w2_t, offs=offs_e)

    return call


@triton.jit
def _read_experts_kernel(w13_ptr, w2_ptr, experts_ptr, out_ptr, w13_numel, w2_numel, stride13, stride2,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Program (chunk, expert): sum CHUNK elements of that expert's w13 then w2 (flattened)."""
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    expert = tl.load(experts_ptr + slot).to(tl.int64)
    start = pid.to(tl.int64) * CHUNK
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    total = w13_numel + w2_numel
    for off in tl.range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        in13 = idx < w13_numel
        in2 = (idx >= w13_numel) & (idx < total)
        a = tl.load(w13_ptr + expert * stride13 + idx, mask=in13, other=0.0)
        b = tl.load(w2_ptr + expert * stride2 + (idx - w13_numel), mask=in2, other=0.0)
        acc += a.to(tl.float32) + b.to(tl.float32)
    tl.store(out_ptr + slot * tl.num_programs(0) + pid, tl.sum(acc))


def weights_read(
    case: MoeCase, chunk: int = 16384, block: int = 2048, num_warps: int = 4
) -> Callable[[], object]:
    """One launch reading each hit expert's w13 and w2 once (the experts found here, outside the timing)."""
    e = case.w13_eFD.shape[0]
    local_S = _local_slots(case)
    experts = torch.unique(local_S[local_S < e]).to(torch.int32)
    w13, w2 = case.w13_eFD, case.w2_eDF
    assert w13[0].is_contiguous() and w2[0].is_contiguous(), (
        "the read walks each expert's weights as one block"
    )
    n13, n2 = w13[0].numel(), w2[0].numel()
    chunks = triton.cdiv(n13 + n2, chunk)
    out = torch.empty(max(len(experts), 1) * chunks, device=w13.device, dtype=torch.float32)

    def call() -> None:
        if len(experts):
            _read_experts_kernel[(chunks, len(experts))](
                w13, w2, experts, out, n13, n2, w13.stride(0), w2.stride(0),
                CHUNK=chunk, BLOCK=block, num_warps=num_warps,
            )  # fmt: skip

    return call


BOUNDS: dict[str, Callable[[MoeCase], Callable[[], object]]] = {
    "grouped_mm_gemms": grouped_mm_gemms,
    "weights_read": weights_read,
    # The same read cut otherwise, so the bound is the best of a few, not one kernel's accident.
    "weights_read_c4k": functools.partial(weights_read, chunk=4096, block=1024),
    "weights_read_c64k": functools.partial(weights_read, chunk=65536, block=4096, num_warps=8),
}
