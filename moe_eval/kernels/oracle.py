"""Which MoE backend runs the experts: the oracle, plus the one entry point a vLLM plugin needs.

`select_moe_backend(hardware, layout, requested)` is a pure function of plain values: it returns
the backend, why, and every other candidate with why it lost, and raises when an explicit request
cannot be met or the platform is unknown. `detect_hardware()` is the one impure function (it asks
torch). Weights go through `convert_to_kernel_format` and the call through `make_moe_kernel`, so a
plugin never touches a backend module directly. Usage:

    choice = select_moe_backend(detect_hardware(), layout, requested=None)
    weights = convert_to_kernel_format(choice.backend, w13_eFD, w2_eDF)
    out_TD = make_moe_kernel(choice.backend)(hidden_TD, weights, topk_weights_TK, topk_ids_TK, None, False)

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import enum
import importlib.util
import platform as _platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moe_eval.core.layout import Layout
from moe_eval.kernels.flashinfer_cutlass import MIN_COMPUTE_CAPABILITY, flashinfer_importable


class MoeBackend(str, enum.Enum):
    TRITON = "triton"  # moe_eval.kernels.fused_moe
    FLASHINFER_CUTLASS = "flashinfer_cutlass"  # moe_eval.kernels.flashinfer_cutlass
    TORCH = "torch"  # moe_eval.kernels.torch_moe
    # The golden MoE (moe_eval.kernels.reference_moe): exact fp32, never chosen by the oracle, never
    # mutated; only golden-reference servers ask for it (moe_eval.evaluate.golden).
    REFERENCE = "reference"


KNOWN_PLATFORMS = ("cuda", "cpu")


@dataclass(frozen=True)
class Hardware:
    """What the oracle needs to know about the machine, as plain values (tests build these by hand)."""

    platform: str  # "cuda", "cpu", or anything else (the oracle rejects it by name)
    device_name: str  # "NVIDIA H200", "cpu", ...
    compute_capability: tuple[int, int] | None  # (9, 0) on Hopper; None off CUDA
    triton_available: bool
    flashinfer_available: bool


@dataclass(frozen=True)
class BackendChoice:
    backend: MoeBackend
    reason: str
    rejected: tuple[tuple[MoeBackend, str], ...]


class MoeBackendUnavailable(RuntimeError):
    """An explicitly requested backend (or every backend) cannot run on this hardware and layout."""


class UnknownPlatformError(ValueError):
    """The hardware's platform is not one the oracle has rules for."""


# --- the rules ---------------------------------------------------------------------------------


def _usable(backend: MoeBackend, hw: Hardware) -> tuple[bool, str]:
    """Can `backend` run here at all? (usable, reason). No rule depends on the layout today."""
    cc = hw.compute_capability
    if backend is MoeBackend.REFERENCE:
        return True, f"exact fp32 reference MoE runs on any {hw.platform} device"
    if backend is MoeBackend.TORCH:
        # Plain torch ops: runs wherever torch does, expert map and all.
        return True, f"torch_moe runs on any {hw.platform} device"
    if backend is MoeBackend.TRITON:
        if hw.platform != "cuda":
            # Triton 3.x has no CPU code generator; TRITON_INTERPRET emulates it in numpy for tests,
            # and there bf16 tl.dot is wrong (relative error ~1e10, measured with triton 3.9).
            return False, f"Triton kernels need a CUDA GPU; platform is {hw.platform}"
        if not hw.triton_available:
            return False, "triton is not importable"
        if cc is None or cc < (8, 0):
            # bf16 tl.dot (mma with bf16 operands) exists from SM80 on.
            return False, f"bf16 tl.dot needs SM80 or newer; device is {_sm(cc)}"
        return True, f"Triton fused MoE on {hw.device_name} ({_sm(cc)})"
    if backend is MoeBackend.FLASHINFER_CUTLASS:
        if hw.platform != "cuda":
            return False, f"FlashInfer CUTLASS MoE needs a CUDA GPU; platform is {hw.platform}"
        if cc is None or cc < MIN_COMPUTE_CAPABILITY:
            # The adapter targets the SM90+ CUTLASS (TMA warp-specialized) BF16 kernels only.
            return False, f"FlashInfer CUTLASS MoE adapter needs SM90 or newer; device is {_sm(cc)}"
        if not hw.flashinfer_available:
            return False, "flashinfer is not importable (pip install 'moe-eval[gpu]')"
        # Under EP the adapter sends other ranks' experts to a phantom second rank; checked on the H200
        # against fused_moe_ref at Qwen3-30B-A3B TEP2, M in {1, 64, 1024, 8192}: relative error
        # 3.81e-3..3.88e-3, other ranks' tokens exactly 0 (docs/flashinfer.md, 2026-11-29).
        return True, f"FlashInfer CUTLASS fused MoE on {hw.device_name} ({_sm(cc)})"
    raise AssertionError(backend)


