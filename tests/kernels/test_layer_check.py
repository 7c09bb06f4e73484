"""The layer check in-process: the torch definition (rows picked, joint estimates, the activation direction),
the plugin's per-layer tables, the mutations it must see and name, the Triton kernels against the torch
definition (Triton's interpreter on the CPU; on a GPU, under CUDA graphs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_eval.core import layer_cells
from moe_eval.core.layer_cells import CELL, ROW, LayerFile
from moe_eval.core.layout import Layout, LayoutKind
from moe_eval.core.plugin_protocol import STATS_INTERVAL_SECONDS, layer_range_index, layer_range_names
from moe_eval.gates.layer_gate import LayerCheckLimits, layer_checks, summarize
from moe_eval.kernels import layer_check as lc
from moe_eval.kernels import layer_check_ref as ref
from moe_eval.kernels import plugin
from moe_eval.kernels.fused_moe import fused_moe_ref
from moe_eval.kernels.moe_call import MoeBackend, MoeCall, MoeWeights, Routing
from moe_eval.kernels.mutations import RANGE_EXPERT_SCALE, RANGE_MUTATIONS, TARGET_EXPERT, range_target
from moe_eval.kernels.plugin import BundledExperts
from moe_eval.kernels.torch_moe import torch_moe
from tests.kernels.conftest import HAS_GPU

# The shipped defaults (config.py): the limits these tests hold the estimates to.
LIMITS = LayerCheckLimits(margin=0.25, scale_bound=0.005, z=5.0, activation_bound=0.002, power=0.01)
# A correct bf16 kernel's scale estimate per expert: rounding only. Measured on this CPU, canary-like shapes
# (E=8, K=2, D=256, F=128): |s| <= 5e-4; 2e-3 leaves room and is 5x under the 1% bug.
CORRECT_SCALE_TOL = 2e-3


def _call(x, weights, ids, expert_map, w13, w2):
    """The call as vLLM hands it to the plugin, its weights as loaded (the layer check's reference)."""
    return MoeCall(x, MoeWeights(MoeBackend.REFERENCE, w13, w2), Routing(weights, ids), expert_map)


def _routing(T: int, E: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.topk(torch.randn(T, E, generator=g).softmax(-1), K)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def _layer(e: int, F: int, D: int, seed: int = 0, expert_map=None, index: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        w13_weight=torch.nn.Parameter((torch.randn(e, 2 * F, D, generator=g) / D**0.5).bfloat16(), False),
        w2_weight=torch.nn.Parameter((torch.randn(e, D, F, generator=g) / F**0.5).bfloat16(), False),
        expert_map=expert_map,
        apply_router_weight_on_input=False,
        activation="silu",
        layer_name=f"model.layers.{index}.mlp.experts",
    )


# --- which rows a call compares --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "count", "rows"),
    [
        (1, 1, [0]),  # one decode sequence: its row
        (3, 3, [0, 1, 2]),  # a small call: every row
        (63, 4, [0, 20, 41, 62]),  # first, last, evenly between
    ],
)
def test_spread_rows_cover_the_call(tokens, count, rows):
    assert ref.spread_rows(tokens, count) == rows


def test_a_background_call_spreads_and_any_other_compares_its_needy_rows_from_a_moving_start():
    needy = torch.tensor([False, True, False, True, True, False, False, True])
    assert ref.pick_rows(8, seen=0, needy_T=needy, cap=3, burst=4, period=16) == [0, 3, 7]  # burst
    assert ref.pick_rows(8, seen=16, needy_T=needy, cap=3, burst=4, period=16) == [0, 3, 7]  # period
    assert (5 * ref.ROW_STRIDE) % 8 == 3  # call 5 searches from row 3: 3, 4, 5, 6, 7, 0, ...
    assert ref.pick_rows(8, seen=5, needy_T=needy, cap=3, burst=4, period=16) == [3, 4, 7]
    assert ref.pick_rows(8, seen=5, needy_T=needy, cap=2, burst=4, period=16) == [3, 4]
    assert ref.pick_rows(8, seen=5, needy_T=torch.zeros(8, dtype=torch.bool), cap=3, burst=4, period=16) == []


# --- the arithmetic --------------------------------------------------------------------------------


def test_exact_contributions_sum_to_the_fp32_oracle():
    """With the oracle's own output (fp32) as the served one, the residual is fp32 summation order only."""
    g = torch.Generator().manual_seed(3)
    E, K, D, F, T = 8, 2, 64, 48, 20
    layer = _layer(E, F, D)
    x = torch.randn(T, D, generator=g)
    weights, ids = _routing(T, E, K, g)
    w13, w2 = layer.w13_weight.data.float(), layer.w2_weight.data.float()
    out = fused_moe_ref(x, w13, w2, weights, ids)
    sums = ref.call_row_sums(_call(x, weights, ids, None, w13, w2), out, list(range(T)))
    rows, sq_res, sq_exact, _, nonfinite = sums.row_R11.sum(0)[:5].tolist()
    assert rows == T and sq_exact > 1 and sq_res / sq_exact < 1e-12 and nonfinite == 0
    assert int(sums.valid_RK.sum()) == T * K  # every slot counted once


def test_rows_of_garbage_input_are_left_out_and_nan_outputs_counted():
    """A CUDA graph's padding rows can hold NaN hidden states (seen on the H200): left out. A NaN output where
    the exact MoE is finite is a bug: counted."""
    g = torch.Generator().manual_seed(4)
    E, K, D, F, T = 8, 2, 64, 48, 4
    layer = _layer(E, F, D)
    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    x = torch.randn(T, D, generator=g).bfloat16()
    weights, ids = _routing(T, E, K, g)
    out = torch_moe(x, w13, w2, weights, ids)
    rows = list(range(T))
    clean = ref.call_row_sums(_call(x, weights, ids, None, w13, w2), out, rows).row_R11.sum(0)
    x[3] = float("nan")  # the last row: padding
    padded = ref.call_row_sums(_call(x, weights, ids, None, w13, w2), out, rows)
    assert padded.row_R11[:, 4].sum() == 0 and padded.row_R11[:, 1].sum() < clean[1]
    assert torch.isfinite(padded.slot_RK6).all() and not padded.valid_RK[3].any()
    out[0, :5] = float("nan")  # a real row: the kernel wrote NaN
    broken = ref.call_row_sums(_call(x, weights, ids, None, w13, w2), out, rows)
    assert broken.row_R11[:, 4].sum() == 5


def _correlated_layer(E: int, F: int, D: int) -> SimpleNamespace:
    """Experts 5 and 6 nearly the same (their outputs correlate ~0.95): where projecting on one expert's
    output alone leaks one's error into the other."""
    layer = _layer(E, F, D, seed=5)
    g = torch.Generator().manual_seed(6)
    w13, w2 = layer.w13_weight.data.float(), layer.w2_weight.data.float()
    w13[5] = w13[6] + 0.3 * torch.randn(w13[6].shape, generator=g) / D**0.5
    w2[5] = w2[6] + 0.3 * torch.randn(w2[6].shape, generator=g) / F**0.5
    layer.w13_weight.data, layer.w2_weight.data = w13.bfloat16(), w2.bfloat16()
    return layer


def test_the_joint_estimate_names_the_right_expert_at_the_right_size():
    """+0.5 % in expert 6 only. Each slot's direction made orthogonal to its row's other slots reads +0.005 in
    expert 6 and ~0 in its twin 5; a projection on expert 5's own output reads a large share of 6's error."""
    E, K, D, F = 8, 2, 128, 64
    layer = _correlated_layer(E, F, D)
    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    g = torch.Generator().manual_seed(7)
    joint, naive = np.zeros((E, 2)), np.zeros((E, 2))
    for _ in range(30):
        T = 16
        x = torch.randn(T, D, generator=g).bfloat16()
        logits = torch.randn(T, E, generator=g)
        logits[:, 5:7] += 3.0  # rows route to both twins
        weights, ids = torch.topk(logits.softmax(-1), K)
        weights, ids = weights / weights.sum(-1, keepdim=True), ids.int()
        served = weights.clone()
        served[ids == 6] *= 1.005
        out = torch_moe(x, w13, w2, served, ids)
        sums = ref.call_row_sums(_call(x, weights, ids, None, w13, w2), out, list(range(T)))
        y, _, _, ids_RK, _ = ref.slot_vectors(x, weights, ids, None, w13, w2, False, list(range(T)))
        res = out.float() - y.sum(1)
        for r in range(T):
            for k in range(K):
                e = int(ids_RK[r, k])
                joint[e] += sums.slot_RK6[r, k, :2].numpy()
                naive[e] += [float((y[r, k] * res[r]).sum()), float((y[r, k] ** 2).sum())]
    s_joint, s_naive = joint[:, 0] / joint[:, 1], naive[:, 0] / naive[:, 1]
    assert s_joint[6] == pytest.approx(0.005, abs=5e-4)
    assert abs(s_joint[5]) < 5e-4  # the twin reads nothing of it
    assert s_naive[5] > 0.0015  # the old estimate blamed the twin (0.0020 here: 40 % of 6's error)


def test_the_activation_direction_reads_a_silu_slope_error_and_no_expert_is_blamed():
    """gate * sigmoid(1.005 gate) * up in every expert (`--mutate silu_slope`): the activation direction
    reads +0.005 (to first order), no expert's scale is off."""
    E, K, D, F = 8, 2, 256, 128
    layer = _layer(E, F, D, seed=9)
    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    g = torch.Generator().manual_seed(8)
    check = lc.LayerCheck("torch", E, None, {}, 2048, target=10**6)  # every row of every call compared
    index = check.register_layer()
    for T in (1, 8, 40, 200) * 6:
        x = torch.randn(T, D, generator=g).bfloat16()
        weights, ids = _routing(T, E, K, g)
        out = torch_moe(x, w13, w2, weights, ids, silu_slope=1.005)
        check.observe(index, _call(x, weights, ids, None, w13, w2), out)
    meta, cells, rows, seen, routed = check.snapshot()
    summary = summarize([LayerFile(meta, cells, rows, seen, routed)], LIMITS, 1)
    checks = {c.name: c for c in layer_checks(summary, LIMITS)}
    assert not checks["layer_check_activation"].passed and checks["layer_check_experts"].passed
    pooled = rows[0].sum(0)
    eps = pooled[ROW["sa"]] / pooled[ROW["sb"]]
    assert eps == pytest.approx(0.005, rel=0.1)


# --- the plugin's tables, and the mutations they must see --------------------------------------------


def _run(mutation, sizes, E=8, K=2, D=256, F=128, expert_map=None, rank=None, calls=8, layers=1, target=16):
    plugin._LAYER_CHECKS.clear()
    e = E if expert_map is None else int((expert_map >= 0).sum())
    tp = Layout(LayoutKind.TP)
    held = [
        BundledExperts("torch", tp, mutation=mutation, max_tokens=2048, rank=rank or {})
        for _ in range(layers)
    ]
    built = [_layer(e, F, D, seed=j, expert_map=expert_map, index=j) for j in range(layers)]
    for experts, layer in zip(held, built, strict=True):
        experts.process_weights(layer, E, K)
        experts.check.target = target
    g = torch.Generator().manual_seed(1)
    for T in sizes:
        for _ in range(calls):
            weights, ids = _routing(T, E, K, g)
            x = torch.randn(T, D, generator=g).bfloat16()
            for experts, layer in zip(held, built, strict=True):
                experts.apply(layer, x, weights, ids)
    check = held[0].check
    return summarize([LayerFile(*check.snapshot())], LIMITS, 1), check


SIZES = (1, 4, 16, 64, 200, 600, 1500)


def _off(summary):
    return [
        c
        for c in summary.experts
        if abs(c.scale) > LIMITS.scale_bound and (c.z is None or c.z >= c.threshold)
    ]


def test_a_correct_kernel_passes_every_check_and_stops_comparing_once_the_cells_are_full():
    summary, check = _run(None, SIZES, calls=16)
    checks = {c.name: c for c in layer_checks(summary, LIMITS)}
    assert all(c.passed for c in checks.values()), [c.detail for c in checks.values()]
    assert max(abs(c.scale) for c in summary.experts) < CORRECT_SCALE_TOL
    # The torch kernel rounds less than vLLM's arithmetic (no per-slot rounding): below 1 in every range.
    assert all(row.ratio < 1.0 for row in summary.ranges)
    # Evidence per cell: 16 calls of 1500 tokens (24,000 rows) were compared on far fewer rows.
    rows = check.layers[0].rows[layer_range_index(1500)]
    assert (
        rows[ROW["rows"]] < 400 and check.layers[0].cells[layer_range_index(1500), :, CELL["n"]].min() >= 16
    )


@pytest.mark.parametrize("mutation", ["scale_expert_decode", "scale_expert_mid", "scale_expert_large"])
def test_a_range_confined_one_percent_bug_fails_its_range_and_only_there(mutation):
    summary, _ = _run(mutation, SIZES)
    checks = {c.name: c for c in layer_checks(summary, LIMITS)}
    assert checks["layer_check_coverage"].passed and not checks["layer_check_experts"].passed
    low, high = RANGE_MUTATIONS[mutation]
    off = _off(summary)
    assert {c.expert for c in off} == {TARGET_EXPERT}
    for cell in off:
        sizes_in_range = [t for t in SIZES if layer_range_names()[layer_range_index(t)] == cell.range]
        assert all(low <= t and (high is None or t <= high) for t in sizes_in_range), cell
        assert cell.scale == pytest.approx(RANGE_EXPERT_SCALE - 1, abs=1.5e-3)


def test_a_two_percent_bug_in_one_layer_fails_that_layer_and_is_named_there():
    summary, _ = _run("scale_expert:expert=3,layer=2,range=M=2-16,scale=0.98", (1, 4, 16, 200), layers=4)
    off = _off(summary)
    assert off and {(c.expert, c.layer) for c in off if c.layer is not None} == {(3, 2)}
    named = next(c for c in off if c.layer == 2)
    assert named.range == "M=2-16" and named.scale == pytest.approx(-0.02, abs=2e-3)


def test_scaling_targets_follow_the_parameters():
    assert range_target("scale_expert_last_rank", 10, 8, last_rank=True) == 7
    assert range_target("scale_expert_last_rank", 10, 8, last_rank=False) is None
    assert range_target("scale_expert:expert=5,layer=1,range=M=1", 1, 8, True, layer=1) == 5
    assert range_target("scale_expert:expert=5,layer=1,range=M=1", 2, 8, True, layer=1) is None
    assert range_target("scale_expert:expert=5,layer=1,range=M=1", 1, 8, True, layer=0) is None
    assert range_target("scale_expert:range=1024-", 4096, 8, True, layer=3) == TARGET_EXPERT


def test_a_target_the_model_lacks_fails_the_server_start():
    plugin._LAYER_CHECKS.clear()
    experts = BundledExperts("torch", Layout(LayoutKind.TP), mutation="scale_expert:expert=9", max_tokens=64)
    with pytest.raises(ValueError, match="expert 9 is not one of the model's 8 experts"):
        experts.process_weights(_layer(8, 16, 32), 8, 2)


def test_the_one_rank_bug_hits_the_last_rank_only_and_the_last_expert():
    # TEP2 over 8 experts: rank 1 holds 4..7 and serves the bug; rank 0 stays right.
    rank1 = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)
    rank0 = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)
    tep = {"use_ep": True, "ep_size": 2}
    last, check1 = _run("scale_expert_last_rank", (16, 200), expert_map=rank1, rank=tep | {"ep_rank": 1})
    first, check0 = _run("scale_expert_last_rank", (16, 200), expert_map=rank0, rank=tep | {"ep_rank": 0})
    assert not {c.name: c for c in layer_checks(last, LIMITS)}["layer_check_experts"].passed
    assert {c.name: c for c in layer_checks(first, LIMITS)}["layer_check_experts"].passed
    assert check1.experts_held == [4, 5, 6, 7] and check0.experts_held == [0, 1, 2, 3]
    assert {c.expert for c in last.experts} <= {4, 5, 6, 7} and {c.expert for c in first.experts} <= {
        0,
        1,
        2,
        3,
    }


