"""The MoE call, stated once: what every bundled kernel computes from (`MoeCall`) and what a kernel is
(`MoeKernel`). Backends (moe_eval.kernels.backends), the oracle, the vLLM plugin, the --mutate bugs
(moe_eval.kernels.mutations) and the TEP / DEP combines (moe_eval.kernels.expert_parallel) all speak it.

    call = MoeCall(hidden_TD, weights, Routing(topk_weights_TK, topk_ids_TK), expert_map_E)
    out_TD = kernel.apply(call)

out_TD[t] = sum over k of topk_weights_TK[t, k] * expert(topk_ids_TK[t, k])(hidden_TD[t]), where
expert(x) = w2 @ (silu(gate @ x) * (up @ x)); under expert parallelism only the experts this rank holds
(expert_map_E[id] >= 0, their local slot) contribute, the others add 0.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class MoeBackend(str, enum.Enum):
    TRITON = "triton"  # moe_eval.kernels.fused_moe
    FLASHINFER_CUTLASS = "flashinfer_cutlass"  # moe_eval.kernels.flashinfer_cutlass
    TORCH = "torch"  # moe_eval.kernels.torch_moe
    # The golden MoE (moe_eval.kernels.reference_moe): exact fp32, never chosen by the oracle, never
    # mutated; only golden-reference servers ask for it (moe_eval.evaluate.golden).
    REFERENCE = "reference"


@dataclass(frozen=True)
class Hardware:
    """What a kernel and the oracle need to know about the machine, as plain values (tests build these by
    hand; moe_eval.kernels.oracle.detect_hardware reads them)."""

    platform: str  # "cuda", "cpu", or anything else (the oracle rejects it by name)
    device_name: str  # "NVIDIA H200", "cpu", ...
    compute_capability: tuple[int, int] | None  # (9, 0) on Hopper; None off CUDA
    triton_available: bool
    flashinfer_available: bool


@dataclass(frozen=True)
class MoeWeights:
    """Expert weights in the layout `backend` wants (MoeKernel.to_kernel_format): w13_eFD is [gate; up] per
    expert, [up; gate] for FlashInfer; w2_eDF is [e, D, F]."""

    backend: MoeBackend
    w13_eFD: torch.Tensor
    w2_eDF: torch.Tensor


@dataclass(frozen=True)
class Routing:
    """Each token's K experts (global ids) and their weights."""

    weights_TK: torch.Tensor
    ids_TK: torch.Tensor


@dataclass(frozen=True)
class MoeOptions:
    apply_router_weight_on_input: bool = False  # the weight scales x before the experts (Llama 4), not y
    # Set by --mutate only (moe_eval.kernels.mutations): a kernel that cannot honour one refuses it there.
    silu_slope: float = 1.0  # silu_slope: gate * sigmoid(slope * gate) * up (Triton, torch)
    tile_config: Any = None  # the perf mutations' tiles, a fused_moe.MoeTileConfig (Triton)


@dataclass(frozen=True)
class MoeCall:
    """One MoE layer's routed-expert computation, as the plugin hands it to the kernel."""

    hidden_TD: torch.Tensor
    weights: MoeWeights
    routing: Routing
    expert_map_E: torch.Tensor | None = None  # global id -> local slot, -1 held elsewhere; None: all here
    options: MoeOptions = field(default_factory=MoeOptions)


class MoeKernel(Protocol):
    """A bundled MoE kernel: its name, whether it runs on this hardware (and why not), its weight layout,
    and the call."""

    @property
    def backend(self) -> MoeBackend: ...

    def usable(self, hardware: Hardware) -> tuple[bool, str]:
        """(runs here, why): the oracle's reason either way."""
        ...

    def to_kernel_format(self, w13_eFD: torch.Tensor, w2_eDF: torch.Tensor) -> MoeWeights:
        """Checkpoint layout (w13 = [gate; up] per expert, w2 = [e, D, F]) -> this kernel's."""
        ...

    def from_kernel_format(self, weights: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of to_kernel_format: back to (w13 [gate; up], w2)."""
        ...

    def apply(self, call: MoeCall) -> torch.Tensor:
        """out_TD, in hidden_TD's dtype."""
        ...


class WrappedKernel:
    """A kernel around another (a --mutate bug, a TEP / DEP combine): everything but `apply` is the inner
    kernel's; a wrapper overrides `apply`."""

    def __init__(self, inner: MoeKernel, name: str) -> None:
        self.inner = inner
        self.name = name  # what the wrapper adds, for logs and tests

    @property
    def backend(self) -> MoeBackend:
        return self.inner.backend

    def usable(self, hardware: Hardware) -> tuple[bool, str]:
        return self.inner.usable(hardware)

    def to_kernel_format(self, w13_eFD: torch.Tensor, w2_eDF: torch.Tensor) -> MoeWeights:
        return self.inner.to_kernel_format(w13_eFD, w2_eDF)

    def from_kernel_format(self, weights: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.from_kernel_format(weights)

    def apply(self, call: MoeCall) -> torch.Tensor:
        return self.inner.apply(call)

    def __repr__(self) -> str:
        return f"{self.name}({self.inner!r})"
