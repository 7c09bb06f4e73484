"""The repeat check: the row's scored texts, scored a second time on the same server in the same way (one
request at a time), give the same log-probabilities bit for bit. A kernel that sums in a varying order (the
top-k slots added by atomics, vLLM #54945) gives a server whose identical requests disagree; users compare
this property across backends. Reported for every row that scores texts; a verdict only where the config
asks (`repeat_gate: true`).

The comparison (moe_eval.core.repeated_scoring) is made in memory by the step that scores again
(moe_eval.steps.RepeatScores): the files keep log p to 6 decimals, too coarse for "bit for bit". The second
pass recomputes every prompt: vLLM reads no prefix cache for a request that asks for prompt
log-probabilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.core.repeated_scoring import RepeatSection
from moe_eval.gates.gate import Column, Gate, GateConfig, RowView, Show, Skipped, gate_keys

if TYPE_CHECKING:
    from moe_eval.gates.measurements import Judgement, Measurements

SECTION = "repeat"


@gate_keys
class RepeatKeys:
    """The repeat check's keys: measured by default, gated when asked."""

    repeat_texts: bool = Field(
        True,
        description="score the log-probability texts a second time on the same server and report whether "
        "they repeat bit for bit (costs the scoring's time again)",
    )
    repeat_gate: bool = Field(
        False, description="fail the row when the second scoring's log-probabilities differ in any bit"
    )


def describe(section: RepeatSection) -> str:
    """'16 texts (6,312 positions) scored twice: bit for bit the same' or where they differ."""
    scored = f"{section['texts']} texts ({section['positions']:,} positions) scored twice on one server"
    if section["identical"]:
        return f"{scored}: the same log-probabilities bit for bit"
    where = section.get("first_difference")
    at = f"; first at text {where['text']} position {where['position']}" if where else ""
    differ = f"{section['differing_positions']:,} positions in {section['differing_texts']} texts differ"
    return f"{scored}: {differ}, max |Δ log p| {section['max_abs_difference']:.3g}{at}"


def _not_scored_again(m: Measurements) -> str:
    why = m.not_measured.get("repeat") or m.logprobs_skipped
    return "the texts were not scored a second time" + (f": {why}" if why else "")


def judge_repeat(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    if m.repeat is None:
        why = _not_scored_again(m)
        out.sections[SECTION] = {"skipped": why}
        return why
    section = m.repeat | {"gated": True}
    out.sections[SECTION] = section
    # Exact, not statistical: what it catches is any difference at all, in the positions it compared.
    positions = section["positions"]
    evidence = Evidence("position", positions, positions, would_catch="one differing bit in any position")
    out.checks.append(Check.judged("repeat_bit_identical", section["identical"], describe(section), evidence))
    return None


def report_repeat(config: GateConfig, m: Measurements, out: Judgement) -> None:
    """Every row that scores its texts twice: the comparison, reported only (or why there is none)."""
    if m.repeat is not None:
        out.sections[SECTION] = m.repeat | {"gated": False}
    elif config.keys(RepeatKeys).repeat_texts and config.logprob_texts > 0:
        out.sections[SECTION] = {"skipped": _not_scored_again(m)}


def _blocked(config: GateConfig) -> tuple[str, str] | None:
    if config.logprob_texts == 0:
        return "logprob_texts is 0: no texts are scored", "logprob_texts 0"
    if not config.keys(RepeatKeys).repeat_texts:
        return "repeat_texts is false: the texts are scored once", "repeat_texts false"
    return None


def repeat_cell(section: Any, row: RowView) -> str:
    """'yes, 6,312 positions' / 'report only: no: 12 of 6,312 positions differ (max |Δ log p| 3e-07)' (no
    verdict rests on it unless repeat_gate) / 'not measured: why' / '-'."""
    if not section:
        return "-"
    if "identical" not in section:
        return f"not measured: {section['skipped']}" if "skipped" in section else "-"
    if section["identical"]:
        return f"yes, {section['positions']:,} positions"
    largest = section.get("max_abs_difference")
    prefix = "report only: " if section.get("gated") is False else ""
    return f"{prefix}no: {section['differing_positions']:,} of {section['positions']:,} positions differ" + (
        f" (max |Δ log p| {largest:.2g})" if largest is not None else ""
    )


def repeat_junit(section: Any) -> dict[str, object]:
    section = section or {}
    return {
        "repeat.identical": section.get("identical"),
        "repeat.differing_positions": section.get("differing_positions"),
        "repeat.positions": section.get("positions"),
        "repeat.gated": section.get("gated"),
    }


GATE = Gate(
    "repeat",
    ("repeat_bit_identical",),
    lambda c, _: c.keys(RepeatKeys).repeat_gate,
    False,
    judge_repeat,
    "the scored texts' log-probabilities, scored again on the same server, the same bit for bit",
    keys=RepeatKeys,
    section=SECTION,
    payload=RepeatSection | Skipped,
    show=Show(columns=(Column("Repeats bit for bit", repeat_cell),), junit=repeat_junit),
    blocked=_blocked,
    report=report_repeat,
)