def test_the_check_reads_the_weights_as_loaded_not_as_mutated():
    """scale_one_expert changes the weights before conversion: the check compares with the loaded ones."""
    summary, _ = _run("scale_one_expert", (16, 200))
    off = _off(summary)
    assert off and all(c.expert == TARGET_EXPERT and c.scale == pytest.approx(-0.05, abs=3e-3) for c in off)


def test_the_golden_reference_backend_is_never_checked():
    plugin._LAYER_CHECKS.clear()
    experts = BundledExperts("reference", Layout(LayoutKind.TP), max_tokens=64)
    experts.process_weights(_layer(4, 16, 32), 4, 2)
    assert experts.check is None


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("MOE_EVAL_LAYER_CHECK", "0")
    plugin._LAYER_CHECKS.clear()
    experts = BundledExperts("torch", Layout(LayoutKind.TP), max_tokens=64)
    experts.process_weights(_layer(4, 16, 32), 4, 2)
    assert experts.check is None


def test_the_tables_are_flushed_to_the_run_folder(tmp_path):
    path = tmp_path / "layer-check" / "1.npz"
    check = lc.LayerCheck("torch", 8, path, {"tp_rank": 0, "tp_size": 1}, 2048)
    first, second = check.register_layer("model.layers.0.mlp.experts"), check.register_layer()
    layer = _layer(8, 32, 64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).bfloat16()
    weights, ids = _routing(5, 8, 2, g)
    out = torch_moe(x, layer.w13_weight.data, layer.w2_weight.data, weights, ids)
    for index in (first, second, second):
        check.observe(index, _call(x, weights, ids, None, layer.w13_weight.data, layer.w2_weight.data), out)
    time.sleep(STATS_INTERVAL_SECONDS * 3)
    f = layer_cells.read(path)
    assert f.meta["counted_on"] == "host" and f.meta["layers"] == ["model.layers.0.mlp.experts", "layer1"]
    assert (
        f.seen[:, 1].tolist() == [1, 2] and f.rows[0, 1, ROW["rows"]] == 5 and f.cells.shape == (2, 7, 8, 7)
    )


