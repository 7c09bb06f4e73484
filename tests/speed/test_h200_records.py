"""The speed gate's rule on what the H200 measured (docs/data/speed_h200/, docs/perf.md "Served speed"): the
GPU canary TP1 rows served by CUDA vLLM 0.26.0 with CUDA graphs, re-judged here by the rule as it is now."""

from __future__ import annotations

import json

import pytest

from moe_eval.core.moe_timing import TimingSummary
from moe_eval.gates.speed import compare, speed_check

MARGIN = 0.15  # the config default


@pytest.fixture(scope="module")
def run2(repo_root):
    rows = json.loads((repo_root / "docs/data/speed_h200/canary-tp1-run2.json").read_text())
    return {r["mutation"] or r["config"].removeprefix("Canary-Qwen3-MoE-BF16-"): r for r in rows}


def _timing(row: dict) -> TimingSummary:
    return TimingSummary.from_dict(row["timing"]["moe"])


@pytest.mark.parametrize(
    "mutation, slow_ranges",
    [
        ("extra_weight_copy", {"M=1", "M=2-16", "M=17-64", "M=65-256"}),
        ("small_batch_bypassed", {"M=1", "M=2-16", "M=17-64"}),  # the calls of <= 64 tokens only
        ("poor_tiles", {"M=17-64"}),  # its range only
    ],
)
def test_each_perf_mutation_fails_the_gate_in_the_ranges_it_slows_and_nowhere_else(
    run2, mutation, slow_ranges
):
    reference = _timing(run2["triton"])  # the same config before the change (--baseline)
    check, _ = speed_check(_timing(run2[mutation]), reference, MARGIN, "before")
    assert not check.passed
    judged = compare(_timing(run2[mutation]), reference, MARGIN)
    assert {r.range for r in judged if r.passed is False} == slow_ranges
    # and nothing else of the row failed: the mutation is the same MoE, slower
    assert [c["name"] for c in run2[mutation]["checks"] if not c["passed"]] == ["speed_gate"]


def test_the_eager_prefill_ranges_noise_fails_nothing_where_the_margin_alone_would(run2):
    """poor_tiles slows M=17-64 only; its M=1024-4095 read x1.19 of the same kernel's by noise (16 eager,
    host-launch-bound calls, 13 % standard error): beyond the margin, not beyond SPEED_Z standard errors."""
    ranges = {r.range: r for r in compare(_timing(run2["poor_tiles"]), _timing(run2["triton"]), MARGIN)}
    noisy = ranges["M=1024-4095"]
    assert noisy.ratio > 1 + MARGIN and noisy.passed and noisy.z < 3


def test_the_correct_bundled_kernel_is_not_slower_than_vllms_in_any_range(run2):
    check, section = speed_check(_timing(run2["triton"]), _timing(run2["vllm-triton"]), MARGIN, "vllm")
    assert check.passed
    # vLLM's row compiled fused_moe_kernel while serving (its JIT monitor counted 1) inside one prefill range:
    # a 1.1 s call there, which the gate must neither trust nor fail on
    vllm = {r.range: r for r in _timing(run2["vllm-triton"]).ranges}
    assert vllm["M=1024-4095"].mean_us > 10_000
