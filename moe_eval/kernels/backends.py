"""The bundled MoE kernels as registered objects (moe_eval.kernels.moe_call.MoeKernel): each says whether it
runs on the hardware and why not, converts the checkpoint's weights to its layout, and applies a MoeCall.
The oracle (moe_eval.kernels.oracle) reads BACKENDS; adding a backend is a class here and its row.

The implementations stay plain functions of tensors in their own modules (fused_moe, flashinfer_cutlass,
torch_moe, reference_moe), imported at the first call: importing flashinfer costs seconds, and a CPU server
never imports Triton's kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moe_eval.kernels.moe_call import Hardware, MoeBackend, MoeCall, MoeKernel, MoeWeights

if TYPE_CHECKING:
    import torch


def _sm(cc: tuple[int, int] | None) -> str:
    return "no compute capability" if cc is None else f"SM{cc[0]}{cc[1]}"


class _CheckpointLayout:
    """A kernel that takes the checkpoint's layout as it is (contiguous) and calls a function with
    fused_moe_ref's signature."""

    backend: MoeBackend

    def to_kernel_format(self, w13_eFD: torch.Tensor, w2_eDF: torch.Tensor) -> MoeWeights:
        return MoeWeights(self.backend, w13_eFD.contiguous(), w2_eDF.contiguous())

    def from_kernel_format(self, weights: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
        return weights.w13_eFD, weights.w2_eDF

    def _impl(self) -> Callable[..., torch.Tensor]:
        raise NotImplementedError

    def _extra(self, call: MoeCall) -> dict[str, Any]:
        """The options this kernel takes beyond the call's tensors."""
        return {}

    def apply(self, call: MoeCall) -> torch.Tensor:
        if call.weights.backend is not self.backend:
            raise ValueError(
                f"weights are in {call.weights.backend.value} format; this kernel is {self.backend.value}"
            )
        return self._impl()(
            call.hidden_TD, call.weights.w13_eFD, call.weights.w2_eDF, call.routing.weights_TK,
            call.routing.ids_TK, expert_map_E=call.expert_map_E,
            apply_router_weight_on_input=call.options.apply_router_weight_on_input, **self._extra(call),
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _slope(call: MoeCall) -> dict[str, Any]:
    # Passed only when mutated: the unmutated call is the kernel's plain signature.
    return {} if call.options.silu_slope == 1.0 else {"silu_slope": call.options.silu_slope}


class TritonKernel(_CheckpointLayout):
    backend = MoeBackend.TRITON

    def usable(self, hardware: Hardware) -> tuple[bool, str]:
        cc = hardware.compute_capability
        if hardware.platform != "cuda":
            # Triton 3.x has no CPU code generator; TRITON_INTERPRET emulates it in numpy for tests,
            # and there bf16 tl.dot is wrong (relative error ~1e10, measured with triton 3.9).
            return False, f"Triton kernels need a CUDA GPU; platform is {hardware.platform}"
        if not hardware.triton_available:
            return False, "triton is not importable"
        if cc is None or cc < (8, 0):
            # bf16 tl.dot (mma with bf16 operands) exists from SM80 on.
            return False, f"bf16 tl.dot needs SM80 or newer; device is {_sm(cc)}"
        return True, f"Triton fused MoE on {hardware.device_name} ({_sm(cc)})"

    @functools.cache  # noqa: B019  one instance per process (BACKENDS)
    def _impl(self) -> Callable[..., torch.Tensor]:
        from moe_eval.kernels.fused_moe import fused_moe

        return fused_moe

    def _extra(self, call: MoeCall) -> dict[str, Any]:
        extra = _slope(call)
        if call.options.tile_config is not None:  # the perf mutations' tiles (mutations.tile_override)
            extra["config"] = call.options.tile_config
        return extra


class TorchKernel(_CheckpointLayout):
    backend = MoeBackend.TORCH

    def usable(self, hardware: Hardware) -> tuple[bool, str]:
        # Plain torch ops: runs wherever torch does, expert map and all. On a CPU with AMX the compiled kernel
        # of cpu_moe runs instead, with the same numerics; the plugin logs which (`implementation`).
        return True, f"torch_moe runs on any {hardware.platform} device"

    @functools.cache  # noqa: B019  one instance per process (BACKENDS)
    def _impl(self) -> Callable[..., torch.Tensor]:
        from moe_eval.kernels.cpu_moe import cpu_moe

        return cpu_moe

    def _extra(self, call: MoeCall) -> dict[str, Any]:
        return _slope(call)


class ReferenceKernel(_CheckpointLayout):
    """The golden MoE: exact fp32, never chosen by the oracle, never mutated."""

    backend = MoeBackend.REFERENCE

    def usable(self, hardware: Hardware) -> tuple[bool, str]:
        return True, f"exact fp32 reference MoE runs on any {hardware.platform} device"

    @functools.cache  # noqa: B019  one instance per process (BACKENDS)
    def _impl(self) -> Callable[..., torch.Tensor]:
        from moe_eval.kernels.reference_moe import reference_moe

        return reference_moe


class FlashInferCutlassKernel(_CheckpointLayout):
    backend = MoeBackend.FLASHINFER_CUTLASS

    def usable(self, hardware: Hardware) -> tuple[bool, str]:
        from moe_eval.kernels.flashinfer_cutlass import MIN_COMPUTE_CAPABILITY

        cc = hardware.compute_capability
        if hardware.platform != "cuda":
            return False, f"FlashInfer CUTLASS MoE needs a CUDA GPU; platform is {hardware.platform}"
        if cc is None or cc < MIN_COMPUTE_CAPABILITY:
            # The adapter targets the SM90+ CUTLASS (TMA warp-specialized) BF16 kernels only.
            return False, f"FlashInfer CUTLASS MoE adapter needs SM90 or newer; device is {_sm(cc)}"
        if not hardware.flashinfer_available:
            return False, "flashinfer is not importable (pip install 'moe-eval[gpu]')"
        # Under EP the adapter sends other ranks' experts to a phantom second rank; checked on the H200
        # against fused_moe_ref at Qwen3-30B-A3B TEP2, M in {1, 64, 1024, 8192}: relative error
        # 3.81e-3..3.88e-3, other ranks' tokens exactly 0 (docs/flashinfer.md, 2026-11-29).
        return True, f"FlashInfer CUTLASS fused MoE on {hardware.device_name} ({_sm(cc)})"

    def to_kernel_format(self, w13_eFD: torch.Tensor, w2_eDF: torch.Tensor) -> MoeWeights:
        from moe_eval.kernels.flashinfer_cutlass import to_flashinfer_w31

        return MoeWeights(self.backend, to_flashinfer_w31(w13_eFD), w2_eDF.contiguous())

    def from_kernel_format(self, weights: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
        from moe_eval.kernels.flashinfer_cutlass import from_flashinfer_w31

        return from_flashinfer_w31(weights.w13_eFD), weights.w2_eDF

    @functools.cache  # noqa: B019  one instance per process (BACKENDS)
    def _impl(self) -> Callable[..., torch.Tensor]:
        from moe_eval.kernels.flashinfer_cutlass import flashinfer_cutlass_moe

        return flashinfer_cutlass_moe


# The registry: every bundled kernel by its backend name.
BACKENDS: dict[MoeBackend, MoeKernel] = {
    kernel.backend: kernel
    for kernel in (TritonKernel(), FlashInferCutlassKernel(), TorchKernel(), ReferenceKernel())
}
