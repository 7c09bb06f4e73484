"""What an H100 served on 2026-12-05 (docs/data/speed_h100/, docs/perf.md "On an H100"): the GPU canary TP1
rows in CUDA vLLM 0.26.0 with CUDA graphs, the first served records with the timer's replay count, re-judged
here by the rule as it is now."""

from __future__ import annotations

import json

import pytest

from moe_eval.core.moe_timing import TimingSummary
from moe_eval.gates.speed import compare, speed_check

MARGIN = 0.15  # the config default
GRAPH_REPLAYED = ("M=1", "M=2-16", "M=17-64", "M=65-256")  # the decode ranges, inside CUDA graphs
EAGER = ("M=257-1023", "M=1024-4095", "M>=4096")  # prefill chunks, outside them


def _rows(repo_root, name: str) -> dict:
    rows = json.loads((repo_root / "docs/data/speed_h100" / name).read_text())
    return {r["config"].removeprefix("Canary-Qwen3-MoE-BF16-"): r for r in rows}


def _timing(row: dict) -> TimingSummary:
    return TimingSummary.from_dict(row["timing"]["moe"])


@pytest.fixture(scope="module")
def shipped(repo_root):
    return _rows(repo_root, "canary-tp1-lite-shipped.json")


def test_every_served_row_counts_its_graph_replays_and_the_eager_prefill_apart(shipped):
    assert set(shipped) == {"vllm-triton", "triton", "fi-cutlass"}
    for name, row in shipped.items():
        ranges = {r.range: r for r in _timing(row).ranges}
        for rng in GRAPH_REPLAYED:
            assert ranges[rng].replayed == ranges[rng].calls > 0 and ranges[rng].eager_share == 0, (name, rng)
        for rng in EAGER:
            assert ranges[rng].replayed == 0 and ranges[rng].eager_share == 1, (name, rng)


def test_the_layer_check_was_paused_through_the_timed_requests_of_both_bundled_rows(shipped):
    for name in ("triton", "fi-cutlass"):
        assert shipped[name]["timing"]["workload"]["layer_check_paused"] is True


def test_the_bundled_kernel_passes_and_a_reference_compiling_while_serving_is_not_judged(shipped):
    check, _ = speed_check(_timing(shipped["triton"]), _timing(shipped["vllm-triton"]), MARGIN, "vllm")
    assert check.passed and "judged 6/7 ranges" in check.detail
    judged = {
        r.range: r for r in compare(_timing(shipped["triton"]), _timing(shipped["vllm-triton"]), MARGIN)
    }
    assert judged["M=1024-4095"].passed is None and "spread too wide" in judged["M=1024-4095"].why_not
    # the floor: an eager range fails only beyond ~x2.8, a graph-replayed one beyond ~x1.16
    assert all(judged[r].fails_above < 1.2 for r in GRAPH_REPLAYED)
    assert all(2.7 < judged[r].fails_above < 2.9 for r in ("M=257-1023", "M>=4096"))


def test_flashinfer_served_untuned_fails_the_gate_in_the_decode_ranges_alone(repo_root):
    """The light site without trtllm_utils: vLLM's warm-up autotune fell back to default tactics, and
    FlashInfer's decode calls read ~21.6 us flat against vLLM's 12.9-17.6."""
    fi2 = _rows(repo_root, "canary-tp1-lite-fi2.json")
    fi, vllm = _timing(fi2["fi-cutlass"]), _timing(fi2["vllm-triton"])
    check, _ = speed_check(fi, vllm, MARGIN, "vllm")
    assert not check.passed
    judged = compare(fi, vllm, MARGIN)
    assert {r.range for r in judged if r.passed is False} == set(GRAPH_REPLAYED)
    failed = {c["name"] for c in fi2["fi-cutlass"]["checks"] if not c["passed"]}
    assert failed == {"speed_gate", "layer_check_ranges"}


def test_flashinfer_tuned_from_the_light_site_with_trtllm_utils_passes_every_range(repo_root):
    """The same light site with the autotuner's delay kernel (trtllm_utils), the next run on an H100: vLLM's
    warm-up tuned FlashInfer (gemm1 and gemm2, 21 profiles each), and every range passed, the decode ones
    at x0.85-0.99 of vLLM's Triton, where the untuned run above failed them."""
    tuned = _rows(repo_root, "canary-tp1-lite-fi2-tuned.json")
    fi, vllm = _timing(tuned["fi-cutlass"]), _timing(tuned["vllm-triton"])
    check, _ = speed_check(fi, vllm, MARGIN, "vllm")
    assert check.passed and "judged 7/7 ranges" in check.detail
    judged = {r.range: r for r in compare(fi, vllm, MARGIN)}
    assert all(judged[r].ratio < 1.0 for r in GRAPH_REPLAYED)
    row = tuned["fi-cutlass"]
    assert row["status"] == "passed" and all(c["passed"] for c in row["checks"])


def test_a_triton_rows_server_logs_flashinfers_fall_back_and_only_a_flashinfer_row_would_count_it(repo_root):
    """The same run's server logs: vLLM autotunes wherever FlashInfer is importable, so vLLM's Triton row
    logged the fall-back (nothing of FlashInfer to tune); the FlashInfer row tuned and loaded its cache."""
    from moe_eval.serve.server_log import speed_warnings

    text = (repo_root / "docs/data/speed_h100/canary-tp1-lite-fi2-tuned-autotune.log").read_text()
    triton_log, fi_log = text.split("## Canary-Qwen3-MoE-BF16-fi-cutlass/server.log")
    untuned = "No FlashInfer autotune cache entries found.Falling back to default tactics. (1x)"
    assert speed_warnings(triton_log, "vllm:TRITON") == []
    # the words as vLLM 0.26 logs them: read, had FlashInfer computed that row's experts
    assert speed_warnings(triton_log, "bundled:flashinfer_cutlass") == [untuned]
    assert "autotune cache loaded" in fi_log and speed_warnings(fi_log, "bundled:flashinfer_cutlass") == []
