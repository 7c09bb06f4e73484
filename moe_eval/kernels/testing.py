"""Random MoE inputs for tests, the tuner and the benchmark (fresh, non-zero, reproducible from a seed).

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_eval.kernels.moe_call import MoeBackend, MoeCall, MoeOptions, Routing
from moe_eval.kernels.tile_configs import MoeShape


@dataclass
class MoeCase:
    hidden_TD: torch.Tensor
    w13_eFD: torch.Tensor
    w2_eDF: torch.Tensor
    topk_weights_TK: torch.Tensor
    topk_ids_TK: torch.Tensor
    expert_map_E: torch.Tensor | None = None
    apply_router_weight_on_input: bool = False

    def args(self) -> tuple:
        return self.hidden_TD, self.w13_eFD, self.w2_eDF, self.topk_weights_TK, self.topk_ids_TK

    def kwargs(self) -> dict:
        return {
            "expert_map_E": self.expert_map_E,
            "apply_router_weight_on_input": self.apply_router_weight_on_input,
        }

    def call(self, backend: MoeBackend = MoeBackend.TORCH) -> MoeCall:
        """The case as one MoeCall, its weights converted to `backend`'s layout."""
        from moe_eval.kernels.backends import BACKENDS

        weights = BACKENDS[MoeBackend(backend)].to_kernel_format(self.w13_eFD, self.w2_eDF)
        routing = Routing(self.topk_weights_TK, self.topk_ids_TK)
        return MoeCall(
            self.hidden_TD, weights, routing, self.expert_map_E, MoeOptions(self.apply_router_weight_on_input)
        )

    def reference_fp32(self) -> torch.Tensor:
        """fused_moe_ref on the same (already rounded) inputs upcast to fp32: fp32 output."""
        from moe_eval.kernels.fused_moe import fused_moe_ref

        return fused_moe_ref(
            self.hidden_TD.float(), self.w13_eFD.float(), self.w2_eDF.float(), self.topk_weights_TK,
            self.topk_ids_TK, **self.kwargs(),
        )  # fmt: skip


def make_case(
    T: int,
    E: int,
    K: int,
    D: int,
    F: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    local_experts: list[int] | None = None,
    topk_ids_TK: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    weights_from: MoeCase | None = None,
) -> MoeCase:
    """Softmax-top-K routing over E experts (distinct per token, renormalised weights).

    local_experts: global ids held on this rank, in slot order; the others map to -1.
    weights_from: reuse that case's expert weights (benchmarks rotate tokens, not 4 GB of weights).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    e = E if local_experts is None else len(local_experts)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    hidden_TD = randn(T, D)
    # 1/sqrt(fan-in) keeps gate/up and y near unit scale, so relative errors mean what they say.
    if weights_from is None:
        w13_eFD = randn(e, 2 * F, D, scale=D**-0.5)
        w2_eDF = randn(e, D, F, scale=F**-0.5)
    else:
        w13_eFD, w2_eDF = weights_from.w13_eFD, weights_from.w2_eDF
    logits_TE = torch.randn(T, E, generator=g, device=device)
    top_TK, ids_TK = logits_TE.softmax(dim=-1).topk(K, dim=-1)
    if topk_ids_TK is None:
        topk_ids_TK = ids_TK.to(torch.int32)
    topk_weights_TK = (top_TK / top_TK.sum(dim=-1, keepdim=True)).float().contiguous()
    expert_map_E = None
    if local_experts is not None:
        expert_map_E = torch.full((E,), -1, dtype=torch.int32, device=device)
        expert_map_E[torch.tensor(local_experts, device=device)] = torch.arange(
            e, dtype=torch.int32, device=device
        )
    return MoeCase(
        hidden_TD, w13_eFD, w2_eDF, topk_weights_TK, topk_ids_TK.contiguous(), expert_map_E,
        apply_router_weight_on_input,
    )  # fmt: skip


def shape_case(
    shape: MoeShape,
    M: int,
    *,
    seed: int,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    weights_from: MoeCase | None = None,
) -> MoeCase:
    """A case at one shipped per-rank shape; EP layouts hold the last e of E experts (rank 1)."""
    local = None
    if shape.local_experts != shape.num_experts:
        local = list(range(shape.num_experts - shape.local_experts, shape.num_experts))
    return make_case(
        M, shape.num_experts, shape.top_k, shape.D, shape.F, dtype=dtype, device=device, seed=seed,
        local_experts=local, apply_router_weight_on_input=shape.apply_router_weight_on_input,
        weights_from=weights_from,
    )  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||. Against an all-zero reference (under EP, tokens whose experts all live on
    another rank) the ratio would be 0 / 0: then ||out||, which is 0 only for an exactly zero output."""
    diff = (out.float() - ref.float()).norm()
    ref_norm = ref.float().norm()
    return (diff / ref_norm if ref_norm > 0 else diff).item()