def _preference(hw: Hardware) -> tuple[MoeBackend, ...]:
    """Order in which usable backends are taken, best first."""
    if hw.platform == "cpu":
        # Only torch runs on CPU (see _usable); listing the others keeps their reasons in `rejected`.
        return (MoeBackend.TORCH, MoeBackend.TRITON, MoeBackend.FLASHINFER_CUTLASS)
    cc = hw.compute_capability or (0, 0)
    if cc >= (10, 0):
        # Blackwell: no measurement in this project (no B200 lent). Triton first because it is the
        # backend whose outputs are checked on a GPU here; FlashInfer stays selectable by request.
        return (MoeBackend.TRITON, MoeBackend.FLASHINFER_CUTLASS, MoeBackend.TORCH)
    # Hopper (H200): CUDA-graph medians, interleaved in one run, FlashInfer 0.7.0.post1 autotuned
    # (docs/perf.md "FlashInfer CUTLASS beside Triton", 2026-11-29). FlashInfer time / Triton time
    # for M = 1, 16, 64, 256, 1024, 4096, 16384:
    #   Qwen3-30B-A3B TP1:  1.39 1.04 1.02 1.02 1.03 0.99 1.03
    #   Qwen3-30B-A3B TEP2: 1.62 1.13 1.10 1.07 1.07 1.02 1.04
    #   Mixtral-8x7B TP2:   1.09 1.05 1.05 1.00 0.87 0.83 0.82
    # Triton is as fast or faster everywhere but Mixtral's few large experts at M >= 1024 (there
    # FlashInfer is 13-18% faster), and it needs no 7-minute JIT build of FlashInfer's MoE module;
    # so Triton first. The oracle does not look at the shape; a config can ask for FlashInfer.
    # torch_moe last: eager on the H200 it took 1087 us at M = 1 and 13.4 ms at M = 1024 (36x and
    # 35x Triton; docs/perf.md): one host sync (bincount().tolist()) and one matmul pair per
    # expert hit, and no CUDA graph.
    return (MoeBackend.TRITON, MoeBackend.FLASHINFER_CUTLASS, MoeBackend.TORCH)


def _sm(cc: tuple[int, int] | None) -> str:
    return "no compute capability" if cc is None else f"SM{cc[0]}{cc[1]}"


def select_moe_backend(
    hardware: Hardware, layout: Layout, requested: MoeBackend | None = None
) -> BackendChoice:
    """Pick the MoE backend. Pure: same inputs, same answer; no globals, no environment.

    `layout` is part of the contract (the plugin and tests pass it) though no rule reads it today.
    """
    if hardware.platform not in KNOWN_PLATFORMS:
        raise UnknownPlatformError(
            f"unknown platform {hardware.platform!r} (device {hardware.device_name!r}); the MoE oracle knows "
            f"{', '.join(KNOWN_PLATFORMS)}"
        )
    order = _preference(hardware)
    verdicts = {b: _usable(b, hardware) for b in order}

    if requested is not None:
        requested = MoeBackend(requested)
        ok, why = verdicts[requested] if requested in verdicts else _usable(requested, hardware)
        if not ok:
            raise MoeBackendUnavailable(f"requested MoE backend {requested.value!r} cannot run: {why}")
        rejected = tuple((b, f"not requested ({requested.value} was)") for b in order if b is not requested)
        return BackendChoice(requested, f"requested explicitly; {why}", rejected)

    rejected: list[tuple[MoeBackend, str]] = []
    for i, backend in enumerate(order):
        ok, why = verdicts[backend]
        if not ok:
            rejected.append((backend, why))
            continue
        for lower in order[i + 1 :]:
            lower_ok, lower_why = verdicts[lower]
            rejected.append((lower, f"ranked below {backend.value}" if lower_ok else lower_why))
        return BackendChoice(
            backend, f"first usable in order {[b.value for b in order]}: {why}", tuple(rejected)
        )
    raise MoeBackendUnavailable(
        "no MoE backend can run: " + "; ".join(f"{b.value}: {w}" for b, w in rejected)
    )