def test_a_paused_check_counts_and_compares_nothing_and_says_so_in_its_file(tmp_path):
    """The speed measurement's pause (evaluate/moe_speed.switch_layer_check): while the folder holds
    LAYER_CHECK_PAUSE the process's flusher pauses the check, whose calls are then neither counted nor
    compared, and the file's meta says "paused"; without it the check counts again. The harness's wait reads
    the same meta back, and names the processes that do not follow."""
    from moe_eval.evaluate.moe_speed import switch_layer_check

    run_dir = tmp_path / "run"
    path = run_dir / "layer-check" / "1.npz"
    check = lc.LayerCheck("torch", 8, path, {"tp_rank": 0, "tp_size": 1}, 2048)
    index = check.register_layer()
    layer = _layer(8, 32, 64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).bfloat16()
    weights, ids = _routing(5, 8, 2, g)
    out = torch_moe(x, layer.w13_weight.data, layer.w2_weight.data, weights, ids)

    def call() -> None:
        check.observe(index, _call(x, weights, ids, None, layer.w13_weight.data, layer.w2_weight.data), out)

    call()  # the flusher starts with the first call
    assert switch_layer_check(run_dir, paused=True) is None
    assert check.paused and layer_cells.read_meta(path)["paused"] is True
    before = check.snapshot()
    for _ in range(3):
        call()
    after = check.snapshot()
    for counted_before, counted_after in zip(before[1:], after[1:], strict=True):
        assert np.array_equal(counted_before, counted_after)  # cells, rows, seen, routed: untouched
    assert switch_layer_check(run_dir, paused=False) is None
    assert not check.paused and not (run_dir / "layer-check" / "paused").exists()
    call()
    assert check.snapshot()[3].sum() == before[3].sum() + 1  # counted again
    # A process that never follows (here: a file nobody rewrites) is named, not waited for forever.
    layer_cells.write(run_dir / "layer-check" / "2.npz", {"paused": False}, *[np.zeros((0,))] * 4)
    why = switch_layer_check(run_dir, paused=True, wait=3 * STATS_INTERVAL_SECONDS)
    assert why == f"1 of 2 layer-check processes did not say they paused in {3 * STATS_INTERVAL_SECONDS:g} s"
    empty = tmp_path / "other"
    assert switch_layer_check(empty, paused=True, wait=0.1).startswith("no layer-check process had written")


