"""torch_moe (the CPU path) and grouped_mm_moe (the benchmark's torch peer) against fused_moe_ref.

T tokens, D hidden, F intermediate per rank, E experts (global), e local experts, K top-k.
"""

from __future__ import annotations

import pytest
import torch

from moe_eval.kernels.testing import make_case, rel_err
from moe_eval.kernels.torch_moe import grouped_mm_moe, torch_moe

# ||out - ref|| / ||ref||, ref = fused_moe_ref on the same inputs upcast to fp32. These paths run
# their matmuls in the weights' dtype: gate/up, h, y and out are each rounded once, four
# roundings of relative rms u / sqrt(3) each (u = unit roundoff), about 1.15 u in all.
TOLERANCE = {
    torch.float32: 1e-5,  # u = 2^-24; what is left is summation order (measured ~3e-8)
    torch.bfloat16: 1e-2,  # u = 2^-8 = 3.9e-3 -> ~4.5e-3 expected (measured 3.4e-3 - 3.9e-3)
}
DTYPES = [torch.float32, torch.bfloat16]
IMPLS = [pytest.param(torch_moe, id="torch_moe"), pytest.param(grouped_mm_moe, id="grouped_mm")]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check(impl, case) -> None:
    out_TD = impl(*case.args(), **case.kwargs())
    assert out_TD.shape == case.hidden_TD.shape and out_TD.dtype == case.hidden_TD.dtype
    assert not torch.isnan(out_TD).any()
    err = rel_err(out_TD, case.reference_fp32())
    tol = TOLERANCE[case.hidden_TD.dtype]
    assert err <= tol, f"{impl.__name__}: relative error {err:.2e} > {tol:.0e}"


def _skip_unsupported(impl, dtype) -> None:
    if impl is grouped_mm_moe and _device() == "cuda" and dtype != torch.bfloat16:
        pytest.skip("grouped_mm on CUDA takes bf16 only")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("T", "E", "K", "D", "F"),
    [
        (1, 8, 2, 64, 32),  # one token
        (40, 6, 3, 64, 48),  # E not a power of two
        (16, 8, 8, 32, 32),  # K = E: every expert gets every token
        (256, 16, 2, 128, 64),  # the tiny CPU model's shape (E8K2 D128 F64 is the served one)
    ],
)
def test_matches_reference(T, E, K, D, F, impl, dtype):
    _skip_unsupported(impl, dtype)
    _check(impl, make_case(T, E, K, D, F, dtype=dtype, device=_device(), seed=T + E))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_all_tokens_to_one_expert(impl, dtype):
    _skip_unsupported(impl, dtype)
    ids_TK = torch.full((30, 1), 2, dtype=torch.int32, device=_device())
    _check(impl, make_case(30, 8, 1, 32, 32, dtype=dtype, device=_device(), seed=1, topk_ids_TK=ids_TK))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_experts_with_no_tokens(impl, dtype):
    _skip_unsupported(impl, dtype)
    ids_TK = torch.stack([torch.randperm(3)[:2] for _ in range(12)]).to(torch.int32).to(_device())
    _check(impl, make_case(12, 16, 2, 32, 32, dtype=dtype, device=_device(), seed=2, topk_ids_TK=ids_TK))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_d_and_f(dtype):
    # torch_moe only: grouped_mm refuses rows that are not multiples of 16 bytes.
    _check(torch_moe, make_case(23, 5, 2, 45, 23, dtype=dtype, device=_device(), seed=3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K", [1, 2])
def test_expert_map_with_unmapped_slots(K, impl, dtype):
    _skip_unsupported(impl, dtype)
    case = make_case(33, 8, K, 32, 48, dtype=dtype, device=_device(), seed=4 + K, local_experts=[5, 1, 6, 2])
    _check(impl, case)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_slot_on_this_rank_gives_zeros(impl):
    case = make_case(9, 8, 2, 32, 32, dtype=torch.bfloat16, device=_device(), seed=6, local_experts=[6, 7])
    case.topk_ids_TK = torch.stack([torch.randperm(6)[:2] for _ in range(9)]).to(torch.int32).to(_device())
    out_TD = impl(*case.args(), **case.kwargs())
    assert torch.equal(out_TD, torch.zeros_like(out_TD))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K", [1, 3])
def test_apply_router_weight_on_input(K, impl, dtype):
    _skip_unsupported(impl, dtype)
    case = make_case(
        21, 6, K, 32, 32, dtype=dtype, device=_device(), seed=7 + K, apply_router_weight_on_input=True
    )
    _check(impl, case)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_tokens(impl):
    case = make_case(0, 8, 2, 32, 32, dtype=torch.bfloat16, device=_device(), seed=9)
    out_TD = impl(*case.args(), **case.kwargs())
    assert out_TD.shape == (0, 32) and out_TD.dtype == torch.bfloat16


@pytest.mark.parametrize("seed", [21, 22])
def test_the_same_call_twice_and_its_tokens_in_another_order_give_the_same_bits(seed):
    """The top-k sum in a fixed order (index_add_ over slots sorted by expert, stably: token order within an
    expert), no atomics: the same call repeats bit for bit, and a token's output does not depend on where it
    sits in the batch (each expert's GEMM sees the same rows, in another order)."""
    case = make_case(37, 8, 2, 64, 48, dtype=torch.bfloat16, device="cpu", seed=seed)
    out = torch_moe(*case.args(), **case.kwargs())
    assert torch.equal(out, torch_moe(*case.args(), **case.kwargs()))
    order = torch.randperm(37, generator=torch.Generator().manual_seed(seed))
    shuffled = torch_moe(
        case.hidden_TD[order], case.w13_eFD, case.w2_eDF, case.topk_weights_TK[order], case.topk_ids_TK[order]
    )
    assert torch.equal(out[order], shuffled)
