"""The MoE backend oracle as tables, weight-format round trips, and the kernel entry point.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_eval.core.layout import Layout, LayoutKind
from moe_eval.kernels.fused_moe import fused_moe_ref
from moe_eval.kernels.oracle import (
    BackendChoice,
    Hardware,
    MoeBackend,
    MoeBackendUnavailable,
    MoeWeights,
    UnknownPlatformError,
    convert_from_kernel_format,
    convert_to_kernel_format,
    detect_hardware,
    make_moe_kernel,
    select_moe_backend,
)
from moe_eval.kernels.testing import make_case, rel_err
from tests.kernels.conftest import INTERPRETER_PROBLEM

TRITON, FLASHINFER, TORCH = MoeBackend.TRITON, MoeBackend.FLASHINFER_CUTLASS, MoeBackend.TORCH

H200 = Hardware("cuda", "NVIDIA H200", (9, 0), triton_available=True, flashinfer_available=True)
H200_NO_FLASHINFER = dataclasses.replace(H200, flashinfer_available=False)
H200_NO_TRITON = dataclasses.replace(H200, triton_available=False)
B200 = Hardware("cuda", "NVIDIA B200", (10, 0), triton_available=True, flashinfer_available=True)
A100 = Hardware("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), triton_available=True, flashinfer_available=True)
V100 = Hardware("cuda", "Tesla V100-SXM2-32GB", (7, 0), triton_available=True, flashinfer_available=False)
CPU = Hardware("cpu", "AMD EPYC", None, triton_available=True, flashinfer_available=False)
CPU_BARE = Hardware("cpu", "AMD EPYC", None, triton_available=False, flashinfer_available=False)

TP1 = Layout(LayoutKind.TP)
TP2 = Layout(LayoutKind.TP, tensor_parallel=2)
TEP2 = Layout(LayoutKind.TEP, tensor_parallel=2)
DEP2 = Layout(LayoutKind.DEP, data_parallel=2)

# (hardware, layout, requested, chosen): each row says why it is there.
CHOICES = [
    (H200, TP1, None, TRITON),  # Hopper: Triton measured faster than or level with FlashInfer
    (H200, TP2, None, TRITON),
    (H200, TEP2, None, TRITON),  # expert map: Triton handles it
    (H200, DEP2, None, TRITON),
    (H200, TP1, FLASHINFER, FLASHINFER),  # an explicit request that can run is honoured
    (H200, TP1, TORCH, TORCH),
    (H200_NO_TRITON, TP1, None, FLASHINFER),  # the next usable one, with Triton's reason recorded
    (H200_NO_TRITON, TEP2, None, FLASHINFER),  # FlashInfer's expert-map path, checked on the H200
    (H200, TEP2, FLASHINFER, FLASHINFER),  # the shipped fi-cutlass configs are TEP
    (B200, TP1, None, TRITON),  # Blackwell: not measured here, Triton is the GPU-tested path
    (B200, TP1, FLASHINFER, FLASHINFER),
    (A100, TP1, None, TRITON),  # SM80: FlashInfer adapter needs SM90
    (V100, TP1, None, TORCH),  # SM70: no bf16 tl.dot
    (CPU, TP1, None, TORCH),  # CPU: only torch runs
    (CPU, TEP2, None, TORCH),
    (CPU_BARE, DEP2, None, TORCH),
    (CPU, TP1, TORCH, TORCH),
]

# (hardware, layout, requested, words the reason must contain)
IMPOSSIBLE = [
    (CPU, TP1, TRITON, "CUDA GPU"),
    (CPU, TP1, FLASHINFER, "CUDA GPU"),
    (A100, TP1, FLASHINFER, "SM90"),
    (V100, TP1, TRITON, "SM80"),
    (H200_NO_FLASHINFER, TP1, FLASHINFER, "not importable"),
    (H200_NO_TRITON, TP1, TRITON, "not importable"),
]


def test_backends_are_exactly_the_kernels_and_the_golden_reference():
    assert {b.value for b in MoeBackend} == {"triton", "flashinfer_cutlass", "torch", "reference"}


@pytest.mark.parametrize(("hw", "layout", "requested", "chosen"), CHOICES)
def test_choice_table(hw, layout, requested, chosen):
    choice = select_moe_backend(hw, layout, requested)
    assert isinstance(choice, BackendChoice)
    assert choice.backend is chosen
    assert choice.reason
    rejected = [b for b, _ in choice.rejected]
    kernels = sorted(set(MoeBackend) - {MoeBackend.REFERENCE})  # the golden backend is never a candidate
    assert sorted(rejected + [chosen]) == kernels, "every other backend is listed once"
    assert all(reason for _, reason in choice.rejected), "every rejection says why"


@pytest.mark.parametrize(("hw", "layout", "requested", "words"), IMPOSSIBLE)
def test_impossible_request_raises_with_reason(hw, layout, requested, words):
    with pytest.raises(MoeBackendUnavailable, match=words):
        select_moe_backend(hw, layout, requested)


@pytest.mark.parametrize("platform", ["rocm", "xpu", "tpu", ""])
def test_unknown_platform_raises_naming_it(platform):
    hw = Hardware(platform, "some accelerator", None, triton_available=True, flashinfer_available=False)
    with pytest.raises(UnknownPlatformError, match=repr(platform)):
        select_moe_backend(hw, TP1, None)


def test_rejected_reasons_on_cpu_name_the_cause():
    choice = select_moe_backend(CPU, TP1, None)
    reasons = dict(choice.rejected)
    assert "CUDA GPU" in reasons[TRITON] and "CUDA GPU" in reasons[FLASHINFER]


def test_lower_ranked_usable_backends_are_listed_as_such():
    choice = select_moe_backend(H200, TP1, None)
    reasons = dict(choice.rejected)
    assert reasons[FLASHINFER] == "ranked below triton" and reasons[TORCH] == "ranked below triton"


def test_requested_as_string_value():
    assert select_moe_backend(H200, TP1, "torch").backend is TORCH


def test_pure_no_environment(monkeypatch):
    # The plugin's variable must not leak into the oracle: same inputs, same answer.
    before = select_moe_backend(H200, TEP2, None)
    monkeypatch.setenv("MOE_EVAL_MOE_BACKEND", "torch")
    monkeypatch.setenv("VLLM_USE_FLASHINFER_MOE_FP16", "1")
    assert select_moe_backend(H200, TEP2, None) == before


def test_detect_hardware_feeds_the_oracle():
    hw = detect_hardware()
    assert hw.platform == ("cuda" if torch.cuda.is_available() else "cpu")
    assert select_moe_backend(hw, TP1, None).backend in MoeBackend


# --- weight formats and the kernel entry point ----------------------------------------------------


@pytest.mark.parametrize("backend", list(MoeBackend))
def test_weight_format_round_trip(backend):
    w13_eFD = torch.randn(4, 2 * 24, 16).to(torch.bfloat16)
    w2_eDF = torch.randn(4, 16, 24).to(torch.bfloat16)
    weights = convert_to_kernel_format(backend, w13_eFD, w2_eDF)
    assert isinstance(weights, MoeWeights) and weights.backend is backend
    back_w13, back_w2 = convert_from_kernel_format(weights)
    assert torch.equal(back_w13, w13_eFD) and torch.equal(back_w2, w2_eDF)


def test_every_backend_is_one_registered_kernel_and_the_oracle_asks_it(monkeypatch):
    """The registry (kernels/backends.py) holds one MoeKernel per backend; the oracle's reasons are the
    kernels' own: a kernel that says it cannot run here is passed over with its words."""
    from moe_eval.kernels import backends
    from moe_eval.kernels.moe_call import WrappedKernel

    assert set(backends.BACKENDS) == set(MoeBackend)
    assert all(kernel.backend is name for name, kernel in backends.BACKENDS.items())

    class Unwell(WrappedKernel):
        def usable(self, hardware):
            return False, "this test says it is unwell"

    monkeypatch.setitem(backends.BACKENDS, TORCH, Unwell(backends.BACKENDS[TORCH], "unwell"))
    with pytest.raises(MoeBackendUnavailable, match="torch: this test says it is unwell"):
        select_moe_backend(CPU, TP1, None)
    choice = select_moe_backend(H200, TP1, None)
    assert (TORCH, "this test says it is unwell") in choice.rejected