# --- the Triton kernels against the torch definition ---------------------------------------------

_INTERPRETED = r"""
import json, sys
import torch
from moe_eval.kernels import layer_check as lc
from moe_eval.kernels.moe_call import MoeBackend, MoeCall, MoeWeights, Routing
from moe_eval.kernels.torch_moe import torch_moe
def _call(x, weights, ids, expert_map, w13, w2):
    return MoeCall(x, MoeWeights(MoeBackend.REFERENCE, w13, w2), Routing(weights, ids), expert_map)
torch.manual_seed(0)
E, K, D, F = 8, 2, 96, 80
w13 = (torch.randn(E, 2 * F, D) / D**0.5).bfloat16(); w2 = (torch.randn(E, D, F) / F**0.5).bfloat16()
emap = torch.tensor([0, 1, -1, -1, 2, 3, -1, -1], dtype=torch.int32)
calls = []
for T in (1, 3, 1, 37, 70, 1, 5, 1, 1, 1, 2):  # background calls, then needy ones (target 3)
    w, ids = torch.topk(torch.randn(T, E).softmax(-1), K); w = w / w.sum(-1, keepdim=True)
    calls.append((torch.randn(T, D).bfloat16(), w, ids.int()))
result = []
for m in (None, emap):
    lw13, lw2 = (w13[[0, 1, 4, 5]], w2[[0, 1, 4, 5]]) if m is not None else (w13, w2)
    snaps = []
    for device in (None, torch.device("cpu")):
        check = lc.LayerCheck("t", E, None, {}, 2048, target=3, burst=2, period=5)
        if device is not None:
            check.attach_device(device, pin=False)
        layer = check.register_layer()
        for x, w, ids in calls:
            out = torch_moe(x, lw13, lw2, w, ids, expert_map_E=m)
            check.observe(layer, _call(x, w, ids, m, lw13, lw2), out)
        _, cells, rows, seen, routed = check.snapshot()
        snaps.append([cells.tolist(), rows.tolist(), seen.tolist(), routed.tolist()])
        if device is not None:
            # The pick kernel itself reads the pause flag (what a captured call does at each replay; an eager
            # call paused launches nothing): a paused call is neither counted nor compared.
            x, w, ids = calls[3]
            out = torch_moe(x, lw13, lw2, w, ids, expert_map_E=m)
            check.set_paused(True)
            check._observe_on_device(check.layers[layer], 3, x, out, w, ids, m, lw13, lw2, False)
            paused_snap = [a.tolist() for a in check.snapshot()[1:]]
            check.set_paused(False)
            check._observe_on_device(check.layers[layer], 3, x, out, w, ids, m, lw13, lw2, False)
            resumed_seen = check.snapshot()[3].tolist()
            snaps.append([paused_snap, resumed_seen])
    result.append(snaps)
json.dump(result, sys.stdout)
"""


