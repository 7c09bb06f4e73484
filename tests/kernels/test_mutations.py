"""The subtle mutations (scale_routing_weights, bf16_down_accumulation, skip_tail_block, the one-expert
weight mutations, routing_temperature_slip): each moves the output a little, not a lot, and each
changes exactly what it names: skip_tail_block its slots, a weight mutation global expert
TARGET_EXPERT under every expert placement.

The strong mutations are held to "> 0.1 relative error" in test_plugin_apply.py; these are held to
a small, non-zero one, because their purpose is to be missed by an accuracy gate and seen by a
log-probability comparison (moe_eval.evaluate.logprobs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_eval.core.layout import Layout, LayoutKind
from moe_eval.kernels.fused_moe import fused_moe_ref
from moe_eval.kernels.moe_call import MoeCall, MoeOptions, Routing, WrappedKernel
from moe_eval.kernels.mutations import (
    DOWN_CHUNKS,
    MUTATIONS,
    ONE_EXPERT_MUTATIONS,
    ONE_EXPERT_SCALE,
    PERF_MUTATIONS,
    ROUTING_TEMPERATURE_EXPONENT,
    SMALL_EXPERT_SCALE,
    STALE_ROW_FRACTION,
    SUBTLE_MUTATIONS,
    TARGET_EXPERT,
    check_mutation,
    mutate_call,
    mutate_kernel,
    mutate_weights,
    tail_block_slots,
)
from moe_eval.kernels.oracle import Hardware, MoeBackend, MoeWeights, make_moe_kernel
from moe_eval.kernels.plugin import BundledExperts
from moe_eval.kernels.testing import make_case, rel_err
from moe_eval.kernels.torch_moe import torch_moe

CPU_HARDWARE = Hardware("cpu", "cpu", None, triton_available=True, flashinfer_available=False)
REL_TOL_FP32 = 1e-5  # fp32 end to end: only summation order differs
# bf16_down_accumulation on fp32 inputs: the only error left is bf16 rounding, of each chunk's output
# and of each of the 3 adds (unit roundoff 2**-8 = 3.9e-3 relative, ~2.3e-3 RMS for one rounding);
# measured 3.1e-3..3.3e-3 in the cases below. A wrong slicing of the chunks gives O(1).
REL_TOL_BF16_ROUNDING = 6e-3

# Relative error of the mutated BundledExperts output against the correct one in the case below
# (torch backend, bf16 weights and activations as in the server, E=8, K=2, D=64, F=128, T=256,
# routing seed 0), measured 2026-11-30 on this CPU with torch 2.13: scale_routing_weights 2.01e-2,
# bf16_down_accumulation 4.23e-3, skip_tail_block 2.51e-2. Over routing seeds 0-4 and T = 16, 64,
# 256: scale 1.99e-2..2.03e-2; bf16 4.1e-3..4.5e-3, the size of the correct bf16 kernel's own error
# against fp32 (3.7e-3..4.1e-3); skip_tail_block 0 at T=16 (no expert has more than 16 tokens),
# 7.1e-2..0.135 at T=64 and 2.5e-2..0.169 at T=256 (the output of each skipped token loses one of
# its two experts); scale_one_expert 7.3e-3..2.5e-2 (one of 8 experts 5% short: how many of the
# tokens it serves varies). The strong mutations give > 0.1 at any T (test_plugin_apply.py).
# skip_tail_block is small in-process but not through vLLM (mutations.py): it is not in SUBTLE_MUTATIONS.
# Measured the same way 2026-11-30, routing seeds 0-4, T = 16, 64, 256 (the case below first):
# scale_one_expert_small 6.3e-3, 3.0e-3..1.1e-2 (0.4 of scale_one_expert's, as 2% is of 5%);
# routing_temperature_slip 1.27e-2, 1.19e-2..1.34e-2; stale_gate_rows 0.157, 5.8e-2..0.28: as large as a
# strong mutation here (the stale rows are an unrelated expert's), subtle only if the canary says so.
SUBTLE_BOUNDS = {
    "scale_routing_weights": (1.5e-2, 2.5e-2),  # 0.02 exactly in real arithmetic, plus bf16 noise
    "bf16_down_accumulation": (1e-3, 1e-2),
    "scale_one_expert": (3e-3, 5e-2),
    "skip_tail_block": (1e-2, 0.2),
    "scale_one_expert_small": (1e-3, 2e-2),
    "stale_gate_rows": (3e-2, 0.4),
    "routing_temperature_slip": (5e-3, 2e-2),
}
SUBTLE = tuple(SUBTLE_BOUNDS)


def _layer(e: int, F: int, D: int, dtype, expert_map=None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * F, D, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(e, D, F, generator=g) / F**0.5).to(dtype)
    return SimpleNamespace(
        w13_weight=torch.nn.Parameter(w13, requires_grad=False),
        w2_weight=torch.nn.Parameter(w2, requires_grad=False),
        expert_map=expert_map,
        apply_router_weight_on_input=False,
        activation=SimpleNamespace(value="silu"),
    )


def _routing(T: int, E: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, -1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def _apply(mutation: str | None, layer_args: dict, x, topk_weights, topk_ids, E: int, K: int):
    layer = _layer(**layer_args)
    experts = BundledExperts("torch", Layout(LayoutKind.TP), CPU_HARDWARE, mutation=mutation)
    experts.process_weights(layer, E, K)
    return experts.apply(layer, x, topk_weights, topk_ids)


def _plugin_applies_mutate_kernel() -> bool:
    experts = BundledExperts("torch", Layout(LayoutKind.TP), CPU_HARDWARE, mutation="bf16_down_accumulation")
    return getattr(experts.kernel, "name", None) == "bf16_down_accumulation"


@pytest.mark.parametrize("mutation", SUBTLE)
def test_subtle_mutation_moves_the_output_a_little(mutation):
    if mutation == "bf16_down_accumulation":
        assert _plugin_applies_mutate_kernel(), (
            "BundledExperts does not wrap its kernel with mutations.mutate_kernel: in __init__, "
            "self.kernel = mutate_kernel(mutation, make_moe_kernel(self.choice.backend))"
        )
    E, K, D, F, T = 8, 2, 64, 128, 256
    layer_args = {"e": E, "F": F, "D": D, "dtype": torch.bfloat16}
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K, seed=0)
    correct = _apply(None, layer_args, x, topk_weights, topk_ids, E, K)
    mutated = _apply(mutation, layer_args, x, topk_weights, topk_ids, E, K)
    lo, hi = SUBTLE_BOUNDS[mutation]
    assert lo < rel_err(mutated, correct) < hi, (
        f"{mutation}: {rel_err(mutated, correct):.3g} not in ({lo}, {hi})"
    )


def test_scale_routing_weights_scales_by_0_98_exactly():
    weights, ids = _routing(5, 8, 2, seed=3)
    new_weights, new_ids, emap = mutate_call("scale_routing_weights", weights, ids, None, 8)
    assert torch.equal(new_weights, weights * 0.98) and torch.equal(new_ids, ids) and emap is None


# --- bf16_down_accumulation ------------------------------------------------------------------


class _CountingKernel:
    """torch_moe behind the MoeKernel contract, recording the F of every call; FlashInfer-layout
    weights ([up; gate]) are swapped back first, so the wrapper's slicing of that layout is checked
    on CPU."""

    backend = MoeBackend.TORCH

    def __init__(self) -> None:
        self.F_seen: list[int] = []

    def apply(self, call):
        weights = call.weights
        w13 = weights.w13_eFD
        if weights.backend is MoeBackend.FLASHINFER_CUTLASS:
            from moe_eval.kernels.flashinfer_cutlass import from_flashinfer_w31

            w13 = from_flashinfer_w31(w13)
        self.F_seen.append(weights.w2_eDF.shape[2])
        return torch_moe(
            call.hidden_TD,
            w13,
            weights.w2_eDF,
            call.routing.weights_TK,
            call.routing.ids_TK,
            expert_map_E=call.expert_map_E,
            apply_router_weight_on_input=call.options.apply_router_weight_on_input,
        )


@pytest.mark.parametrize(
    "backend", [MoeBackend.TORCH, MoeBackend.FLASHINFER_CUTLASS]
)  # [gate; up], [up; gate]
@pytest.mark.parametrize("F", [128, 30])  # 30: chunks of 7, 8, 7, 8 (F not a multiple of 4)
def test_bf16_down_accumulation_sums_the_chunks_of_F(backend, F):
    """In fp32 the chunks' sum is the full MoE: only the bf16 rounding of the sum remains."""
    from moe_eval.kernels.flashinfer_cutlass import to_flashinfer_w31

    E, K, D, T = 8, 2, 64, 40
    layer = _layer(E, F, D, torch.float32)
    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = _routing(T, E, K, seed=2)
    kernel_w13 = to_flashinfer_w31(w13) if backend is MoeBackend.FLASHINFER_CUTLASS else w13
    inner = _CountingKernel()
    call = MoeCall(x, MoeWeights(backend, kernel_w13, w2), Routing(topk_weights, topk_ids))
    out = mutate_kernel("bf16_down_accumulation", inner).apply(call)
    assert inner.F_seen == [F * (c + 1) // DOWN_CHUNKS - F * c // DOWN_CHUNKS for c in range(DOWN_CHUNKS)]
    ref = fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == torch.float32 and 0 < rel_err(out, ref) < REL_TOL_BF16_ROUNDING


def test_bf16_down_accumulation_under_ep_and_router_weight_on_input():
    """The wrapper passes the expert map and apply_router_weight_on_input through to every chunk."""
    E, K, D, F, T = 8, 1, 32, 64, 24
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[4:] = torch.arange(4, dtype=torch.int32)
    layer = _layer(4, F, D, torch.float32)
    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    topk_weights, topk_ids = _routing(T, E, K, seed=5)
    kernel = mutate_kernel("bf16_down_accumulation", make_moe_kernel(MoeBackend.TORCH))
    weights = MoeWeights(MoeBackend.TORCH, w13, w2)
    out = kernel.apply(MoeCall(x, weights, Routing(topk_weights, topk_ids), emap, MoeOptions(True)))
    ref = fused_moe_ref(
        x, w13, w2, topk_weights, topk_ids, expert_map_E=emap, apply_router_weight_on_input=True
    )
    assert rel_err(out, ref) < REL_TOL_BF16_ROUNDING
    assert (out[(emap[topk_ids.long()] < 0).all(-1)] == 0).all()  # other ranks' tokens stay 0


def test_other_mutations_leave_the_kernel_alone():
    kernel = make_moe_kernel(MoeBackend.TORCH)
    assert all(
        mutate_kernel(name, kernel) is kernel
        for name in [None, *MUTATIONS]
        if name not in ("bf16_down_accumulation", "silu_slope", "last_bit_race", *PERF_MUTATIONS)
    )


def test_last_bit_race_moves_a_few_elements_one_ulp_and_others_at_the_next_call():
    """The same call twice: each output within one bf16 ulp (toward zero) of the correct kernel's, about 1 %
    of the elements moved, and not the same ones: the bits differ from call to call."""
    case = make_case(64, 8, 2, 64, 32, dtype=torch.bfloat16, device="cpu", seed=31)
    call = case.call()
    plain = make_moe_kernel(MoeBackend.TORCH).apply(call)
    raced = mutate_kernel("last_bit_race", make_moe_kernel(MoeBackend.TORCH))
    torch.manual_seed(0)
    first, again = raced.apply(call), raced.apply(call)
    for out in (first, again):
        moved = out != plain
        assert 0.002 < moved.float().mean().item() < 0.03
        toward_zero = torch.nextafter(plain, torch.zeros_like(plain))
        assert torch.equal(out[moved], toward_zero[moved])
    assert not torch.equal(first, again)


def test_silu_slope_computes_gate_times_a_steeper_sigmoid_and_nothing_else():
    """`--mutate silu_slope:slope=1.01`: the torch kernel's h = gate * sigmoid(1.01 gate) * up, against the
    fp32 reference computed the same way (the Triton kernel's SILU_SLOPE is checked on the GPU)."""
    torch.manual_seed(0)
    E, K, D, F, T = 8, 2, 64, 32, 12
    w13 = (torch.randn(E, 2 * F, D) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F) / F**0.5).bfloat16()
    x = torch.randn(T, D).bfloat16()
    weights, ids = torch.topk(torch.randn(T, E).softmax(-1), K)
    weights, ids = weights / weights.sum(-1, keepdim=True), ids.int()
    weights_obj = MoeWeights(MoeBackend.TORCH, w13, w2)
    kernel = mutate_kernel("silu_slope:slope=1.01", make_moe_kernel(MoeBackend.TORCH))
    call = MoeCall(x, weights_obj, Routing(weights, ids))
    out = kernel.apply(call).float()
    expected = torch.zeros(T, D)
    for t in range(T):
        for k in range(K):
            gu = w13[ids[t, k]].float() @ x[t].float()
            h = gu[:F] * torch.sigmoid(1.01 * gu[:F]) * gu[F:]
            expected[t] += weights[t, k] * (w2[ids[t, k]].float() @ h.bfloat16().float())
    plain = make_moe_kernel(MoeBackend.TORCH).apply(call).float()
    assert (out - expected).norm() / expected.norm() < 1e-2
    assert (out - plain).norm() / plain.norm() > 1e-3  # it changed something


