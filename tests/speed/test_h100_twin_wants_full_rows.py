"""The Qwen3-30B-A3B twin served with the top-up's wants, and what the timed step costs in full rows: one H100
(GPU-d024313b, 2026-12-07 14:35-14:59 UTC, committed code daef9f3; docs/perf.md "The twin with the wants, and
the timed step's cost in full rows"), three chained calls on one machine:
- power-topup-twin.json (`STAGE=power MODEL=twin REPEATS=1 LIMIT=8`): a speed-only pair (vLLM's row, the
  bundled row), one repeat and the 5 % decode / 10 % eager slowdown, each against the pair's bundled row as
  --baseline;
- full-rows-cost.json: full rows (golden, texts, repeat scoring, layer check, the eval) of the twin's
  CUDA-graph pair (`STAGE=twin BENCH=0`) and of the GPU canary TP1 list (`STAGE=shipped LIMIT=100`).
Re-judged by the rule as it is now."""

from __future__ import annotations

from moe_eval.gates.speed import speed_check
from tests.speed import stored_power as stored
from tests.speed.stored_power import DECODE, EAGER, MARGINS, timing

TWIN = "power-topup-twin"
FULL_ROWS = "full-rows-cost"


def test_the_twin_with_the_wants_fails_every_slowed_range_and_passes_its_repeat(repo_root):
    """The slowed row fails 7 of 7 ranges (decode x1.046-1.052 against x1.037-1.039, eager x1.090-1.096
    against x1.076-1.080); the correct repeat passes 7 of 7 (worst x1.002); the pair's bundled row against
    vLLM's is judged 7 of 7 and passes (x0.75-0.98)."""
    rows = stored.stored_rows(repo_root, TWIN)
    comparisons = stored.judged_rows(rows)
    assert len(rows) == 4 and len(comparisons) == 2
    assert {r["gpu_uuids"][0] for r in rows} == {"GPU-d024313b-ffb8-93fe-b42b-e442585aeec6"}
    for row, reference in comparisons:
        check, _ = speed_check(timing(row), timing(reference), MARGINS, reference["run"])
        judged = stored.ranges_judged(row, reference)
        assert check is not None and check.evidence is not None and check.evidence.judged == 7
        assert check.passed is (not stored.slowed(row))
        if stored.slowed(row):
            assert all(judged[r].passed is False for r in DECODE + EAGER)
            assert all(1.045 < judged[r].ratio < 1.053 for r in DECODE)  # type: ignore[operator]
            assert all(1.089 < judged[r].ratio < 1.097 for r in EAGER)  # type: ignore[operator]
            assert all(1.036 < judged[r].fails_above < 1.040 for r in DECODE)  # type: ignore[operator]
            assert all(1.075 < judged[r].fails_above < 1.080 for r in EAGER)  # type: ignore[operator]
        else:
            assert max(j.ratio for j in judged.values()) < 1.003  # type: ignore[type-var]
    bundled, vllm = stored.correct(rows)[0], stored.correct(rows, vllm=True)[0]
    check, _ = speed_check(timing(bundled), timing(vllm), MARGINS, vllm["run"])
    assert check is not None and check.passed and check.evidence is not None and check.evidence.judged == 7
    ratios = [j.ratio for j in stored.ranges_judged(bundled, vllm).values()]
    assert 0.75 < min(ratios) and max(ratios) < 0.99  # type: ignore[operator]


