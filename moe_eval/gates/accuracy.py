"""The accuracy gate.

vLLM's rule: pass iff strict-match accuracy >= threshold - tolerance. With `stderr_gate_k` set,
also accuracy >= threshold - k * stderr: at 1319 questions and accuracy near 0.88 the stderr is
about 0.009, so the tolerance of 0.08 is about nine standard errors and only catches breakage,
while k = 3 catches a 3-point regression. The effective floor is the stricter of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field
from typing_extensions import NotRequired, TypedDict  # pydantic reads typing's TypedDict from 3.12 only

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.gates.gate import Column, Gate, GateConfig, RowView, Show, Skipped, gate_keys
from moe_eval.gates.stats import describe_power, detectable_drop

if TYPE_CHECKING:
    from moe_eval.gates.measurements import Judgement, Measurements


@gate_keys
class AccuracyKeys:
    """The accuracy gate's keys (beside the harness's accuracy_threshold and tolerance)."""

    stderr_gate_k: float | None = Field(
        None, ge=0, description="also require accuracy >= threshold - k * stderr"
    )


@dataclass(frozen=True)
class GateResult:
    accuracy: float
    stderr: float
    threshold: float
    tolerance: float
    stderr_k: float | None = None

    @property
    def tolerance_floor(self) -> float:
        return self.threshold - self.tolerance

    @property
    def stderr_floor(self) -> float | None:
        if self.stderr_k is None or self.stderr is None or math.isnan(self.stderr):
            return None
        return self.threshold - self.stderr_k * self.stderr

    @property
    def floor(self) -> float:
        floors = [self.tolerance_floor] + ([self.stderr_floor] if self.stderr_floor is not None else [])
        return max(floors)

    @property
    def passed(self) -> bool:
        # Rounded so that an accuracy printed equal to the floor never fails on float noise.
        return round(self.accuracy - self.floor, 12) >= 0

    @property
    def margin(self) -> float:
        return self.accuracy - self.floor

    @property
    def margin_in_stderr(self) -> float | None:
        """How many standard errors above (+) or below (-) the floor; None when stderr is 0 or unknown."""
        if self.stderr is None or math.isnan(self.stderr) or self.stderr <= 0:
            return None
        return self.margin / self.stderr

    def describe(self) -> str:
        sigma = self.margin_in_stderr
        sigma_text = "n/a" if sigma is None else f"{sigma:+.1f} stderr"
        verdict = "PASS" if self.passed else "FAIL"
        rule = f"threshold {self.threshold:.4f} - tolerance {self.tolerance:.4f}"
        if self.stderr_floor is not None:
            rule += f"; threshold - {self.stderr_k:g} x stderr = {self.stderr_floor:.4f}"
        return (
            f"{verdict}: accuracy {self.accuracy:.4f} vs floor {self.floor:.4f} ({rule}); "
            f"margin {self.margin:+.4f}, {sigma_text}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "metric": "exact_match,strict-match",
            "accuracy": self.accuracy,
            "stderr": self.stderr,
            "threshold": self.threshold,
            "tolerance": self.tolerance,
            "tolerance_floor": self.tolerance_floor,
            "stderr_k": self.stderr_k,
            "stderr_floor": self.stderr_floor,
            "floor": self.floor,
            "margin": self.margin,
            "margin_in_stderr": self.margin_in_stderr,
            "passed": self.passed,
        }


class AccuracyGate(TypedDict):
    """results.json `gate`: GateResult and the gate's power (gates/stats.py)."""

    metric: str
    """the lm-eval score gated: exact_match,strict-match"""
    accuracy: float
    """strict-match accuracy"""
    stderr: float
    """its standard error (lm-eval's)"""
    threshold: float
    """the config's accuracy_threshold"""
    tolerance: float
    """the config's tolerance"""
    tolerance_floor: float
    """threshold - tolerance"""
    stderr_k: float | None
    """the config's stderr_gate_k (null: not set)"""
    stderr_floor: float | None
    """threshold - stderr_k x stderr (null: stderr_k not set or stderr unknown)"""
    floor: float
    """the stricter of the two floors: the accuracy needed to pass"""
    margin: float
    """accuracy - floor"""
    margin_in_stderr: float | None
    """the margin in standard errors (null: stderr 0 or unknown)"""
    passed: bool
    """accuracy >= floor"""
    power: NotRequired[float]
    """the probability at which detectable_drop is caught (this and the next two: results.json only)"""
    detectable_drop: NotRequired[float | None]
    """the smallest drop of true accuracy the gate catches with that probability (null: it cannot fail)"""
    power_n: NotRequired[int]
    """questions the power was computed for"""


SECTION = "gate"  # results.json's key of the accuracy gate (its first name, kept for readers)


def judge_accuracy(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    if m.answers is None:
        return "the evaluation made no answers"
    assert config.accuracy_threshold is not None  # answers_gated: parse_config requires it
    strict = m.answers.scores["strict-match"]
    gate = GateResult(
        accuracy=strict["accuracy"],
        stderr=strict["stderr"],
        threshold=config.accuracy_threshold,
        tolerance=config.tolerance,
        stderr_k=config.keys(AccuracyKeys).stderr_gate_k,
    )
    n = m.answers.num_questions
    drop = detectable_drop(n, config.accuracy_threshold, gate.floor)
    # inf: no accuracy can fail the gate (a floor at or below 0), said as null rather than a number
    out.sections[SECTION] = gate.as_dict() | {
        "power": 0.8,
        "detectable_drop": drop if math.isfinite(drop) else None,
        "power_n": n,
    }
    power = describe_power(n, config.accuracy_threshold, gate.floor)
    asked = m.answers.asked if m.answers.asked is not None else config.num_questions
    catch = f"an accuracy drop of {drop:.3f}" if math.isfinite(drop) else None
    evidence = Evidence("question", n, asked, would_catch=catch)
    out.checks.append(Check.judged("accuracy_gate", gate.passed, f"{gate.describe()}; {power}", evidence))
    return None


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def floor_cell(gate: Any, row: RowView) -> str:
    """The accuracy needed to pass: the section's (the stricter floor), else the config's threshold -
    tolerance (a row that ended before its evaluation)."""
    if gate:
        return _fmt(gate["floor"])
    threshold = row.config.accuracy_threshold
    return _fmt(threshold - row.config.tolerance) if threshold is not None else "n/a"


def margin_cell(gate: Any, row: RowView) -> str:
    sigma = (gate or {}).get("margin_in_stderr")
    return f"{sigma:+.1f}" if sigma is not None else ("" if gate else "-")


def drop_cell(gate: Any, row: RowView) -> str:
    drop = (gate or {}).get("detectable_drop")
    return _fmt(drop, 3) if drop is not None else ("" if gate else "-")


GATE = Gate(
    "accuracy",
    ("accuracy_gate",),
    lambda c, _: c.answers_gated,
    False,
    judge_accuracy,
    "strict-match accuracy against accuracy_threshold - tolerance (and stderr_gate_k)",
    keys=AccuracyKeys,
    section=SECTION,
    payload=AccuracyGate | Skipped,
    show=Show(
        columns=(
            Column("Floor", floor_cell),
            Column("Margin (stderr)", margin_cell),
            Column("Catches a drop of (80%)", drop_cell),
        ),
        junit=lambda gate: {"gate.detectable_drop_80": (gate or {}).get("detectable_drop")},
    ),
)
