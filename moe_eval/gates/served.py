"""The served gate: the server answered every question asked of it (what an incumbent row with nothing else
to gate proves)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.gates.gate import Gate, GateConfig

if TYPE_CHECKING:
    from moe_eval.gates.measurements import Judgement, Measurements


def judge_served(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    if m.answers is None:
        return "the evaluation made no answers"
    # Against the questions asked, not a count of the same samples (which could not fail).
    n = m.answers.num_questions
    asked = m.answers.asked if m.answers.asked is not None else config.num_questions
    evidence = Evidence("question", n, asked)
    detail = f"{n} of {asked} questions asked answered by the server"
    out.checks.append(Check.judged("served", n == asked, detail, evidence))
    return None


GATE = Gate(
    "served",
    ("served",),
    lambda c, _: True,
    False,
    judge_served,
    "the server answered every question asked: what an incumbent row with nothing else to gate proves",
)