def test_the_twins_top_up_ran_three_rounds_and_asked_the_aim_where_its_largest_calls_scattered(repo_root):
    """Every twin row ran the three rounds. Its batched prefill lands at several sizes (the most-called
    M>=4096 size was 4500-8192 tokens, 2-4 calls at the first reading), so three of the four rows asked the
    `aim` there and the repeat `min_calls`; M=1024-4095 asked the `share` in every row, M=257-1023
    `min_calls`."""
    rows = stored.stored_rows(repo_root, TWIN)
    reasons = []
    for row in rows:
        top_up = row["timing"]["workload"]["top_up"]
        assert top_up["rounds"] == 3
        wanted = top_up["wanted"]
        assert wanted["M=1024-4095"]["reason"] == "share" and wanted["M=257-1023"]["reason"] == "min_calls"
        assert 4500 <= wanted["M>=4096"]["size"] <= 8192
        reasons.append(wanted["M>=4096"]["reason"])
    assert sorted(reasons) == ["aim", "aim", "aim", "min_calls"]


def test_the_timed_step_is_2_to_5_percent_of_a_full_row_and_the_rest_is_vllms_compiles(repo_root):
    """In the four full rows the timed step (its warm-up, the timed requests, the top-up's rounds and the
    readings) took 2.0 % (twin, bundled), 2.6 % (twin, vLLM's), 2.0 % (canary, bundled) and 5.2 % (canary,
    vLLM's) of the row's wall time. The one above 5 % is the warm-up: vLLM's Triton kernel compiled for the
    sizes the workload makes (4.2 of its 7.0 s; the bundled kernel's warm-up 0.8-0.9 s, its kernels built
    ahead). Less the warm-up, the timed requests and their readings are 1.6-2.1 % of every full row. The
    speed-only rows (no golden, texts or layer check, about 1.5 minutes) spend 4.2-6.3 %."""
    shares = {}
    for row in stored.stored_rows(repo_root, FULL_ROWS):
        seconds, total = row["timings"]["speed_seconds"], row["timings"]["total_seconds"]
        warm_up = row["timing"]["workload"]["warm_up"]["seconds"]
        shares[row["config"]] = (seconds / total, (seconds - warm_up) / total, warm_up)
        assert row["status"] == "passed" and total > 130
    assert set(shares) == {
        "Qwen3-30B-A3B-BF16-triton",
        "Qwen3-30B-A3B-BF16-vllm",
        "Canary-Qwen3-MoE-BF16-triton",
        "Canary-Qwen3-MoE-BF16-vllm-triton",
    }
    for config, (share, less_warm_up, warm_up) in shares.items():
        assert 0.015 < less_warm_up < 0.022, config
        if config == "Canary-Qwen3-MoE-BF16-vllm-triton":
            assert 0.051 < share < 0.053 and 4.1 < warm_up < 4.3
        else:
            assert 0.019 < share < 0.026 and warm_up < 1.0, config
    for row in stored.stored_rows(repo_root, TWIN):
        share = row["timings"]["speed_seconds"] / row["timings"]["total_seconds"]
        assert 0.042 < share < 0.063


def test_the_full_rows_speed_gate_judged_every_range_and_passed(repo_root):
    """Both full bundled rows gated against vLLM's row of their pair: judged 7 of 7, passed (the twin's worst
    x0.984 at M=65-256, the canary's x0.904 at M=1024-4095)."""
    rows = stored.stored_rows(repo_root, FULL_ROWS)
    for model in ("Qwen3-30B-A3B-BF16", "Canary-Qwen3-MoE-BF16"):
        bundled = next(r for r in rows if r["config"] == f"{model}-triton")
        vllm = next(r for r in rows if r["config"].startswith(f"{model}-vllm"))
        check, _ = speed_check(timing(bundled), timing(vllm), MARGINS, vllm["run"])
        assert check is not None and check.passed
        assert check.evidence is not None and check.evidence.judged == 7
        worst = max(stored.ranges_judged(bundled, vllm).values(), key=lambda r: r.ratio or 0.0)
        assert (worst.range, round(worst.ratio or 0.0, 3)) == {
            "Qwen3-30B-A3B-BF16": ("M=65-256", 0.984),
            "Canary-Qwen3-MoE-BF16": ("M=1024-4095", 0.904),
        }[model]
        assert [c["passed"] for c in bundled["checks"] if c["name"] == "speed_gate"] == [True]
