"""Adapter for FlashInfer's CUTLASS fused MoE (BF16): weight layout, lazy import, clear errors.

FlashInfer's `cutlass_fused_moe` (0.7.0.post1) wants w13 with its halves swapped per expert,
[up; gate] ("w31"); unswapped weights give a relative error of 0.75 (measured on the H200, see
shared/notes/flashinfer-h200.md). It has no expert map: it skips experts outside this rank's
range [ep_rank * e, (ep_rank + 1) * e), so slots of experts held elsewhere are sent to id e
with ep_size=2, ep_rank=0, where a second rank would own them. It has no
apply_router_weight_on_input either: for K = 1 the weight is applied to x here, in fp32.

Checked on the H200 against fused_moe_ref at Qwen3-30B-A3B TP1 and TEP2 (expert map) and
Mixtral-8x7B TP2, M in {1, 64, 1024, 8192}: relative error 3.8e-3..3.9e-3 (docs/flashinfer.md).
The first call JIT-builds its CUTLASS module (429 s for the BF16-only sources there). Usage:

    w31 = to_flashinfer_w31(w13_eFD)
    out_TD = flashinfer_cutlass_moe(hidden_TD, w31, w2_eDF, topk_weights_TK, topk_ids_TK)

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import importlib.util

import torch


class FlashInferUnavailable(RuntimeError):
    """FlashInfer or a GPU it supports (SM90 or newer) is missing."""


MIN_COMPUTE_CAPABILITY = (9, 0)


def flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def swap_w13_halves(w_eFD: torch.Tensor) -> torch.Tensor:
    """[gate; up] <-> [up; gate] per expert. Its own inverse."""
    F = w_eFD.shape[1] // 2
    assert w_eFD.shape[1] == 2 * F, f"w13 rows must be even, got {w_eFD.shape[1]}"
    return torch.cat([w_eFD[:, F:], w_eFD[:, :F]], dim=1).contiguous()


def to_flashinfer_w31(w13_eFD: torch.Tensor) -> torch.Tensor:
    return swap_w13_halves(w13_eFD)


def from_flashinfer_w31(w31_eFD: torch.Tensor) -> torch.Tensor:
    return swap_w13_halves(w31_eFD)


def ep_size_for(expert_map: bool) -> int:
    """FlashInfer's ep_size in this adapter's calls (always ep_rank 0): 2 with an expert map, where
    the slots of experts held elsewhere go to id e, owned by a phantom rank 1 (ids [e, 2e)) that
    FlashInfer skips on rank 0; else 1."""
    return 2 if expert_map else 1


def workspace_bytes(
    max_tokens: int, hidden: int, intermediate: int, local_experts: int, top_k: int, *, expert_map: bool
) -> int:
    """Bytes of the `workspace` that `flashinfer_cutlass_moe` takes for up to `max_tokens` tokens
    (FlashInfer's `cutlass_fused_moe_workspace_size` with this adapter's ep_size and dtypes)."""
    from flashinfer.fused_moe import cutlass_fused_moe_workspace_size  # lazy (seconds to import)

    ep_size = ep_size_for(expert_map)
    return cutlass_fused_moe_workspace_size(
        max_tokens, hidden, intermediate, local_experts * ep_size, top_k,
        x_dtype=torch.bfloat16, weight_dtype=torch.bfloat16, ep_size=ep_size, ep_rank=0,
    )  # fmt: skip


def new_workspace(
    max_tokens: int,
    hidden: int,
    intermediate: int,
    local_experts: int,
    top_k: int,
    *,
    expert_map: bool,
    device: torch.device | str = "cuda",
) -> torch.Tensor:
    """An uninitialised uint8 workspace of `workspace_bytes(...)` for `flashinfer_cutlass_moe`."""
    size = workspace_bytes(max_tokens, hidden, intermediate, local_experts, top_k, expert_map=expert_map)
    return torch.empty(size, dtype=torch.uint8, device=device)


def check_flashinfer_supported(device: torch.device) -> None:
    if device.type != "cuda":
        raise FlashInferUnavailable(f"FlashInfer CUTLASS MoE needs a CUDA GPU; tensors are on {device}")
    cc = torch.cuda.get_device_capability(device)
    if cc < MIN_COMPUTE_CAPABILITY:
        raise FlashInferUnavailable(
            f"FlashInfer CUTLASS MoE (BF16) needs SM90 or newer; "
            f"{torch.cuda.get_device_name(device)} is SM{cc[0]}{cc[1]}"
        )
    if not flashinfer_importable():
        raise FlashInferUnavailable(
            "flashinfer is not installed: pip install 'moe-eval[gpu]' (flashinfer-python==0.7.0.post1)"
        )


def flashinfer_cutlass_moe(
    hidden_TD: torch.Tensor,
    w31_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    *,
    expert_map_E: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    tune_max_num_tokens: int | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """FlashInfer CUTLASS fused MoE on weights already converted by `to_flashinfer_w31`.

    Pass `workspace` (from `new_workspace`, or sized with `workspace_bytes`) to capture the
    call in a CUDA graph: without it FlashInfer allocates per call. `tune_max_num_tokens` is the
    largest token count its autotuner profiles (FlashInfer's default: 8192). `enable_pdl`:
    programmatic dependent launch (FlashInfer's default: on where the GPU has it, SM90+).
    """
    check_flashinfer_supported(hidden_TD.device)
    from flashinfer.fused_moe import cutlass_fused_moe  # lazy: importing flashinfer costs seconds

    e = w31_eFD.shape[0]
    K = topk_ids_TK.shape[1]
    assert hidden_TD.dtype == torch.bfloat16, "this adapter is BF16-only (the JIT module is built for BF16)"
    ids_TK = topk_ids_TK.int()
    ep_size, ep_rank = ep_size_for(expert_map_E is not None), 0
    if expert_map_E is not None:
        local_TK = expert_map_E[topk_ids_TK.long()]
        ids_TK = torch.where(local_TK >= 0, local_TK, e).int()  # e: the phantom rank 1's first id
    weights_TK = topk_weights_TK.float()
    if apply_router_weight_on_input:
        if K != 1:
            raise ValueError(
                "apply_router_weight_on_input with FlashInfer needs top-k 1 (weight folded into x)"
            )
        hidden_TD = (hidden_TD.float() * weights_TK).to(hidden_TD.dtype)
        weights_TK = torch.ones_like(weights_TK)
    kwargs = {"output": out, "ep_size": ep_size, "ep_rank": ep_rank}
    if workspace is not None:
        kwargs["workspace_buffer"] = workspace
    if tune_max_num_tokens is not None:
        kwargs["tune_max_num_tokens"] = tune_max_num_tokens
    if enable_pdl is not None:
        kwargs["enable_pdl"] = enable_pdl
    result = cutlass_fused_moe(
        hidden_TD, ids_TK, weights_TK, w31_eFD, w2_eDF, hidden_TD.dtype, quant_scales=[], **kwargs
    )
    return result[0] if isinstance(result, (list, tuple)) else result
