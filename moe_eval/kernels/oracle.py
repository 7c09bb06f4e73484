"""Which MoE backend runs the experts: the oracle, plus the one entry point a vLLM plugin needs.

`select_moe_backend(hardware, layout, requested)` is a pure function of plain values: it asks each
registered kernel (moe_eval.kernels.backends.BACKENDS) whether it runs here, and returns the backend, why,
and every other candidate with why it lost; it raises when an explicit request cannot be met or the
platform is unknown. `detect_hardware()` is the one impure function (it asks torch). The plugin gets the
kernel from `make_moe_kernel` and never touches a backend module directly. Usage:

    choice = select_moe_backend(detect_hardware(), layout, requested=None)
    kernel = make_moe_kernel(choice.backend)
    weights = kernel.to_kernel_format(w13_eFD, w2_eDF)
    out_TD = kernel.apply(MoeCall(hidden_TD, weights, Routing(topk_weights_TK, topk_ids_TK)))
"""

from __future__ import annotations

import importlib.util
import platform as _platform
from dataclasses import dataclass

import torch

from moe_eval.core.layout import Layout
from moe_eval.kernels.backends import BACKENDS
from moe_eval.kernels.flashinfer_cutlass import flashinfer_importable
from moe_eval.kernels.moe_call import Hardware, MoeBackend, MoeKernel, MoeWeights

__all__ = [  # the oracle's contract; the call's types are moe_eval.kernels.moe_call's
    "BackendChoice", "Hardware", "MoeBackend", "MoeBackendUnavailable", "MoeKernel", "MoeWeights",
    "UnknownPlatformError", "convert_from_kernel_format", "convert_to_kernel_format", "detect_hardware",
    "make_moe_kernel", "select_moe_backend",
]  # fmt: skip


KNOWN_PLATFORMS = ("cuda", "cpu")


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
    """Can `backend` run here at all? (usable, reason): the kernel's own answer. No rule depends on the
    layout today."""
    return BACKENDS[backend].usable(hw)


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


def convert_to_kernel_format(backend: MoeBackend, w13_eFD: torch.Tensor, w2_eDF: torch.Tensor) -> MoeWeights:
    """Checkpoint layout (w13 = [gate; up] per expert, w2 = [e, D, F]) -> the backend's layout."""
    return BACKENDS[MoeBackend(backend)].to_kernel_format(w13_eFD, w2_eDF)


def convert_from_kernel_format(weights: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `convert_to_kernel_format`: back to (w13 [gate; up], w2)."""
    return BACKENDS[weights.backend].from_kernel_format(weights)


def make_moe_kernel(backend: MoeBackend) -> MoeKernel:
    """The backend's registered kernel (moe_eval.kernels.moe_call.MoeKernel)."""
    return BACKENDS[MoeBackend(backend)]
