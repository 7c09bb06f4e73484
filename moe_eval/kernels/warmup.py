"""Compile every variant of the bundled Triton kernels a layer can run, before the server serves.

Triton compiles a kernel the first time it sees a new set of compile-time constants. vLLM warms
up with a few batch sizes (the profile run, the CUDA-graph capture sizes) and then watches for
compilation during inference (its JIT monitor logs "Triton kernel JIT compilation during
inference: <kernel>"): a prefill of a size it never warmed up would compile there, a latency
spike in the middle of serving. `fused_moe.launch_plan` names everything that selects a compiled
variant (tile config, alignment variant); this module walks every token count up to the largest
the layer can see, keeps the first token count of each distinct plan, and runs the kernel once at
each. Usage (the plugin, after converting a layer's weights):

    report = precompile_fused_moe(weights, top_k=K, num_experts=E, expert_map_E=m, max_tokens=N)

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_eval.kernels.fused_moe import LaunchPlan, fused_moe, launch_plan
from moe_eval.kernels.tile_configs import MoeTileConfig


@dataclass(frozen=True)
class WarmupReport:
    variants: int  # distinct launch plans, each run once
    token_counts: tuple[int, ...]  # the token count that stood for each plan
    max_tokens: int
    seconds: float

    def as_dict(self) -> dict:
        return {
            "variants": self.variants,
            "max_tokens": self.max_tokens,
            "seconds": round(self.seconds, 2),
            "token_counts": list(self.token_counts),
        }


def distinct_plans(
    max_tokens: int, num_local_experts: int, F: int, D: int, top_k: int, device_name: str, itemsize: int = 2,
    tile_for: Callable[[int], MoeTileConfig | None] | None = None,
) -> dict[LaunchPlan, int]:  # fmt: skip
    """Each plan a call of 1..max_tokens tokens can follow, with the smallest token count that follows it.

    Every token count is looked at (about 10 us each): plans change at power-of-two slot counts,
    at the midpoints between tuned M values and where the alignment's chunking changes, and
    enumerating them by rule would be a second copy of the launcher's logic.
    """
    plans: dict[LaunchPlan, int] = {}
    for tokens in range(1, max_tokens + 1):
        config = tile_for(tokens) if tile_for is not None else None
        plans.setdefault(
            launch_plan(tokens, num_local_experts, F, D, top_k, device_name, config, itemsize), tokens
        )
    return plans


def precompile_fused_moe(
    w13_eFD: torch.Tensor,
    w2_eDF: torch.Tensor,
    *,
    top_k: int,
    num_experts: int,
    expert_map_E: torch.Tensor | None,
    apply_router_weight_on_input: bool,
    max_tokens: int,
    silu_slope: float = 1.0,
    tile_for: Callable[[int], MoeTileConfig | None] | None = None,
) -> WarmupReport:
    """Run `fused_moe` once per distinct plan on random routing (the outputs are thrown away). silu_slope,
    tile_for (tokens -> tiles in place of the tuned ones): the kernels a `--mutate` server runs."""
    started = time.monotonic()
    device = w13_eFD.device
    e, F2, D = w13_eFD.shape
    plans = distinct_plans(
        max_tokens, e, F2 // 2, D, top_k, torch.cuda.get_device_name(device), w13_eFD.element_size(), tile_for
    )
    generator = torch.Generator(device=device).manual_seed(0)
    for tokens in plans.values():
        hidden_TD = torch.randn(tokens, D, device=device, dtype=w13_eFD.dtype, generator=generator)
        scores_TE = torch.rand(tokens, num_experts, device=device, generator=generator)
        weights_TK, ids_TK = scores_TE.topk(top_k, dim=-1)
        fused_moe(
            hidden_TD,
            w13_eFD,
            w2_eDF,
            weights_TK.contiguous(),
            ids_TK.to(torch.int32).contiguous(),
            expert_map_E=expert_map_E,
            apply_router_weight_on_input=apply_router_weight_on_input,
            silu_slope=silu_slope,
            config=tile_for(tokens) if tile_for is not None else None,
        )
    torch.cuda.synchronize(device)
    # The buffers of the largest calls would otherwise stay reserved by the caching allocator and
    # count against the KV cache in vLLM's memory profile.
    torch.cuda.empty_cache()
    return WarmupReport(len(plans), tuple(plans.values()), max_tokens, time.monotonic() - started)