def test_flashinfer_format_swaps_halves_per_expert():
    w13_eFD = torch.randn(3, 2 * 8, 16)
    w31 = convert_to_kernel_format(FLASHINFER, w13_eFD, torch.randn(3, 16, 8)).w13_eFD
    assert torch.equal(w31[:, :8], w13_eFD[:, 8:]) and torch.equal(w31[:, 8:], w13_eFD[:, :8])


@pytest.mark.parametrize("apply_on_input", [False, True])
def test_torch_kernel_through_the_entry_point(apply_on_input):
    K = 1 if apply_on_input else 2
    case = make_case(17, 8, K, 32, 48, dtype=torch.float32, device="cpu", seed=3, local_experts=[1, 3, 5, 7],
                     apply_router_weight_on_input=apply_on_input)  # fmt: skip
    out_TD = make_moe_kernel(TORCH).apply(case.call(TORCH))
    assert rel_err(out_TD, fused_moe_ref(*case.args(), **case.kwargs())) <= 1e-5


def test_triton_kernel_through_the_entry_point(device):
    assert INTERPRETER_PROBLEM is None, INTERPRETER_PROBLEM
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # interpreter: no bf16 dot
    case = make_case(9, 8, 2, 32, 32, dtype=dtype, device=device, seed=4, local_experts=[0, 2, 4, 6])
    out_TD = make_moe_kernel(TRITON).apply(case.call(TRITON))
    assert rel_err(out_TD, case.reference_fp32()) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_kernel_refuses_weights_of_another_format():
    case = make_case(4, 4, 2, 32, 32, dtype=torch.float32, device="cpu", seed=5)
    with pytest.raises(ValueError, match="flashinfer_cutlass format"):
        make_moe_kernel(TORCH).apply(case.call(FLASHINFER))
