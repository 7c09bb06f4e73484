"""The paired gate: per-question flips against the incumbent's answers to the same questions, with an exact
McNemar test (moe_eval.gates.stats)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict from 3.12 only

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.gates.gate import Gate, GateConfig, gate_keys
from moe_eval.gates.stats import PairedResult, paired_compare

if TYPE_CHECKING:
    from moe_eval.gates.measurements import IncumbentRow, Judgement, Measurements


@gate_keys
class PairedKeys:
    """The paired gate's keys."""

    paired_alpha: float = Field(
        0.05, ge=1e-9, le=0.5, description="paired gate: fail when McNemar p(worse) < this"
    )


class PairedFlips(TypedDict):
    """results.json `paired`: gates/stats.py PairedResult against the incumbent."""

    n: int
    """questions both runs answered"""
    both_right: int
    """right in both"""
    baseline_only_right: int
    """right in the incumbent only (b)"""
    new_only_right: int
    """right in this run only (c)"""
    both_wrong: int
    """wrong in both"""
    p_worse: float
    """exact one-sided McNemar p-value for 'this run is worse'"""
    p_two_sided: float
    """two-sided"""
    alpha: float
    """the config's paired_alpha"""
    passed: bool
    """not (b > c and p_worse < alpha)"""
    baseline: str
    """the incumbent's results.json"""


def paired_check(
    incumbent: IncumbentRow, correct: dict[int, bool], alpha: float
) -> tuple[Check, PairedResult]:
    """The paired gate: this run's per-question strict-match correctness against the incumbent's."""
    result = paired_compare(incumbent.correctness, correct, alpha)
    detail = result.describe() + f" [incumbent {incumbent.results_path}]"
    return Check.judged(
        "paired_gate", result.passed, detail, Evidence("question", result.n, len(correct))
    ), result


def judge_paired(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    if m.answers is None:
        return "the evaluation made no answers"
    assert m.incumbent is not None  # the gate needs an incumbent: the judge gives it one or none
    check, result = paired_check(m.incumbent, m.answers.correctness, config.keys(PairedKeys).paired_alpha)
    out.sections["paired"] = result.as_dict() | {"baseline": str(m.incumbent.results_path)}
    out.checks.append(check)
    return None


GATE = Gate(
    "paired",
    ("paired_gate",),
    lambda c, incumbent: c.answers_gated and incumbent,
    True,
    judge_paired,
    "per-question flips against the incumbent, exact McNemar test (paired_alpha)",
    keys=PairedKeys,
    section="paired",
    payload=PairedFlips,
)