# --- the impure edge ---------------------------------------------------------------------------


def detect_hardware() -> Hardware:
    """Read the machine once (torch, importability of triton / flashinfer) into plain values."""
    triton_ok = importlib.util.find_spec("triton") is not None
    flashinfer_ok = flashinfer_importable()
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if torch.version.hip is not None:
            # ROCm builds answer through torch.cuda; the oracle has no rules for them and says so.
            return Hardware("rocm", name, None, triton_ok, flashinfer_ok)
        return Hardware("cuda", name, torch.cuda.get_device_capability(0), triton_ok, flashinfer_ok)
    return Hardware(
        "cpu", _platform.processor() or _platform.machine() or "cpu", None, triton_ok, flashinfer_ok
    )


# --- weights and kernels -----------------------------------------------------------------------


@dataclass(frozen=True)
class MoeWeights:
    """Expert weights in the layout `backend` wants. w13_eFD is [up; gate] for FlashInfer."""

    backend: MoeBackend
    w13_eFD: torch.Tensor
    w2_eDF: torch.Tensor


MoeKernel = Callable[
    [torch.Tensor, MoeWeights, torch.Tensor, torch.Tensor, "torch.Tensor | None", bool], torch.Tensor
]


def convert_to_kernel_format(backend: MoeBackend, w13_eFD: torch.Tensor, w2_eDF: torch.Tensor) -> MoeWeights:
    """Checkpoint layout (w13 = [gate; up] per expert, w2 = [e, D, F]) -> the backend's layout."""
    backend = MoeBackend(backend)
    if backend is MoeBackend.FLASHINFER_CUTLASS:
        from moe_eval.kernels.flashinfer_cutlass import to_flashinfer_w31

        return MoeWeights(backend, to_flashinfer_w31(w13_eFD), w2_eDF.contiguous())
    return MoeWeights(backend, w13_eFD.contiguous(), w2_eDF.contiguous())


def convert_from_kernel_format(weights: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `convert_to_kernel_format`: back to (w13 [gate; up], w2)."""
    if weights.backend is MoeBackend.FLASHINFER_CUTLASS:
        from moe_eval.kernels.flashinfer_cutlass import from_flashinfer_w31

        return from_flashinfer_w31(weights.w13_eFD), weights.w2_eDF
    return weights.w13_eFD, weights.w2_eDF


def make_moe_kernel(backend: MoeBackend) -> MoeKernel:
    """The backend as one callable:
    kernel(hidden_TD, weights, topk_weights_TK, topk_ids_TK, expert_map_E, apply_router_weight_on_input)."""
    backend = MoeBackend(backend)
    if backend is MoeBackend.TRITON:
        from moe_eval.kernels.fused_moe import fused_moe as impl
    elif backend is MoeBackend.FLASHINFER_CUTLASS:
        from moe_eval.kernels.flashinfer_cutlass import flashinfer_cutlass_moe as impl
    elif backend is MoeBackend.REFERENCE:
        from moe_eval.kernels.reference_moe import reference_moe as impl
    else:
        from moe_eval.kernels.torch_moe import torch_moe as impl

    def kernel(
        hidden_TD: torch.Tensor,
        weights: MoeWeights,
        topk_weights_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        expert_map_E: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        silu_slope: float = 1.0,
        tile_config: Any = None,
    ) -> torch.Tensor:
        if weights.backend is not backend:
            raise ValueError(f"weights are in {weights.backend.value} format; this kernel is {backend.value}")
        # silu_slope: `--mutate silu_slope` only; the Triton and torch kernels take it (check_mutation).
        extra = {} if silu_slope == 1.0 else {"silu_slope": silu_slope}
        if tile_config is not None:  # the perf mutations' tiles (mutations.tile_override): Triton only
            extra["config"] = tile_config
        return impl(
            hidden_TD, weights.w13_eFD, weights.w2_eDF, topk_weights_TK, topk_ids_TK,
            expert_map_E=expert_map_E, apply_router_weight_on_input=apply_router_weight_on_input, **extra,
        )  # fmt: skip

    kernel.__name__ = f"moe_kernel_{backend.value}"
    return kernel
