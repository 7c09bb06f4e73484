"""The golden gate's arithmetic on synthetic captures: errors, the rule, the power, decode."""

from __future__ import annotations

import numpy as np
import pytest

from moe_eval.core.logprob_texts import TextLogprobs
from moe_eval.gates.golden_errors import (
    decode_errors,
    decode_rule,
    errors_vs_golden,
    golden_rule,
    paired_t_greater,
    scale_error_power,
)


def capture(lps: np.ndarray, ids: list[list[int]] | None = None) -> list[TextLogprobs]:
    """Texts (rows) of positions (columns); position 0 has no logprob, top-1 is the text's own token."""
    records = []
    for i, row in enumerate(lps):
        tokens = tuple(ids[i]) if ids else tuple(range(len(row) + 1))
        lp = (None, *map(float, row))
        top_ids = (None, *((t, 10_000 + t) for t in tokens[1:]))
        top_lps = (None, *((float(v), float(v) - 3.0) for v in row))
        records.append(TextLogprobs(i, tokens, lp, top_ids, top_lps))
    return records


@pytest.fixture
def world():
    rng = np.random.default_rng(0)
    texts, positions = 32, 200
    golden = -np.abs(rng.normal(1.0, 0.5, size=(texts, positions)))
    sensitivity = rng.normal(0.0, 0.4, size=(texts, positions)) - 0.05  # a 100% scale error's effect
    incumbent = golden + rng.normal(0, 0.02, size=golden.shape)
    return golden, sensitivity, incumbent, rng


def test_a_correct_kernel_passes_and_a_bug_fails(world):
    golden, sensitivity, incumbent, rng = world
    correct = golden + rng.normal(0, 0.02, size=golden.shape)
    buggy = correct + 0.05 * sensitivity
    inc = errors_vs_golden(capture(golden), capture(incumbent))
    ok = golden_rule(errors_vs_golden(capture(golden), capture(correct)), inc)
    bad = golden_rule(errors_vs_golden(capture(golden), capture(buggy)), inc)
    assert not ok.failed and 0.9 < ok.ratio < 1.1
    assert bad.failed and bad.ratio > 1.1 and bad.p < 0.01 and bad.texts_worse > 28


def test_a_larger_error_without_significance_passes_and_significance_without_size_passes(world):
    golden, _, incumbent, _ = world
    inc = errors_vs_golden(capture(golden), capture(incumbent))
    slightly_worse = golden + 1.05 * (incumbent - golden)  # 5% more error on every text: under the margin
    result = golden_rule(errors_vs_golden(capture(golden), capture(slightly_worse)), inc, margin=0.10)
    assert result.ratio == pytest.approx(1.05) and result.p < 1e-6 and not result.failed
    # The same run with a zero margin: the test alone decides (and here finds it significant).
    assert golden_rule(errors_vs_golden(capture(golden), capture(slightly_worse)), inc, margin=0.0).failed


def test_errors_report_signed_shift_kl_and_top1(world):
    golden, _, _, _ = world
    shifted = golden + 0.01
    errs = errors_vs_golden(capture(golden), capture(shifted))
    assert errs.mean_abs == pytest.approx(0.01) and errs.signed_mean == pytest.approx(0.01)
    assert errs.texts_more_likely == errs.texts and errs.top1_agreement == 1.0
    assert errs.positions == golden.size and len(errs.per_text) == golden.shape[0]


def test_other_texts_are_refused(world):
    golden, _, incumbent, _ = world
    with pytest.raises(ValueError, match="token ids differ"):
        errors_vs_golden(
            capture(golden), capture(incumbent, ids=[[7] * (golden.shape[1] + 1)] * golden.shape[0])
        )


def test_paired_t_edges():
    assert paired_t_greater(np.array([0.5, 0.5, 0.5]))[1] == 0.0
    assert paired_t_greater(np.array([-0.5, -0.5]))[1] == 1.0
    t, p = paired_t_greater(np.array([0.3, 0.1, 0.2, 0.25]))
    assert t > 4 and p < 0.05


