"""Statistics against hand-computed values; the stderr gate; garbage checks; baselines."""

import json
import math
from pathlib import Path

import pytest

from moe_eval.configs.config import parse_config
from moe_eval.core.errors import ConfigError
from moe_eval.evaluate.incumbent import find_incumbent
from moe_eval.gates.accuracy import GateResult
from moe_eval.gates.answers import answer_stats
from moe_eval.gates.garbage import garbage_checks
from moe_eval.gates.stats import accuracy_stderr, mcnemar_exact, paired_compare


@pytest.mark.parametrize(
    "b, c, p_worse, p_two",
    [
        (5, 0, 1 / 32, 2 / 32),  # all 5 flips against the new run: P(X>=5 | n=5) = 1/32
        (3, 1, 5 / 16, 10 / 16),  # P(X>=3 | n=4) = (C(4,3)+C(4,4))/16
        (2, 8, 1013 / 1024, 112 / 1024),  # new run better: P(X>=2 | 10) = 1 - 11/1024; 2*P(X>=8) = 2*56/1024
        (0, 0, 1.0, 1.0),  # no discordant pair: no evidence either way
        (4, 4, 163 / 256, 1.0),  # balanced: P(X>=4 | 8) = 163/256; two-sided capped at 1
    ],
)
def test_mcnemar_exact_hand_computed(b, c, p_worse, p_two):
    got_worse, got_two = mcnemar_exact(b, c)
    assert got_worse == pytest.approx(p_worse, rel=1e-12) and got_two == pytest.approx(p_two, rel=1e-12)


def test_stderr_matches_hand_value_and_lm_eval():
    from lm_eval.api.metrics import mean_stderr

    assert accuracy_stderr(88, 100) == pytest.approx(math.sqrt(0.88 * 0.12 / 99))
    outcomes = [1] * 88 + [0] * 12
    assert accuracy_stderr(88, 100) == pytest.approx(mean_stderr(outcomes))
    # 1319 questions near 0.88: about 0.009, so vLLM's tolerance 0.08 is ~9 stderr
    assert accuracy_stderr(1161, 1319) == pytest.approx(0.00895, abs=1e-4)


def test_paired_gate_fails_only_when_significantly_worse():
    base = {i: True for i in range(40)}
    worse = {i: i >= 8 for i in range(40)}  # 8 flips right->wrong, none back: p = 1/256
    assert not paired_compare(base, worse, alpha=0.05).passed
    slightly = {i: i >= 2 for i in range(40)}  # 2 flips: p = 1/4, not significant
    assert paired_compare(base, slightly, alpha=0.05).passed
    with pytest.raises(ValueError, match="different questions"):
        paired_compare(base, {i: True for i in range(39)}, alpha=0.05)


def test_stderr_gate_is_the_stricter_floor():
    loose = GateResult(accuracy=0.85, stderr=0.009, threshold=0.88, tolerance=0.08)
    strict = GateResult(accuracy=0.85, stderr=0.009, threshold=0.88, tolerance=0.08, stderr_k=3)
    assert loose.passed and not strict.passed  # a 3-point regression: inside 0.08, outside 3 stderr
    assert strict.floor == pytest.approx(0.88 - 0.027) and strict.stderr_floor == pytest.approx(0.853)
    wide = GateResult(accuracy=0.81, stderr=0.05, threshold=0.88, tolerance=0.08, stderr_k=3)
    assert wide.floor == pytest.approx(0.80) and wide.passed  # few questions: the tolerance floor rules


def _sample(qid: int, filt: str, text: str, filtered: str, right: bool) -> dict:
    return {
        "doc_id": qid,
        "filter": filt,
        "resps": [[text]],
        "filtered_resps": [filtered],
        "exact_match": float(right),
    }


def _samples(answers: list[tuple[str, str, str, bool]]) -> list[dict]:
    out = []
    for qid, (text, strict, flexible, right) in enumerate(answers):
        out.append(_sample(qid, "strict-match", text, strict, right))
        out.append(_sample(qid, "flexible-extract", text, flexible, right))
    return out


CONFIG = "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 4\nnum_fewshot: 5\nmax_tokens: 8\n"


def test_garbage_checks_count_empty_truncated_and_invalid():
    samples = _samples(
        [
            ("", "[invalid]", "[invalid]", False),
            ("It is 4. #### 4", "4", "4", True),
            ("blah blah", "[invalid]", "[invalid]", False),
            ("so 12", "[invalid]", "12", False),
        ]
    )
    stats = answer_stats(samples, {0: 0, 1: 8, 2: 8, 3: 3}, max_tokens=8)
    assert (stats["empty"], stats["invalid"], stats["no_strict_answer"], stats["truncated"]) == (1, 2, 3, 2)
    config = parse_config(
        Path("c.yaml"), CONFIG + "max_empty_rate: 0.3\nmax_truncated_rate: 0.4\nmax_invalid_rate: 0.5\n"
    )
    checks = {c.name: c for c in garbage_checks(config, stats)}
    assert checks["max_empty_rate"].passed  # 1/4 <= 0.3
    assert not checks["max_truncated_rate"].passed and "2/4 = 0.500" in checks["max_truncated_rate"].detail
    assert checks["max_invalid_rate"].passed  # 2/4 <= 0.5
    assert garbage_checks(parse_config(Path("c.yaml"), CONFIG), stats) == []  # off unless configured
    unknown = garbage_checks(config, answer_stats(samples, None, 8))
    assert not {c.name: c for c in unknown}["max_truncated_rate"].passed  # cannot count: never a silent pass


def _results_dir(
    root: Path, name: str, model: str, n: int, status: str = "passed", fewshot: int = 5, **keys
) -> Path:
    run = root / name / "fam" / "cfg"
    run.mkdir(parents=True)
    record = {
        "status": status,
        "config_name": "cfg",
        "num_questions_evaluated": n,
        "config": {"model_name": model, "num_fewshot": fewshot},
        **keys,
    }
    (run / "results.json").write_text(json.dumps(record))
    (run / "samples.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in _samples([("x", "1", "1", i % 2 == 0) for i in range(n)]))
    )
    return root / name


def test_find_baseline_matches_model_questions_and_fewshot(tmp_path):
    config = parse_config(tmp_path / "cfg.yaml", CONFIG)
    run = _results_dir(tmp_path, "run1", "m", 4)
    baseline = find_incumbent(run, config)
    assert baseline.correctness == {0: True, 1: False, 2: True, 3: False}
    assert baseline.speed_warnings == ()  # a record from before version 7 has none
    untuned = ["No FlashInfer autotune cache entries found.Falling back to default tactics. (1x)"]
    warned = find_incumbent(_results_dir(tmp_path, "run4", "m", 4, speed_warnings_logged=untuned), config)
    assert warned.speed_warnings == tuple(untuned)  # the speed gate names the reference's too
    with pytest.raises(ConfigError, match="holds no finished result for model m with 4 questions"):
        find_incumbent(_results_dir(tmp_path, "run2", "other-model", 4), config)
    with pytest.raises(ConfigError, match="holds no finished result"):
        find_incumbent(_results_dir(tmp_path, "run3", "m", 4, status="error"), config)
    _results_dir(tmp_path / "both", "a", "m", 4)
    _results_dir(tmp_path / "both", "b", "m", 4)
    with pytest.raises(ConfigError, match="holds 2 results"):
        find_incumbent(tmp_path / "both", config)