# --- skip_tail_block ---------------------------------------------------------------------------


def _expected_skip(local_TK: torch.Tensor, e: int) -> torch.Tensor:
    """The rule in plain Python: the lowest local expert with more than 16 slots, its last
    (count mod 16) slots in token order."""
    slots = [(t, k) for t in range(local_TK.shape[0]) for k in range(local_TK.shape[1])]
    skip = torch.zeros(local_TK.shape, dtype=torch.bool)
    for expert in range(e):
        mine = [(t, k) for t, k in slots if local_TK[t, k] == expert]
        if len(mine) > 16:
            for t, k in mine[len(mine) - len(mine) % 16 :]:
                skip[t, k] = True
            break
    return skip


E_SKIP, FILLERS = 32, range(16, 32)  # planned experts below 16; fillers never reach 16 slots


def _ids(T: int, planned: dict[int, int], seed: int) -> torch.Tensor:
    """(T, 2) ids, distinct per token: each planned expert on `count` random tokens, in slot t % 2
    (so token order and slot order mix) or the other slot when taken; the free slots cycle over 16
    filler experts, which get at most ceil(2T / 16) slots each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((T, 2), -1, dtype=torch.int32)
    for expert, count in planned.items():
        for t in torch.randperm(T, generator=g)[:count].tolist():
            free = [k for k in (t % 2, 1 - t % 2) if ids[t, k] < 0]
            assert free, "plan too dense for T"
            ids[t, free[0]] = expert
    cycle = iter(list(FILLERS) * T)
    for t in range(T):
        for k in range(2):
            if ids[t, k] < 0:
                ids[t, k] = next(cycle)
    assert (ids[:, 0] != ids[:, 1]).all()
    return ids


@pytest.mark.parametrize(
    "T, planned, victim, skipped",
    [
        (40, {1: 21}, 1, 5),  # expert 0 idle, expert 1 has 21 tokens: 16 fill a block, the last 5 are skipped
        (40, {0: 7, 3: 20}, 3, 4),  # expert 0 fits one block (as every expert of a decode step): passed over
        (64, {2: 33}, 2, 1),  # two full blocks and one token over
    ],
)
def test_skip_tail_block_zeroes_exactly_the_tail(T, planned, victim, skipped):
    K, D, F = 2, 32, 16
    topk_ids = _ids(T, planned, seed=T)
    topk_weights, _ = _routing(T, E_SKIP, K, seed=T)
    expected_skip = _expected_skip(topk_ids.long(), E_SKIP)
    assert int(expected_skip.sum()) == skipped and (topk_ids[expected_skip] == victim).all()

    assert torch.equal(tail_block_slots(topk_ids, None, E_SKIP), expected_skip)
    new_weights, new_ids, _ = mutate_call("skip_tail_block", topk_weights, topk_ids, None, E_SKIP)
    assert torch.equal(new_ids, topk_ids)
    assert torch.equal(new_weights, torch.where(expected_skip, 0.0, topk_weights))

    x = torch.randn(T, D, generator=torch.Generator().manual_seed(7))
    layer_args = {"e": E_SKIP, "F": F, "D": D, "dtype": torch.float32}
    out = _apply("skip_tail_block", layer_args, x, topk_weights, topk_ids, E_SKIP, K)
    layer = _layer(**layer_args)
    ref = fused_moe_ref(
        x,
        layer.w13_weight.data,
        layer.w2_weight.data,
        torch.where(expected_skip, 0.0, topk_weights),
        topk_ids,
    )
    assert rel_err(out, ref) < REL_TOL_FP32


def test_skip_tail_block_under_ep_counts_local_experts_only():
    """Rank 1 of 2 holds experts 4..7 (local 0..3). Global experts 0..3 are not this rank's, so the
    victim is the lowest *local* expert with more than 16 tokens: global 5 (local 1) here, with 19;
    global 4 (local 0) has 9."""
    E, e, K, T = 8, 4, 2, 48
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[4:] = torch.arange(e, dtype=torch.int32)
    g = torch.Generator().manual_seed(11)
    ids = torch.empty(T, K, dtype=torch.int32)
    for t in range(T):
        ids[t, 0] = 5 if t < 19 else (4 if t < 28 else 6 + t % 2)
        ids[t, 1] = int(torch.randint(0, 4, (1,), generator=g))  # other ranks' experts
    skip = tail_block_slots(ids, emap, e)
    assert torch.equal(skip, _expected_skip(emap[ids.long()].long(), e))
    assert skip.sum() == 3 and skip[16:19, 0].all()


@pytest.mark.parametrize(
    "case", ["the victim holds exactly two blocks", "decode-sized call", "no local expert has a slot"]
)
def test_skip_tail_block_skips_nothing_without_a_victim(case):
    """Nothing is skipped when the lowest expert with more than 16 tokens holds a multiple of 16 (even
    though expert 4 here ends in a partial block), when no expert has more than 16 (a decode step of
    16 sequences: 16 tokens is one block), or when every slot belongs to another rank."""
    emap, e = None, E_SKIP
    if case == "the victim holds exactly two blocks":
        T, topk_ids = 48, _ids(48, {1: 32, 4: 21}, seed=3)
    elif case == "decode-sized call":  # expert 0 in all 16 tokens: one full block, no more, not a victim
        T, topk_ids = 16, _ids(16, {0: 16}, seed=3)
    else:
        T, e = 40, 2
        emap = torch.full((E_SKIP,), -1, dtype=torch.int32)
        emap[30:] = torch.arange(2, dtype=torch.int32)
        topk_ids = torch.randint(0, 30, (T, 2), generator=torch.Generator().manual_seed(3)).to(torch.int32)
    weights, _ = _routing(T, E_SKIP, 2, seed=3)
    assert not tail_block_slots(topk_ids, emap, e).any()
    new_weights, _, _ = mutate_call("skip_tail_block", weights, topk_ids, emap, e)
    assert torch.equal(new_weights, weights)


def test_skip_tail_block_with_no_tokens():
    ids = torch.empty(0, 2, dtype=torch.int32)
    weights = torch.empty(0, 2)
    new_weights, _, _ = mutate_call("skip_tail_block", weights, ids, None, 8)
    assert new_weights.shape == (0, 2)


# --- one-expert weight mutations: the same global expert under every placement ----------------


def _w13(e: int, F: int, D: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(e, 2 * F, D, generator=torch.Generator().manual_seed(seed))


def _expert_map(E: int, held: list[int]) -> torch.Tensor:
    """vLLM's expert map of a rank holding global experts `held` in local slots 0, 1, ...: -1 elsewhere."""
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[torch.tensor(held)] = torch.arange(len(held), dtype=torch.int32)
    return emap


