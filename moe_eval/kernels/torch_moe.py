"""Torch MoE for the CPU server: slots sorted by expert, one GEMM pair per expert that got a slot.

Same contract as `fused_moe_ref` (see fused_moe.py), with a bf16 kernel's roundings: GEMMs on
bf16 operands summed in fp32, the GEMM2 input rounded to the weights' dtype, the output once.
No per-token Python work: the only loop is over the experts hit, at most e (8-16 on the tiny
models the CPU server runs). Usage:

    out_TD = torch_moe(hidden_TD, w13_eFD, w2_eDF, topk_weights_TK, topk_ids_TK)

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k,
S slots (T*K), V valid slots (those whose expert is on this rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_nn


def torch_moe(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    expert_map_E: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    silu_slope: float = 1.0,
) -> torch.Tensor:
    """silu_slope != 1: a deliberate bug (`--mutate silu_slope`): gate * sigmoid(silu_slope * gate) * up."""
    T, D = hidden_TD.shape
    e, F2, _ = w13_eFD.shape
    F = F2 // 2
    K = topk_ids_TK.shape[1]
    dtype = hidden_TD.dtype
    assert w13_eFD.shape == (e, 2 * F, D) and w2_eDF.shape == (e, D, F), "w13 (e, 2F, D), w2 (e, D, F)"
    assert topk_ids_TK.shape == (T, K) and topk_weights_TK.shape == (T, K), "topk shapes must be (T, K)"
    out_TD = torch.zeros(T, D, dtype=torch.float32, device=hidden_TD.device)
    if T == 0:
        return out_TD.to(dtype)

    local_S = topk_ids_TK.reshape(-1).long()
    if expert_map_E is not None:
        local_S = expert_map_E.long()[local_S]
    # Stable sort keeps each expert's slots in token order; slots of other ranks (-1) sort first
    # and are dropped by starting after them.
    order_S = torch.argsort(local_S, stable=True)
    counts = torch.bincount(local_S + 1, minlength=e + 1).tolist()  # counts[0]: slots of other ranks
    order_V = order_S[counts[0] :]
    token_V = order_V // K
    weight_V1 = topk_weights_TK.reshape(-1)[order_V].float()[:, None]
    x_VD = hidden_TD[token_V]
    if apply_router_weight_on_input:
        x_VD = (x_VD.float() * weight_V1).to(dtype)

    # Each GEMM takes bf16 operands and sums in fp32, as a tensor core (and the bundled Triton kernel) does:
    # the operands are upcast per expert (a product of two bf16 values is exact in fp32). Only the GEMM2
    # input h is rounded to the model's dtype in between, and the output once at the end. (Until 2026-11-30
    # both GEMMs ran in bf16, rounding gate/up and each expert's output too: 13% more error against the
    # exact golden than vLLM's CPU kernel, which the golden gate failed; docs/logprob-gate.md.)
    y_VD = torch.empty(order_V.numel(), D, dtype=torch.float32, device=hidden_TD.device)
    start = 0
    for expert, n in enumerate(counts[1:]):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate_up_N2F = x_VD[rows].float() @ w13_eFD[expert].float().T
        gate_NF = gate_up_N2F[:, :F]
        act_NF = F_nn.silu(gate_NF) if silu_slope == 1.0 else gate_NF * torch.sigmoid(silu_slope * gate_NF)
        h_NF = (act_NF * gate_up_N2F[:, F:]).to(dtype)
        torch.matmul(h_NF.float(), w2_eDF[expert].float().T, out=y_VD[rows])
        start += n

    if not apply_router_weight_on_input:
        y_VD = y_VD * weight_V1
    out_TD.index_add_(0, token_V, y_VD)
    return out_TD.to(dtype)


def _grouped_mm():
    # torch.nn.functional.grouped_mm is the public name (torch 2.10+); torch._grouped_mm before it.
    return getattr(F_nn, "grouped_mm", None) or torch._grouped_mm


def grouped_mm_moe(
    hidden_TD: torch.Tensor,
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    expert_map_E: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """The torch grouped-GEMM MoE (the benchmark's peer): sort by expert, grouped GEMM, SiLU-and-mul,
    grouped GEMM, unpermute, sum. No host sync, so it can be captured in a CUDA graph.

    Same contract as `fused_moe_ref`. Needs bf16 on CUDA SM80+ (or a torch whose CPU grouped_mm
    exists: 2.13 has one), and D and F whose rows are multiples of 16 bytes (grouped_mm refuses
    others: "strides should be multiple of 16 bytes").
    """
    T, D = hidden_TD.shape
    e = w13_eFD.shape[0]
    F = w2_eDF.shape[2]
    K = topk_ids_TK.shape[1]
    dtype = hidden_TD.dtype
    local_S = topk_ids_TK.reshape(-1).long()
    if expert_map_E is not None:
        local_S = expert_map_E.long()[local_S]
    # Slots held elsewhere (-1) become expert e: sorted last, past offs[-1], so grouped_mm skips them.
    local_S = torch.where(local_S >= 0, local_S, e)
    order_S = torch.argsort(local_S, stable=True)
    counts_e = torch.zeros(e + 1, dtype=torch.int32, device=hidden_TD.device)
    counts_e.index_add_(0, local_S, torch.ones_like(local_S, dtype=torch.int32))
    offs_e = torch.cumsum(counts_e[:e], dim=0, dtype=torch.int32)
    token_S = order_S // K
    weight_S1 = topk_weights_TK.reshape(-1)[order_S].float()[:, None]
    valid_S1 = (local_S[order_S] < e)[:, None]
    x_SD = hidden_TD[token_S]
    if apply_router_weight_on_input:
        x_SD = (x_SD.float() * weight_S1).to(dtype)
    gate_up_S2F = _grouped_mm()(x_SD, w13_eFD.transpose(1, 2), offs=offs_e)
    h_SF = (F_nn.silu(gate_up_S2F[:, :F].float()) * gate_up_S2F[:, F:].float()).to(dtype)
    y_SD = _grouped_mm()(h_SF, w2_eDF.transpose(1, 2), offs=offs_e).float()
    if not apply_router_weight_on_input:
        y_SD = y_SD * weight_S1
    # Rows past offs[-1] were never computed: select zeros there (where, not multiply: they may be NaN).
    y_SD = torch.where(valid_S1, y_SD, 0.0)
    out_TD = torch.zeros(T, D, dtype=torch.float32, device=hidden_TD.device)
    out_TD.index_add_(0, token_S, y_SD)
    return out_TD.to(dtype)