def test_power_finds_the_scale_error_the_rule_catches(world):
    golden, sensitivity, incumbent, rng = world
    correct = golden + rng.normal(0, 0.02, size=golden.shape)
    probe = golden + 0.05 * sensitivity  # exact MoE with a 5% expert error: the bug's effect alone
    inc = errors_vs_golden(capture(golden), capture(incumbent))
    run = errors_vs_golden(capture(golden), capture(correct))
    power = scale_error_power(capture(golden), capture(probe), 0.05, run, inc)
    assert power is not None and 0.001 < power < 0.05
    # What it says holds: a run with that error added fails, with half of it the rule passes.
    at = golden_rule(errors_vs_golden(capture(golden), capture(correct + power * sensitivity)), inc)
    half = golden_rule(errors_vs_golden(capture(golden), capture(correct + power / 2 * sensitivity)), inc)
    assert at.failed and not half.failed
    assert scale_error_power(capture(golden), capture(golden), 0.05, run, inc) is None  # dead expert


def test_decode_compares_up_to_the_first_different_token():
    gold = [
        TextLogprobs(0, (1, 2, 3, 4), (-0.1, -0.2, -0.3, -0.4), ((1,),) * 4, ((-0.1,),) * 4),
        TextLogprobs(1, (5, 6), (-0.5, -0.6), ((5,),) * 2, ((-0.5,),) * 2),
    ]
    run = [
        TextLogprobs(0, (1, 2, 9, 9), (-0.2, -0.2, -1.0, -1.0), ((1,),) * 4, ((-0.2,),) * 4),
        TextLogprobs(1, (5, 6), (-0.5, -0.7), ((5,),) * 2, ((-0.5,),) * 2),
    ]
    errs = decode_errors(gold, run)
    assert errs.first_difference == (2, None) and errs.identical_texts == 1
    assert errs.per_text_positions == (2, 2) and errs.positions == 4
    assert errs.mean_abs == pytest.approx((0.1 + 0.0 + 0.0 + 0.1) / 4)
    assert decode_rule(errs, decode_errors(gold, gold)) is not None
    parted_at_once = [gold[0], TextLogprobs(1, (8,), (-1.0,), ((8,),), ((-1.0,),))]
    assert decode_rule(errs, decode_errors(gold, parted_at_once)) is None  # one text left to compare


def test_decode_error_reads_the_runner_up_tokens_not_only_the_saturated_greedy_one():
    # The greedy token's log p sits at 0 in both (6 decimals, as vLLM returns it); the runner-ups moved.
    gold = [TextLogprobs(0, (7, 7), (0.0, 0.0), ((7, 3, 4),) * 2, ((0.0, -9.0, -11.0),) * 2)]
    run = [TextLogprobs(0, (7, 7), (0.0, 0.0), ((7, 4, 3),) * 2, ((0.0, -10.8, -9.3),) * 2)]
    errs = decode_errors(gold, run)
    assert errs.mean_abs == pytest.approx((0.0 + 0.3 + 0.2) / 3)  # matched by token id, not by rank
    dropped = [TextLogprobs(0, (7, 7), (0.0, 0.0), ((7, 5, 6),) * 2, ((0.0, -9.0, -11.0),) * 2)]
    assert decode_errors(gold, dropped).mean_abs == 0.0  # only the tokens both list count


@pytest.mark.parametrize("df", [1, 3, 15, 63, 400])
@pytest.mark.parametrize("t", [-8.0, -1.3, 0.0, 0.4, 2.1, 9.5, 40.0])
def test_student_t_tail_matches_scipy(t, df):
    from scipy.stats import t as scipy_t  # lm-eval's dependencies bring SciPy on the CPU

    from moe_eval.gates.golden_errors import student_t_sf

    assert student_t_sf(t, df) == pytest.approx(float(scipy_t.sf(t, df)), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize(
    ("backend", "layout", "role"),
    [
        ("vllm:CPU", "TP (TP1)", "vLLM's own MoE kernel at the same layout"),
        ("vllm:CPU", "TP (TP2)", "vLLM's own MoE kernel at TP (TP2), standing in"),
        ("bundled:triton", "TP (TP1)", "your baseline run (--baseline)"),
    ],
)
def test_the_incumbent_is_named_for_what_it_is(backend, layout, role, tmp_path):
    """Which run stands as the incumbent: vLLM's kernel at the row's layout, at another one (a stand-in), or
    an earlier run of a bundled kernel."""
    from moe_eval.configs.config import parse_config
    from moe_eval.gates.golden import incumbent_description
    from moe_eval.gates.measurements import IncumbentRow

    config = parse_config(
        tmp_path / "c.yaml", "model_name: m\nrandom_weights: true\nnum_questions: 4\nnum_fewshot: 0\n"
    )
    incumbent = IncumbentRow(tmp_path / "results.json", {}, moe_backend_used=backend, layout=layout)
    described = incumbent_description(config, incumbent)
    assert described["role"].startswith(role) and described["layout"] == layout