def _mutate_pure(name: str, w13: torch.Tensor, emap: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
    """The mutated w13 and the local slots it changed; the input must come back unmodified."""
    before = w13.clone()
    out = mutate_weights(name, w13, emap)
    assert torch.equal(w13, before), f"{name} modified its input in place"
    return out, [s for s in range(w13.shape[0]) if not torch.equal(out[s], before[s])]


@pytest.mark.parametrize("mutation", ONE_EXPERT_MUTATIONS)
def test_one_expert_mutation_hits_one_global_expert_across_two_ranks(mutation):
    """EP over 2 ranks (E=8, e=4): rank 0 holds experts 0-3, rank 1 experts 4-7. Only the rank that holds
    TARGET_EXPERT changes it; the other leaves its weights alone. Both ranks' results, put back
    together, equal the mutation of the whole (TP) w13."""
    E, e, F, D = 8, 4, 32, 8
    full = _w13(E, F, D)
    changed, pieces = [], []
    for rank in range(2):
        held = list(range(rank * e, (rank + 1) * e))
        out, slots = _mutate_pure(mutation, full[held].clone(), _expert_map(E, held))
        changed += [held[s] for s in slots]
        pieces.append(out)
    assert changed == [TARGET_EXPERT]
    assert torch.equal(pieces[1], full[4:])
    assert torch.equal(torch.cat(pieces), mutate_weights(mutation, full.clone(), None))


@pytest.mark.parametrize("mutation", ONE_EXPERT_MUTATIONS)
def test_one_expert_mutation_follows_a_non_contiguous_placement(mutation):
    """A rank holding global experts [6, 0, 3, 5] keeps TARGET_EXPERT = 0 in local slot 1."""
    E, F, D = 8, 32, 8
    _, slots = _mutate_pure(mutation, _w13(4, F, D), _expert_map(E, [6, 0, 3, 5]))
    assert slots == [1]


@pytest.mark.parametrize("mutation", ONE_EXPERT_MUTATIONS)
def test_one_expert_mutation_without_a_map_changes_slot_0(mutation):
    _, slots = _mutate_pure(mutation, _w13(8, 32, 8), None)
    assert slots == [TARGET_EXPERT] == [0]


@pytest.mark.parametrize(
    "mutation, scale",
    [("scale_one_expert", ONE_EXPERT_SCALE), ("scale_one_expert_small", SMALL_EXPERT_SCALE)],
)
def test_scale_one_expert_scales_the_up_rows_only(mutation, scale):
    F = 16
    w13 = _w13(4, F, 8)
    out, _ = _mutate_pure(mutation, w13, _expert_map(8, [6, 0, 3, 5]))
    assert torch.equal(out[1, :F], w13[1, :F]) and torch.equal(out[1, F:], w13[1, F:] * scale)


@pytest.mark.parametrize(
    "held, slot, neighbour",
    [
        ([0, 1, 2, 3], 0, 1),  # the slot after the target's
        ([6, 0, 3, 5], 1, 2),  # ... whichever global expert the rank keeps there (3)
        ([4, 5, 6, 0], 3, 2),  # the target in the last slot: the one before
    ],
)
def test_stale_gate_rows_copies_f_over_8_gate_rows_from_the_neighbour(held, slot, neighbour):
    F = 32
    rows = F // STALE_ROW_FRACTION
    w13 = _w13(4, F, 8)
    out, slots = _mutate_pure("stale_gate_rows", w13, _expert_map(8, held))
    assert slots == [slot]
    differ = [r for r in range(2 * F) if not torch.equal(out[slot, r], w13[slot, r])]
    assert differ == list(range(rows))  # gate rows 0 .. F/8 - 1, no up row
    assert torch.equal(out[slot, :rows], w13[neighbour, :rows])


def test_stale_gate_rows_with_a_single_local_expert_is_a_no_op():
    w13 = _w13(1, 32, 8)
    out, slots = _mutate_pure("stale_gate_rows", w13, _expert_map(8, [0]))
    assert slots == [] and torch.equal(out, w13)


def test_other_mutations_leave_the_weights_alone():
    w13, emap = _w13(4, 16, 8), _expert_map(8, [0, 1, 2, 3])
    others = [name for name in [None, *MUTATIONS] if name not in (*ONE_EXPERT_MUTATIONS, "swap_gate_up")]
    assert all(mutate_weights(name, w13, emap) is w13 for name in others)


# --- routing_temperature_slip ------------------------------------------------------------------


def test_routing_temperature_slip_keeps_each_sum_and_sharpens_the_ratio():
    weights, ids = _routing(64, 8, 2, seed=4)
    emap = _expert_map(8, [4, 5, 6, 7])
    new_weights, new_ids, new_emap = mutate_call("routing_temperature_slip", weights, ids, emap, 4)
    assert torch.equal(new_ids, ids) and new_emap is emap and new_weights.dtype == weights.dtype
    torch.testing.assert_close(new_weights.sum(-1), weights.sum(-1))
    larger = weights.argmax(-1, keepdim=True)
    smaller = 1 - larger
    unequal = weights.gather(1, larger) > weights.gather(1, smaller)
    assert unequal.all()
    assert (new_weights.gather(1, larger) > weights.gather(1, larger)).all()
    assert (new_weights.gather(1, smaller) < weights.gather(1, smaller)).all()
    p = ROUTING_TEMPERATURE_EXPONENT
    expected = weights**p / (weights**p).sum(-1, keepdim=True) * weights.sum(-1, keepdim=True)
    torch.testing.assert_close(new_weights, expected)


def test_routing_temperature_slip_with_top_1_is_a_no_op():
    weights = torch.rand(16, 1, generator=torch.Generator().manual_seed(6))
    ids = torch.randint(0, 8, (16, 1), generator=torch.Generator().manual_seed(6)).to(torch.int32)
    new_weights, _, _ = mutate_call("routing_temperature_slip", weights, ids, None, 8)
    assert torch.equal(new_weights, weights)


def test_routing_temperature_slip_in_bf16_and_on_zero_weights():
    """bf16 weights come back bf16; a token whose weights are all 0 (skipped) stays 0, not nan."""
    weights = torch.tensor([[0.7, 0.2, 0.1], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    new_weights, _, _ = mutate_call("routing_temperature_slip", weights, ids, None, 8)
    assert new_weights.dtype == torch.bfloat16 and torch.equal(new_weights[1], weights[1])
    assert new_weights[0, 0] > weights[0, 0] and new_weights[0, 2] < weights[0, 2]


# --- names and config checks -------------------------------------------------------------------


def test_subtle_mutations_are_listed_and_apply_to_any_bundled_config(tmp_path):
    from moe_eval.configs.config import parse_config

    base = "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 4\nnum_fewshot: 5\nmoe_backend: torch\n"
    tp = parse_config(tmp_path / "a.yaml", base)
    for name in SUBTLE:
        assert name in MUTATIONS
        check_mutation(name, tp)
    assert set(SUBTLE_MUTATIONS) < set(SUBTLE)


# --- GPU: no host sync, so a CUDA graph holds the mutated call ----------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mutation", SUBTLE)
def test_subtle_mutations_capture_in_a_cuda_graph(mutation):
    """Triton backend, Qwen3-30B-A3B-like routing (E=128, K=8) at decode and prefill sizes: the graph's
    replay on new routing equals the eager call."""
    E, K, D, F = 128, 8, 1024, 384
    layer = _layer(E, F, D, torch.bfloat16)
    layer.w13_weight.data = layer.w13_weight.data.cuda()
    layer.w2_weight.data = layer.w2_weight.data.cuda()
    experts = BundledExperts("triton", Layout(LayoutKind.TP), mutation=mutation, max_tokens=300)
    experts.process_weights(layer, E, K)
    for T in (7, 300):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        weights, ids = (t.cuda() for t in _routing(T, E, K, seed=T))
        static = [x.clone(), weights.clone(), ids.clone()]
        for _ in range(2):  # warm up (Triton compiles, tile configs load) outside the graph
            experts.apply(layer, *static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts.apply(layer, *static)
        new_weights, new_ids = (t.cuda() for t in _routing(T, E, K, seed=T + 1))
        static[1].copy_(new_weights)
        static[2].copy_(new_ids)
        graph.replay()
        eager = experts.apply(layer, x, new_weights, new_ids)
        assert torch.equal(out, eager), f"{mutation} T={T}: replay differs from eager"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 16, 2048])  # the decode plan, a small-BLOCK_M plan, the prefill plan
def test_triton_silu_slope_computes_what_the_torch_kernel_does(tokens):
    """`--mutate silu_slope`: the Triton kernels' SILU_SLOPE (every plan's GEMM1) against the torch kernel's
    slope at Qwen3-30B-A3B's TP1 shape; the default slope is the shipped kernel, bit for bit."""
    from moe_eval.kernels.fused_moe import fused_moe

    E, K, D, F = 128, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * F, D, device="cuda", generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device="cuda", generator=g) / F**0.5).bfloat16()
    x = torch.randn(tokens, D, device="cuda", generator=g).bfloat16()
    weights, ids = torch.rand(tokens, E, device="cuda", generator=g).softmax(-1).topk(K)
    weights, ids = (weights / weights.sum(-1, keepdim=True)).contiguous(), ids.int().contiguous()
    sloped = fused_moe(x, w13, w2, weights, ids, silu_slope=1.01).float()
    expected = torch_moe(x, w13, w2, weights, ids, silu_slope=1.01).float()
    plain = fused_moe(x, w13, w2, weights, ids).float()
    assert torch.equal(fused_moe(x, w13, w2, weights, ids, silu_slope=1.0).float(), plain)
    assert rel_err(sloped, expected) < 1e-2 and rel_err(sloped, plain) > 1e-3