# Slow tier (CI runs it): 33 s of Triton's interpreter on 2 cores, a third of what kept the default tier over
# 10 minutes on a fresh clone (10.8 at ff5bede).
@pytest.mark.slow
def test_triton_kernels_match_the_torch_definition_in_the_interpreter():
    """The GPU kernels' arithmetic and row picking, run by Triton's interpreter on the CPU (its bf16
    conversion truncates, so the incumbent's sums are compared on a GPU only)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for host, device, (paused, resumed_seen) in json.loads(done.stdout):
        (h_cells, h_rows, h_seen, h_routed), (d_cells, d_rows, d_seen, d_routed) = map(
            lambda s: [np.array(t) for t in s], (host, device)
        )
        # paused: the tables exactly as before the call; resumed: the same call counted
        assert all(
            np.array_equal(np.array(a), b) for a, b in zip(paused, (d_cells, d_rows, d_seen, d_routed))
        )
        assert np.array(resumed_seen).sum() == d_seen.sum() + 1
        assert np.array_equal(h_seen, d_seen) and h_seen.sum() == 11
        assert np.array_equal(h_routed, d_routed) and h_routed.sum() > 0
        assert np.array_equal(h_cells[..., CELL["n"]], d_cells[..., CELL["n"]])  # the same rows picked
        # a is a signed sum of rounding-sized residuals: fp32 summation order moves it by ~1e-6 (of ~1e-2).
        a_tol = 1e-3 * np.abs(h_cells[..., CELL["a"]]).max()
        np.testing.assert_allclose(d_cells[..., CELL["a"]], h_cells[..., CELL["a"]], rtol=0, atol=a_tol)
        for field in ("b", "vb"):
            np.testing.assert_allclose(
                d_cells[..., CELL[field]], h_cells[..., CELL[field]], rtol=2e-3, atol=1e-8
            )
        for field in ("calls", "rows", "sq_exact", "nonfinite", "sb"):
            np.testing.assert_allclose(d_rows[..., ROW[field]], h_rows[..., ROW[field]], rtol=2e-3, atol=1e-8)
        for field in ("sq_res", "svb"):  # squares of rounding residuals: 1 % between summation orders
            np.testing.assert_allclose(d_rows[..., ROW[field]], h_rows[..., ROW[field]], rtol=1e-2, atol=1e-8)
        sa_tol = 1e-2 * np.abs(h_rows[..., ROW["sa"]]).max()
        np.testing.assert_allclose(d_rows[..., ROW["sa"]], h_rows[..., ROW["sa"]], rtol=0, atol=sa_tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("expert_map", [False, True])
def test_device_path_matches_torch_under_cuda_graphs(expert_map):
    """Qwen3-30B-A3B's TP1 MoE shape: the tables of captured calls, replayed, equal the torch definition's
    on the same inputs and the same sequence of calls (background and needy picks alike)."""
    E, K, D, F = 128, 8, 2048, 768
    g = torch.Generator().manual_seed(0)
    emap, e = None, E
    if expert_map:
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[E // 2 :] = torch.arange(E // 2, dtype=torch.int32)
        e = E // 2
    w13 = (torch.randn(e, 2 * F, D, generator=g) / D**0.5).bfloat16().cuda()
    w2 = (torch.randn(e, D, F, generator=g) / F**0.5).bfloat16().cuda()
    emap_d = emap.cuda() if emap is not None else None
    host = lc.LayerCheck("triton", E, None, {}, 8192, target=2, burst=1, period=3)
    device = lc.LayerCheck("triton", E, None, {}, 8192, target=2, burst=1, period=3)
    device.attach_device(torch.device("cuda"))
    h_layer, d_layer = host.register_layer(), device.register_layer()
    device.prepare(w13, w2, K, emap_d, False)
    graphs = []
    for T in (1, 24, 100):  # a decode step, a decode batch, a prefill chunk: one graph each
        x = torch.randn(T, D, generator=g).bfloat16().cuda()
        weights, ids = _routing(T, E, K, g)
        weights, ids = weights.cuda(), ids.cuda()
        out = torch_moe(x, w13, w2, weights, ids, expert_map_E=emap_d)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            device.observe(d_layer, _call(x, weights, ids, emap_d, w13, w2), out)
        graphs.append((graph, (x, out, weights, ids)))
    for _ in range(3):
        for graph, args in graphs:
            graph.replay()
            torch.cuda.synchronize()
            host.observe(h_layer, _call(args[0], args[2], args[3], emap_d, w13, w2), args[1])
    _, h_cells, h_rows, h_seen, h_routed = host.snapshot()
    _, d_cells, d_rows, d_seen, d_routed = device.snapshot()  # the pinned mirrors the flusher reads
    assert np.array_equal(h_seen, d_seen) and np.array_equal(h_cells[..., 0], d_cells[..., 0])
    assert np.array_equal(h_routed, d_routed)
    # a is a signed sum of rounding-sized residuals: fp32 summation order moved one cell by 2.6 % of itself
    # (2e-6 of a largest |a| of 1e-3, H200): held to 1 % of the largest.
    a_tol = 1e-2 * np.abs(h_cells[..., CELL["a"]]).max()
    np.testing.assert_allclose(d_cells[..., CELL["a"]], h_cells[..., CELL["a"]], rtol=0, atol=a_tol)
    for field in ("b", "vb"):
        np.testing.assert_allclose(d_cells[..., CELL[field]], h_cells[..., CELL[field]], rtol=1e-2, atol=1e-9)
    sa_tol = 1e-2 * np.abs(h_rows[..., ROW["sa"]]).max()
    np.testing.assert_allclose(d_rows[..., ROW["sa"]], h_rows[..., ROW["sa"]], rtol=0, atol=sa_tol)
    for field in ("calls", "rows", "sq_res", "sq_exact", "sq_ref", "sb"):
        np.testing.assert_allclose(d_rows[..., ROW[field]], h_rows[..., ROW[field]], rtol=1e-2, atol=1e-9)
    # Paused, the same graphs replay their check kernels, which read the flag and count nothing; resumed, the
    # next replays count again (the speed measurement pauses the check while a server serves its timed
    # requests, with the graphs captured long before).
    device.set_paused(True)
    for graph, _ in graphs:
        graph.replay()
    torch.cuda.synchronize()
    paused = device.snapshot()
    assert np.array_equal(paused[3], d_seen) and np.array_equal(paused[1], d_cells)
    assert np.array_equal(paused[4], d_routed)
    device.set_paused(False)
    for graph, _ in graphs:
        graph.replay()
    torch.cuda.synchronize()
    assert device.snapshot()[3].sum() == d_seen.sum() + len(graphs)
    # The incumbent's: a bf16 rounding that falls the other way on one element (summation order) moves the
    # signed sum a_inc relatively more, so compare the scale it gives where a cell has evidence.
    b = h_cells[..., CELL["b"]]
    has = b > 0
    np.testing.assert_allclose(
        d_cells[..., CELL["a_inc"]][has] / b[has], h_cells[..., CELL["a_inc"]][has] / b[has], atol=1e-3
    )
