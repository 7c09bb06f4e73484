"""The golden MoE backend: exact against float64, refuses inexact fp32 matmuls, never mutated."""

from __future__ import annotations

import pytest
import torch

from moe_eval.kernels.oracle import MoeBackend, make_moe_kernel
from moe_eval.kernels.reference_moe import exact_matmul_mode, exact_matmul_problem, reference_moe
from moe_eval.kernels.testing import make_case


@pytest.fixture(autouse=True)
def _restore_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("apply_on_input", [False, True])
def test_matches_float64_to_a_final_bf16_rounding(apply_on_input):
    exact_matmul_mode()
    K = 1 if apply_on_input else 2
    case = make_case(
        37,
        8,
        K,
        64,
        48,
        dtype=torch.bfloat16,
        device="cpu",
        seed=11,
        local_experts=[1, 3, 5, 7],
        apply_router_weight_on_input=apply_on_input,
    )
    out = reference_moe(*case.args(), **case.kwargs())
    # The same sums in float64, rounded once to bf16: the fp32 result must round to the same bf16 values
    # nearly everywhere (a tie at the rounding boundary may go either way).
    exact = make_case(
        37,
        8,
        K,
        64,
        48,
        dtype=torch.bfloat16,
        device="cpu",
        seed=11,
        local_experts=[1, 3, 5, 7],
        apply_router_weight_on_input=apply_on_input,
    )
    from moe_eval.kernels.fused_moe import fused_moe_ref

    ref64 = fused_moe_ref(
        exact.hidden_TD.double(),
        exact.w13_eFD.double(),
        exact.w2_eDF.double(),
        exact.topk_weights_TK.double(),
        exact.topk_ids_TK,
        **exact.kwargs(),
    )
    differs = (out != ref64.to(torch.bfloat16)).float().mean().item()
    assert out.dtype == torch.bfloat16
    assert differs < 0.01, f"{differs:.2%} of outputs round differently from float64"


def test_refuses_when_fp32_matmuls_may_use_tf32_or_bf16():
    exact_matmul_mode()
    assert exact_matmul_problem() is None
    torch.set_float32_matmul_precision("medium")
    assert "medium" in exact_matmul_problem()
    case = make_case(4, 4, 2, 32, 32, dtype=torch.bfloat16, device="cpu", seed=1)
    with pytest.raises(RuntimeError, match="refuses to run inexactly"):
        reference_moe(*case.args(), **case.kwargs())


def test_through_the_oracle_entry_point():
    exact_matmul_mode()
    case = make_case(9, 8, 2, 32, 32, dtype=torch.bfloat16, device="cpu", seed=4)
    out = make_moe_kernel(MoeBackend.REFERENCE).apply(case.call(MoeBackend.REFERENCE))
    assert torch.equal(out, reference_moe(*case.args(), **case.kwargs()))


def test_the_plugin_never_mutates_the_reference(monkeypatch):
    """`--mutate` is refused with the reference backend; the golden's probe switch (kernels/golden_probe.py)
    reaches reference layers only, never a kernel under test."""
    from types import SimpleNamespace

    from moe_eval.core.layout import Layout, LayoutKind
    from moe_eval.kernels import plugin
    from moe_eval.kernels.plugin import BundledExperts, switch_golden_probe

    monkeypatch.setattr(plugin, "_REFERENCE_EXPERTS", [])
    tp1 = Layout(kind=LayoutKind.TP, tensor_parallel=1, data_parallel=1)
    with pytest.raises(ValueError, match="never mutated"):
        BundledExperts("reference", tp1, mutation="scale_one_expert")
    w13 = torch.randn(4, 16, 8, dtype=torch.bfloat16)
    layer = SimpleNamespace(
        w13_weight=torch.nn.Parameter(w13.clone(), requires_grad=False),
        w2_weight=torch.nn.Parameter(torch.randn(4, 8, 8, dtype=torch.bfloat16), requires_grad=False),
        expert_map=None,
        apply_router_weight_on_input=False,
    )
    under_test = BundledExperts("torch", tp1)
    under_test.process_weights(layer, 4, 2)
    assert under_test.mutation is None and under_test.choice.backend is MoeBackend.TORCH
    assert switch_golden_probe(True)["layers"] == 0  # only reference layers register for the probe
    assert torch.equal(layer.w13_weight.data, w13)
