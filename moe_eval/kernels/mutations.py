"""Deliberate kernel bugs, for users who want to know whether their gate would catch one.

`moe-eval run --mutate NAME` makes the bundled kernel inside the server compute something
plausible but wrong; a gate that passes anyway is too weak to protect that kernel. Each
mutation wraps the call (weights, routing or expert map), never the kernel code itself, so it
applies to every backend alike.
"""

from __future__ import annotations

from typing import Any

MUTATIONS = {
    "swap_gate_up": "w13's halves swapped: silu applied to the up projection, the gate used linearly",
    "ignore_routing_weights": "each expert's output added with weight 1 instead of its routing weight",
    "shift_expert_ids": "every token routed to the expert after the chosen one (id + 1 mod E)",
    "ignore_expert_map": "EP only: global expert ids used as local slots (mod e); other ranks' experts not masked",
}


def check_mutation(name: str, config: Any) -> None:
    """Refuse (ConfigError) a mutation that cannot apply to this config."""
    from moe_eval.errors import ConfigError

    if name not in MUTATIONS:
        raise ConfigError(f"--mutate: value '{name}' is not one of {', '.join(MUTATIONS)}")
    if config.moe_backend is None:
        raise ConfigError(f"--mutate {name}: {config.path} runs vLLM's own MoE kernel (no moe_backend); "
                          "mutations apply to the bundled kernels only")
    if name == "ignore_expert_map" and not config.layout.expert_parallel:
        raise ConfigError(f"--mutate {name}: {config.path} has layout {config.layout.describe()}, which has no "
                          "expert map; use a TEP or DEP config")


def mutate_weights(name: str | None, w13_eFD: Any) -> Any:
    """Applied once, to the checkpoint-layout w13 before conversion."""
    if name != "swap_gate_up":
        return w13_eFD
    from moe_eval.kernels.flashinfer_cutlass import swap_w13_halves  # the same swap FlashInfer's layout needs

    return swap_w13_halves(w13_eFD)


def mutate_call(name: str | None, topk_weights_TK: Any, topk_ids_TK: Any, expert_map_E: Any,
                num_local_experts: int) -> tuple[Any, Any, Any]:
    """Applied on every call, to the routing vLLM hands apply()."""
    import torch

    if name == "ignore_routing_weights":
        topk_weights_TK = torch.ones_like(topk_weights_TK)
    elif name == "shift_expert_ids":
        num_experts = expert_map_E.numel() if expert_map_E is not None else num_local_experts
        topk_ids_TK = ((topk_ids_TK.long() + 1) % num_experts).to(topk_ids_TK.dtype)
    elif name == "ignore_expert_map" and expert_map_E is not None:
        topk_ids_TK = (topk_ids_TK.long() % num_local_experts).to(topk_ids_TK.dtype)
        expert_map_E = None
    return topk_weights_TK, topk_ids_TK.contiguous(), expert_map_E
