"""The garbage gate: empty answers, answers that ran to max_tokens, answers with no number at all, each
against its limit. A broken kernel often produces these while a lenient accuracy gate still passes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from moe_eval.core.check import Check
from moe_eval.core.evidence import Evidence
from moe_eval.gates.gate import Gate, GateConfig, gate_keys

if TYPE_CHECKING:
    from moe_eval.gates.measurements import Judgement, Measurements


@gate_keys
class GarbageKeys:
    """The garbage gate's keys: each limit set turns its check on."""

    max_empty_rate: float | None = Field(
        None, ge=0.0, le=1.0, description="fail when more answers than this are empty"
    )
    max_truncated_rate: float | None = Field(
        None, ge=0.0, le=1.0, description="fail when more answers than this hit max_tokens"
    )
    max_invalid_rate: float | None = Field(
        None, ge=0.0, le=1.0, description="fail when more answers than this hold no number at all"
    )


LIMITS = (  # (check name and config key, the count it limits, what it counts); each on when its limit is set
    ("max_empty_rate", "empty", "empty answers"),
    ("max_truncated_rate", "truncated", "answers cut at max_tokens"),
    ("max_invalid_rate", "invalid", "answers with no number"),
)


def garbage_checks(config: GateConfig, stats: dict[str, Any]) -> list[Check]:
    n = max(stats["questions"], 1)
    checks = []
    keys = config.keys(GarbageKeys)
    for key, count_key, what in LIMITS:
        limit = getattr(keys, key)
        if limit is None:
            continue
        count = stats[count_key]
        if count is None:
            why = f"not run: {what}: could not be counted (token counts unavailable)"
            checks.append(Check.not_run(key, why, Evidence("answer", 0, stats["questions"])))
            continue
        rate = count / n
        detail = f"{what}: {count}/{n} = {rate:.3f} (limit {limit:g})"
        checks.append(Check.judged(key, rate <= limit, detail, Evidence("answer", n, n)))
    return checks


def judge_garbage(config: GateConfig, m: Measurements, out: Judgement) -> str | None:
    if m.answers is None:
        return "the evaluation made no answers"
    out.checks += garbage_checks(config, m.answers.stats)
    return None


GATE = Gate(
    "garbage",
    tuple(key for key, _, _ in LIMITS),
    lambda c, _: c.answers_gated and any(getattr(c.keys(GarbageKeys), key) is not None for key, *_ in LIMITS),
    False,
    judge_garbage,
    "empty, truncated and number-less answers, each against its max_*_rate",
    keys=GarbageKeys,
)