@pytest.mark.parametrize(
    "mutation, T, retiled",
    [
        ("small_batch_bypassed", 3, True),  # a decode call: the prefill plan
        ("small_batch_bypassed", 80, False),  # beyond 64 tokens: the tuned plan
        ("poor_tiles:range=M=2-16", 5, True),
        ("poor_tiles:range=M=2-16", 20, False),
    ],
)
def test_the_tile_perf_mutations_compute_the_same_moe_with_other_tiles(mutation, T, retiled, device):
    """The perf mutations change how the Triton kernel computes, not what: the same MoE (fp32, IEEE dots: the
    tiles move only the summation order), with the tiles chosen per call size as the mutation says."""
    E, K, D, F = 8, 2, 32, 64
    layer = _layer(E, F, D, torch.float32)
    w13, w2 = layer.w13_weight.data.to(device), layer.w2_weight.data.to(device)
    weights = MoeWeights(MoeBackend.TRITON, w13, w2)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(3)).to(device)
    topk_weights, topk_ids = (t.to(device) for t in _routing(T, E, K, seed=3))
    kernel = make_moe_kernel(MoeBackend.TRITON)
    seen = []

    class Recording(WrappedKernel):
        def apply(self, call):
            seen.append(call.options.tile_config)
            return self.inner.apply(call)

    call = MoeCall(x, weights, Routing(topk_weights, topk_ids))
    out = mutate_kernel(mutation, Recording(kernel, "recording")).apply(call)
    assert (seen[0] is not None) is retiled
    ref = fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    assert rel_err(out, ref) < 1e-5
    assert torch.allclose(out, kernel.apply(call), rtol=1e-5, atol=1e-6)


def test_last_bit_race_is_refused_where_no_gate_can_see_it(tmp_path):
    """Only the repeat gate sees a race in the last bits: without it the mutated run could pass, proving
    nothing (exit 4, the file, the keys and their values named)."""
    from moe_eval.configs.config import parse_config
    from moe_eval.core.errors import ConfigError

    base = "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 4\nnum_fewshot: 5\nmoe_backend: torch\n"
    with pytest.raises(ConfigError, match=r"a\.yaml does not gate the repeat check \(repeat_gate: false"):
        check_mutation("last_bit_race", parse_config(tmp_path / "a.yaml", base))
    with pytest.raises(ConfigError, match="repeat_gate: true, logprob_texts: 0"):
        check_mutation(
            "last_bit_race", parse_config(tmp_path / "b.yaml", base + "repeat_gate: true\nlogprob_texts: 0\n")
        )
    check_mutation("last_bit_race", parse_config(tmp_path / "c.yaml", base + "repeat_gate: true\n"))
